//! `nanogpt prepare`: text → `train.bin`, `val.bin`, `meta.json`.
//!
//! The source is streamed in batches of pieces; each batch is tokenized in parallel
//! (rayon) and appended, in order, to the `.bin` files. The files are written into a
//! temporary folder beside `--out` and moved into place together only when complete
//! ([`Staged`]): a dataset never mixes files of two runs.

use std::collections::BTreeSet;
use std::fmt;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

use crate::fsutil::{OutputKind, Staged};

use super::instruct::{instruct_eot, DataFormat, Example, CHAR_EOT};
use super::mask::{mask_path, MaskWriter};
use super::meta::{Meta, TokenDtype};
use super::readers::{ProgressUnit, Source};
use super::token_writer::TokenWriter;
use super::tokenizer::files::{self, TokenizerFiles};
use super::tokenizer::hf::HfTokenizer;
use super::tokenizer::Tokenizer;
use super::Split;

/// Text handed to the tokenizer threads at once.
const BATCH_BYTES: usize = 16 << 20;
/// Validation share of a single document (nanoGPT's shakespeare split: 90/10).
pub const DEFAULT_VAL_FRACTION_SINGLE: f64 = 0.1;
/// Validation share of a multi-document corpus (nanoGPT's openwebtext split).
pub const DEFAULT_VAL_FRACTION_DOCUMENTS: f64 = 0.0005;
/// A single document goes through a model's tokenizer in pieces of about this size.
const PIECE_BYTES: usize = 256 << 10;
/// Text of a single document that a model's tokenizer could not be given in pieces is
/// held up to this size before `prepare` gives up.
const MAX_UNCUT_BYTES: usize = 256 << 20;

/// The tokenizer `prepare` is asked for: `gpt2`, `char`, or a model's own (a folder
/// holding `tokenizer.json`, or the path of one; or its files already read, as those
/// a GGUF file's metadata makes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerSpec {
    Gpt2,
    Char,
    Model(PathBuf),
    Files(Box<TokenizerFiles>),
}

impl FromStr for TokenizerSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "gpt2" => TokenizerSpec::Gpt2,
            "char" => TokenizerSpec::Char,
            "" => bail!("--tokenizer needs gpt2, char, or a model folder holding tokenizer.json"),
            path => TokenizerSpec::Model(PathBuf::from(path)),
        })
    }
}

/// What `nanogpt prepare` was asked to do.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareOptions {
    /// `shakespeare`, a `.txt` / `.jsonl` / `.parquet` file, or a directory of them.
    pub source: String,
    /// Where `train.bin`, `val.bin` and `meta.json` go (created if missing).
    pub out_dir: PathBuf,
    pub tokenizer: TokenizerSpec,
    /// Share of the text that goes to `val.bin`; `None` picks
    /// `DEFAULT_VAL_FRACTION_SINGLE` for one document and
    /// `DEFAULT_VAL_FRACTION_DOCUMENTS` for many.
    pub val_fraction: Option<f64>,
    /// JSONL field / parquet column holding the text.
    pub text_column: String,
    /// Draw a progress bar (only ever when stderr is a terminal).
    pub show_progress: bool,
    /// How `.jsonl` lines are read; `None` detects it per file (see
    /// [`DataFormat::detect`]). Alpaca and chat examples are written with a loss mask.
    pub format: Option<DataFormat>,
    /// Extra variables of a model's chat template (`enable_thinking`).
    pub template_variables: serde_json::Map<String, serde_json::Value>,
}

impl PrepareOptions {
    /// The JSONL field / parquet column read unless `--text-column` says otherwise.
    pub const DEFAULT_TEXT_COLUMN: &'static str = "text";

    /// Options with the defaults: GPT-2 tokens, default split, column `text`.
    pub fn new(source: impl Into<String>, out_dir: impl Into<PathBuf>) -> PrepareOptions {
        PrepareOptions {
            source: source.into(),
            out_dir: out_dir.into(),
            tokenizer: TokenizerSpec::Gpt2,
            val_fraction: None,
            text_column: Self::DEFAULT_TEXT_COLUMN.to_string(),
            show_progress: true,
            format: None,
            template_variables: serde_json::Map::new(),
        }
    }
}

/// What [`prepare`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareSummary {
    pub out_dir: PathBuf,
    /// The `meta.json` that was written.
    pub meta: Meta,
    /// Non-empty documents read (1 for a single-document source).
    pub documents: u64,
    /// Of which went to `val.bin` (0 for a single document, split by position).
    pub val_documents: u64,
}

impl fmt::Display for PrepareSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wrote {} train and {} val tokens ({} tokenizer, vocab {}, {}) from {} \
             document(s) to {}",
            self.meta.train_tokens,
            self.meta.val_tokens,
            self.meta.tokenizer,
            self.meta.vocab_size,
            self.meta.dtype,
            self.documents,
            self.out_dir.display()
        )
    }
}

