//! Token files and batches.
//!
//! A [`TokenFile`] reads a `train.bin` / `val.bin` with positional reads, one window
//! at a time (B·(T+1) tokens a micro-step): no memory map, so a file truncated or
//! rewritten while a run reads it is an error naming the file, never a `SIGBUS`.
//! Training batches are
//! random windows like nanoGPT's `get_batch`, but the offsets of each optimizer
//! step's global batch are a pure function of `(seed, draw, iteration)`
//! ([`batch_offsets`]): micro-step `k` of `B` rows takes rows `k·B .. (k+1)·B`,
//! ranks can slice the same global batch, and a resumed run sees the same data.
//! Evaluation over a whole file uses sequential windows ([`eval_window_offsets`]).

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{bail, ensure, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::meta::{Meta, TokenDtype};
use super::Split;

/// An open `.bin` file of little-endian token ids (uint16 or uint32, as its
/// `meta.json` says), read window by window into `u32`s.
pub struct TokenFile {
    path: PathBuf,
    file: File,
    dtype: TokenDtype,
    /// Its size when opened; a read finding another size is an error.
    bytes: u64,
    /// The vocabulary [`TokenFile::check_vocab`] checked the whole file against (0:
    /// none yet); every window read later is checked against it too.
    vocab: AtomicUsize,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TokenFile({}, {} {} tokens)",
            self.path.display(),
            self.len(),
            self.dtype
        )
    }
}

/// Tokens read by [`TokenFile::read_all`] and [`TokenFile::check_vocab`] at a time.
const READ_CHUNK: usize = 1 << 22;

impl TokenFile {
    /// Opens `path`, a file of `dtype` ids, refusing a missing or empty file and one
    /// whose length is not a whole number of ids.
    pub fn open(path: &Path, dtype: TokenDtype) -> Result<TokenFile> {
        if cfg!(target_endian = "big") {
            bail!("token files are little-endian and this machine is big-endian: unsupported");
        }
        crate::fsutil::check_regular_file(path, "token file")?;
        let file = File::open(path).with_context(|| {
            format!(
                "cannot open token file {}; prepare the dataset with `nanogpt prepare`",
                path.display()
            )
        })?;
        let bytes = file
            .metadata()
            .with_context(|| format!("cannot read {}", path.display()))?
            .len();
        ensure!(
            bytes > 0,
            "token file {} is empty; prepare the dataset again with `nanogpt prepare`",
            path.display()
        );
        ensure!(
            bytes.is_multiple_of(dtype.width() as u64),
            "token file {} has a length of {bytes} bytes, not a whole number of {dtype} \
             tokens ({} bytes each; truncated copy?); prepare the dataset again",
            path.display(),
            dtype.width()
        );
        ensure!(
            usize::try_from(bytes).is_ok(),
            "token file {} ({bytes} bytes) is too large for this machine's address space",
            path.display()
        );
        Ok(TokenFile {
            path: path.to_path_buf(),
            file,
            dtype,
            bytes,
            vocab: AtomicUsize::new(0),
        })
    }

    /// Opens `dir/train.bin` or `dir/val.bin`, of `meta`'s dtype, checking its length
    /// against `meta`.
    pub fn open_split(dir: &Path, split: Split, meta: &Meta) -> Result<TokenFile> {
        let file = TokenFile::open(&dir.join(split.file_name()), meta.dtype)?;
        let expected = meta.tokens(split);
        ensure!(
            file.len() as u64 == expected,
            "{} holds {} tokens but {} says {expected}: the files come from different \
             runs of prepare; prepare the dataset again",
            file.path.display(),
            file.len(),
            dir.join(Meta::FILE_NAME).display()
        );
        Ok(file)
    }

    /// Number of tokens (when opened).
    pub fn len(&self) -> usize {
        (self.bytes / self.dtype.width() as u64) as usize
    }

