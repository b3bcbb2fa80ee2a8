//! Text ⇄ token ids: GPT-2 BPE (tiktoken's `r50k_base`, shipped inside
//! `tiktoken-rs`, so it works offline) and char-level vocabularies.

use std::fmt;

use anyhow::{bail, Result};
use tiktoken_rs::CoreBPE;

use super::meta::{Meta, TokenizerKind};
use super::MAX_VOCAB_SIZE;

/// GPT-2's vocabulary size (ids 0..=50256).
pub const GPT2_VOCAB_SIZE: usize = 50257;
/// GPT-2's `<|endoftext|>` token, appended after every document.
pub const GPT2_EOT: u32 = 50256;

/// The Unicode replacement character's UTF-8 bytes, shown for unknown ids.
const REPLACEMENT: &[u8] = "\u{FFFD}".as_bytes();

/// A tokenizer for a prepared dataset.
#[derive(Clone)]
pub enum Tokenizer {
    /// GPT-2 BPE; the encoder is built once per process and shared.
    Gpt2(&'static CoreBPE),
    /// Char-level: id `i` is `chars[i]`; `chars` is sorted and free of duplicates.
    Char { chars: Vec<char> },
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tokenizer::Gpt2(_) => f.write_str("Tokenizer::Gpt2"),
            Tokenizer::Char { chars } => write!(f, "Tokenizer::Char({} chars)", chars.len()),
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
        if chars.len() > MAX_VOCAB_SIZE {
            bail!(
                "the text has {} distinct characters, more than the {MAX_VOCAB_SIZE} ids \
                 that fit the uint16 .bin format; use `--tokenizer gpt2` instead",
                chars.len()
            );
        }
        Ok(Tokenizer::Char { chars })
    }

    /// The tokenizer a dataset was prepared with.
    pub fn from_meta(meta: &Meta) -> Result<Tokenizer> {
        meta.check()?;
        match meta.tokenizer {
            TokenizerKind::Gpt2 => Ok(Tokenizer::gpt2()),
            TokenizerKind::Char => {
                Tokenizer::char_level(meta.chars.as_deref().unwrap_or_default().chars())
            }
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Gpt2(_) => GPT2_VOCAB_SIZE,
            Tokenizer::Char { chars } => chars.len(),
        }
    }

    /// The end-of-text token, where the vocabulary has one.
    pub fn eot(&self) -> Option<u32> {
        match self {
            Tokenizer::Gpt2(_) => Some(GPT2_EOT),
            Tokenizer::Char { .. } => None,
        }
    }

    /// Encodes text as data: GPT-2 treats `<|endoftext|>` in the text as ordinary
    /// characters (tiktoken's `encode_ordinary`); char-level refuses characters
    /// outside the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Gpt2(bpe) => Ok(encode_gpt2(text, |t| bpe.encode_ordinary(t))),
            Tokenizer::Char { chars } => encode_chars(chars, text),
        }
    }

    /// Encodes a prompt: like [`Tokenizer::encode`], except that GPT-2 reads the
    /// literal `<|endoftext|>` as the end-of-text token, as nanoGPT's sample.py does.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Gpt2(bpe) => Ok(encode_gpt2(text, |t| bpe.encode_with_special_tokens(t))),
            Tokenizer::Char { .. } => self.encode(text),
        }
    }

    /// Decodes ids to text. Never fails: ids outside the vocabulary and byte
    /// sequences cut mid-character decode to U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
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
        StreamDecoder {
            tokenizer: self,
            pending: Vec::new(),
        }
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
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds one token and returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.tokenizer.append_token_bytes(id, &mut self.pending);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Returns whatever is still buffered (an unfinished character shows as U+FFFD).
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
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
            train_tokens: 1,
            val_tokens: 1,
            chars: Some(" ab".into()),
            source: String::new(),
        };
        let t = Tokenizer::from_meta(&meta).unwrap();
        assert_eq!(t.encode("ba ").unwrap(), vec![2, 1, 0]);
    }
}
