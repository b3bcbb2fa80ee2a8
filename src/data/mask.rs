//! Loss masks: `train.mask` / `val.mask` beside the token files of instruction data.
//!
//! Format: one byte per token of the `.bin` file beside it (same name, extension
//! `.mask`), `1` when the token is trained as a target (a response token or its
//! end-of-text), `0` when it is only context (a prompt). The target of input position
//! `i` is token `i + 1`, so window row `o..o+T` trains target `j` iff
//! `mask[o + 1 + j] == 1`. A `.bin` without a `.mask` beside it trains every token.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use std::os::unix::fs::FileExt;

use crate::fsutil::AtomicFile;

/// The mask file beside a token file: `train.bin` → `train.mask`.
pub fn mask_path(token_file: &Path) -> PathBuf {
    token_file.with_extension("mask")
}

/// Appends mask bytes to a `.mask` file, all-or-nothing like [`super::token_writer`].
pub(crate) struct MaskWriter {
    file: AtomicFile,
    len: u64,
}

impl MaskWriter {
    pub(crate) fn create(dest: &Path) -> Result<MaskWriter> {
        Ok(MaskWriter {
            file: AtomicFile::create(dest)?,
            len: 0,
        })
    }

    pub(crate) fn write(&mut self, mask: &[u8]) -> Result<()> {
        let dest = self.file.dest().display().to_string();
        self.file
            .writer()
            .write_all(mask)
            .with_context(|| format!("cannot write {dest}; is the disk full?"))?;
        self.len += mask.len() as u64;
        Ok(())
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    pub(crate) fn commit(self) -> Result<()> {
        self.file.commit()
    }
}

/// A `.mask` file, checked against its token file and read window by window with
/// positional reads (no memory map: a mask truncated or rewritten while a run reads it
/// is an error naming the file, never a SIGBUS), like [`super::TokenFile`].
pub struct TokenMask {
    file: File,
    path: PathBuf,
    /// Bytes (= tokens) when opened.
    len: u64,
    /// Bytes that are 1 (trained targets), counted when opened.
    trained: u64,
}

impl std::fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenMask({} tokens)", self.len)
    }
}

/// Bytes a mask is checked in when opened.
const CHECK_CHUNK: usize = 4 << 20;

impl TokenMask {
    /// The mask beside `token_file` (of `tokens` tokens), or `None` when there is
    /// none. Refuses a mask of another length or with bytes other than 0 and 1.
    pub fn open_beside(token_file: &Path, tokens: usize) -> Result<Option<TokenMask>> {
        let path = mask_path(token_file);
        if !path.exists() {
            return Ok(None);
        }
        crate::fsutil::check_regular_file(&path, "mask file")?;
        let file = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("cannot read {}", path.display()))?
            .len();
        ensure!(
            len == tokens as u64,
            "{} has {len} bytes but {} holds {tokens} tokens (one mask byte per token): \
             the files come from different runs of prepare; prepare the dataset again",
            path.display(),
            token_file.display()
        );
        if len == 0 {
            bail!("{} is empty; prepare the dataset again", path.display());
        }
        let mut mask = TokenMask {
            file,
            path,
            len,
            trained: 0,
        };
        let mut chunk = vec![0u8; CHECK_CHUNK];
        for start in (0..tokens).step_by(CHECK_CHUNK) {
            let bytes = &mut chunk[..CHECK_CHUNK.min(tokens - start)];
            mask.read_at(start, bytes)?;
            if let Some(i) = bytes.iter().position(|&b| b > 1) {
                bail!(
                    "{} has byte {} at position {}; a mask holds only 0 and 1: prepare the \
                     dataset again",
                    mask.path.display(),
                    bytes[i],
                    start + i
                );
            }
            mask.trained += bytes.iter().filter(|&&b| b == 1).count() as u64;
        }
        Ok(Some(mask))
    }

    /// The file this mask was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many tokens the mask trains (bytes that are 1).
    pub fn trained(&self) -> u64 {
        self.trained
    }

    /// The whole mask.
    pub fn read_all(&self) -> Result<Vec<u8>> {
        let mut all = vec![0u8; self.len as usize];
        self.read_at(0, &mut all)?;
        Ok(all)
    }

    /// Fills `out` with the mask bytes from `start`, checking the file still has the
    /// size it had when opened.
    fn read_at(&self, start: usize, out: &mut [u8]) -> Result<()> {
        let changed = |why: String| {
            anyhow::anyhow!(
                "mask file {} changed while in use ({why}; {} bytes when opened); re-run \
                 prepare into a new folder, not over the dataset a run is reading",
                self.path.display(),
                self.len
            )
        };
        let now = self.file.metadata().map(|m| m.len()).unwrap_or(0);
        if now != self.len {
            return Err(changed(format!("{now} bytes now")));
        }
        self.file
            .read_exact_at(out, start as u64)
            .map_err(|e| changed(e.to_string()))
    }

    /// The mask bits of the targets of the window at `offset` (tokens
    /// `offset + 1 .. offset + 1 + block_size`), into `bits`.
    fn window(&self, offset: usize, bits: &mut [u8]) -> Result<()> {
        let end = (offset + 1 + bits.len()) as u64;
        ensure!(
            end <= self.len,
            "window at offset {offset} runs past the {} bytes of {}",
            self.len,
            self.path.display()
        );
        self.read_at(offset + 1, bits)?;
        if let Some(&b) = bits.iter().find(|&&b| b > 1) {
            bail!(
                "mask file {} changed while in use (byte {b} near position {}); re-run \
                 prepare into a new folder",
                self.path.display(),
                offset + 1
            );
        }
        Ok(())
    }

    /// Sets to -1 (ignored) the targets this mask does not train, for the windows at
    /// `offsets` as [`super::TokenFile::read_batch`] fills them; returns how many remain.
    pub fn apply(
        &self,
        offsets: &[usize],
        block_size: usize,
        targets: &mut [i32],
    ) -> Result<usize> {
        ensure!(
            targets.len() == offsets.len() * block_size,
            "targets hold {} but {} rows × block_size {block_size} need more",
            targets.len(),
            offsets.len()
        );
        let mut bits = vec![0u8; block_size];
        let mut kept = 0;
        for (&offset, row) in offsets.iter().zip(targets.chunks_exact_mut(block_size)) {
            self.window(offset, &mut bits)?;
            kept += mask_row(&bits, row);
        }
        Ok(kept)
    }

    /// How many targets the windows at `offsets` train (as [`TokenMask::apply`] would
    /// keep), without a batch.
    pub fn count_trained(&self, offsets: &[usize], block_size: usize) -> Result<usize> {
        let mut bits = vec![0u8; block_size];
        let mut kept = 0;
        for &offset in offsets {
            self.window(offset, &mut bits)?;
            kept += bits.iter().filter(|&&b| b != 0).count();
        }
        Ok(kept)
    }
}