    /// The width of its ids.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Always false: empty files are refused on open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file these tokens come from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads tokens `start .. start + out.len()` into `out`. A file that is now
    /// shorter, or of another size than when opened, is an error naming it.
    pub fn read_at(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let end = start.saturating_add(out.len());
        ensure!(
            end <= self.len(),
            "tokens {start}..{end} run past the {} tokens of {}",
            self.len(),
            self.path.display()
        );
        let width = self.dtype.width();
        let n = out.len();
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        let bytes = &mut bytes[..n * width];
        let read = self.file.read_exact_at(bytes, (start * width) as u64);
        let now = self.file.metadata().map(|m| m.len()).ok();
        if read.is_err() || now != Some(self.bytes) {
            let size = match now {
                Some(n) => format!("{n} bytes now, {} when opened", self.bytes),
                None => format!("{} bytes when opened", self.bytes),
            };
            let why = match read {
                Err(e) => format!("{e}; "),
                Ok(()) => String::new(),
            };
            bail!(
                "token file {} changed while in use ({why}{size}); re-run prepare into a \
                 new folder, not over the dataset a run is reading",
                self.path.display()
            );
        }
        if self.dtype == TokenDtype::Uint16 {
            widen_u16_in_place(out);
        }
        Ok(())
    }

    /// The whole file.
    pub fn read_all(&self) -> Result<Vec<u32>> {
        let mut tokens = vec![0; self.len()];
        for (k, chunk) in tokens.chunks_mut(READ_CHUNK).enumerate() {
            self.read_at(k * READ_CHUNK, chunk)?;
        }
        Ok(tokens)
    }

    /// Checks, chunk by chunk (in parallel within one), that every token id is below
    /// `vocab_size`; windows read later are checked against it too.
    pub fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        if let Some((position, id)) = self.first_outside(vocab_size)? {
            bail!(
                "{} has token id {id} at position {position}, outside the vocabulary of \
                 {vocab_size} from meta.json: the files do not belong together; prepare \
                 the dataset again",
                self.path.display()
            );
        }
        self.vocab.store(vocab_size, Ordering::Relaxed);
        Ok(())
    }

    /// The position and id of the first token id at or above `vocab_size`, if any.
    pub fn first_outside(&self, vocab_size: usize) -> Result<Option<(usize, u32)>> {
        const PIECE: usize = 1 << 16;
        let mut chunk = vec![0u32; READ_CHUNK.min(self.len())];
        for start in (0..self.len()).step_by(READ_CHUNK) {
            let n = READ_CHUNK.min(self.len() - start);
            self.read_at(start, &mut chunk[..n])?;
            let bad = chunk[..n]
                .par_chunks(PIECE)
                .enumerate()
                .find_map_first(|(c, piece)| {
                    let i = piece.iter().position(|&t| t as usize >= vocab_size)?;
                    Some((start + c * PIECE + i, piece[i]))
                });
            if bad.is_some() {
                return Ok(bad);
            }
        }
        Ok(None)
    }

    /// Reads the windows starting at `offsets` (each `block_size + 1` tokens, through
    /// `window`, resized as needed) into `inputs` and `targets` as [`fill_batch`] does.
    /// After [`TokenFile::check_vocab`], a token outside that vocabulary (the file was
    /// rewritten in place) is an error.
    pub fn read_batch(
        &self,
        offsets: &[usize],
        block_size: usize,
        window: &mut Vec<u32>,
        inputs: &mut [u32],
        targets: &mut [i32],
    ) -> Result<()> {
        let row = block_size + 1;
        window.resize(offsets.len() * row, 0);
        for (&offset, dst) in offsets.iter().zip(window.chunks_exact_mut(row)) {
            self.read_at(offset, dst)?;
        }
        let vocab = self.vocab.load(Ordering::Relaxed);
        if vocab > 0 {
            if let Some(t) = window.iter().find(|&&t| t as usize >= vocab) {
                bail!(
                    "token file {} changed while in use (token id {t} is outside the \
                     vocabulary of {vocab} it was checked against); re-run prepare into a new \
                     folder, not over the dataset a run is reading",
                    self.path.display()
                );
            }
        }
        let rows = batch_rows(offsets.len(), block_size, inputs, targets)?;
        for (tokens, (input, target)) in window.chunks_exact(row).zip(rows) {
            copy_window(tokens, input, target);
        }
        Ok(())
    }

    /// A 64-bit fingerprint of the file: its length and 64 evenly spaced runs of up
    /// to 256 tokens, hashed (an identity check, not a defence against forgery). A
    /// token enters as its id rotated left by 48 bits: for uint16 ids that is the
    /// shift earlier versions used, so their fingerprints are unchanged.
    pub fn fingerprint(&self) -> Result<u64> {
        const RUNS: usize = 64;
        const RUN: usize = 256;
        let n = self.len();
        let mut hash = crate::kernels::dropout::mix64(n as u64 ^ 0x6461_7461);
        let mut run = [0u32; RUN];
        for k in 0..RUNS {
            let start = (n as u128 * k as u128 / RUNS as u128) as usize;
            let take = RUN.min(n - start);
            self.read_at(start, &mut run[..take])?;
            for (i, &t) in run[..take].iter().enumerate() {
                let word = (start + i) as u64 ^ u64::from(t).rotate_left(48);
                hash = crate::kernels::dropout::mix64(hash ^ word);
            }
        }
        Ok(hash)
    }

    /// Checks that the file holds at least one training window of `block_size`.
    pub fn check_block_size(&self, block_size: usize) -> Result<()> {
        ensure!(
            self.len() > block_size,
            "{} has {} tokens, too few for one window of block_size {block_size} (+1 \
             target); use a smaller block_size or more data{}",
            self.path.display(),
            self.len(),
            match self.path.file_name().is_some_and(|n| n == "val.bin") {
                // Many short documents (instruction data) leave 0.05 % for val.bin.
                true => ", or prepare it again with a larger --val-fraction (e.g. 0.05)",
                false => "",
            }
        );
        Ok(())
    }
}

