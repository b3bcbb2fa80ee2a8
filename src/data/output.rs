//! Files written all-or-nothing: data goes to a temporary file next to the
//! destination and is renamed into place only once complete, so a crash never
//! leaves a half-written `train.bin` that looks finished.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A file being written under a temporary name; [`AtomicFile::commit`] moves it
/// into place, dropping it uncommitted deletes it.
pub(crate) struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    writer: Option<BufWriter<File>>,
}

impl AtomicFile {
    pub(crate) fn create(dest: &Path) -> Result<AtomicFile> {
        let name = dest
            .file_name()
            .with_context(|| format!("{} is not a file path", dest.display()))?
            .to_string_lossy();
        // The process id keeps concurrent writers (several ranks preparing the same
        // bundled dataset) off each other's temporary files.
        let tmp = dest.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
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

    pub(crate) fn dest(&self) -> &Path {
        &self.dest
    }

    pub(crate) fn writer(&mut self) -> &mut BufWriter<File> {
        self.writer
            .as_mut()
            .expect("AtomicFile writer is present until commit")
    }

    /// Flushes, syncs to disk and renames the file to its destination.
    pub(crate) fn commit(mut self) -> Result<()> {
        let writer = self.writer.take().expect("commit is called once");
        let file = writer
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("cannot write {}", self.tmp.display()))?;
        file.sync_all()
            .with_context(|| format!("cannot sync {}", self.tmp.display()))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.dest).with_context(|| {
            format!(
                "cannot move {} to {}",
                self.tmp.display(),
                self.dest.display()
            )
        })?;
        sync_parent_dir(&self.dest);
        Ok(())
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

/// Makes the rename durable where the platform allows it (best effort).
fn sync_parent_dir(path: &Path) {
    if let Some(dir) = path.parent() {
        if let Ok(handle) = File::open(dir) {
            let _ = handle.sync_all();
        }
    }
}

/// Appends uint16 little-endian token ids to a `.bin` file.
pub(crate) struct TokenWriter {
    file: AtomicFile,
    tokens: u64,
    scratch: Vec<u8>,
}

impl TokenWriter {
    pub(crate) fn create(dest: &Path) -> Result<TokenWriter> {
        Ok(TokenWriter {
            file: AtomicFile::create(dest)?,
            tokens: 0,
            scratch: Vec::new(),
        })
    }

    pub(crate) fn write(&mut self, tokens: &[u16]) -> Result<()> {
        self.scratch.clear();
        self.scratch
            .extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        let dest = self.file.dest().display().to_string();
        self.file
            .writer()
            .write_all(&self.scratch)
            .with_context(|| format!("cannot write {dest}; is the disk full?"))?;
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    pub(crate) fn tokens(&self) -> u64 {
        self.tokens
    }

    pub(crate) fn commit(self) -> Result<()> {
        self.file.commit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::TempDir;

    #[test]
    fn token_writer_writes_little_endian_u16() {
        let dir = TempDir::new("output-le");
        let dest = dir.path().join("x.bin");
        let mut w = TokenWriter::create(&dest).unwrap();
        w.write(&[1, 258, 65535]).unwrap();
        assert!(!dest.exists(), "nothing is visible before commit");
        assert_eq!(w.tokens(), 3);
        w.commit().unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), [1, 0, 2, 1, 255, 255]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn dropped_uncommitted_file_leaves_nothing() {
        let dir = TempDir::new("output-drop");
        let dest = dir.path().join("x.bin");
        let mut w = TokenWriter::create(&dest).unwrap();
        w.write(&[7; 100]).unwrap();
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