/// A prepared dataset's folder: the token files, the masks of instruction data, and
/// the model's tokenizer files (a dataset prepared with `--tokenizer MODEL_DIR`), and
/// `meta.json` (what marks a dataset) last. A new dataset replaces the previous one
/// whole: the masks of an earlier instruction dataset, and the tokenizer files of an
/// earlier model's, go with it.
pub const DATASET: OutputKind = OutputKind {
    what: "prepare",
    files: &[
        "train.bin",
        "val.bin",
        "train.mask",
        "val.mask",
        files::TOKENIZER_JSON,
        files::TOKENIZER_CONFIG,
        files::CHAT_TEMPLATE,
        files::GENERATION_CONFIG,
        "meta.json",
    ],
    last: "meta.json",
};

/// Tokenizes a text source into `train.bin`, `val.bin` and `meta.json`.
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareSummary> {
    let source = Source::resolve_as(&opts.source, &opts.text_column, opts.format)?;
    prepare_source(&source, opts)
}

/// [`prepare`] for an already resolved source (`opts.source` is not read).
pub fn prepare_source(source: &Source, opts: &PrepareOptions) -> Result<PrepareSummary> {
    if source.is_instruct() && opts.text_column != PrepareOptions::DEFAULT_TEXT_COLUMN {
        crate::errln!(
            "note: --text-column {} is not used: instruction examples are read from their \
             own fields (instruction, input, output; or messages), not from a text field",
            opts.text_column
        );
    }
    let single = source.is_single_document();
    let fraction = opts.val_fraction.unwrap_or(if single {
        DEFAULT_VAL_FRACTION_SINGLE
    } else {
        DEFAULT_VAL_FRACTION_DOCUMENTS
    });
    check_fraction(fraction)?;
    let char_level = opts.tokenizer == TokenizerSpec::Char;
    // A model's tokenizer is read first: a missing file is refused before a long scan.
    let model = match &opts.tokenizer {
        TokenizerSpec::Model(path) => Some(Tokenizer::from_files(TokenizerFiles::read(path)?)?),
        TokenizerSpec::Files(files) => Some(Tokenizer::from_files((**files).clone())?),
        _ => None,
    };
    let scan = match single || char_level {
        true => scan(source, char_level, opts.show_progress)?,
        false => Scan::default(),
    };
    let tokenizer = match (&opts.tokenizer, model) {
        (_, Some(model)) => model,
        (TokenizerSpec::Char, _) if scan.chars.is_empty() => bail!(empty_corpus(source)),
        // Instruction data ends each response with U+0003 (END OF TEXT).
        (TokenizerSpec::Char, _) => Tokenizer::char_level(
            scan.chars
                .iter()
                .copied()
                .chain(source.is_instruct().then_some(CHAR_EOT)),
        )?,
        _ => Tokenizer::gpt2(),
    };
    let out_dir = &opts.out_dir;
    if out_dir.symlink_metadata().is_ok() && !out_dir.exists() {
        bail!(
            "--out {} is a symbolic link to nothing; remove the link or choose another --out",
            out_dir.display()
        );
    }
    if out_dir.exists() && !out_dir.is_dir() {
        bail!(
            "--out {} is a file, not a folder; choose another --out",
            out_dir.display()
        );
    }
    let made = crate::fsutil::create_dir_all_noting(out_dir).with_context(|| {
        format!(
            "cannot create output folder {}; check permissions or choose another --out",
            out_dir.display()
        )
    })?;
    // Nothing prepared (an error): the folder this run created goes too.
    let _lock =
        crate::fsutil::DirLock::acquire(out_dir, "--out", "a prepare run")?.created_here(made);
    let run = Run {
        source,
        opts,
        tokenizer: &tokenizer,
        fraction,
        train_chars: (scan.char_count as f64 * (1.0 - fraction)) as u64,
    };
    run.write()
}

/// What one `prepare` writes, and from what.
struct Run<'a> {
    source: &'a Source,
    opts: &'a PrepareOptions,
    tokenizer: &'a Tokenizer,
    fraction: f64,
    /// One document: the characters that go to train.
    train_chars: u64,
}

impl Run<'_> {
    /// Writes the dataset into `--out` (whose lock the caller holds), whole: the
    /// tokenizer files of an earlier dataset that this one does not write go with it.
    fn write(&self) -> Result<PrepareSummary> {
        let (source, opts, tokenizer) = (self.source, self.opts, self.tokenizer);
        let out_dir = &opts.out_dir;
        // Temporary files an older version wrote inside --out: every writer of these
        // files held the lock we hold, so any of them is a leftover.
        let stale = crate::fsutil::Stale::AllButOurs;
        for path in crate::fsutil::remove_stale_temps(out_dir, DATASET.files, stale) {
            crate::errln!(
                "note: removed {}, left by an interrupted prepare",
                path.display()
            );
        }
        let staged = Staged::begin(out_dir, &DATASET)?;
        let dtype = TokenDtype::for_vocab(tokenizer.vocab_size());
        let mut out = Outputs::create(staged.dir(), source.is_instruct(), dtype)?;
        let bar = progress_bar(source, "tokenizing", opts.show_progress)?;
        let docs = if source.is_instruct() {
            let vars = &opts.template_variables;
            write_examples(source, tokenizer, self.fraction, vars, &mut out, &bar)?
        } else if source.is_single_document() {
            let chars = self.train_chars;
            match tokenizer.hf() {
                Some(hf) => write_single_document_in_pieces(source, hf, chars, &mut out, &bar)?,
                None => write_single_document(source, tokenizer, chars, &mut out, &bar)?,
            }
        } else {
            write_documents(source, tokenizer, self.fraction, &mut out, &bar)?
        };
        bar.finish_and_clear();
        check_outputs(source, &out, &docs)?;
        let meta = Meta {
            train_tokens: out.train.tokens(),
            val_tokens: out.val.tokens(),
            ..tokenizer.meta(source.describe())
        };
        out.commit()?;
        if let Some(hf) = tokenizer.hf() {
            hf.files().write_into(staged.dir())?;
        }
        meta.save(staged.dir())?;
        staged.commit()?;
        Ok(PrepareSummary {
            out_dir: opts.out_dir.clone(),
            meta,
            documents: docs.train + docs.val,
            val_documents: docs.val,
        })
    }
}