/// Widens the uint16 ids packed into the first half of `out`'s bytes into `out`,
/// from the last id to the first: id `i` moves to bytes `4i..4i+4`, which hold packed
/// ids `2i` and `2i+1`, both already moved (or id `i` itself, read first, for 0).
fn widen_u16_in_place(out: &mut [u32]) {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    for i in (0..bytes.len() / 4).rev() {
        let id = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
        bytes[4 * i..4 * i + 4].copy_from_slice(&u32::from(id).to_ne_bytes());
    }
}

/// Which file a batch reads and for what: training steps and the two evaluations
/// draw from independent random streams, so evaluating never shifts training data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Draw {
    /// The batches of optimizer steps (from `train.bin`).
    Train,
    /// Loss estimates on `train.bin`.
    EvalTrain,
    /// Loss estimates on `val.bin`.
    EvalVal,
}

impl Draw {
    fn tag(self) -> u64 {
        match self {
            Draw::Train => 1,
            Draw::EvalTrain => 2,
            Draw::EvalVal => 3,
        }
    }
}

/// Start offsets of the `rows` windows of one global batch, each uniform in
/// `0..=data_len - block_size - 1` so every window of `block_size + 1` tokens fits.
///
/// A pure function of its arguments: `rows = batch_size × gradient_accumulation_steps`
/// and micro-step `k` uses rows `k·batch_size .. (k+1)·batch_size`. For evaluation,
/// pass `Draw::EvalTrain` / `Draw::EvalVal` with `iter = 0..eval_iters` to score the
/// same batches at every evaluation.
pub fn batch_offsets(
    seed: u64,
    draw: Draw,
    iter: u64,
    rows: usize,
    data_len: usize,
    block_size: usize,
) -> Result<Vec<usize>> {
    let mut offsets = vec![0; rows];
    batch_offsets_into(seed, draw, iter, data_len, block_size, &mut offsets)?;
    Ok(offsets)
}

/// [`batch_offsets`] writing into the caller's buffer (one row per element).
pub fn batch_offsets_into(
    seed: u64,
    draw: Draw,
    iter: u64,
    data_len: usize,
    block_size: usize,
    offsets: &mut [usize],
) -> Result<()> {
    ensure!(
        block_size > 0 && data_len > block_size,
        "{data_len} tokens are too few for one window of block_size {block_size} (+1 \
         target); use a smaller block_size or more data"
    );
    let max = (data_len - block_size - 1) as u64;
    let mut rng = batch_rng(seed, draw, iter);
    for offset in offsets {
        // Drawn as u64 so that every platform sees the same numbers.
        *offset = rng.gen_range(0..=max) as usize;
    }
    Ok(())
}

/// A generator keyed by all three inputs (no mixing, so no collisions).
fn batch_rng(seed: u64, draw: Draw, iter: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&draw.tag().to_le_bytes());
    key[16..24].copy_from_slice(&iter.to_le_bytes());
    key[24..].copy_from_slice(b"nGPTdata");
    ChaCha8Rng::from_seed(key)
}

