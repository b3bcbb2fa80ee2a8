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
use crate::data::tokenizer::files::{TokenizerFiles, TOKENIZER_CONFIG, TOKENIZER_JSON};
use crate::data::tokenizer::hf::HfTokenizer;
use crate::data::{GPT2_EOT, GPT2_VOCAB_SIZE};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value as Json};

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

/// llama.cpp's `llama_token_type` of tokens added to a vocabulary that are not
/// special.
pub const USER_DEFINED: i32 = 4;
/// The key of the end-of-turn and end-of-message ids.
pub const EOT: &str = "tokenizer.ggml.eot_token_id";
pub const EOM: &str = "tokenizer.ggml.eom_token_id";
pub const UNK: &str = "tokenizer.ggml.unknown_token_id";

/// Llama 3's split regex (`llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's (and Qwen2.5's, Qwen3's): Llama 3's with digits one by one.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer names (`tokenizer.ggml.pre`) nanogpt reads and writes.
pub const PRE_NAMES: [&str; 4] = ["llama-bpe", "qwen2", "smollm", "gpt-2"];

/// The `tokenizers` pre-tokenizer of a llama.cpp pre-tokenizer name, and whether its
/// BPE takes a whole word found in the vocabulary as it is (`ignore_merges`, Llama 3).
fn pre_tokenizer(pre: &str) -> Option<(Json, bool)> {
    let byte_level = |trim_offsets: bool, use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim_offsets,
               "use_regex": use_regex})
    };
    let split = |regex: &str| {
        json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
               "invert": false})
    };
    let sequence = |steps: [Json; 2]| json!({"type": "Sequence", "pretokenizers": steps});
    Some(match pre {
        "llama-bpe" => (
            sequence([split(LLAMA3_SPLIT), byte_level(true, false)]),
            true,
        ),
        "qwen2" => (
            sequence([split(QWEN2_SPLIT), byte_level(false, false)]),
            false,
        ),
        "smollm" => (
            sequence([
                json!({"type": "Digits", "individual_digits": true}),
                byte_level(true, true),
            ]),
            false,
        ),
        "gpt-2" => (byte_level(true, true), false),
        _ => return None,
    })
}

/// What a pre-tokenizer does, with the settings that do not change ids left out.
fn pre_signature(p: &Json) -> Vec<String> {
    let s = |v: Option<&Json>| v.map(|v| v.to_string()).unwrap_or_default();
    match p.get("type").and_then(Json::as_str).unwrap_or("") {
        "Sequence" => p
            .get("pretokenizers")
            .and_then(Json::as_array)
            .map(|steps| steps.iter().flat_map(pre_signature).collect())
            .unwrap_or_default(),
        "Split" => vec![format!(
            "Split {} {} {}",
            s(p.get("pattern")),
            s(p.get("behavior")),
            s(p.get("invert"))
        )],
        "ByteLevel" => vec![format!(
            "ByteLevel {} {}",
            s(p.get("add_prefix_space")),
            s(p.get("use_regex"))
        )],
        "Digits" => vec![format!("Digits {}", s(p.get("individual_digits")))],
        other => vec![other.to_string()],
    }
}

/// The llama.cpp name of the pre-tokenizer `p` of a tokenizer.json, if it has one
/// nanogpt knows.
pub fn pre_name(p: &Json) -> Option<&'static str> {
    let sig = pre_signature(p);
    PRE_NAMES
        .into_iter()
        .find(|name| pre_tokenizer(name).is_some_and(|(q, _)| pre_signature(&q) == sig))
}

