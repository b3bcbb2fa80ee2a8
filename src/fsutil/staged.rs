//! Outputs of several files that appear whole or not at all: an export, a PEFT
//! adapter, a prepared dataset with its masks.
//!
//! The files are written into a temporary sibling folder `.NAME.tmp-PID` (locked
//! while the output lasts), then moved into place at once:
//!
//! - **a new or empty folder**: one rename of the temporary folder;
//! - **a folder holding a previous output**: the entries of the folder that are not
//!   ours (a lock file, a user's README) are hard-linked into the temporary folder,
//!   which is then swapped with the folder in one `renameat2(RENAME_EXCHANGE)`; the
//!   previous output, now at the temporary name, is deleted. A reader sees the old
//!   folder or the new one, never a mix;
//! - **where that cannot be done** (the folder holds sub-folders, or the file system
//!   cannot swap or link): the temporary folder is renamed `.NAME.commit-PID` (the
//!   commit point), then its files are moved in one by one, [`OutputKind::last`]
//!   last, and files of the previous output that the new one lacks are removed. An
//!   interruption there is finished by [`finish_interrupted`], which the next command
//!   reading or writing the folder calls.
//!
//! A temporary folder whose process has ended (no lock on it) is a leftover: the
//! next output removes it, saying so.

use std::ffi::CString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::{lock_folder, parent_dir, rename, temp_path, temp_target};
use crate::fault::{self, IoOp};

/// A kind of multi-file output and the files it writes into its folder.
#[derive(Debug)]
pub struct OutputKind {
    /// What writes it, for messages: "export", "prepare".
    pub what: &'static str,
    /// Every file an output of this kind may write. Those the new output does not
    /// write are removed from the folder: they belong to the previous output.
    pub files: &'static [&'static str],
    /// The file that readers take as the mark of the output (`config.json`,
    /// `meta.json`): moved in last when files are moved one by one.
    pub last: &'static str,
}

impl OutputKind {
    /// Whether the entry `name` of an output folder is ours: one of our files, or a
    /// temporary file of one that an older version left inside.
    fn owns(&self, name: &str) -> bool {
        self.files.contains(&name) || temp_target(name).is_some_and(|t| self.files.contains(&t))
    }
}

/// What marks a committed output waiting to be moved in: `.NAME.commit-PID`.
const COMMIT_MARK: &str = ".commit-";
/// In a committed folder: the names it holds, one a line.
const FILE_LIST: &str = ".files";

/// An output being written into its temporary folder; [`Staged::commit`] moves it
/// into place, dropping it uncommitted removes it.
pub struct Staged {
    kind: &'static OutputKind,
    dest: PathBuf,
    dir: PathBuf,
    /// The OS lock on the temporary folder (it follows the folder through renames).
    lock: Option<File>,
}

