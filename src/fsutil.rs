//! Files replaced all-or-nothing: everything nanogpt writes (checkpoints, token
//! files, `meta.json`, the metrics log on resume, the loss plot, exports) goes to a
//! temporary file `.NAME.tmp-PID` beside the destination, which is synced to disk,
//! renamed over the destination and made durable by syncing the directory. A crash
//! or an error leaves the previous file as it was, never a half-written one that
//! looks finished; a failed write removes its temporary file.
//!
//! The process id in the temporary name keeps concurrent writers (several ranks
//! preparing the same bundled dataset) off each other's files; [`temp_target`]
//! recognises the names, so that leftovers of a killed process can be reported.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::fault::{self, IoOp};

mod read;
mod staged;
pub use read::{check_regular_file, open_regular, read_json, read_limited, BOM, JSON_LIMIT};
pub use staged::{check_destination, finish_interrupted, OutputKind, Staged};

/// What a temporary file's name carries after the destination's name.
const TEMP_MARK: &str = ".tmp-";

/// Writes `dest` through `write(tmp)`, which creates and fills the temporary file
/// `tmp` beside it; then syncs, renames and syncs the directory. On failure the
/// previous `dest` is untouched, the temporary file removed, and the error names
/// `dest`.
pub fn write_atomic(dest: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temp_path(dest)?;
    let result = write(&tmp).and_then(|()| {
        fault::io(IoOp::Write, &tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
        let file =
            File::open(&tmp).with_context(|| format!("cannot sync {} to disk", tmp.display()))?;
        commit(file, &tmp, dest)
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| not_written(dest))
}

/// [`write_atomic`] of a whole buffer.
pub fn write_bytes_atomic(dest: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    write_atomic(dest, |tmp| {
        std::fs::write(tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))
    })
}

/// A file written piece by piece under its temporary name; [`AtomicFile::commit`]
/// moves it into place, dropping it uncommitted deletes it.
pub struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    writer: Option<BufWriter<File>>,
}

impl AtomicFile {
    pub fn create(dest: &Path) -> Result<AtomicFile> {
        let tmp = temp_path(dest)?;
        let file = File::create(&tmp).with_context(|| {
            format!(
                "cannot create {}; check that the folder is writable",
                tmp.display()
            )
        })?;
        Ok(AtomicFile {
            dest: dest.to_path_buf(),
            tmp,
            writer: Some(BufWriter::with_capacity(1 << 20, file)),
        })
    }

    /// The path the file will have once committed.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    pub fn writer(&mut self) -> &mut BufWriter<File> {
        self.writer
            .as_mut()
            .expect("AtomicFile writer is present until commit")
    }

    /// Flushes, then syncs and renames the file to its destination (see
    /// [`write_atomic`]); on failure the temporary file is removed by the drop.
    pub fn commit(mut self) -> Result<()> {
        let writer = self.writer.take().expect("commit is called once");
        let result = writer
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|file| fault::io(IoOp::Write, &self.tmp).map(|()| file))
            .with_context(|| format!("cannot write {}", self.tmp.display()))
            .and_then(|file| commit(file, &self.tmp, &self.dest));
        if result.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        result.with_context(|| not_written(&self.dest))
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.writer.is_some() {
            // Not committed: the partial file must not survive.
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// The lock file a writer holds in the folder it writes (see [`DirLock`]).
pub const LOCK_FILE: &str = ".nanogpt.lock";

/// An exclusive advisory lock on a folder that one run writes into (`train`'s
/// `out_dir`, `prepare`'s `--out`), so that a second run writing the same folder is
/// refused instead of interleaving its files with the first one's. It is an OS lock
/// on `FOLDER/.nanogpt.lock` (`flock`), held until this value is dropped or the
/// process ends in any way, so a crash never leaves a stale lock; the file records
/// the holder's process id and host for the refusal message.
///
/// A folder the run created itself ([`DirLock::created_here`]) goes again when the
/// lock is dropped if the run left nothing in it but the lock file (it was refused
/// or failed before writing anything), so that a refusal leaves no trace.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    /// The locked folder.
    dir: PathBuf,
    /// The outermost folder this process created for it (the folder itself, or a
    /// missing parent), when it created any.
    created: Option<PathBuf>,
}

