//! Text ⇄ token ids: GPT-2 BPE (tiktoken's `r50k_base`, shipped inside
//! `tiktoken-rs`, so it works offline), char-level vocabularies, and a model's own
//! `tokenizer.json` ([`hf`], through Hugging Face's `tokenizers`).

pub mod files;
pub mod hf;

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Result};
use tiktoken_rs::CoreBPE;

use super::chat_template::ChatTemplate;
use super::meta::{Meta, TokenDtype, TokenizerKind, GPT2_EOT, GPT2_VOCAB_SIZE};
use files::TokenizerFiles;
use hf::HfTokenizer;

/// The Unicode replacement character's UTF-8 bytes, shown for unknown ids.
const REPLACEMENT: &[u8] = "\u{FFFD}".as_bytes();

/// A tokenizer for a prepared dataset.
#[derive(Clone)]
pub enum Tokenizer {
    /// GPT-2 BPE; the encoder is built once per process and shared.
    Gpt2(&'static CoreBPE),
    /// Char-level: id `i` is `chars[i]`; `chars` is sorted and free of duplicates.
    Char { chars: Vec<char> },
    /// A model's own tokenizer (shared: it is large).
    Hf(Arc<HfTokenizer>),
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tokenizer::Gpt2(_) => f.write_str("Tokenizer::Gpt2"),
            Tokenizer::Char { chars } => write!(f, "Tokenizer::Char({} chars)", chars.len()),
            Tokenizer::Hf(t) => write!(f, "Tokenizer::{t:?}"),
        }
    }
}

impl Tokenizer {
    /// GPT-2's BPE tokenizer.
    pub fn gpt2() -> Tokenizer {
        Tokenizer::Gpt2(tiktoken_rs::r50k_base_singleton())
    }

    /// A char-level tokenizer over the given characters (sorted and deduplicated
    /// here, so ids follow code-point order as in nanoGPT's `shakespeare_char`).
    pub fn char_level(chars: impl IntoIterator<Item = char>) -> Result<Tokenizer> {
        let mut chars: Vec<char> = chars.into_iter().collect();
        chars.sort_unstable();
        chars.dedup();
        if chars.is_empty() {
            bail!("a char-level vocabulary needs at least one character");
        }
        let max = TokenDtype::Uint32.max_vocab();
        if chars.len() > max {
            bail!(
                "the text has {} distinct characters, more than the {max} ids a token \
                 file holds; use `--tokenizer gpt2` instead",
                chars.len()
            );
        }
        Ok(Tokenizer::Char { chars })
    }

    /// A model's own tokenizer, from its files (read from a folder, or made in
    /// memory).
    pub fn from_files(files: TokenizerFiles) -> Result<Tokenizer> {
        Ok(Tokenizer::Hf(Arc::new(HfTokenizer::from_files(files)?)))
    }

    /// The tokenizer of `meta` (a dataset's, or the one a checkpoint records);
    /// `dir` holds its tokenizer files when it is a model's own, and those must be
    /// the ones `meta` names by hash.
    pub fn from_meta(meta: &Meta, dir: &Path) -> Result<Tokenizer> {
        meta.check()?;
        match meta.tokenizer {
            TokenizerKind::Gpt2 => Ok(Tokenizer::gpt2()),
            TokenizerKind::Char => {
                Tokenizer::char_level(meta.chars.as_deref().unwrap_or_default().chars())
            }
            TokenizerKind::HuggingFace => {
                let files = TokenizerFiles::read(dir)?;
                let found = files.sha256();
                let want = meta.tokenizer_sha256.as_deref().unwrap_or_default();
                if found != want {
                    bail!(
                        "{} is not the tokenizer its meta.json names (SHA-256 {found}, \
                         meta.json says {want}): the ids would mean other text; put the \
                         tokenizer files back, or prepare the data again",
                        files.path_of(files::TOKENIZER_JSON)
                    );
                }
                let tokenizer = Tokenizer::from_files(files)?;
                if tokenizer.vocab_size() != meta.vocab_size {
                    bail!(
                        "{} has {} ids but meta.json says vocab_size {}",
                        dir.display(),
                        tokenizer.vocab_size(),
                        meta.vocab_size
                    );
                }
                Ok(tokenizer)
            }
        }
    }