/// A model's own byte-level BPE tokenizer (a Hugging Face tokenizer.json, as Llama 3,
/// SmolLM2 and Qwen have) in GGUF metadata, for a model of `vocab_size` rows: every
/// id's token (`[PADn]` of type unused where the tokenizer has none), the token
/// types (added special tokens, and those llama.cpp's converter takes for special,
/// `<|...|>`, are control tokens), the merges, the pre-tokenizer's llama.cpp name,
/// BOS/EOS/padding ids of tokenizer_config.json and whether BOS is prepended. Anything
/// else is refused, naming the file and the key.
pub fn hf_metadata(tok: &HfTokenizer, vocab_size: usize) -> Result<Vec<(String, Value)>> {
    let files = tok.files();
    let path = files.path_of(TOKENIZER_JSON);
    let json: Json = serde_json::from_slice(&files.tokenizer_json)
        .with_context(|| format!("{path} is not valid JSON"))?;
    let model = &json["model"];
    let kind = model["type"].as_str().unwrap_or("?");
    if kind != "BPE" || model["byte_fallback"].as_bool() == Some(true) {
        bail!(
            "{path}: model.type is {kind}{}: nanogpt writes byte-level BPE tokenizers (Llama 3, \
             SmolLM2, Qwen) to GGUF only; export to a Hugging Face folder (--to DIR) instead",
            match kind {
                "BPE" => " with byte_fallback",
                _ => "",
            }
        );
    }
    let Some(pre) = pre_name(&json["pre_tokenizer"]) else {
        bail!(
            "{path}: pre_tokenizer {} is none of those llama.cpp names {}; export to a Hugging \
             Face folder (--to DIR) instead",
            json["pre_tokenizer"],
            PRE_NAMES.join(", ")
        );
    };
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let mut put = |id: u64, token: &str, ty: i32| -> Result<()> {
        match tokens.get_mut(id as usize) {
            Some(slot) => {
                *slot = Some((token.to_string(), ty));
                Ok(())
            }
            None => bail!(
                "{path}: token {token:?} has id {id}, beyond the model's vocabulary of \
                 {vocab_size}: the tokenizer is not this model's"
            ),
        }
    };
    let vocab = model["vocab"]
        .as_object()
        .with_context(|| format!("{path}: model.vocab is not an object"))?;
    for (token, id) in vocab {
        let id = id
            .as_u64()
            .with_context(|| format!("{path}: model.vocab[{token:?}] is not an id"))?;
        put(id, token, NORMAL)?;
    }
    for added in json["added_tokens"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        let (Some(id), Some(token)) = (added["id"].as_u64(), added["content"].as_str()) else {
            bail!("{path}: an entry of added_tokens without id or content");
        };
        let looks_special = token.starts_with("<|") && token.ends_with("|>");
        let ty = match added["special"].as_bool() == Some(true) || looks_special {
            true => CONTROL,
            false => USER_DEFINED,
        };
        put(id, token, ty)?;
    }
    let merges = model["merges"]
        .as_array()
        .with_context(|| format!("{path}: model.merges is not a list"))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Some(s.clone()),
            Json::Array(pair) => Some(format!(
                "{} {}",
                pair.first()?.as_str()?,
                pair.get(1)?.as_str()?
            )),
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .with_context(|| format!("{path}: model.merges holds an entry that is not a merge"))?;
    let (names, types): (Vec<String>, Vec<i32>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), UNUSED)))
        .unzip();
    let mut m = vec![
        (MODEL.into(), Value::String("gpt2".into())),
        (PRE.into(), Value::String(pre.into())),
        (TOKENS.into(), Value::strings(names)),
        (TOKEN_TYPE.into(), Value::i32s(types)),
        (MERGES.into(), Value::strings(merges)),
    ];
    let config: Json = match &files.tokenizer_config {
        Some(bytes) => serde_json::from_slice(bytes)
            .with_context(|| format!("{} is not valid JSON", files.path_of(TOKENIZER_CONFIG)))?,
        None => Json::Null,
    };
    for (name, key) in [
        ("bos_token", BOS),
        ("eos_token", EOS),
        ("pad_token", PADDING),
        ("unk_token", UNK),
    ] {
        let token = match &config[name] {
            Json::String(s) => Some(s.as_str()),
            Json::Object(o) => o.get("content").and_then(Json::as_str),
            _ => None,
        };
        if let Some(id) = token.and_then(|t| tok.token_id(t)) {
            m.push((key.into(), Value::U32(id)));
        }
    }
    m.push((ADD_BOS.into(), Value::Bool(!tok.specials().0.is_empty())));
    if let Some(template) = chat_template_source(files, &config) {
        m.push((CHAT_TEMPLATE.into(), Value::String(template)));
    }
    Ok(m)
}

/// The chat template's text: chat_template.jinja, else tokenizer_config.json's
/// (a string, or the template named `default`).
fn chat_template_source(files: &TokenizerFiles, config: &Json) -> Option<String> {
    if let Some(t) = &files.chat_template {
        return Some(t.clone());
    }
    match &config["chat_template"] {
        Json::String(s) => Some(s.clone()),
        Json::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str().map(str::to_string)),
        _ => None,
    }
}

/// Texts of control tokens that end a turn, which llama.cpp also stops at.
const END_OF_TURN: [&str; 5] = [
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end_of_text|>",
    "<|endoftext|>",
];