fn check_fraction(fraction: f64) -> Result<()> {
    if !(fraction > 0.0 && fraction < 1.0) {
        bail!(
            "--val-fraction {fraction} is out of range: it must be above 0 and below 1 \
             (e.g. 0.1 keeps 10% of the text for validation)"
        );
    }
    Ok(())
}

fn empty_corpus(source: &Source) -> String {
    format!(
        "source {} contains no text; check the path (and --text-column for .jsonl / \
         .parquet)",
        source.describe()
    )
}

fn check_outputs(source: &Source, out: &Outputs, docs: &DocCounts) -> Result<()> {
    let (train, val) = (out.train.tokens(), out.val.tokens());
    if train == 0 && val == 0 {
        bail!(empty_corpus(source));
    }
    if source.is_single_document() && (train == 0 || val == 0) {
        bail!(
            "source {} is too short to split into train and val ({train} and {val} \
             tokens); use more text or a different --val-fraction",
            source.describe()
        );
    }
    if val == 0 || train == 0 {
        bail!(
            "source {} has {} non-empty document(s): splitting by document needs at least \
             2 (pass a single .txt file instead to split one text by position)",
            source.describe(),
            docs.train + docs.val
        );
    }
    Ok(())
}

/// A bar over the source's bytes or rows, hidden unless stderr is a terminal.
fn progress_bar(source: &Source, label: &'static str, show: bool) -> Result<ProgressBar> {
    if !show || !std::io::stderr().is_terminal() {
        return Ok(ProgressBar::hidden());
    }
    let (total, unit) = source.progress_total()?;
    let template = match unit {
        ProgressUnit::Bytes => {
            "{msg} [{bar:40}] {binary_bytes}/{binary_total_bytes} \
             ({binary_bytes_per_sec}, eta {eta})"
        }
        ProgressUnit::Rows => {
            "{msg} [{bar:40}] {human_pos}/{human_len} rows ({per_sec}, eta {eta})"
        }
    };
    let style = ProgressStyle::with_template(template)
        .context("progress bar template")?
        .progress_chars("=> ");
    Ok(ProgressBar::new(total)
        .with_style(style)
        .with_message(label))
}

/// Streams the source in batches of about [`BATCH_BYTES`] of text.
fn for_each_batch(
    source: &Source,
    bar: &ProgressBar,
    mut handle: impl FnMut(Vec<String>) -> Result<()>,
) -> Result<()> {
    let mut batch = Vec::new();
    let mut bytes = 0;
    for piece in source.pieces()? {
        let piece = piece?;
        bar.inc(piece.progress);
        bytes += piece.text.len();
        batch.push(piece.text);
        if bytes >= BATCH_BYTES {
            handle(std::mem::take(&mut batch))?;
            bytes = 0;
        }
    }
    if !batch.is_empty() {
        handle(batch)?;
    }
    Ok(())
}

/// What the first pass learns: the character set and the length in characters.
#[derive(Default)]
struct Scan {
    chars: BTreeSet<char>,
    char_count: u64,
}

fn scan(source: &Source, collect_chars: bool, show: bool) -> Result<Scan> {
    let bar = progress_bar(source, "scanning", show)?;
    let mut total = Scan::default();
    for_each_batch(source, &bar, |batch| {
        let part = batch
            .par_iter()
            .map(|text| Scan {
                chars: match collect_chars {
                    true => distinct_chars(text),
                    false => BTreeSet::new(),
                },
                char_count: text.chars().count() as u64,
            })
            .reduce(Scan::default, merge_scans);
        total = merge_scans(std::mem::take(&mut total), part);
        Ok(())
    })?;
    bar.finish_and_clear();
    Ok(total)
}

fn merge_scans(mut a: Scan, b: Scan) -> Scan {
    a.chars.extend(b.chars);
    a.char_count += b.char_count;
    a
}

fn distinct_chars(text: &str) -> BTreeSet<char> {
    let mut ascii = [false; 128];
    let mut set = BTreeSet::new();
    for c in text.chars() {
        match c.is_ascii() {
            true => ascii[c as usize] = true,
            false => {
                set.insert(c);
            }
        }
    }
    set.extend((0..128u8).filter(|&b| ascii[b as usize]).map(char::from));
    set
}

/// Tokenizes texts in parallel, keeping their order.
fn encode_all(tokenizer: &Tokenizer, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
    first_error(
        texts
            .par_iter()
            .map(|text| tokenizer.encode(text))
            .collect(),
    )
}

