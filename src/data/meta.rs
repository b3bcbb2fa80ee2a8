//! `meta.json`: what a prepared dataset holds and how it was tokenized.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::Split;
use crate::fsutil::AtomicFile;

/// GPT-2's vocabulary size (ids 0..=50256).
pub const GPT2_VOCAB_SIZE: usize = 50257;
/// GPT-2's `<|endoftext|>` token, appended after every document.
pub const GPT2_EOT: u32 = 50256;

/// How text was turned into token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// GPT-2's byte-level BPE (tiktoken's `r50k_base`), vocabulary 50257.
    Gpt2,
    /// One token per character; the vocabulary is the corpus's sorted character set.
    Char,
    /// A model's own `tokenizer.json`, through Hugging Face's `tokenizers`; the
    /// dataset folder holds a copy of the model's tokenizer files, and `meta.json`
    /// the SHA-256 of its tokenizer.json (`tokenizer_sha256`).
    #[serde(rename = "huggingface")]
    HuggingFace,
}

impl TokenizerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenizerKind::Gpt2 => "gpt2",
            TokenizerKind::Char => "char",
            TokenizerKind::HuggingFace => "huggingface",
        }
    }
}

impl fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TokenizerKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gpt2" => Ok(TokenizerKind::Gpt2),
            "char" => Ok(TokenizerKind::Char),
            other => bail!(
                "unknown tokenizer `{other}`: use `gpt2` (BPE), `char`, or a model folder \
                 holding tokenizer.json (or the path of a tokenizer.json)"
            ),
        }
    }
}

/// The width of the token ids in `train.bin` / `val.bin` (little-endian).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// nanoGPT's format: vocabularies of up to 65,536 ids.
    #[default]
    Uint16,
    /// Larger vocabularies (Llama 3's 128,256, Qwen's 151,669).
    Uint32,
}

impl TokenDtype {
    /// The largest vocabulary whose ids fit uint16 (ids 0..=65535).
    pub const UINT16_VOCAB: usize = u16::MAX as usize + 1;

    /// uint16 where the vocabulary fits it (so nanoGPT reads the files), else uint32.
    pub fn for_vocab(vocab_size: usize) -> TokenDtype {
        match vocab_size <= Self::UINT16_VOCAB {
            true => TokenDtype::Uint16,
            false => TokenDtype::Uint32,
        }
    }

    /// Bytes per token id.
    pub fn width(self) -> usize {
        match self {
            TokenDtype::Uint16 => 2,
            TokenDtype::Uint32 => 4,
        }
    }

    /// The largest vocabulary this width holds (uint32: ids below 2^31, since training
    /// targets are `i32`s with -1 for "not trained").
    pub fn max_vocab(self) -> usize {
        match self {
            TokenDtype::Uint16 => Self::UINT16_VOCAB,
            TokenDtype::Uint32 => i32::MAX as usize,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TokenDtype::Uint16 => "uint16",
            TokenDtype::Uint32 => "uint32",
        }
    }
}

impl fmt::Display for TokenDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The contents of `meta.json` next to `train.bin` and `val.bin`. Unknown fields
/// are refused: a file from another tool that means something else by its data
/// must not be read as if it were ours.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    pub tokenizer: TokenizerKind,
    /// Number of distinct token ids; every id in the `.bin` files is below it.
    pub vocab_size: usize,
    /// The width of the ids in the `.bin` files (absent in older files: uint16).
    #[serde(default)]
    pub dtype: TokenDtype,
    pub train_tokens: u64,
    pub val_tokens: u64,
    /// The vocabulary of a char-level dataset, in id order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chars: Option<String>,
    /// The SHA-256 (hex) of the `tokenizer.json` a [`TokenizerKind::HuggingFace`]
    /// dataset was tokenized with: the identity of its ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_sha256: Option<String>,
    /// Where the text came from (informational).
    #[serde(default)]
    pub source: String,
}

impl Meta {
    pub const FILE_NAME: &'static str = "meta.json";

    /// Reads and checks `dir/meta.json`.
    ///
    /// A directory prepared by nanoGPT's GPT-2 scripts (train.bin and val.bin, no
    /// meta file) is read as GPT-2 tokens, as nanoGPT's train.py assumes.
    pub fn load(dir: &Path) -> Result<Meta> {
        let path = dir.join(Self::FILE_NAME);
        if !path.exists() {
            return Self::without_meta_file(dir);
        }
        let text = crate::fsutil::read_json(&path, "dataset description")?;
        Self::parse(text.as_bytes()).with_context(|| {
            format!(
                "{} is not a valid dataset description; prepare the data again with \
                 `nanogpt prepare SOURCE --out {}`",
                path.display(),
                dir.display()
            )
        })
    }