    /// Its description in a `meta.json`, without token counts.
    pub fn meta(&self, source: String) -> Meta {
        let vocab_size = self.vocab_size();
        Meta {
            tokenizer: self.kind(),
            vocab_size,
            dtype: TokenDtype::for_vocab(vocab_size),
            train_tokens: 0,
            val_tokens: 0,
            chars: match self {
                Tokenizer::Char { chars } => Some(chars.iter().collect()),
                _ => None,
            },
            tokenizer_sha256: self.hf().map(|t| t.sha256().to_string()),
            source,
        }
    }

    /// How it tokenizes.
    pub fn kind(&self) -> TokenizerKind {
        match self {
            Tokenizer::Gpt2(_) => TokenizerKind::Gpt2,
            Tokenizer::Char { .. } => TokenizerKind::Char,
            Tokenizer::Hf(_) => TokenizerKind::HuggingFace,
        }
    }

    /// The model's own tokenizer, when it is one.
    pub fn hf(&self) -> Option<&HfTokenizer> {
        match self {
            Tokenizer::Hf(t) => Some(t),
            _ => None,
        }
    }

    /// The model's chat template, where it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.hf().and_then(HfTokenizer::template)
    }

    /// One more than the largest id.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Gpt2(_) => GPT2_VOCAB_SIZE,
            Tokenizer::Char { chars } => chars.len(),
            Tokenizer::Hf(t) => t.vocab_size(),
        }
    }

    /// The end-of-text token, where the vocabulary has one: GPT-2's
    /// `<|endoftext|>`, a model's `eos_token`.
    pub fn eot(&self) -> Option<u32> {
        match self {
            Tokenizer::Gpt2(_) => Some(GPT2_EOT),
            Tokenizer::Char { .. } => None,
            Tokenizer::Hf(t) => t.eos(),
        }
    }

    /// Encodes text as data: GPT-2 treats `<|endoftext|>` in the text as ordinary
    /// characters (tiktoken's `encode_ordinary`); char-level refuses characters
    /// outside the vocabulary; a model's tokenizer reads special tokens written in
    /// the text as those tokens, as `AutoTokenizer` does, and adds none of its own.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Gpt2(bpe) => Ok(encode_gpt2(text, |t| bpe.encode_ordinary(t))),
            Tokenizer::Char { chars } => encode_chars(chars, text),
            Tokenizer::Hf(t) => t.encode(text),
        }
    }

    /// Encodes a prompt: like [`Tokenizer::encode`], except that GPT-2 reads the
    /// literal `<|endoftext|>` as the end-of-text token, as nanoGPT's sample.py does,
    /// and a model's tokenizer adds its post-processor's tokens (Llama 3's BOS), as
    /// `AutoTokenizer` does by default.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Gpt2(bpe) => Ok(encode_gpt2(text, |t| bpe.encode_with_special_tokens(t))),
            Tokenizer::Char { .. } => self.encode(text),
            Tokenizer::Hf(t) => {
                let (before, after) = t.specials();
                Ok([before, &t.encode(text)?, after].concat())
            }
        }
    }

    /// Encodes a text as one document without an end (a `.txt` split by position, as
    /// `prepare` writes it, or evaluated): GPT-2 and char as [`Tokenizer::encode`]; a
    /// model's tokenizer adds its post-processor's tokens (Llama 3's BOS before).
    pub fn encode_single_document(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Hf(_) => self.encode_prompt(text),
            _ => self.encode(text),
        }
    }

    /// Encodes one document of a corpus, as `prepare` writes it: its text, then the
    /// end-of-text token where the vocabulary has one. A model's tokenizer adds its
    /// post-processor's tokens (Llama 3's BOS before the text), then `eos_token`
    /// unless the post-processor already ends with it.
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>> {
        let (mut ids, after) = match self {
            Tokenizer::Hf(t) => (self.encode_prompt(text)?, t.specials().1),
            _ => (self.encode(text)?, &[][..]),
        };
        match self.eot() {
            Some(eot) if after.last() != Some(&eot) => ids.push(eot),
            _ => {}
        }
        Ok(ids)
    }

    /// The ids that end generation: GPT-2's `<|endoftext|>`, a model's `eos_token` and
    /// the `eos_token_id`s of its generation_config.json.
    pub fn stops(&self) -> Vec<u32> {
        match self {
            Tokenizer::Hf(t) => t.stops().to_vec(),
            _ => self.eot().into_iter().collect(),
        }
    }

    /// Decodes ids to text. Never fails: ids outside the vocabulary and byte
    /// sequences cut mid-character decode to U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Hf(t) => t.decode(ids),
            Tokenizer::Gpt2(_) => {
                let mut bytes = Vec::with_capacity(ids.len() * 4);
                for &id in ids {
                    self.append_token_bytes(id, &mut bytes);
                }
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Char { chars } => ids
                .iter()
                .map(|&id| chars.get(id as usize).copied().unwrap_or('\u{FFFD}'))
                .collect(),
        }
    }

    /// A decoder for a token stream that emits text as soon as it forms whole
    /// characters (a GPT-2 token can end in the middle of a UTF-8 sequence).
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder(match self {
            Tokenizer::Hf(t) => Stream::Hf(t.decode_stream()),
            _ => Stream::Bytes {
                tokenizer: self,
                pending: Vec::new(),
            },
        })
    }

    /// One token's bytes (a GPT-2 token may be part of a character); U+FFFD's for
    /// an unknown id.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let mut bytes = Vec::new();
        self.append_token_bytes(id, &mut bytes);
        bytes
    }

    fn append_token_bytes(&self, id: u32, out: &mut Vec<u8>) {
        match self {
            Tokenizer::Gpt2(bpe) => match bpe.decode_bytes(&[id]) {
                Ok(bytes) => out.extend_from_slice(&bytes),
                Err(_) => out.extend_from_slice(REPLACEMENT),
            },
            Tokenizer::Char { chars } => {
                let c = chars.get(id as usize).copied().unwrap_or('\u{FFFD}');
                out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
            }
            Tokenizer::Hf(t) => out.extend_from_slice(t.decode(&[id]).as_bytes()),
        }
    }
}