/// Copies the windows starting at `offsets` into `inputs` (tokens `o .. o+T`) and
/// `targets` (tokens `o+1 .. o+T+1`), row after row; both hold
/// `offsets.len() × block_size` elements. Allocates nothing.
pub fn fill_batch(
    tokens: &[u32],
    offsets: &[usize],
    block_size: usize,
    inputs: &mut [u32],
    targets: &mut [i32],
) -> Result<()> {
    let rows = batch_rows(offsets.len(), block_size, inputs, targets)?;
    for (&offset, (input, target)) in offsets.iter().zip(rows) {
        let end = offset.saturating_add(block_size + 1);
        let Some(window) = tokens.get(offset..end) else {
            bail!(
                "window at offset {offset} (+{} tokens) runs past the {} tokens of the data",
                block_size + 1,
                tokens.len()
            );
        };
        copy_window(window, input, target);
    }
    Ok(())
}

/// The `rows` (input, target) rows of `block_size` of a batch's buffers, which must
/// hold exactly `rows × block_size` elements each.
fn batch_rows<'a>(
    rows: usize,
    block_size: usize,
    inputs: &'a mut [u32],
    targets: &'a mut [i32],
) -> Result<impl Iterator<Item = (&'a mut [u32], &'a mut [i32])>> {
    let cells = rows * block_size;
    ensure!(
        inputs.len() == cells && targets.len() == cells,
        "batch buffers hold {} inputs and {} targets, but {rows} rows × block_size \
         {block_size} need {cells}",
        inputs.len(),
        targets.len(),
    );
    Ok(inputs
        .chunks_exact_mut(block_size)
        .zip(targets.chunks_exact_mut(block_size)))
}

/// One window of `T + 1` tokens into a row: inputs its first `T`, targets its last `T`
/// (ids are below [`TokenDtype::max_vocab`], so they fit an `i32`).
fn copy_window(window: &[u32], input: &mut [u32], target: &mut [i32]) {
    input.copy_from_slice(&window[..input.len()]);
    for (slot, &t) in target.iter_mut().zip(&window[1..]) {
        *slot = t as i32;
    }
}

/// How many whole, non-overlapping evaluation windows the data holds: window `k`
/// reads inputs `k·T .. k·T+T` and targets `k·T+1 .. k·T+T+1`.
pub fn eval_window_count(data_len: usize, block_size: usize) -> usize {
    match block_size {
        0 => 0,
        t => data_len.saturating_sub(1) / t,
    }
}