/// The tokenizer files of a GGUF byte-level BPE tokenizer (`tokenizer.ggml.model`
/// `gpt2` with a pre-tokenizer of [`PRE_NAMES`]), built in memory: tokenizer.json
/// (vocabulary, merges, control and user-defined tokens as added tokens, BOS
/// prepended where `add_bos_token` says), tokenizer_config.json (the special tokens
/// and the chat template) and generation_config.json (EOS and the end-of-turn ids
/// where generation stops). `origin` names the file in messages.
pub fn hf_files(header: &Header, origin: &str) -> Result<TokenizerFiles> {
    let model = header.get(MODEL).and_then(Value::as_str);
    if model != Some("gpt2") {
        bail!(
            "{origin}: {MODEL} is {}: nanogpt reads byte-level BPE tokenizers (`gpt2`: Llama 3, \
             SmolLM2, Qwen) from GGUF files only",
            model.map_or("missing".to_string(), |m| format!("`{m}`"))
        );
    }
    let pre = header.get(PRE).and_then(Value::as_str).unwrap_or("default");
    let Some((pre_tokenizer, ignore_merges)) = pre_tokenizer(pre) else {
        bail!(
            "{origin}: {PRE} is `{pre}`; nanogpt reads the pre-tokenizers {}",
            PRE_NAMES.join(", ")
        );
    };
    let strings = |key: &str| -> Result<Vec<String>> {
        let list = header
            .get(key)
            .and_then(Value::as_array)
            .with_context(|| format!("{origin} has no {key}"))?;
        list.iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .with_context(|| format!("{origin}: {key} holds a value that is not a string"))
    };
    let tokens = strings(TOKENS)?;
    let merges = strings(MERGES)?;
    let types: Vec<i64> = match header.get(TOKEN_TYPE).and_then(Value::as_array) {
        Some(list) if list.len() == tokens.len() => list
            .iter()
            .map(|v| v.as_i64())
            .collect::<Option<_>>()
            .with_context(|| format!("{origin}: {TOKEN_TYPE} holds a value that is not a type"))?,
        Some(list) => bail!(
            "{origin}: {TOKEN_TYPE} has {} entries for {} tokens",
            list.len(),
            tokens.len()
        ),
        None => vec![NORMAL as i64; tokens.len()],
    };
    let id = |key: &str| -> Result<Option<u32>> {
        match header.get(key).map(|v| v.as_u64()) {
            None => Ok(None),
            Some(Some(id)) if (id as usize) < tokens.len() => Ok(Some(id as u32)),
            Some(_) => bail!(
                "{origin}: {key} is not an id of its {} tokens",
                tokens.len()
            ),
        }
    };
    let (bos, eos) = (id(BOS)?, id(EOS)?);
    let add_bos = header
        .get(ADD_BOS)
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, (token, &ty)) in tokens.iter().zip(&types).enumerate() {
        if vocab.insert(token.clone(), json!(i)).is_some() {
            bail!("{origin}: {TOKENS} lists {token:?} twice");
        }
        if ty == CONTROL as i64 || ty == USER_DEFINED as i64 {
            added.push(
                json!({"id": i, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == CONTROL as i64}),
            );
        }
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": false, "use_regex": false});
    let post_processor = match (add_bos, bos) {
        (true, Some(b)) => {
            let name = &tokens[b as usize];
            let tp = json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": name, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": name, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": name, "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {name.as_str(): {"id": name, "ids": [b], "tokens": [name]}}});
            json!({"type": "Sequence", "processors": [byte_level, tp]})
        }
        (true, None) => bail!("{origin}: {ADD_BOS} is true but {BOS} is missing"),
        (false, _) => byte_level,
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": merges},
    });
    let name = |id: Option<u32>| id.map(|i| Json::String(tokens[i as usize].clone()));
    let mut config = serde_json::Map::new();
    for (key, gguf_key) in [
        ("bos_token", BOS),
        ("eos_token", EOS),
        ("pad_token", PADDING),
        ("unk_token", UNK),
    ] {
        if let Some(token) = name(id(gguf_key)?) {
            config.insert(key.into(), token);
        }
    }
    config.insert("add_bos_token".into(), add_bos.into());
    if let Some(t) = header.get(CHAT_TEMPLATE).and_then(Value::as_str) {
        config.insert("chat_template".into(), t.into());
    }
    let mut stops: Vec<u32> = [eos, id(EOT)?, id(EOM)?].into_iter().flatten().collect();
    for (i, (token, &ty)) in tokens.iter().zip(&types).enumerate() {
        if ty == CONTROL as i64 && END_OF_TURN.contains(&token.as_str()) {
            stops.push(i as u32);
        }
    }
    stops.sort_unstable();
    stops.dedup();
    Ok(TokenizerFiles {
        origin: origin.to_string(),
        tokenizer_json: serde_json::to_vec(&tokenizer)?,
        tokenizer_config: Some(serde_json::to_vec_pretty(&config)?),
        chat_template: None,
        generation_config: Some(serde_json::to_vec(&json!({"eos_token_id": stops}))?),
    })
}
