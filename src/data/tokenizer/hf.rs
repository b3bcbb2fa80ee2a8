//! A model's own tokenizer: its `tokenizer.json` through Hugging Face's `tokenizers`
//! crate (the library `AutoTokenizer` runs), with what `tokenizer_config.json` and
//! `generation_config.json` add: the special tokens by name, the chat template, and
//! the ids where generation ends.

use std::collections::BTreeSet;
use std::ops::Range;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value as Json};

use super::files::{TokenizerFiles, CHAT_TEMPLATE, GENERATION_CONFIG, TOKENIZER_CONFIG};
use crate::data::chat_template::ChatTemplate;

/// The names transformers passes a chat template, with their strings.
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A Hugging Face tokenizer and what its model's files say around it.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    files: TokenizerFiles,
    sha256: String,
    /// One more than the largest id (the model's vocabulary and the added tokens).
    vocab_size: usize,
    /// The post-processor's tokens before and after a text (Llama 3: BOS before).
    prefix: Vec<u32>,
    suffix: Vec<u32>,
    /// `eos_token` of tokenizer_config.json: what ends a document.
    eos: Option<u32>,
    /// Where generation ends: `eos` and generation_config.json's `eos_token_id`s.
    stops: Vec<u32>,
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HfTokenizer({}, vocab {}, sha256 {})",
            self.files.origin, self.vocab_size, self.sha256
        )
    }
}

impl HfTokenizer {
    /// The tokenizer of `files`; each error names the file at fault.
    pub fn from_files(files: TokenizerFiles) -> Result<HfTokenizer> {
        let json_path = files.path_of(super::files::TOKENIZER_JSON);
        let inner = tokenizers::Tokenizer::from_bytes(&files.tokenizer_json).map_err(|e| {
            anyhow!("{json_path} is not a tokenizer the `tokenizers` library reads: {e}")
        })?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&id| id as usize + 1);
        if vocab_size == 0 {
            bail!("{json_path} has an empty vocabulary");
        }
        let config =
            parse_json_object(&files, TOKENIZER_CONFIG, files.tokenizer_config.as_deref())?;
        let special_tokens = special_tokens(&config, &files)?;
        let id_of = |name: &str| -> Result<Option<u32>> {
            let Some(token) = special_tokens.get(name).and_then(Json::as_str) else {
                return Ok(None);
            };
            match inner.token_to_id(token) {
                Some(id) => Ok(Some(id)),
                None => bail!(
                    "{} names {name} {token:?}, which {json_path} does not hold; fix the \
                     tokenizer files (they come from different models?)",
                    files.path_of(TOKENIZER_CONFIG)
                ),
            }
        };
        let eos = id_of("eos_token")?;
        id_of("bos_token")?;
        let generation = parse_json_object(
            &files,
            GENERATION_CONFIG,
            files.generation_config.as_deref(),
        )?;
        let mut stops: BTreeSet<u32> = eos.into_iter().collect();
        stops.extend(generation_eos(&generation, &files, vocab_size)?);
        let template = chat_template(&files, &config, special_tokens)?;
        let (prefix, suffix) = post_processor_tokens(&inner, &json_path)?;
        Ok(HfTokenizer {
            sha256: files.sha256(),
            inner,
            files,
            vocab_size,
            prefix,
            suffix,
            eos,
            stops: stops.into_iter().collect(),
            template,
        })
    }

    pub fn files(&self) -> &TokenizerFiles {
        &self.files
    }

    /// The SHA-256 of its `tokenizer.json`.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of `eos_token`: what ends a document and an instruction response.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Every id that ends generation.
    pub fn stops(&self) -> &[u32] {
        &self.stops
    }

    /// The chat template, where the model has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The post-processor's tokens around a text: `(before, after)`.
    pub fn specials(&self) -> (&[u32], &[u32]) {
        (&self.prefix, &self.suffix)
    }

    /// The ids of `text` (special tokens written in it become their ids, as with
    /// `AutoTokenizer`), without the post-processor's tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encoding(text)?.get_ids().to_vec())
    }

    /// [`HfTokenizer::encode`] with each token's byte range in `text`.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Range<usize>>)> {
        let encoding = self.encoding(text)?;
        let offsets = encoding.get_offsets().iter().map(|&(a, b)| a..b).collect();
        Ok((encoding.get_ids().to_vec(), offsets))
    }

    fn encoding(&self, text: &str) -> Result<tokenizers::Encoding> {
        self.inner
            .encode(text, false)
            .map_err(|e| anyhow!("the tokenizer of {} failed: {e}", self.files.origin))
    }

    /// The text of `ids`, special tokens included; an id outside the vocabulary
    /// reads as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        for run in ids.chunk_by(|a, b| self.knows(*a) == self.knows(*b)) {
            match self.knows(run[0]) {
                true => out.push_str(&self.inner.decode(run, false).unwrap_or_default()),
                false => run.iter().for_each(|_| out.push('\u{FFFD}')),
            }
        }
        out
    }

    /// The id of the token `token` (added tokens included), if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn knows(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some()
    }

    /// The text of the token `id` alone (`<|eot_id|>`, ` world`).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.knows(id)
            .then(|| self.inner.decode(&[id], false).ok())
            .flatten()
    }

    /// A decoder that emits text as tokens complete it (see [`super::StreamDecoder`]).
    pub(super) fn decode_stream(&self) -> HfStream<'_> {
        HfStream {
            tokenizer: self,
            stream: self.inner.decode_stream(false),
            waiting: 0,
        }
    }
}