/// The results of a parallel map, in order, or the error of the earliest item that
/// failed: rayon's own `collect::<Result<_>>` returns whichever failure it met first,
/// so with two bad lines the message would name either, depending on the threads.
fn first_error<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    results.into_iter().collect()
}

struct Outputs {
    train: TokenWriter,
    val: TokenWriter,
    /// The `.mask` files of instruction data (train, val).
    masks: Option<(MaskWriter, MaskWriter)>,
}

impl Outputs {
    fn create(dir: &Path, masked: bool, dtype: TokenDtype) -> Result<Outputs> {
        let bin = |split: Split| dir.join(split.file_name());
        let masks = match masked {
            true => Some((
                MaskWriter::create(&mask_path(&bin(Split::Train)))?,
                MaskWriter::create(&mask_path(&bin(Split::Val)))?,
            )),
            false => None,
        };
        Ok(Outputs {
            train: TokenWriter::create(&bin(Split::Train), dtype)?,
            val: TokenWriter::create(&bin(Split::Val), dtype)?,
            masks,
        })
    }

    /// Appends `tokens` to a split, and with masks, their `mask` (one byte each).
    fn write(&mut self, split: Split, tokens: &[u32], mask: &[u8]) -> Result<()> {
        match split {
            Split::Train => self.train.write(tokens)?,
            Split::Val => self.val.write(tokens)?,
        }
        if let Some((train, val)) = &mut self.masks {
            debug_assert_eq!(tokens.len(), mask.len());
            match split {
                Split::Train => train.write(mask)?,
                Split::Val => val.write(mask)?,
            }
        }
        Ok(())
    }

    /// Renames every file into place in the temporary folder.
    fn commit(self) -> Result<()> {
        if let Some((train, val)) = self.masks {
            debug_assert_eq!(train.len(), self.train.tokens());
            train.commit()?;
            val.commit()?;
        }
        self.train.commit()?;
        self.val.commit()
    }
}

#[derive(Default)]
struct DocCounts {
    train: u64,
    val: u64,
}

/// One document split by position: its first `train_chars` characters are train,
/// the rest val, each tokenized on its own (like nanoGPT's shakespeare preps, and
/// without end-of-text tokens: there is no document boundary to mark).
fn write_single_document(
    source: &Source,
    tokenizer: &Tokenizer,
    train_chars: u64,
    out: &mut Outputs,
    bar: &ProgressBar,
) -> Result<DocCounts> {
    let mut seen = 0u64;
    for_each_batch(source, bar, |batch| {
        let mut parts: Vec<(&str, Split)> = Vec::new();
        for text in &batch {
            let (train, val) = split_at_char(text, train_chars.saturating_sub(seen));
            seen += text.chars().count() as u64;
            parts.extend([(train, Split::Train), (val, Split::Val)]);
        }
        parts.retain(|(text, _)| !text.is_empty());
        let texts: Vec<&str> = parts.iter().map(|(text, _)| *text).collect();
        let encoded = encode_all(tokenizer, &texts)
            .with_context(|| format!("cannot tokenize {}", source.describe()))?;
        for ((_, split), tokens) in parts.iter().zip(encoded) {
            out.write(*split, &tokens, &[])?;
        }
        Ok(())
    })?;
    Ok(DocCounts { train: 1, val: 0 })
}

/// Splits `text` before its `n`-th character (or keeps it whole if shorter).
fn split_at_char(text: &str, n: u64) -> (&str, &str) {
    let n = usize::try_from(n).unwrap_or(usize::MAX);
    match text.char_indices().nth(n) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    }
}

/// One document split by position, through a model's tokenizer: its first
/// `train_chars` characters are train, the rest val, each with the post-processor's
/// tokens around it (Llama 3's BOS before) and no end-of-text. The text goes through
/// the tokenizer in pieces cut where it gives the ids of the whole ([`super::cuts`]);
/// the rest of a batch after its last cut waits for the next.
fn write_single_document_in_pieces(
    source: &Source,
    hf: &HfTokenizer,
    train_chars: u64,
    out: &mut Outputs,
    bar: &ProgressBar,
) -> Result<DocCounts> {
    let (before, after) = hf.specials();
    let describe = || format!("cannot tokenize {}", source.describe());
    let mut seen = 0u64;
    let mut split = Split::Train;
    let mut pending = String::new();
    out.write(split, before, &[])?;
    for_each_batch(source, bar, |batch| {
        for text in &batch {
            let (train, val) = split_at_char(text, train_chars.saturating_sub(seen));
            seen += text.chars().count() as u64;
            match split {
                Split::Train => pending.push_str(train),
                Split::Val => pending.push_str(text),
            }
            if split == Split::Train && !val.is_empty() {
                write_pieces(hf, &pending, &[], out, split).with_context(describe)?;
                out.write(split, after, &[])?;
                split = Split::Val;
                out.write(split, before, &[])?;
                pending = val.to_string();
            }
        }
        let cuts = super::cuts::safe_cuts(hf, &pending, PIECE_BYTES).with_context(describe)?;
        if let Some(&last) = cuts.last() {
            write_pieces(hf, &pending[..last], &cuts[..cuts.len() - 1], out, split)
                .with_context(describe)?;
            pending.drain(..last);
        }
        if pending.len() > MAX_UNCUT_BYTES {
            bail!(
                "the tokenizer of {} cannot be given {} in pieces (it encodes text \
                 differently when cut at line breaks), and more than {} MB of it is \
                 waiting; split the text into documents (a folder of .txt files or a \
                 .jsonl) instead",
                hf.files().origin,
                source.describe(),
                MAX_UNCUT_BYTES >> 20
            );
        }
        Ok(())
    })?;
    write_pieces(hf, &pending, &[], out, split).with_context(describe)?;
    out.write(split, after, &[])?;
    Ok(DocCounts { train: 1, val: 0 })
}