/// Creates `dir` and any missing parents, as `create_dir_all` does; returns the
/// outermost folder it created (`None` when `dir` existed), for
/// [`DirLock::created_here`].
pub fn create_dir_all_noting(dir: &Path) -> std::io::Result<Option<PathBuf>> {
    let mut outermost = None;
    let mut at = Some(dir);
    while let Some(d) = at.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        outermost = Some(d.to_path_buf());
        at = d.parent();
    }
    std::fs::create_dir_all(dir)?;
    Ok(outermost)
}

impl DirLock {
    /// Takes the lock on `dir` (which must exist), the folder that the setting `key`
    /// names (for messages: `out_dir`, `--out`), for `what` (e.g. "a training run"),
    /// or fails at once, naming the process that holds it.
    pub fn acquire(dir: &Path, key: &str, what: &str) -> Result<DirLock> {
        let path = dir.join(LOCK_FILE);
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path);
        let mut file = match opened {
            Ok(file) => file,
            Err(e) => bail!(
                "cannot create {} in {key} {}: {e}; check that the folder is writable, or \
                 choose another {key}",
                path.display(),
                dir.display()
            ),
        };
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = std::io::Read::read_to_string(&mut file, &mut holder);
                let holder = holder.trim();
                let holder = match holder.is_empty() {
                    true => "another process".to_string(),
                    false => holder.to_string(),
                };
                bail!(
                    "{key} {} is in use by {holder}; wait for that run to finish (or stop it), \
                     or choose another {key}",
                    dir.display()
                );
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        let me = format!(
            "{what} (pid {} on host {})\n",
            std::process::id(),
            host_name()
        );
        // Best effort: the lock itself is what protects the folder.
        let _ = file.set_len(0).and_then(|()| {
            std::io::Write::write_all(&mut file, me.as_bytes())?;
            file.sync_data()
        });
        Ok(DirLock {
            _file: file,
            dir: dir.to_path_buf(),
            created: None,
        })
    }

    /// Records that this process created the locked folder, `outermost` being what
    /// [`create_dir_all_noting`] returned for it.
    pub fn created_here(mut self, outermost: Option<PathBuf>) -> DirLock {
        self.created = outermost;
        self
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        let (dir, Some(outermost)) = (&self.dir, &self.created) else {
            return;
        };
        let only_the_lock = std::fs::read_dir(dir).is_ok_and(|entries| {
            let names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
            names == [LOCK_FILE]
        });
        if !only_the_lock {
            return;
        }
        let _ = std::fs::remove_file(dir.join(LOCK_FILE));
        // Inside out, up to the outermost folder created; `remove_dir` only removes
        // an empty folder, so nothing that appeared meanwhile is lost.
        for d in dir.ancestors() {
            if std::fs::remove_dir(d).is_err() || d == outermost.as_path() {
                break;
            }
        }
    }
}

impl DirLock {
    /// Waits until no process holds the lock on `dir` (`what` names what the wait is
    /// for, in the messages), for at most `limit`; says once that it waits. Returns
    /// at once when `dir` has no lock file or it is free. Takes nothing: the caller
    /// then checks what the holder left and takes the lock itself if it must write.
    pub fn wait_until_free(dir: &Path, what: &str, limit: Duration) -> Result<()> {
        let path = dir.join(LOCK_FILE);
        let Ok(mut file) = File::open(&path) else {
            return Ok(());
        };
        let started = Instant::now();
        let mut said = false;
        loop {
            match file.try_lock_shared() {
                Ok(()) => return Ok(()),
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("cannot lock {}", path.display()))
                }
                Err(std::fs::TryLockError::WouldBlock) => {}
            }
            let mut holder = String::new();
            let _ = std::io::Seek::rewind(&mut file);
            let _ = std::io::Read::read_to_string(&mut file, &mut holder);
            let holder = match holder.trim() {
                "" => "another process",
                h => h,
            }
            .to_string();
            if started.elapsed() >= limit {
                bail!(
                    "{} is still in use by {holder} after {} s; wait for it to finish (or \
                     stop it), then run again",
                    dir.display(),
                    limit.as_secs()
                );
            }
            if !said {
                crate::errln!("note: waiting for {holder} to finish {what}");
                said = true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// This machine's host name, for messages.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "this host".to_string())
}

/// The destination's name if `name` is a temporary file's (`.NAME.tmp-PID`).
pub fn temp_target(name: &str) -> Option<&str> {
    let (target, pid) = name.strip_prefix('.')?.rsplit_once(TEMP_MARK)?;
    let is_pid = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (is_pid && !target.is_empty()).then_some(target)
}

/// Whether a temporary file or folder is a leftover, for [`remove_stale_temps`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stale {
    /// Every one but this process's: the caller holds the lock that every writer
    /// of these names takes, so no other process is writing them.
    AllButOurs,
    /// Folders that no process holds a lock on (see [`lock_folder`]). (A process id
    /// alone proves nothing: ids are reused, within seconds where `pid_max` is small.)
    Unlocked,
}