/// Whitespace runs longer than this many characters are encoded in pieces of this
/// length. tiktoken's pre-tokenizer (fancy-regex) fails with a stack overflow on
/// runs of some hundred thousand whitespace characters; below the limit, and so for
/// all ordinary text, the tokens are exactly tiktoken's.
const MAX_WHITESPACE_RUN: usize = 32 << 10;

/// Encodes `text` with `encode`, cutting it inside overlong whitespace runs.
fn encode_gpt2(text: &str, encode: impl Fn(&str) -> Vec<u32>) -> Vec<u32> {
    if text.len() <= MAX_WHITESPACE_RUN {
        return encode(text);
    }
    let mut ids = Vec::with_capacity(text.len() / 3);
    let mut start = 0;
    for cut in whitespace_cuts(text) {
        ids.extend(encode(&text[start..cut]));
        start = cut;
    }
    ids.extend(encode(&text[start..]));
    ids
}

/// Byte positions that split every whitespace run into pieces of at most
/// [`MAX_WHITESPACE_RUN`] characters.
fn whitespace_cuts(text: &str) -> Vec<usize> {
    let mut cuts = Vec::new();
    let mut run = 0;
    for (at, c) in text.char_indices() {
        if !c.is_whitespace() {
            run = 0;
            continue;
        }
        if run == MAX_WHITESPACE_RUN {
            cuts.push(at);
            run = 0;
        }
        run += 1;
    }
    cuts
}

fn encode_chars(chars: &[char], text: &str) -> Result<Vec<u32>> {
    text.chars()
        .map(|c| match chars.binary_search(&c) {
            Ok(id) => Ok(id as u32),
            Err(_) => bail!(
                "character {c:?} (U+{:04X}) is not in this char-level vocabulary of {} \
                 characters; use only characters that occur in the training text",
                c as u32,
                chars.len()
            ),
        })
        .collect()
}

/// Incremental decoding for streamed samples; see [`Tokenizer::stream_decoder`].
pub struct StreamDecoder<'a>(Stream<'a>);

enum Stream<'a> {
    /// GPT-2 and char: each token's bytes, joined until they make characters.
    Bytes {
        tokenizer: &'a Tokenizer,
        pending: Vec<u8>,
    },
    /// A model's tokenizer, whose decoder needs the tokens' context.
    Hf(hf::HfStream<'a>),
}