impl Staged {
    /// Starts an output of `kind` into the folder `dest` (which need not exist):
    /// finishes or removes what interrupted outputs left, then creates the locked
    /// temporary folder beside `dest`.
    pub fn begin(dest: &Path, kind: &'static OutputKind) -> Result<Staged> {
        let dest = normalize(dest)?;
        if dest.exists() && !dest.is_dir() {
            bail!("{} is a file, not a folder", dest.display());
        }
        for note in finish_interrupted(&dest, kind)? {
            crate::errln!("note: {note}");
        }
        let dir = temp_path(&dest)?;
        // Our own process id, so a leftover of a process long gone.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).with_context(|| {
            format!(
                "cannot create {}: {} builds its files beside {} and moves them into place; \
                 check that {} is writable",
                dir.display(),
                kind.what,
                dest.display(),
                parent_dir(&dest).display()
            )
        })?;
        let lock = lock_folder(&dir)?;
        Ok(Staged {
            kind,
            dest,
            dir,
            lock: Some(lock),
        })
    }

    /// The temporary folder to write the files into (each under its final name).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The folder the output goes to.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Moves the finished output into place (see the module's description). On an
    /// error before the commit point, `dest` is as it was and the temporary folder
    /// is removed.
    pub fn commit(mut self) -> Result<()> {
        let written = self.written()?;
        sync_dir(&self.dir);
        let entries = match std::fs::read_dir(&self.dest) {
            Ok(entries) => Some(entries.flatten().collect::<Vec<_>>()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(e).with_context(|| format!("cannot list {}", self.dest.display()))
            }
        };
        let kind = self.kind;
        match entries {
            None => self.rename_into_place()?,
            Some(e) if e.is_empty() => self.rename_into_place()?,
            Some(entries) => {
                let others: Vec<_> = entries
                    .iter()
                    .filter(|e| !kind.owns(&e.file_name().to_string_lossy()))
                    .collect();
                let folders = others
                    .iter()
                    .any(|e| e.file_type().is_ok_and(|t| t.is_dir()));
                let names: Vec<_> = others.iter().map(|e| e.file_name()).collect();
                if folders || !self.swap(&names)? {
                    self.install_one_by_one(&written)?;
                }
            }
        }
        sync_dir(parent_dir(&self.dest));
        Ok(())
    }

    /// The names of the files written, checked to be the kind's.
    fn written(&self) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&self.dir)
            .with_context(|| format!("cannot list {}", self.dir.display()))?
        {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if !self.kind.files.contains(&name.as_str()) {
                bail!(
                    "internal error: {} wrote {name}, not one of its files",
                    self.kind.what
                );
            }
            names.push(name);
        }
        Ok(names)
    }

    /// A new or empty `dest`: the temporary folder becomes it, in one rename.
    fn rename_into_place(&mut self) -> Result<()> {
        rename(&self.dir, &self.dest).with_context(|| {
            format!(
                "cannot move {} to {}; nothing was changed",
                self.dir.display(),
                self.dest.display()
            )
        })?;
        self.dir = self.dest.clone();
        Ok(())
    }

    /// Links the entries `others` of `dest` (not ours) into the temporary folder and
    /// swaps the two folders; the previous output is then deleted. `Ok(false)` when
    /// the file system can do neither (nothing changed then).
    fn swap(&mut self, others: &[std::ffi::OsString]) -> Result<bool> {
        let mut linked = Vec::new();
        for name in others {
            let to = self.dir.join(name);
            if std::fs::hard_link(self.dest.join(name), &to).is_err() {
                unlink_all(&linked);
                return Ok(false);
            }
            linked.push(to);
        }
        if let Err(e) = exchange(&self.dir, &self.dest) {
            unlink_all(&linked);
            let unsupported = [libc::EINVAL, libc::ENOSYS, libc::EOPNOTSUPP];
            if e.raw_os_error().is_some_and(|c| unsupported.contains(&c)) {
                return Ok(false);
            }
            return Err(e).with_context(|| {
                format!(
                    "cannot move {} into place at {}; nothing was changed",
                    self.dir.display(),
                    self.dest.display()
                )
            });
        }
        // The previous output is now at the temporary name. An entry that appeared in
        // `dest` between the links and the swap goes back; the rest is deleted.
        let old = std::mem::replace(&mut self.dir, self.dest.clone());
        if let Ok(entries) = std::fs::read_dir(&old) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                let ours = self.kind.owns(&name.to_string_lossy());
                if !ours && !others.contains(&name) && !self.dest.join(&name).exists() {
                    let _ = std::fs::rename(entry.path(), self.dest.join(&name));
                }
            }
        }
        let _ = std::fs::remove_dir_all(&old);
        Ok(true)
    }

    /// The fallback: commit by renaming the temporary folder `.NAME.commit-PID`,
    /// then move its files into `dest` one by one.
    fn install_one_by_one(&mut self, written: &[String]) -> Result<()> {
        let list = self.dir.join(FILE_LIST);
        super::write_bytes_atomic(&list, written.join("\n") + "\n")?;
        sync_dir(&self.dir);
        let committed = commit_path(&self.dest)?;
        rename(&self.dir, &committed).with_context(|| {
            format!(
                "cannot rename {} to {}; nothing was changed",
                self.dir.display(),
                committed.display()
            )
        })?;
        self.dir = committed.clone();
        move_in(&committed, &self.dest, self.kind).with_context(|| {
            format!(
                "the new output is complete in {} but could not be moved into {}; the next \
                 nanogpt command that reads or writes {} finishes the move",
                committed.display(),
                self.dest.display(),
                self.dest.display()
            )
        })?;
        self.dir = self.dest.clone();
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        // Not committed (an error, or a panic): the temporary folder must not survive.
        if self.dir != self.dest && temp_target(&file_name(&self.dir)).is_some() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        self.lock.take();
    }
}