/// Encodes `text` cut at `cuts` (in parallel, in order) into `split`.
fn write_pieces(
    hf: &HfTokenizer,
    text: &str,
    cuts: &[usize],
    out: &mut Outputs,
    split: Split,
) -> Result<()> {
    let bounds: Vec<usize> = std::iter::once(0)
        .chain(cuts.iter().copied())
        .chain(std::iter::once(text.len()))
        .collect();
    let encoded = bounds
        .par_windows(2)
        .map(|w| hf.encode(&text[w[0]..w[1]]))
        .collect::<Result<Vec<_>>>()?;
    for ids in encoded {
        out.write(split, &ids, &[])?;
    }
    Ok(())
}

/// Many documents: each goes whole to train or val, followed by the end-of-text
/// token where the vocabulary has one (with a model's tokenizer, also its
/// post-processor's tokens: [`Tokenizer::encode_document`]).
fn write_documents(
    source: &Source,
    tokenizer: &Tokenizer,
    fraction: f64,
    out: &mut Outputs,
    bar: &ProgressBar,
) -> Result<DocCounts> {
    let mut router = DocRouter::new(fraction);
    let mut index = 0u64;
    for_each_batch(source, bar, |batch| {
        let encoded = first_error(
            batch
                .par_iter()
                .map(|text| match text.is_empty() {
                    true => Ok(Vec::new()),
                    false => tokenizer.encode_document(text),
                })
                .collect(),
        )
        .with_context(|| format!("cannot tokenize {}", source.describe()))?;
        for tokens in encoded {
            if !tokens.is_empty() {
                router.route(index, (tokens, Vec::new()), out)?;
            }
            index += 1;
        }
        Ok(())
    })?;
    router.finish(out)
}

/// Instruction examples: each goes whole to train or val (split as documents are),
/// its tokens with a mask that trains the responses and their end-of-text.
fn write_examples(
    source: &Source,
    tokenizer: &Tokenizer,
    fraction: f64,
    variables: &serde_json::Map<String, serde_json::Value>,
    out: &mut Outputs,
    bar: &ProgressBar,
) -> Result<DocCounts> {
    let eot = instruct_eot(tokenizer)?;
    let mut router = DocRouter::new(fraction);
    let mut index = 0u64;
    let mut batch: Vec<Example> = Vec::new();
    let mut bytes = 0;
    let mut flush = |batch: &mut Vec<Example>, router: &mut DocRouter| -> Result<()> {
        let encoded = first_error(
            batch
                .par_iter()
                .map(|example| example.encode(tokenizer, eot, variables))
                .collect(),
        )
        .with_context(|| format!("cannot tokenize {}", source.describe()))?;
        for doc in encoded {
            router.route(index, doc, out)?;
            index += 1;
        }
        batch.clear();
        Ok(())
    };
    for example in source.examples() {
        let (example, progress) = example?;
        bar.inc(progress);
        bytes += progress as usize;
        batch.push(example);
        if bytes >= BATCH_BYTES {
            flush(&mut batch, &mut router)?;
            bytes = 0;
        }
    }
    flush(&mut batch, &mut router)?;
    router.finish(out)
}

/// A document's tokens and its mask (empty without masks).
type Doc = (Vec<u32>, Vec<u8>);

