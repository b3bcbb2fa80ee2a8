//! The writer of `train.bin` / `val.bin`, all-or-nothing ([`AtomicFile`]): a crash
//! never leaves a half-written token file that looks finished.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

use crate::fsutil::AtomicFile;

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