/// Refuses to write an output of `kind` into `dest` unless it is new, empty, or
/// holds a previous output of this kind (`is_previous(dest)`), whose files are then
/// replaced and others kept: a folder holding files nanogpt did not write is never
/// written into. `flag` names the setting for messages (`--to`).
pub fn check_destination(
    dest: &Path,
    kind: &OutputKind,
    flag: &str,
    is_previous: impl Fn(&Path) -> bool,
) -> Result<()> {
    let meta = match dest.symlink_metadata() {
        Err(_) => return Ok(()),
        Ok(meta) => meta,
    };
    if meta.file_type().is_symlink() && !dest.exists() {
        bail!(
            "{flag} {} is a symbolic link to nothing; remove the link or choose another {flag}",
            dest.display()
        );
    }
    if !dest.is_dir() {
        bail!(
            "{flag} {} is a file, not a folder; choose another {flag} (nothing was written)",
            dest.display()
        );
    }
    let mut found: Vec<String> = std::fs::read_dir(dest)
        .with_context(|| format!("cannot list {flag} {}", dest.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| temp_target(name).is_none_or(|t| !kind.files.contains(&t)))
        .collect();
    if found.is_empty() || is_previous(dest) {
        return Ok(());
    }
    found.sort();
    let shown = found.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
    let more = if found.len() > 5 { ", ..." } else { "" };
    bail!(
        "{flag} {} already holds files that nanogpt's {} did not write ({shown}{more}); \
         choose a new or empty directory (nothing was written)",
        dest.display(),
        kind.what
    )
}

/// Finishes what interrupted outputs of `kind` into `dest` left beside it: a
/// committed folder (`.NAME.commit-PID`) is moved in, a temporary one removed, when
/// no process holds its lock. Returns a note for each; an error when a committed
/// output cannot be moved in (`dest` would read as a mix).
pub fn finish_interrupted(dest: &Path, kind: &OutputKind) -> Result<Vec<String>> {
    let dest = normalize(dest)?;
    let name = file_name(&dest);
    let parent = parent_dir(&dest);
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Ok(Vec::new());
    };
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| leftover_of(&file_name(p), &name).is_some())
        .collect();
    found.sort();
    let mut notes = Vec::new();
    for path in found {
        let Ok(_held) = lock_folder(&path) else {
            continue; // a live output
        };
        if leftover_of(&file_name(&path), &name) == Some(COMMIT_MARK) {
            move_in(&path, &dest, kind).with_context(|| {
                format!(
                    "{} is incomplete: an interrupted {} left its new files in {}, and they \
                     cannot be moved in; check the permissions of {}, then run again",
                    dest.display(),
                    kind.what,
                    path.display(),
                    dest.display()
                )
            })?;
            notes.push(format!(
                "finished moving the files of an interrupted {} from {} into {}",
                kind.what,
                path.display(),
                dest.display()
            ));
        } else if std::fs::remove_dir_all(&path).is_ok() {
            notes.push(format!(
                "removed {}, left by an interrupted {}",
                path.display(),
                kind.what
            ));
        }
    }
    Ok(notes)
}

