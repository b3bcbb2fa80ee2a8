//! The writer of `train.bin` / `val.bin`, all-or-nothing ([`AtomicFile`]): a crash
//! never leaves a half-written token file that looks finished.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::meta::TokenDtype;
use crate::fsutil::AtomicFile;

/// Appends little-endian token ids of one [`TokenDtype`] to a `.bin` file.
pub(crate) struct TokenWriter {
    file: AtomicFile,
    dtype: TokenDtype,
    tokens: u64,
    scratch: Vec<u8>,
}

impl TokenWriter {
    pub(crate) fn create(dest: &Path, dtype: TokenDtype) -> Result<TokenWriter> {
        Ok(TokenWriter {
            file: AtomicFile::create(dest)?,
            dtype,
            tokens: 0,
            scratch: Vec::new(),
        })
    }

    /// Appends `tokens`; an id too wide for the file's dtype is an error.
    pub(crate) fn write(&mut self, tokens: &[u32]) -> Result<()> {
        self.scratch.clear();
        match self.dtype {
            TokenDtype::Uint16 => {
                if let Some(&id) = tokens.iter().find(|&&t| t > u32::from(u16::MAX)) {
                    bail!("token id {id} does not fit the uint16 token file");
                }
                let narrow = tokens.iter().flat_map(|&t| (t as u16).to_le_bytes());
                self.scratch.extend(narrow);
            }
            TokenDtype::Uint32 => {
                let wide = tokens.iter().flat_map(|t| t.to_le_bytes());
                self.scratch.extend(wide);
            }
        }
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
        let mut w = TokenWriter::create(&dest, TokenDtype::Uint16).unwrap();
        w.write(&[1, 258, 65535]).unwrap();
        assert!(!dest.exists(), "nothing is visible before commit");
        assert_eq!(w.tokens(), 3);
        let err = w.write(&[2, 65536]).unwrap_err().to_string();
        assert!(err.contains("65536 does not fit"), "{err}");
        assert_eq!(w.tokens(), 3);
        w.commit().unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), [1, 0, 2, 1, 255, 255]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn token_writer_writes_little_endian_u32() {
        let dir = TempDir::new("output-le32");
        let dest = dir.path().join("x.bin");
        let mut w = TokenWriter::create(&dest, TokenDtype::Uint32).unwrap();
        w.write(&[1, 65536, 151_668]).unwrap();
        w.commit().unwrap();
        let want: Vec<u8> = [1u32, 65536, 151_668]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        assert_eq!(std::fs::read(&dest).unwrap(), want);
    }

    #[test]
    fn dropped_uncommitted_file_leaves_nothing() {
        let dir = TempDir::new("output-drop");
        let dest = dir.path().join("x.bin");
        let mut w = TokenWriter::create(&dest, TokenDtype::Uint16).unwrap();
        w.write(&[7; 100]).unwrap();
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