impl StreamDecoder<'_> {
    /// Adds one token and returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let (tokenizer, pending) = match &mut self.0 {
            Stream::Hf(stream) => return stream.push(id),
            Stream::Bytes { tokenizer, pending } => (tokenizer, pending),
        };
        tokenizer.append_token_bytes(id, pending);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(pending) {
                Ok(text) => {
                    out.push_str(text);
                    pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Returns whatever is still buffered (an unfinished character shows as U+FFFD).
    pub fn finish(self) -> String {
        match self.0 {
            Stream::Bytes { pending, .. } => String::from_utf8_lossy(&pending).into_owned(),
            Stream::Hf(stream) => stream.finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_known_ids() {
        let t = Tokenizer::gpt2();
        assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(t.decode(&[15496, 995]), "Hello world");
        assert_eq!(t.vocab_size(), 50257);
        assert_eq!(t.eot(), Some(50256));
    }

    #[test]
    fn gpt2_round_trips_unicode() {
        let t = Tokenizer::gpt2();
        let text = "Ünïcödé — 日本語 🎉\n  spaces";
        assert_eq!(t.decode(&t.encode(text).unwrap()), text);
    }

    #[test]
    fn gpt2_endoftext_is_text_in_data_and_special_in_prompts() {
        let t = Tokenizer::gpt2();
        let data = t.encode("<|endoftext|>").unwrap();
        assert!(data.len() > 1 && !data.contains(&GPT2_EOT), "{data:?}");
        assert_eq!(t.encode_prompt("<|endoftext|>").unwrap(), vec![GPT2_EOT]);
        assert_eq!(t.decode(&[GPT2_EOT]), "<|endoftext|>");
    }

    #[test]
    fn decode_tolerates_bad_ids_and_partial_characters() {
        let t = Tokenizer::gpt2();
        let ids = t.encode("🎉").unwrap();
        assert!(ids.len() > 1, "emoji spans several byte tokens: {ids:?}");
        assert_eq!(t.decode(&ids[..1]), "\u{FFFD}");
        assert_eq!(t.decode(&[60000]), "\u{FFFD}");
    }

    #[test]
    fn stream_decoder_emits_whole_characters() {
        let t = Tokenizer::gpt2();
        let ids = t.encode("a🎉b").unwrap();
        let mut dec = t.stream_decoder();
        let pieces: Vec<String> = ids.iter().map(|&id| dec.push(id)).collect();
        assert_eq!(pieces.concat(), "a🎉b");
        assert!(pieces.iter().any(|p| p.is_empty()), "{pieces:?}");
        assert_eq!(dec.finish(), "");

        let mut cut = t.stream_decoder();
        cut.push(ids[1]);
        assert_eq!(cut.finish(), "\u{FFFD}");
    }

    #[test]
    fn huge_whitespace_runs_encode_without_failing() {
        let t = Tokenizer::gpt2();
        let text = format!("a{}b\n{}", " ".repeat(1_000_000), "\n\t".repeat(300_000));
        let ids = t.encode(&text).unwrap();
        assert_eq!(t.decode(&ids), text);
        // 1,000,000 spaces and 600,001 newlines/tabs: 30 + 18 cuts of 32,768.
        assert_eq!(whitespace_cuts(&text).len(), 48);
        let at_limit = format!("x{}y", " ".repeat(MAX_WHITESPACE_RUN));
        assert!(whitespace_cuts(&at_limit).is_empty());
    }

    #[test]
    fn char_level_sorted_ids_and_round_trip() {
        let t = Tokenizer::char_level("hello\n".chars()).unwrap();
        // Sorted: '\n' < 'e' < 'h' < 'l' < 'o'.
        assert_eq!(t.vocab_size(), 5);
        assert_eq!(t.encode("hello").unwrap(), vec![2, 1, 3, 3, 4]);
        assert_eq!(t.decode(&[2, 1, 3, 3, 4, 0]), "hello\n");
        assert_eq!(t.decode(&[9]), "\u{FFFD}");
        assert_eq!(t.eot(), None);
    }

    #[test]
    fn char_level_unknown_character_is_named() {
        let t = Tokenizer::char_level("abc".chars()).unwrap();
        let err = t.encode("abz").unwrap_err().to_string();
        assert!(err.contains("'z'") && err.contains("U+007A"), "{err}");
    }

    #[test]
    fn from_meta_rebuilds_char_vocabulary() {
        let meta = Meta {
            tokenizer: TokenizerKind::Char,
            vocab_size: 3,
            dtype: TokenDtype::Uint16,
            train_tokens: 1,
            val_tokens: 1,
            chars: Some(" ab".into()),
            tokenizer_sha256: None,
            source: String::new(),
        };
        let t = Tokenizer::from_meta(&meta, Path::new("")).unwrap();
        assert_eq!(t.encode("ba ").unwrap(), vec![2, 1, 0]);
    }
}