/// Which leftover of the output folder `name` the entry `entry` is:
/// `.NAME.tmp-PID` ([`super::TEMP_MARK`]) or `.NAME.commit-PID` ([`COMMIT_MARK`]).
fn leftover_of(entry: &str, name: &str) -> Option<&'static str> {
    let rest = entry.strip_prefix('.')?.strip_prefix(name)?;
    [super::TEMP_MARK, COMMIT_MARK].into_iter().find(|mark| {
        rest.strip_prefix(mark)
            .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// Moves the files of the committed folder `from` into `dest`, `kind.last` last;
/// files of `kind` that `from` does not hold are removed from `dest`. Idempotent: a
/// file already moved is not in `from` any more, and its name is in the file list.
fn move_in(from: &Path, dest: &Path, kind: &OutputKind) -> Result<()> {
    let list = from.join(FILE_LIST);
    let text = std::fs::read_to_string(&list)
        .with_context(|| format!("cannot read {}", list.display()))?;
    let written: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
    std::fs::create_dir_all(dest).with_context(|| format!("cannot create {}", dest.display()))?;
    let order = kind
        .files
        .iter()
        .filter(|&&n| n != kind.last)
        .chain([&kind.last]);
    for &name in order {
        let (src, to) = (from.join(name), dest.join(name));
        if written.contains(&name) {
            if src.exists() {
                rename(&src, &to).with_context(|| {
                    format!("cannot move {} to {}", src.display(), to.display())
                })?;
            }
        } else if to.symlink_metadata().is_ok() {
            std::fs::remove_file(&to).with_context(|| {
                format!("cannot remove {}, of the previous output", to.display())
            })?;
        }
    }
    sync_dir(dest);
    std::fs::remove_file(&list).with_context(|| format!("cannot remove {}", list.display()))?;
    std::fs::remove_dir(from).with_context(|| format!("cannot remove {}", from.display()))?;
    Ok(())
}

/// `.NAME.commit-PID` beside `dest`.
fn commit_path(dest: &Path) -> Result<PathBuf> {
    let name = format!(".{}{COMMIT_MARK}{}", file_name(dest), std::process::id());
    Ok(dest.with_file_name(name))
}

/// `dest` with a last component to name siblings after (`.` and `..` resolved), and
/// a symbolic link to a folder resolved to that folder (the output goes there; the
/// link stays a link).
fn normalize(dest: &Path) -> Result<PathBuf> {
    let is_link = dest
        .symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink());
    if dest.file_name().is_some() && !(is_link && dest.is_dir()) {
        return Ok(dest.to_path_buf());
    }
    let real = dest
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", dest.display()))?;
    if real.file_name().is_none() {
        bail!(
            "{} has no parent folder to build an output beside",
            real.display()
        );
    }
    Ok(real)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Swaps the folders `a` and `b` in one step (Linux `renameat2(RENAME_EXCHANGE)`).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    fault::io(IoOp::Rename, a)?;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two valid NUL-terminated paths, only read by the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

fn unlink_all(paths: &[PathBuf]) {
    for p in paths {
        let _ = std::fs::remove_file(p);
    }
}

/// Makes a folder's entries durable (where the file system can sync a folder).
fn sync_dir(dir: &Path) {
    if let Ok(f) = File::open(dir) {
        let _ = f.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsutil::tests::{folder_with, names};
    use std::os::unix::fs::MetadataExt;

    const KIND: OutputKind = OutputKind {
        what: "test output",
        files: &["a.bin", "b.mask", "meta.json"],
        last: "meta.json",
    };

    fn write(staged: &Staged, files: &[(&str, &str)]) {
        for (name, text) in files {
            std::fs::write(staged.dir().join(name), text).unwrap();
        }
    }

    fn read(dir: &Path, name: &str) -> String {
        std::fs::read_to_string(dir.join(name)).unwrap()
    }

    #[test]
    fn a_new_folder_appears_whole_by_one_rename() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        let staged = Staged::begin(&dest, &KIND).unwrap();
        write(&staged, &[("a.bin", "1"), ("meta.json", "m1")]);
        assert!(!dest.exists(), "nothing before the commit");
        staged.commit().unwrap();
        assert_eq!(names(&dest), ["a.bin", "meta.json"]);
        assert_eq!(names(tmp.path()), ["out"], "no temporary folder left");
    }

    #[test]
    fn a_previous_output_is_swapped_whole_and_other_files_are_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        std::fs::create_dir(&dest).unwrap();
        for (name, text) in [("a.bin", "old"), ("b.mask", "old"), ("meta.json", "old")] {
            std::fs::write(dest.join(name), text).unwrap();
        }
        std::fs::write(dest.join("notes.txt"), "the user's").unwrap();
        std::fs::write(dest.join(".a.bin.tmp-7"), "an older version's leftover").unwrap();
        let inode = |p: &Path| std::fs::metadata(p).unwrap().ino();
        let (notes, folder) = (inode(&dest.join("notes.txt")), inode(&dest));
        let staged = Staged::begin(&dest, &KIND).unwrap();
        write(&staged, &[("a.bin", "new"), ("meta.json", "new")]);
        assert_eq!(read(&dest, "a.bin"), "old");
        staged.commit().unwrap();
        // The mask of the previous output went with it; the user's file is the same file.
        assert_eq!(names(&dest), ["a.bin", "meta.json", "notes.txt"]);
        assert_eq!(
            (read(&dest, "a.bin"), read(&dest, "meta.json")),
            ("new".into(), "new".into())
        );
        assert_eq!(inode(&dest.join("notes.txt")), notes);
        assert_ne!(inode(&dest), folder, "swapped, not filled file by file");
        assert_eq!(names(tmp.path()), ["out"]);
    }

    #[test]
    fn a_folder_with_sub_folders_gets_the_files_one_by_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        std::fs::create_dir_all(dest.join("corpus")).unwrap();
        std::fs::write(dest.join("corpus/doc.txt"), "text").unwrap();
        std::fs::write(dest.join("b.mask"), "old").unwrap();
        let folder = std::fs::metadata(&dest).unwrap().ino();
        let staged = Staged::begin(&dest, &KIND).unwrap();
        write(&staged, &[("a.bin", "new"), ("meta.json", "new")]);
        staged.commit().unwrap();
        assert_eq!(std::fs::metadata(&dest).unwrap().ino(), folder);
        assert_eq!(names(&dest), ["a.bin", "corpus", "meta.json"]);
        assert_eq!(read(&dest, "corpus/doc.txt"), "text");
        assert_eq!(names(tmp.path()), ["out"]);
    }

    #[test]
    fn an_interrupted_commit_is_finished_and_a_dropped_output_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let old = [("a.bin", "new"), ("b.mask", "old"), ("meta.json", "old")];
        let dest = folder_with(tmp.path(), "out", &old);
        // Killed after moving a.bin in: meta.json waits in the committed folder.
        let moving = [("meta.json", "new"), (FILE_LIST, "a.bin\nmeta.json\n")];
        folder_with(tmp.path(), ".out.commit-4242", &moving);
        folder_with(tmp.path(), ".out.tmp-4243", &[("a.bin", "partial")]);
        let notes = finish_interrupted(&dest, &KIND).unwrap();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].contains("finished moving"), "{notes:?}");
        assert!(notes[1].contains("removed") && notes[1].contains(".out.tmp-4243"));
        assert_eq!(names(&dest), ["a.bin", "meta.json"]);
        assert_eq!(read(&dest, "meta.json"), "new");
        assert_eq!(names(tmp.path()), ["out"]);

        let staged = Staged::begin(&dest, &KIND).unwrap();
        write(&staged, &[("a.bin", "newer")]);
        drop(staged);
        assert_eq!(names(tmp.path()), ["out"]);
        assert_eq!(read(&dest, "a.bin"), "new");
    }

    #[test]
    fn a_link_to_a_folder_gets_the_output_and_stays_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        let (real, link) = (tmp.path().join("real"), tmp.path().join("link"));
        std::fs::create_dir(&real).unwrap();
        std::fs::write(real.join("meta.json"), "old").unwrap();
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let staged = Staged::begin(&link, &KIND).unwrap();
        write(&staged, &[("meta.json", "new")]);
        staged.commit().unwrap();
        assert!(link.symlink_metadata().unwrap().file_type().is_symlink());
        assert_eq!(read(&real, "meta.json"), "new");
        assert_eq!(names(tmp.path()), ["link", "real"]);
    }

    #[test]
    fn a_live_output_s_folder_is_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        let first = Staged::begin(&dest, &KIND).unwrap();
        // Another output into the same place (as another process would be).
        let notes = finish_interrupted(&dest, &KIND).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        assert!(first.dir().is_dir());
    }

    #[test]
    fn only_new_empty_or_previous_outputs_are_written_into() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let check = |name: &str, previous: bool| {
            check_destination(&d.join(name), &KIND, "--to", |_| previous).map_err(|e| e.to_string())
        };
        assert!(check("new", false).is_ok());
        std::fs::create_dir(d.join("empty")).unwrap();
        assert!(check("empty", false).is_ok());
        std::fs::create_dir(d.join("full")).unwrap();
        std::fs::write(d.join("full/meta.json"), "").unwrap();
        std::fs::write(d.join("full/README.md"), "").unwrap();
        let err = check("full", false).unwrap_err();
        assert!(
            err.contains("already holds files that nanogpt's test output did not write (README.md, meta.json)"),
            "{err}"
        );
        assert!(check("full", true).is_ok());
        std::fs::write(d.join("file"), "").unwrap();
        let err = check("file", false).unwrap_err();
        assert!(
            err.contains("--to") && err.contains("is a file, not a folder"),
            "{err}"
        );
        std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling")).unwrap();
        let err = check("dangling", false).unwrap_err();
        assert!(err.contains("is a symbolic link to nothing"), "{err}");
    }
}