/// Whether document `index` belongs to val: a fixed hash of the index, so the
/// split does not depend on batching, threads or the number of documents.
pub(crate) fn is_val_document(index: u64, fraction: f64) -> bool {
    let hash = splitmix64(index ^ 0x7661_6c5f_7370_6c74);
    ((hash >> 11) as f64 / (1u64 << 53) as f64) < fraction
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Sends documents to train or val. While val is still empty, the latest train
/// document is held back, so that a corpus whose hashes picked no val document
/// still gets one: its last document.
struct DocRouter {
    fraction: f64,
    held: Option<Doc>,
    counts: DocCounts,
}

impl DocRouter {
    fn new(fraction: f64) -> DocRouter {
        DocRouter {
            fraction,
            held: None,
            counts: DocCounts::default(),
        }
    }

    fn route(&mut self, index: u64, doc: Doc, out: &mut Outputs) -> Result<()> {
        if is_val_document(index, self.fraction) {
            self.release_held(out)?;
            out.write(Split::Val, &doc.0, &doc.1)?;
            self.counts.val += 1;
        } else if self.counts.val == 0 {
            self.release_held(out)?;
            self.held = Some(doc);
        } else {
            out.write(Split::Train, &doc.0, &doc.1)?;
            self.counts.train += 1;
        }
        Ok(())
    }

    fn release_held(&mut self, out: &mut Outputs) -> Result<()> {
        if let Some(held) = self.held.take() {
            out.write(Split::Train, &held.0, &held.1)?;
            self.counts.train += 1;
        }
        Ok(())
    }

    fn finish(mut self, out: &mut Outputs) -> Result<DocCounts> {
        if let Some(last) = self.held.take() {
            let split = match self.counts.val == 0 && self.counts.train > 0 {
                true => Split::Val,
                false => Split::Train,
            };
            out.write(split, &last.0, &last.1)?;
            match split {
                Split::Val => self.counts.val += 1,
                Split::Train => self.counts.train += 1,
            }
        }
        Ok(self.counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::loader::TokenFile;
    use crate::data::testutil::TempDir;

    fn opts(source: &Path, out: &Path, tokenizer: TokenizerSpec) -> PrepareOptions {
        PrepareOptions {
            tokenizer,
            show_progress: false,
            ..PrepareOptions::new(source.to_str().unwrap(), out)
        }
    }

    fn read_bin(path: &Path) -> Vec<u32> {
        let meta = Meta::load(path.parent().unwrap()).unwrap();
        TokenFile::open(path, meta.dtype)
            .unwrap()
            .read_all()
            .unwrap()
    }

    #[test]
    fn bundled_shakespeare_char_matches_nanogpt_counts() {
        let dir = TempDir::new("prep-char");
        let options = PrepareOptions {
            tokenizer: TokenizerSpec::Char,
            show_progress: false,
            ..PrepareOptions::new("shakespeare", dir.path())
        };
        let summary = prepare_source(&Source::Bundled, &options).unwrap();
        // nanoGPT's data/shakespeare_char/prepare.py reports these numbers.
        assert_eq!(summary.meta.vocab_size, 65);
        assert_eq!(summary.meta.train_tokens, 1_003_854);
        assert_eq!(summary.meta.val_tokens, 111_540);
        let chars = summary.meta.chars.clone().unwrap();
        assert!(chars.starts_with("\n !$&',-.3:;?ABC"), "{chars:?}");
        let train = read_bin(&dir.path().join("train.bin"));
        let t = Tokenizer::from_meta(&Meta::load(dir.path()).unwrap(), dir.path()).unwrap();
        assert_eq!(t.decode(&train[..14]), "First Citizen:");
        assert_eq!(&train[..5], &[18, 47, 56, 57, 58]);
    }

    #[test]
    fn bundled_shakespeare_gpt2_matches_nanogpt_counts() {
        let dir = TempDir::new("prep-gpt2");
        let options = PrepareOptions {
            show_progress: false,
            ..PrepareOptions::new("shakespeare", dir.path())
        };
        let summary = prepare_source(&Source::Bundled, &options).unwrap();
        // nanoGPT's data/shakespeare/prepare.py reports these numbers.
        assert_eq!(summary.meta.train_tokens, 301_966);
        assert_eq!(summary.meta.val_tokens, 36_059);
        let val_bytes = std::fs::metadata(dir.path().join("val.bin")).unwrap().len();
        assert_eq!(val_bytes, 2 * 36_059);
        assert_eq!(
            &read_bin(&dir.path().join("train.bin"))[..3],
            &[5962, 22307, 25]
        );
    }

    #[test]
    fn txt_file_split_by_position_with_fraction() {
        let dir = TempDir::new("prep-txt");
        let src = dir.write("in.txt", "abcdefghij".repeat(10)); // 100 chars
        let out = dir.path().join("out");
        let mut o = opts(&src, &out, TokenizerSpec::Char);
        o.val_fraction = Some(0.25);
        let summary = prepare(&o).unwrap();
        assert_eq!(
            (summary.meta.train_tokens, summary.meta.val_tokens),
            (75, 25)
        );
        assert_eq!(&read_bin(&out.join("val.bin"))[..3], &[5, 6, 7]); // "fgh"
    }

    #[test]
    fn documents_get_eot_and_at_least_one_val_document() {
        let dir = TempDir::new("prep-docs");
        dir.write("docs/a.txt", "Hello world");
        dir.write("docs/b.txt", "Hello");
        dir.write("docs/c.txt", "");
        let out = dir.path().join("out");
        let summary = prepare(&opts(&dir.path().join("docs"), &out, TokenizerSpec::Gpt2)).unwrap();
        assert_eq!((summary.documents, summary.val_documents), (2, 1));
        assert_eq!(read_bin(&out.join("train.bin")), [15496, 995, 50256]);
        assert_eq!(read_bin(&out.join("val.bin")), [15496, 50256]);
        let meta = Meta::load(&out).unwrap();
        assert_eq!(
            (meta.train_tokens, meta.val_tokens, meta.vocab_size),
            (3, 2, 50257)
        );
    }

    #[test]
    fn document_split_follows_fraction() {
        let val = (0..20_000u64).filter(|&i| is_val_document(i, 0.1)).count();
        assert!((1_800..2_200).contains(&val), "{val} of 20000");
        let val = (0..100_000u64)
            .filter(|&i| is_val_document(i, 0.0005))
            .count();
        assert!((30..70).contains(&val), "{val} of 100000");
    }

    #[test]
    fn jsonl_documents_split_by_hash_with_fraction() {
        let dir = TempDir::new("prep-jsonl");
        let lines: String = (0..2_000)
            .map(|i| format!("{{\"text\": \"d{i}\"}}\n"))
            .collect();
        let src = dir.write("docs.jsonl", lines);
        let out = dir.path().join("out");
        let mut o = opts(&src, &out, TokenizerSpec::Char);
        o.val_fraction = Some(0.1);
        let summary = prepare(&o).unwrap();
        let expected = (0..2_000).filter(|&i| is_val_document(i, 0.1)).count() as u64;
        assert_eq!(summary.val_documents, expected);
        assert_eq!(summary.documents, 2_000);
        let total = summary.meta.train_tokens + summary.meta.val_tokens;
        let chars: u64 = (0..2_000).map(|i| format!("d{i}").len() as u64).sum();
        assert_eq!(total, chars, "char datasets have no end-of-text token");
    }

    #[test]
    fn parquet_source_prepares() {
        let dir = TempDir::new("prep-parquet");
        let src = dir.path().join("x.parquet");
        crate::data::testutil::write_parquet(
            &src,
            &["Hello world", "Hello"],
            parquet::basic::Compression::SNAPPY,
        );
        let out = dir.path().join("out");
        let mut o = opts(&src, &out, TokenizerSpec::Gpt2);
        o.text_column = "body".into();
        let summary = prepare(&o).unwrap();
        assert_eq!(summary.meta.train_tokens + summary.meta.val_tokens, 5);
    }

    #[test]
    fn empty_and_unsplittable_corpora_are_refused() {
        let dir = TempDir::new("prep-empty");
        let src = dir.write("empty.txt", "");
        let err = prepare(&opts(&src, &dir.path().join("o"), TokenizerSpec::Char)).unwrap_err();
        assert!(err.to_string().contains("contains no text"), "{err}");
        let err = prepare(&opts(&src, &dir.path().join("o"), TokenizerSpec::Gpt2)).unwrap_err();
        assert!(err.to_string().contains("contains no text"), "{err}");
        let src = dir.write("one/a.txt", "just one");
        let err = prepare(&opts(
            src.parent().unwrap(),
            &dir.path().join("o"),
            TokenizerSpec::Gpt2,
        ))
        .unwrap_err();
        assert!(err.to_string().contains("at least 2"), "{err}");
        assert!(
            !dir.path().join("o/train.bin").exists(),
            "no partial output"
        );
    }

    #[test]
    fn bad_fraction_is_refused() {
        let dir = TempDir::new("prep-frac");
        let src = dir.write("in.txt", "text");
        let mut o = opts(&src, dir.path(), TokenizerSpec::Char);
        o.val_fraction = Some(1.0);
        let err = prepare(&o).unwrap_err().to_string();
        assert!(err.contains("--val-fraction"), "{err}");
    }

    fn read_mask(path: &Path) -> Vec<u8> {
        std::fs::read(path).unwrap()
    }

    #[test]
    fn alpaca_examples_get_a_mask_over_response_and_eot() {
        let dir = TempDir::new("prep-alpaca");
        let src = dir.write(
            "a.jsonl",
            "{\"instruction\": \"Say hi\", \"output\": \"hi\"}\n\
             {\"instruction\": \"Add\", \"input\": \"1 2\", \"output\": \"3\"}\n",
        );
        let out = dir.path().join("out");
        let mut o = opts(&src, &out, TokenizerSpec::Gpt2);
        o.val_fraction = Some(0.5);
        let summary = prepare(&o).unwrap();
        assert_eq!(summary.documents, 2);
        let t = Tokenizer::gpt2();
        let mut want_tokens = Vec::new();
        let mut want_mask = Vec::new();
        for (prompt, response) in [
            (crate::data::instruct::alpaca_prompt("Say hi", ""), "hi"),
            (crate::data::instruct::alpaca_prompt("Add", "1 2"), "3"),
        ] {
            let p = t.encode(&prompt).unwrap();
            let r = t.encode(response).unwrap();
            want_mask.extend(std::iter::repeat_n(0u8, p.len()));
            want_mask.extend(std::iter::repeat_n(1u8, r.len() + 1));
            want_tokens.push([p, r, vec![50256]].concat());
        }
        let (train, val) = (
            read_bin(&out.join("train.bin")),
            read_bin(&out.join("val.bin")),
        );
        let (tm, vm) = (
            read_mask(&out.join("train.mask")),
            read_mask(&out.join("val.mask")),
        );
        assert_eq!((train.len(), val.len()), (tm.len(), vm.len()));
        let got: Vec<u32> = [train, val].concat();
        let mut sorted_want: Vec<Vec<u32>> = want_tokens.clone();
        // One example per split; which one goes where is the hash's choice.
        if got[..sorted_want[0].len()] != sorted_want[0][..] {
            sorted_want.swap(0, 1);
            let n = want_mask.len() - want_tokens[1].len();
            want_mask.rotate_left(n);
        }
        assert_eq!(got, sorted_want.concat());
        assert_eq!([tm, vm].concat(), want_mask);
        assert_eq!(*got.last().unwrap(), 50256);
    }

    #[test]
    fn chat_examples_char_level_use_u0003_as_end_of_text() {
        let dir = TempDir::new("prep-chat");
        let line = r#"{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}"#;
        let src = dir.write("c.jsonl", format!("{line}\n{line}\n"));
        let out = dir.path().join("out");
        prepare(&opts(&src, &out, TokenizerSpec::Char)).unwrap();
        let meta = Meta::load(&out).unwrap();
        let t = Tokenizer::from_meta(&meta, &out).unwrap();
        assert!(meta.chars.as_deref().unwrap().starts_with('\u{3}'));
        let train = read_bin(&out.join("train.bin"));
        let text = t.decode(&train);
        assert_eq!(text, "<|user|>\nab\n<|assistant|>\nba\u{3}");
        let mask = read_mask(&out.join("train.mask"));
        let trained: String = text
            .chars()
            .zip(&mask)
            .filter(|(_, &m)| m == 1)
            .map(|(c, _)| c)
            .collect();
        assert_eq!(trained, "ba\u{3}");
    }

    #[test]
    fn plain_text_removes_an_earlier_mask_and_format_overrides() {
        let dir = TempDir::new("prep-stale");
        let line = r#"{"instruction": "i", "output": "o", "text": "plain"}"#;
        let src = dir.write("x.jsonl", format!("{line}\n{line}\n"));
        let out = dir.path().join("out");
        prepare(&opts(&src, &out, TokenizerSpec::Gpt2)).unwrap();
        assert!(out.join("train.mask").exists() && out.join("val.mask").exists());
        let mut o = opts(&src, &out, TokenizerSpec::Gpt2);
        o.format = Some(DataFormat::Text);
        let summary = prepare(&o).unwrap();
        assert_eq!(summary.meta.train_tokens + summary.meta.val_tokens, 4);
        assert!(!out.join("train.mask").exists() && !out.join("val.mask").exists());
    }

    #[test]
    fn bad_example_names_file_line_and_field() {
        let dir = TempDir::new("prep-bad-example");
        let src = dir.write(
            "x.jsonl",
            "{\"instruction\": \"i\", \"output\": \"o\"}\n\n{\"instruction\": \"i\"}\n",
        );
        let err = format!(
            "{:#}",
            prepare(&opts(&src, &dir.path().join("o"), TokenizerSpec::Gpt2)).unwrap_err()
        );
        assert!(
            err.contains("x.jsonl line 3") && err.contains("`output` is missing"),
            "{err}"
        );
        let mut o = opts(&src, &dir.path().join("o"), TokenizerSpec::Gpt2);
        o.format = Some(DataFormat::Chat);
        let err = format!("{:#}", prepare(&o).unwrap_err());
        assert!(
            err.contains("line 1") && err.contains("`messages` is missing"),
            "{err}"
        );
        dir.write("mix/a.jsonl", "{\"text\": \"t\"}\n");
        dir.write("mix/b.jsonl", "{\"messages\": []}\n");
        let err = prepare(&opts(
            &dir.path().join("mix"),
            &dir.path().join("o"),
            TokenizerSpec::Gpt2,
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("a.jsonl holds plain text"), "{err}");
        let txt = dir.write("t.txt", "text");
        let mut o = opts(&txt, &dir.path().join("o"), TokenizerSpec::Gpt2);
        o.format = Some(DataFormat::Alpaca);
        let err = prepare(&o).unwrap_err().to_string();
        assert!(err.contains("--format alpaca reads .jsonl"), "{err}");
    }

    #[test]
    fn vocab_beyond_uint16_writes_uint32() {
        let dir = TempDir::new("prep-vocab");
        // 67,952 distinct characters (the surrogates are no characters).
        let text: String = (0x4E00u32..0x4E00 + 70_000)
            .filter_map(char::from_u32)
            .collect();
        let src = dir.write("wide.txt", &text);
        let out = dir.path().join("out");
        let summary = prepare(&opts(&src, &out, TokenizerSpec::Char)).unwrap();
        assert_eq!(summary.meta.vocab_size, 67_952);
        assert_eq!(summary.meta.dtype, TokenDtype::Uint32);
        let json = std::fs::read_to_string(out.join("meta.json")).unwrap();
        assert!(json.contains("\"dtype\": \"uint32\""), "{json}");
        let bytes = std::fs::metadata(out.join("train.bin")).unwrap().len();
        assert_eq!(bytes, 4 * summary.meta.train_tokens);
        let ids = [
            read_bin(&out.join("train.bin")),
            read_bin(&out.join("val.bin")),
        ]
        .concat();
        assert_eq!(ids.len(), 67_952);
        assert_eq!(*ids.last().unwrap(), 67_951, "every id, up to the largest");
        let t = Tokenizer::from_meta(&Meta::load(&out).unwrap(), &out).unwrap();
        assert_eq!(t.decode(&ids), text);
        // A vocabulary that fits stays uint16, as nanoGPT reads it.
        let small = prepare(&opts(
            &dir.write("s.txt", "abcabc"),
            &dir.path().join("s"),
            TokenizerSpec::Char,
        ))
        .unwrap();
        assert_eq!(small.meta.dtype, TokenDtype::Uint16);
    }
}
