//! Tokenizers in GGUF metadata (`tokenizer.ggml.*`): GPT-2's written as llama.cpp's
//! converter writes it, and recognised when a file carries it.
//!
//! A byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is its tokens (bytes shown as
//! printable characters, as in Hugging Face's `vocab.json`), one type per token
//! (normal, control, unused...), the merges in rank order (`"Ġ t"`), the
//! pre-tokenizer's name (`tokenizer.ggml.pre`: which split regex llama.cpp applies)
//! and the special ids.

use super::read::Header;
use super::types::Value;
use crate::data::gpt2_vocab::gpt2_vocab;
use crate::data::{GPT2_EOT, GPT2_VOCAB_SIZE};
use anyhow::Result;

/// llama.cpp's token types (`llama_token_type`).
pub const NORMAL: i32 = 1;
pub const CONTROL: i32 = 3;
pub const UNUSED: i32 = 5;

/// The keys.
pub const MODEL: &str = "tokenizer.ggml.model";
pub const PRE: &str = "tokenizer.ggml.pre";
pub const TOKENS: &str = "tokenizer.ggml.tokens";
pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub const MERGES: &str = "tokenizer.ggml.merges";
pub const BOS: &str = "tokenizer.ggml.bos_token_id";
pub const EOS: &str = "tokenizer.ggml.eos_token_id";
pub const PADDING: &str = "tokenizer.ggml.padding_token_id";
pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
pub const CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// GPT-2's tokenizer for a model of `vocab_size` rows (at least GPT-2's 50,257:
/// rows past them are padding, `[PADn]` tokens of type unused, as llama.cpp's
/// converter writes a padded vocabulary). `<|endoftext|>` is the BOS and EOS token
/// and a control token; nothing is prepended (`add_bos_token = false`), as GPT-2's
/// Hugging Face tokenizer does.
pub fn gpt2_metadata(vocab_size: usize) -> Result<Vec<(String, Value)>> {
    let vocab = gpt2_vocab()?;
    let mut tokens: Vec<String> = vocab.tokens.clone();
    tokens.extend((GPT2_VOCAB_SIZE..vocab_size).map(|i| format!("[PAD{i}]")));
    let types = (0..vocab_size).map(|i| match i {
        i if i == GPT2_EOT as usize => CONTROL,
        i if i < GPT2_VOCAB_SIZE => NORMAL,
        _ => UNUSED,
    });
    Ok(vec![
        (MODEL.into(), Value::String("gpt2".into())),
        (PRE.into(), Value::String("gpt-2".into())),
        (TOKENS.into(), Value::strings(tokens)),
        (TOKEN_TYPE.into(), Value::i32s(types)),
        (MERGES.into(), Value::strings(vocab.merges.iter().cloned())),
        (BOS.into(), Value::U32(GPT2_EOT)),
        (EOS.into(), Value::U32(GPT2_EOT)),
        (ADD_BOS.into(), Value::Bool(false)),
    ])
}

/// What a file's tokenizer is, as far as nanogpt's tokenizers go.
#[derive(Clone, Debug, PartialEq)]
pub enum Recognised {
    /// GPT-2's byte-level BPE, token for token and merge for merge (rows past its
    /// 50,257 tokens unused padding).
    Gpt2,
    /// Another tokenizer: its model name and pre-tokenizer, and why it is not GPT-2's.
    Other {
        model: String,
        pre: String,
        n_tokens: usize,
    },
    /// No `tokenizer.ggml.model`.
    Missing,
}

/// Recognises the tokenizer `header` carries.
pub fn recognise(header: &Header) -> Result<Recognised> {
    let Some(model) = header.get(MODEL).and_then(Value::as_str) else {
        return Ok(Recognised::Missing);
    };
    let pre = header.get(PRE).and_then(Value::as_str).unwrap_or("default");
    let tokens = header.get(TOKENS).and_then(Value::as_array).unwrap_or(&[]);
    let merges = header.get(MERGES).and_then(Value::as_array).unwrap_or(&[]);
    let other = Recognised::Other {
        model: model.to_string(),
        pre: pre.to_string(),
        n_tokens: tokens.len(),
    };
    if model != "gpt2" || tokens.len() < GPT2_VOCAB_SIZE {
        return Ok(other);
    }
    let gpt2 = gpt2_vocab()?;
    let same_tokens = tokens
        .iter()
        .zip(&gpt2.tokens)
        .all(|(a, b)| a.as_str() == Some(b.as_str()));
    let padding = tokens[GPT2_VOCAB_SIZE..]
        .iter()
        .all(|t| t.as_str().is_some_and(|s| s.starts_with("[PAD")));
    let same_merges = merges.len() == gpt2.merges.len()
        && merges
            .iter()
            .zip(&gpt2.merges)
            .all(|(a, b)| a.as_str() == Some(b.as_str()));
    Ok(match same_tokens && padding && same_merges {
        true => Recognised::Gpt2,
        false => other,
    })
}