    /// Reads and checks the bytes of a `meta.json` (the error says what is wrong,
    /// the caller adds which file).
    pub fn parse(bytes: &[u8]) -> Result<Meta> {
        let meta: Meta = serde_json::from_slice(bytes)?;
        meta.check()?;
        Ok(meta)
    }

    /// Writes `dir/meta.json` atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut file = AtomicFile::create(&dir.join(Self::FILE_NAME))?;
        serde_json::to_writer_pretty(file.writer(), self)
            .with_context(|| format!("cannot write {}", file.dest().display()))?;
        file.commit()
    }

    /// Token count recorded for one split.
    pub fn tokens(&self, split: Split) -> u64 {
        match split {
            Split::Train => self.train_tokens,
            Split::Val => self.val_tokens,
        }
    }

    /// How the tokenizer of `other` differs from this one's, so that the same ids
    /// would mean other text (`None`: the same tokenizer). `this` and `that` name the
    /// two sides in the message ("the checkpoint", "dataset ds").
    pub fn tokenizer_difference(&self, other: &Meta, this: &str, that: &str) -> Option<String> {
        if self.tokenizer != other.tokenizer {
            return Some(format!(
                "{this} has {} tokens, {that} {} tokens",
                self.tokenizer, other.tokenizer
            ));
        }
        if let (Some(a), Some(b)) = (&self.chars, &other.chars) {
            if a != b {
                let first = a
                    .chars()
                    .zip(b.chars())
                    .enumerate()
                    .find(|(_, (x, y))| x != y);
                let at = match first {
                    Some((i, (x, y))) => format!("id {i} is {x:?} in {this}, {y:?} in {that}"),
                    None => format!("{} characters in {this}, {} in {that}", a.len(), b.len()),
                };
                return Some(format!("the character vocabularies differ ({at})"));
            }
        }
        if let (Some(a), Some(b)) = (&self.tokenizer_sha256, &other.tokenizer_sha256) {
            if a != b {
                return Some(format!(
                    "{this} was tokenized with another tokenizer.json than {that} (SHA-256 \
                     {a} and {b})"
                ));
            }
        }
        None
    }

    /// Checks that the fields agree with each other; the message says which one is off.
    pub fn check(&self) -> Result<()> {
        let max = self.dtype.max_vocab();
        if self.vocab_size == 0 || self.vocab_size > max {
            bail!(
                "vocab_size {} must be between 1 and {max} ({} token ids)",
                self.vocab_size,
                self.dtype
            );
        }
        match (self.tokenizer, &self.tokenizer_sha256) {
            (TokenizerKind::HuggingFace, None) => {
                bail!("tokenizer huggingface needs a `tokenizer_sha256` field")
            }
            (TokenizerKind::HuggingFace, Some(hash)) if !is_sha256_hex(hash) => {
                bail!("tokenizer_sha256 `{hash}` is not a SHA-256 (64 lowercase hex digits)")
            }
            (TokenizerKind::Gpt2 | TokenizerKind::Char, Some(_)) => bail!(
                "tokenizer_sha256 belongs to huggingface datasets, not {}",
                self.tokenizer
            ),
            _ => {}
        }
        match (self.tokenizer, &self.chars) {
            (TokenizerKind::Gpt2, _) if self.vocab_size != GPT2_VOCAB_SIZE => bail!(
                "tokenizer gpt2 has vocab_size {GPT2_VOCAB_SIZE}, the file says {}",
                self.vocab_size
            ),
            (TokenizerKind::Gpt2, _) => Ok(()),
            (TokenizerKind::Char, None) => bail!("tokenizer char needs a `chars` field"),
            (TokenizerKind::Char, Some(chars)) => check_chars(chars, self.vocab_size),
            (TokenizerKind::HuggingFace, None) => Ok(()),
            (TokenizerKind::HuggingFace, Some(_)) => {
                bail!("`chars` belongs to char datasets, not huggingface")
            }
        }
    }

    fn without_meta_file(dir: &Path) -> Result<Meta> {
        let train = dir.join(Split::Train.file_name());
        let val = dir.join(Split::Val.file_name());
        let prepare_hint = format!(
            "prepare it with `nanogpt prepare SOURCE --out {}`",
            dir.display()
        );
        if dir.join("meta.pkl").exists() {
            bail!(
                "{} holds nanoGPT's meta.pkl, which is not read here (pickle is unsafe); {}",
                dir.display(),
                prepare_hint
            );
        }
        if !train.exists() || !val.exists() {
            bail!(
                "{} is not a prepared dataset (no {}); {}",
                dir.display(),
                Self::FILE_NAME,
                prepare_hint
            );
        }
        crate::errln!(
            "note: {} has no {}: reading its token files as GPT-2 BPE tokens (nanoGPT's \
             layout); if they hold other tokens, {}",
            dir.display(),
            Self::FILE_NAME,
            prepare_hint
        );
        Ok(Meta {
            tokenizer: TokenizerKind::Gpt2,
            vocab_size: GPT2_VOCAB_SIZE,
            dtype: TokenDtype::Uint16,
            train_tokens: token_count(&train)?,
            val_tokens: token_count(&val)?,
            chars: None,
            tokenizer_sha256: None,
            source: format!("{} (nanoGPT layout, no meta.json)", dir.display()),
        })
    }
}