/// Streamed decoding: `tokenizers`' own, which keeps the context a decoder needs
/// (leading spaces, bytes of a character split over tokens).
pub(super) struct HfStream<'a> {
    tokenizer: &'a HfTokenizer,
    stream: tokenizers::tokenizer::DecodeStream<
        'a,
        tokenizers::ModelWrapper,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >,
    /// Tokens taken since text was last emitted.
    waiting: usize,
}

impl HfStream<'_> {
    pub(super) fn push(&mut self, id: u32) -> String {
        if !self.tokenizer.knows(id) {
            return "\u{FFFD}".into();
        }
        match self.stream.step(id) {
            Ok(Some(text)) => {
                self.waiting = 0;
                text
            }
            Ok(None) => {
                self.waiting += 1;
                String::new()
            }
            Err(_) => {
                self.stream = self.tokenizer.inner.decode_stream(false);
                self.waiting = 0;
                "\u{FFFD}".into()
            }
        }
    }

    /// What is still held back: an unfinished character shows as U+FFFD.
    pub(super) fn finish(self) -> String {
        match self.waiting {
            0 => String::new(),
            _ => "\u{FFFD}".into(),
        }
    }
}

/// The contents of an optional JSON object file (absent: empty).
fn parse_json_object(
    files: &TokenizerFiles,
    name: &str,
    bytes: Option<&[u8]>,
) -> Result<Map<String, Json>> {
    let Some(bytes) = bytes else {
        return Ok(Map::new());
    };
    match serde_json::from_slice(bytes) {
        Ok(Json::Object(map)) => Ok(map),
        Ok(_) => bail!("{} is not a JSON object", files.path_of(name)),
        Err(e) => Err(e).with_context(|| format!("{} is not valid JSON", files.path_of(name))),
    }
}

/// `bos_token`, `eos_token`, ... of tokenizer_config.json as strings (each a string or
/// an `{"content": ...}` object there).
fn special_tokens(config: &Map<String, Json>, files: &TokenizerFiles) -> Result<Map<String, Json>> {
    let mut out = Map::new();
    for name in SPECIAL_TOKEN_NAMES {
        let token = match config.get(name) {
            None | Some(Json::Null) => continue,
            Some(Json::String(s)) => s.clone(),
            Some(Json::Object(o)) => match o.get("content") {
                Some(Json::String(s)) => s.clone(),
                _ => bail!(
                    "{}: {name} is an object without a string `content`",
                    files.path_of(TOKENIZER_CONFIG)
                ),
            },
            Some(other) => bail!(
                "{}: {name} is {other}, not a token",
                files.path_of(TOKENIZER_CONFIG)
            ),
        };
        out.insert(name.into(), Json::String(token));
    }
    Ok(out)
}

/// generation_config.json's `eos_token_id`: one id or a list of them.
fn generation_eos(
    config: &Map<String, Json>,
    files: &TokenizerFiles,
    vocab: usize,
) -> Result<Vec<u32>> {
    let ids = match config.get("eos_token_id") {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::Array(list)) => list.clone(),
        Some(one) => vec![one.clone()],
    };
    ids.iter()
        .map(|id| match id.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            _ => bail!(
                "{}: eos_token_id {id} is not an id of the vocabulary (0..{vocab})",
                files.path_of(GENERATION_CONFIG)
            ),
        })
        .collect()
}

/// The chat template: chat_template.jinja, else tokenizer_config.json's
/// `chat_template` (a string, or a list of named templates: `default`).
fn chat_template(
    files: &TokenizerFiles,
    config: &Map<String, Json>,
    special_tokens: Map<String, Json>,
) -> Result<Option<ChatTemplate>> {
    if let Some(source) = &files.chat_template {
        return ChatTemplate::new(source, files.path_of(CHAT_TEMPLATE), special_tokens).map(Some);
    }
    let origin = files.path_of(TOKENIZER_CONFIG);
    let source = match config.get("chat_template") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(named)) => {
            let find = |name: &str| {
                named.iter().find_map(|t| {
                    (t.get("name")?.as_str()? == name).then(|| t.get("template")?.as_str())?
                })
            };
            match find("default") {
                Some(s) => s.to_string(),
                None => bail!("{origin}: chat_template lists no template named `default`"),
            }
        }
        Some(_) => bail!("{origin}: chat_template is neither a string nor a list of templates"),
    };
    ChatTemplate::new(&source, origin, special_tokens).map(Some)
}

/// The tokens the post-processor puts around a text, found by encoding a probe with
/// and without them.
fn post_processor_tokens(
    inner: &tokenizers::Tokenizer,
    origin: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let encode = |special| {
        inner
            .encode("x", special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| anyhow!("{origin}: cannot encode a probe text: {e}"))
    };
    let (plain, with) = (encode(false)?, encode(true)?);
    let at = (0..=with.len().saturating_sub(plain.len()))
        .find(|&at| with[at..].starts_with(&plain))
        .ok_or_else(|| {
            anyhow!("{origin}: its post-processor changes the text's own tokens, which nanogpt does not support")
        })?;
    Ok((with[..at].to_vec(), with[at + plain.len()..].to_vec()))
}
