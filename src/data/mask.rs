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
use memmap2::Mmap;
use rayon::prelude::*;

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

/// A memory-mapped `.mask` file, checked against its token file.
pub struct TokenMask {
    map: Mmap,
}

impl std::fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenMask({} tokens)", self.map.len())
    }
}

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
        // SAFETY: read-only map owned by `self`; prepare replaces files by rename only
        // (as for token files), which leaves a live map intact.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot memory-map {}", path.display()))?;
        if let Some(at) = map.par_iter().position_first(|&b| b > 1) {
            bail!(
                "{} has byte {} at position {at}; a mask holds only 0 and 1: prepare the \
                 dataset again",
                path.display(),
                map[at]
            );
        }
        Ok(Some(TokenMask { map }))
    }

    /// One byte per token, 1 = trained.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// Sets to -1 (ignored) the targets that `mask` does not train, for the windows at
/// `offsets` as [`super::fill_batch`] fills them. Returns how many targets remain.
pub fn apply_mask(
    mask: &[u8],
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
    let mut kept = 0;
    for (&offset, row) in offsets.iter().zip(targets.chunks_exact_mut(block_size)) {
        let Some(bits) = mask.get(offset + 1..offset + 1 + block_size) else {
            bail!(
                "window at offset {offset} runs past the {} bytes of the mask",
                mask.len()
            );
        };
        for (t, &bit) in row.iter_mut().zip(bits) {
            if bit == 0 {
                *t = -1;
            } else {
                kept += 1;
            }
        }
    }
    Ok(kept)
}

/// How many targets `mask` trains in the windows at `offsets` (as [`apply_mask`]
/// would keep), without filling a batch.
pub fn count_trained(mask: &[u8], offsets: &[usize], block_size: usize) -> usize {
    offsets
        .iter()
        .map(|&o| {
            mask[o + 1..o + 1 + block_size]
                .iter()
                .filter(|&&b| b != 0)
                .count()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::TempDir;

    #[test]
    fn mask_drops_untrained_targets() {
        let mask = [0u8, 0, 1, 1, 0, 1, 1, 0];
        let mut targets = [10i32, 11, 12, 20, 21, 22];
        let kept = apply_mask(&mask, &[0, 4], 3, &mut targets).unwrap();
        // Row 0 targets tokens 1..4 (mask 0,1,1); row 1 tokens 5..8 (1,1,0).
        assert_eq!(targets, [-1, 11, 12, 20, 21, -1]);
        assert_eq!(kept, 4);
        assert_eq!(count_trained(&mask, &[0, 4], 3), 4);
        let err = apply_mask(&mask, &[5], 3, &mut targets[..3]).unwrap_err();
        assert!(err.to_string().contains("offset 5"), "{err}");
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
        assert_eq!(m.bytes(), [0, 1, 1, 0]);
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