/// Sets to -1 the targets of one row whose mask bit is 0; returns how many remain.
fn mask_row(bits: &[u8], row: &mut [i32]) -> usize {
    let mut kept = 0;
    for (t, &bit) in row.iter_mut().zip(bits) {
        if bit == 0 {
            *t = -1;
        } else {
            kept += 1;
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::TempDir;

    #[test]
    fn mask_drops_untrained_targets() {
        let dir = TempDir::new("mask-apply");
        let bin = dir.path().join("train.bin");
        dir.write("train.mask", [0u8, 0, 1, 1, 0, 1, 1, 0]);
        let mask = TokenMask::open_beside(&bin, 8).unwrap().unwrap();
        let mut targets = [10i32, 11, 12, 20, 21, 22];
        let kept = mask.apply(&[0, 4], 3, &mut targets).unwrap();
        // Row 0 targets tokens 1..4 (mask 0,1,1); row 1 tokens 5..8 (1,1,0).
        assert_eq!(targets, [-1, 11, 12, 20, 21, -1]);
        assert_eq!(kept, 4);
        assert_eq!(mask.count_trained(&[0, 4], 3).unwrap(), 4);
        let err = mask.apply(&[5], 3, &mut targets[..3]).unwrap_err();
        assert!(err.to_string().contains("offset 5"), "{err}");
    }

    #[test]
    fn a_mask_changed_while_in_use_is_an_error() {
        let dir = TempDir::new("mask-changed");
        let bin = dir.path().join("train.bin");
        dir.write("train.mask", [1u8; 8]);
        let mask = TokenMask::open_beside(&bin, 8).unwrap().unwrap();
        std::fs::write(dir.path().join("train.mask"), [1u8; 3]).unwrap();
        let err = mask.count_trained(&[0], 3).unwrap_err().to_string();
        assert!(
            err.contains("changed while in use") && err.contains("3 bytes now"),
            "{err}"
        );
    }

    #[test]
    fn mask_file_is_checked_against_its_tokens() {
        let dir = TempDir::new("mask-open");
        let bin = dir.path().join("train.bin");
        assert!(TokenMask::open_beside(&bin, 4).unwrap().is_none());
        let mut w = MaskWriter::create(&mask_path(&bin)).unwrap();
        w.write(&[0, 1, 1, 0]).unwrap();
        assert_eq!(w.len(), 4);
        w.commit().unwrap();
        let m = TokenMask::open_beside(&bin, 4).unwrap().unwrap();
        assert_eq!(m.count_trained(&[0], 3).unwrap(), 2);
        let err = TokenMask::open_beside(&bin, 5).unwrap_err().to_string();
        assert!(
            err.contains("train.mask has 4 bytes") && err.contains("5 tokens"),
            "{err}"
        );
        dir.write("train.mask", [0u8, 2, 1, 0]);
        let err = TokenMask::open_beside(&bin, 4).unwrap_err().to_string();
        assert!(err.contains("byte 2 at position 1"), "{err}");
    }
}