/// Start offsets of evaluation windows `windows` (see [`eval_window_count`]), for
/// [`fill_batch`].
pub fn eval_window_offsets(windows: Range<usize>, block_size: usize) -> Vec<usize> {
    windows.map(|k| k * block_size).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::meta::TokenizerKind;
    use crate::data::testutil::TempDir;

    const U16: TokenDtype = TokenDtype::Uint16;

    fn write_tokens(dir: &TempDir, name: &str, tokens: &[u16]) -> PathBuf {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        dir.write(name, bytes)
    }

    #[test]
    fn token_file_reads_little_endian_u16() {
        let dir = TempDir::new("loader-read");
        let path = dir.write("t.bin", [1u8, 0, 0, 1, 255, 255]);
        let file = TokenFile::open(&path, U16).unwrap();
        assert_eq!(file.len(), 3);
        assert_eq!(file.read_all().unwrap(), [1, 256, 65535]);
        // Reads at any offset and length widen the right ids.
        let ids: Vec<u16> = (0..1000u16).map(|i| i.wrapping_mul(40503)).collect();
        let file = TokenFile::open(&write_tokens(&dir, "w.bin", &ids), U16).unwrap();
        for (start, len) in [(0, 1), (1, 2), (3, 997), (500, 333), (999, 1)] {
            let mut out = vec![7u32; len];
            file.read_at(start, &mut out).unwrap();
            let want: Vec<u32> = ids[start..start + len].iter().map(|&t| t.into()).collect();
            assert_eq!(out, want, "{start}+{len}");
        }
    }

    #[test]
    fn token_file_reads_little_endian_u32() {
        let dir = TempDir::new("loader-read32");
        let ids = [0u32, 65_535, 65_536, 128_255, 151_668];
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        let path = dir.write("t.bin", &bytes);
        let file = TokenFile::open(&path, TokenDtype::Uint32).unwrap();
        assert_eq!((file.len(), file.dtype()), (5, TokenDtype::Uint32));
        assert_eq!(file.read_all().unwrap(), ids);
        file.check_vocab(151_669).unwrap();
        let err = file.check_vocab(128_256).unwrap_err().to_string();
        assert!(err.contains("id 151668 at position 4"), "{err}");
        // The same bytes read as uint16 are ten other ids.
        assert_eq!(TokenFile::open(&path, U16).unwrap().len(), 10);
        let odd = dir.write("odd.bin", [0u8; 6]);
        let err = TokenFile::open(&odd, TokenDtype::Uint32)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a whole number of uint32"), "{err}");
        // A window of ids beyond uint16 reaches inputs and targets whole.
        let (mut window, mut x, mut y) = (Vec::new(), [0u32; 2], [0i32; 2]);
        file.read_batch(&[2], 2, &mut window, &mut x, &mut y)
            .unwrap();
        assert_eq!((x, y), ([65_536, 128_255], [128_255, 151_668]));
    }

    #[test]
    fn fingerprint_of_uint16_files_is_unchanged() {
        // Pinned: checkpoints record these fingerprints and resume compares them.
        let dir = TempDir::new("loader-fp");
        let ids: Vec<u16> = (0..5000u32).map(|i| (i * 7919 % 65536) as u16).collect();
        let file = TokenFile::open(&write_tokens(&dir, "t.bin", &ids), U16).unwrap();
        assert_eq!(file.fingerprint().unwrap(), FINGERPRINT);
    }

    #[test]
    fn token_file_refuses_missing_empty_and_odd_files() {
        let dir = TempDir::new("loader-bad");
        let missing = dir.path().join("none.bin");
        let err = format!("{:#}", TokenFile::open(&missing, U16).unwrap_err());
        assert!(
            err.contains("none.bin") && err.contains("nanogpt prepare"),
            "{err}"
        );
        let empty = dir.write("empty.bin", []);
        let err = TokenFile::open(&empty, U16).unwrap_err().to_string();
        assert!(
            err.contains("empty.bin") && err.contains("is empty"),
            "{err}"
        );
        let odd = dir.write("odd.bin", [1, 2, 3]);
        let err = TokenFile::open(&odd, U16).unwrap_err().to_string();
        assert!(
            err.contains("odd.bin") && err.contains("length of 3 bytes"),
            "{err}"
        );
    }

    #[test]
    fn open_split_checks_meta_counts() {
        let dir = TempDir::new("loader-split");
        write_tokens(&dir, "train.bin", &[1, 2, 3]);
        let mut meta = Meta {
            tokenizer: TokenizerKind::Gpt2,
            vocab_size: 50257,
            dtype: U16,
            train_tokens: 3,
            val_tokens: 1,
            chars: None,
            tokenizer_sha256: None,
            source: String::new(),
        };
        assert_eq!(
            TokenFile::open_split(dir.path(), Split::Train, &meta)
                .unwrap()
                .len(),
            3
        );
        meta.train_tokens = 4;
        let err = TokenFile::open_split(dir.path(), Split::Train, &meta).unwrap_err();
        assert!(err.to_string().contains("holds 3 tokens but"), "{err}");
    }

    #[test]
    fn check_vocab_finds_first_bad_token() {
        let dir = TempDir::new("loader-vocab");
        let path = write_tokens(&dir, "t.bin", &[0, 5, 64, 70, 2]);
        let file = TokenFile::open(&path, U16).unwrap();
        file.check_vocab(71).unwrap();
        let err = file.check_vocab(65).unwrap_err().to_string();
        assert!(err.contains("id 70 at position 3"), "{err}");
    }

    #[test]
    fn short_data_is_refused_with_block_size() {
        let dir = TempDir::new("loader-short");
        let path = write_tokens(&dir, "t.bin", &[1; 64]);
        let file = TokenFile::open(&path, U16).unwrap();
        file.check_block_size(63).unwrap();
        let err = file.check_block_size(64).unwrap_err().to_string();
        assert!(
            err.contains("t.bin")
                && err.contains("64 tokens")
                && err.contains("smaller block_size")
                && !err.contains("--val-fraction")
        );
        // A short val.bin (many short documents at the default 0.05 %) names the fix.
        let val = TokenFile::open(&write_tokens(&dir, "val.bin", &[1; 46]), U16).unwrap();
        let err = val.check_block_size(512).unwrap_err().to_string();
        assert!(err.contains("a larger --val-fraction"), "{err}");
        let err = batch_offsets(1, Draw::Train, 0, 2, 64, 64)
            .unwrap_err()
            .to_string();
        assert!(err.contains("block_size 64"), "{err}");
    }

    #[test]
    fn batch_offsets_are_a_pure_function_of_seed_draw_iter() {
        let a = batch_offsets(1337, Draw::Train, 7, 64, 10_000, 256).unwrap();
        assert_eq!(
            a,
            batch_offsets(1337, Draw::Train, 7, 64, 10_000, 256).unwrap()
        );
        assert_ne!(
            a,
            batch_offsets(1337, Draw::Train, 8, 64, 10_000, 256).unwrap()
        );
        assert_ne!(
            a,
            batch_offsets(1338, Draw::Train, 7, 64, 10_000, 256).unwrap()
        );
        assert_ne!(
            a,
            batch_offsets(1337, Draw::EvalTrain, 7, 64, 10_000, 256).unwrap()
        );
        // A prefix of a larger batch is the smaller batch: ranks can slice rows.
        let more = batch_offsets(1337, Draw::Train, 7, 128, 10_000, 256).unwrap();
        assert_eq!(&more[..64], &a[..]);
        let mut buf = [0usize; 64];
        batch_offsets_into(1337, Draw::Train, 7, 10_000, 256, &mut buf).unwrap();
        assert_eq!(&buf[..], &a[..]);
    }

    #[test]
    fn batch_offsets_golden_values() {
        // Pinned so a dependency upgrade cannot silently change resumed runs.
        let got = batch_offsets(1337, Draw::Train, 0, 4, 1_000_000, 1024).unwrap();
        assert_eq!(got, GOLDEN);
    }

    const GOLDEN: [usize; 4] = [745_014, 4_574, 128_343, 154_125];

    /// The fingerprint of `fingerprint_of_uint16_files_is_unchanged`'s file under the
    /// earlier formula (`id << 48`), computed independently.
    const FINGERPRINT: u64 = 0xf864_de8c_1879_c7a0;

    #[test]
    fn batch_offsets_cover_the_whole_inclusive_range() {
        let (len, block) = (20, 16); // offsets 0..=3
        let mut seen = [0usize; 4];
        for iter in 0..200 {
            for o in batch_offsets(5, Draw::EvalVal, iter, 8, len, block).unwrap() {
                seen[o] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n > 300), "{seen:?}");
        let tight = batch_offsets(5, Draw::Train, 0, 8, 17, 16).unwrap();
        assert_eq!(tight, vec![0; 8]);
    }

    #[test]
    fn fill_batch_copies_shifted_windows() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut inputs = [0u32; 8];
        let mut targets = [0i32; 8];
        fill_batch(&tokens, &[0, 95], 4, &mut inputs, &mut targets).unwrap();
        assert_eq!(inputs, [0, 1, 2, 3, 95, 96, 97, 98]);
        assert_eq!(targets, [1, 2, 3, 4, 96, 97, 98, 99]);
        let err = fill_batch(&tokens, &[0, 96], 4, &mut inputs, &mut targets).unwrap_err();
        assert!(err.to_string().contains("offset 96"), "{err}");
        let err = fill_batch(&tokens, &[0], 4, &mut inputs, &mut targets).unwrap_err();
        assert!(err.to_string().contains("need 4"), "{err}");
    }

    #[test]
    fn eval_windows_tile_the_data() {
        assert_eq!(eval_window_count(10, 3), 3);
        assert_eq!(eval_window_count(9, 3), 2);
        assert_eq!(eval_window_count(3, 3), 0);
        assert_eq!(eval_window_count(0, 3), 0);
        let tokens: Vec<u32> = (0..10).collect();
        let offsets = eval_window_offsets(1..3, 3);
        assert_eq!(offsets, [3, 6]);
        let (mut inputs, mut targets) = ([0u32; 6], [0i32; 6]);
        fill_batch(&tokens, &offsets, 3, &mut inputs, &mut targets).unwrap();
        assert_eq!(inputs, [3, 4, 5, 6, 7, 8]);
        assert_eq!(targets, [4, 5, 6, 7, 8, 9]);
    }
}