/// Removes the temporary files or folders `.NAME.tmp-PID` in `dir` whose NAME is one
/// of `targets` and that are `stale`: a killed process's leftovers, ours by their
/// names. Returns what was removed.
pub fn remove_stale_temps(dir: &Path, targets: &[&str], stale: Stale) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mine = format!("{TEMP_MARK}{}", std::process::id());
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !temp_target(&name).is_some_and(|t| targets.contains(&t)) || name.ends_with(&mine) {
            continue;
        }
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        let gone = match (stale, is_dir) {
            (Stale::AllButOurs, false) => std::fs::remove_file(&path),
            (Stale::AllButOurs, true) => std::fs::remove_dir_all(&path),
            (Stale::Unlocked, true) if lock_folder(&path).is_ok() => std::fs::remove_dir_all(&path),
            (Stale::Unlocked, _) => continue,
        };
        if gone.is_ok() {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

/// Takes an OS lock on the folder `dir` itself, held while the returned handle lives
/// (and follows the folder through renames); fails if another process holds it.
pub fn lock_folder(dir: &Path) -> Result<File> {
    let file = File::open(dir).with_context(|| format!("cannot open {}", dir.display()))?;
    file.try_lock()
        .map_err(|e| anyhow::anyhow!("{} is locked: {e:?}", dir.display()))?;
    Ok(file)
}

/// `.NAME.tmp-PID` beside `dest` (a file or a folder), for this process.
pub fn temp_sibling(dest: &Path) -> Result<PathBuf> {
    temp_path(dest)
}

/// `.NAME.tmp-PID` in the destination's directory.
fn temp_path(dest: &Path) -> Result<PathBuf> {
    let name = dest
        .file_name()
        .with_context(|| format!("{} is not a file path", dest.display()))?;
    let tmp = format!(
        ".{}{TEMP_MARK}{}",
        name.to_string_lossy(),
        std::process::id()
    );
    Ok(dest.with_file_name(tmp))
}

/// Syncs the complete temporary `file`, renames it over `dest` and syncs the
/// directory, so that the new contents survive a power cut.
fn commit(file: File, tmp: &Path, dest: &Path) -> Result<()> {
    file.sync_all()
        .with_context(|| format!("cannot sync {} to disk", tmp.display()))?;
    drop(file);
    rename(tmp, dest).with_context(|| format!("cannot move {} into place", tmp.display()))?;
    // The rename is durable only once the directory entry is on disk. Some file
    // systems cannot sync a directory; the file itself is complete either way.
    if let Ok(dir) = File::open(parent_dir(dest)) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Renames `from` to `to` (a file or a folder moving into place), through the
/// fault-injection hook of the tests.
fn rename(from: &Path, to: &Path) -> std::io::Result<()> {
    fault::io(IoOp::Rename, from)?;
    std::fs::rename(from, to)
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

fn not_written(dest: &Path) -> String {
    format!(
        "{} was not written (any previous copy is intact)",
        dest.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// The names in `dir`, sorted.
    pub(super) fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// A new folder `name` in `parent` holding `files` (name, text).
    pub(super) fn folder_with(parent: &Path, name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = parent.join(name);
        std::fs::create_dir(&dir).unwrap();
        for (file, text) in files {
            std::fs::write(dir.join(file), text).unwrap();
        }
        dir
    }

    #[test]
    fn a_locked_folder_refuses_a_second_writer_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = DirLock::acquire(dir.path(), "out_dir", "a training run").unwrap();
        let err = DirLock::acquire(dir.path(), "out_dir", "another run").unwrap_err();
        let msg = format!("{err:#}");
        let holder = format!(
            "in use by a training run (pid {} on host ",
            std::process::id()
        );
        assert!(msg.contains(&holder), "{msg}");
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        drop(first);
        assert!(msg.contains("choose another out_dir"), "{msg}");
        let again = DirLock::acquire(dir.path(), "out_dir", "a later run");
        assert!(again.is_ok(), "released on drop");
    }

    #[test]
    fn a_folder_created_for_a_lock_goes_again_when_nothing_was_written() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b");
        let made = create_dir_all_noting(&dir).unwrap();
        assert_eq!(made.as_deref(), Some(root.path().join("a").as_path()));
        let lock = DirLock::acquire(&dir, "out_dir", "a run").unwrap();
        drop(lock.created_here(made.clone()));
        assert_eq!(
            names(root.path()),
            Vec::<String>::new(),
            "both folders removed"
        );
        // With a file written, the folder and the lock file stay.
        let made = create_dir_all_noting(&dir).unwrap();
        let lock = DirLock::acquire(&dir, "out_dir", "a run").unwrap();
        std::fs::write(dir.join("ckpt.json"), "{}").unwrap();
        drop(lock.created_here(made));
        assert_eq!(names(&dir), [LOCK_FILE, "ckpt.json"]);
        // A folder that existed is never removed.
        std::fs::remove_file(dir.join("ckpt.json")).unwrap();
        assert_eq!(create_dir_all_noting(&dir).unwrap(), None);
        let lock = DirLock::acquire(&dir, "out_dir", "a run").unwrap();
        drop(lock.created_here(None));
        assert_eq!(names(&dir), [LOCK_FILE]);
    }

    #[test]
    fn a_write_replaces_the_file_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("a.json");
        std::fs::write(&dest, "old").unwrap();
        write_bytes_atomic(&dest, "new").unwrap();
        assert_eq!(std::fs::read_to_string(&dest).unwrap(), "new");
        assert_eq!(names(dir.path()), ["a.json"]);
    }

    #[test]
    fn a_failed_write_keeps_the_previous_file_and_removes_the_temporary_one() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("a.json");
        std::fs::write(&dest, "old").unwrap();
        let err = write_atomic(&dest, |tmp| {
            std::fs::write(tmp, "half")?;
            anyhow::bail!("disk full")
        })
        .unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.starts_with(&format!(
                "{} was not written (any previous copy is intact)",
                dest.display()
            )) && msg.ends_with("disk full"),
            "{msg}"
        );
        assert_eq!(std::fs::read_to_string(&dest).unwrap(), "old");
        assert_eq!(names(dir.path()), ["a.json"]);
    }

    #[test]
    fn a_streamed_file_appears_only_on_commit() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("x.bin");
        std::fs::write(&dest, "old").unwrap();
        let mut file = AtomicFile::create(&dest).unwrap();
        file.writer().write_all(b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&dest).unwrap(), "old");
        let tmp = format!(".x.bin.tmp-{}", std::process::id());
        assert_eq!(names(dir.path()), [tmp.as_str(), "x.bin"]);
        file.commit().unwrap();
        assert_eq!(std::fs::read_to_string(&dest).unwrap(), "new");
        assert_eq!(names(dir.path()), ["x.bin"]);
    }

    #[test]
    fn a_dropped_streamed_file_leaves_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("x.bin");
        std::fs::write(&dest, "old").unwrap();
        let mut file = AtomicFile::create(&dest).unwrap();
        file.writer().write_all(b"partial").unwrap();
        drop(file);
        assert_eq!(std::fs::read_to_string(&dest).unwrap(), "old");
        assert_eq!(names(dir.path()), ["x.bin"]);
    }

    #[test]
    fn a_failed_commit_keeps_the_previous_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory cannot be replaced by a file: the rename fails.
        let dest = folder_with(dir.path(), "taken", &[("inside", "kept")]);
        let mut file = AtomicFile::create(&dest).unwrap();
        file.writer().write_all(b"new").unwrap();
        let err = format!("{:#}", file.commit().unwrap_err());
        assert!(
            err.contains("was not written (any previous copy is intact)"),
            "{err}"
        );
        assert!(err.contains("cannot move"), "{err}");
        assert_eq!(names(dir.path()), ["taken"]);
        assert_eq!(
            std::fs::read_to_string(dest.join("inside")).unwrap(),
            "kept"
        );
    }

    #[test]
    fn temporary_names_are_recognised() {
        let dest = Path::new("run/ckpt-000400.safetensors");
        let tmp = temp_path(dest).unwrap();
        assert_eq!(tmp.parent(), Some(Path::new("run")));
        let name = tmp.file_name().unwrap().to_str().unwrap();
        assert_eq!(temp_target(name), Some("ckpt-000400.safetensors"));
        assert_eq!(temp_target(".ckpt.json.tmp-12"), Some("ckpt.json"));
        for other in [
            "ckpt.json",
            ".ckpt.json",
            ".ckpt.json.tmp-",
            ".x.tmp-1a",
            "..tmp-3",
        ] {
            assert_eq!(temp_target(other), None, "{other}");
        }
    }
}