fn check_chars(chars: &str, vocab_size: usize) -> Result<()> {
    let list: Vec<char> = chars.chars().collect();
    if list.len() != vocab_size {
        bail!(
            "`chars` has {} characters but vocab_size is {vocab_size}",
            list.len()
        );
    }
    if list.windows(2).any(|w| w[0] >= w[1]) {
        bail!("`chars` must be sorted and free of duplicates");
    }
    Ok(())
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn token_count(path: &Path) -> Result<u64> {
    let bytes = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    Ok(bytes / 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::TempDir;

    fn char_meta() -> Meta {
        Meta {
            tokenizer: TokenizerKind::Char,
            vocab_size: 3,
            dtype: TokenDtype::Uint16,
            train_tokens: 10,
            val_tokens: 2,
            chars: Some("\nab".into()),
            tokenizer_sha256: None,
            source: "test".into(),
        }
    }

    #[test]
    fn save_then_load_round_trips() {
        let dir = TempDir::new("meta-roundtrip");
        char_meta().save(dir.path()).unwrap();
        assert_eq!(Meta::load(dir.path()).unwrap(), char_meta());
        let json = std::fs::read_to_string(dir.path().join("meta.json")).unwrap();
        assert!(json.contains("\"tokenizer\": \"char\""), "{json}");
    }

    #[test]
    fn missing_meta_names_directory_and_fix() {
        let dir = TempDir::new("meta-missing");
        let err = format!("{:#}", Meta::load(dir.path()).unwrap_err());
        assert!(err.contains("not a prepared dataset"), "{err}");
        assert!(err.contains("nanogpt prepare"), "{err}");
    }

    #[test]
    fn nanogpt_gpt2_layout_without_meta_is_gpt2() {
        let dir = TempDir::new("meta-nanogpt");
        std::fs::write(dir.path().join("train.bin"), [0u8; 20]).unwrap();
        std::fs::write(dir.path().join("val.bin"), [0u8; 6]).unwrap();
        let meta = Meta::load(dir.path()).unwrap();
        assert_eq!(meta.tokenizer, TokenizerKind::Gpt2);
        assert_eq!((meta.train_tokens, meta.val_tokens), (10, 3));
        assert_eq!(meta.vocab_size, 50257);
    }

    #[test]
    fn inconsistent_meta_is_refused() {
        let dir = TempDir::new("meta-bad");
        let mut meta = char_meta();
        meta.vocab_size = 4;
        std::fs::write(
            dir.path().join("meta.json"),
            serde_json::to_string(&meta).unwrap(),
        )
        .unwrap();
        let err = format!("{:#}", Meta::load(dir.path()).unwrap_err());
        assert!(err.contains("meta.json"), "{err}");
        assert!(err.contains("vocab_size is 4"), "{err}");
    }

    #[test]
    fn tokenizer_kind_parses_and_rejects() {
        assert_eq!(
            "char".parse::<TokenizerKind>().unwrap(),
            TokenizerKind::Char
        );
        let err = "bpe".parse::<TokenizerKind>().unwrap_err().to_string();
        assert!(err.contains("gpt2") && err.contains("bpe"), "{err}");
    }
}
