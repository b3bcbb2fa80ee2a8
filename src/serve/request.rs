//! A request body turned into a checked [`Request`]: every field read with its type
//! and range ([`super::api`]), prompts tokenised and fitted to the model's context,
//! chat messages put in the model's chat template. Nothing unchecked reaches the
//! model's thread.

use super::api::{self, ApiError, Fields, Message, Prompt, MAX_LOGPROBS, MAX_N};
use super::engine::{Generation, Sampling};
use crate::chat::{ChatFormat, Conversation};
use crate::data::Tokenizer;
use serde_json::Value;
use std::sync::Arc;

/// What requests are checked against: the model's tokenizer, vocabulary, context and
/// chat template.
pub struct Model {
    pub tokenizer: Arc<Tokenizer>,
    pub eot: Option<u32>,
    pub vocab: usize,
    /// The context (block size).
    pub block: usize,
    pub template: ChatFormat,
}

/// Which API a request came through: they differ in their bodies' shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
}

impl Api {
    pub fn name(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }
}

/// A checked request: the job's settings and how to answer.
pub struct Request {
    pub api: Api,
    pub generation: Generation,
    pub stream: bool,
    pub include_usage: bool,
}

/// The sampling fields both APIs share.
fn sampling(s: &Model, f: &mut Fields) -> Result<(Sampling, usize), ApiError> {
    let _ = f.string("model")?;
    let _ = f.string("user")?;
    let n = f.int("n", 1..=MAX_N as i64)?.unwrap_or(1) as usize;
    let sampling = Sampling {
        temperature: f.number("temperature", 0.0..=2.0)?.unwrap_or(1.0) as f32,
        top_p: f.number("top_p", 0.0..=1.0)?.map(|p| p as f32),
        top_k: f
            .int("top_k", -1..=s.vocab as i64)?
            .filter(|&k| k > 0)
            .map(|k| k as usize),
        repetition_penalty: f.number("repetition_penalty", 0.01..=100.0)?.unwrap_or(1.0) as f32,
        presence_penalty: f.number("presence_penalty", -2.0..=2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: f.number("frequency_penalty", -2.0..=2.0)?.unwrap_or(0.0) as f32,
        logit_bias: api::logit_bias(f, s.vocab)?,
        seed: f
            .int("seed", i64::MIN..=i64::MAX)?
            .map_or_else(rand::random, |x| x as u64),
    };
    if sampling.top_p == Some(0.0) {
        return Err(ApiError::invalid("top_p", "'top_p' must be above 0"));
    }
    Ok((sampling, n))
}

pub fn completion_request(s: &Model, body: &[u8]) -> Result<Request, ApiError> {
    let mut f = Fields::parse(body)?;
    let prompt = f
        .take("prompt")
        .ok_or_else(|| ApiError::invalid("prompt", "'prompt' is required"))?;
    let (sampling, n) = sampling(s, &mut f)?;
    let max_tokens = f.int("max_tokens", 0..=s.block as i64)?.unwrap_or(16) as usize;
    let logprobs = f
        .int("logprobs", 0..=MAX_LOGPROBS as i64)?
        .map(|k| k as usize);
    let echo = f.bool("echo")?.unwrap_or(false);
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = api::include_usage(&mut f, stream)?;
    let stop = api::stops(&mut f)?;
    if let Some(best_of) = f.int("best_of", 1..=MAX_N as i64)? {
        if best_of as usize != n {
            return Err(ApiError::invalid(
                "best_of",
                "'best_of' other than 'n' is not supported",
            ));
        }
    }
    if f.string("suffix")?.is_some_and(|x| !x.is_empty()) {
        return Err(ApiError::invalid(
            "suffix",
            "'suffix' (insertion) is not supported by this model",
        ));
    }
    f.finish()?;
    let mut prompts = Vec::new();
    for p in api::prompts(prompt, s.vocab)? {
        let ids = match p {
            Prompt::Text(text) => s.encode(&text, "prompt")?,
            Prompt::Tokens(ids) => ids,
        };
        s.check_length(ids.len(), max_tokens, "prompt")?;
        prompts.push(ids);
    }
    Ok(Request {
        api: Api::Completions,
        generation: Generation {
            prompts,
            n,
            max_tokens,
            sampling,
            stop,
            logprobs,
            echo,
        },
        stream,
        include_usage,
    })
}

pub fn chat_request(s: &Model, body: &[u8]) -> Result<Request, ApiError> {
    let mut f = Fields::parse(body)?;
    let messages = f
        .take("messages")
        .ok_or_else(|| ApiError::invalid("messages", "'messages' is required"))?;
    let messages = api::messages(messages)?;
    let (sampling, n) = sampling(s, &mut f)?;
    let limit = 1..=s.block as i64;
    let max_tokens = match f.int("max_completion_tokens", limit.clone())? {
        Some(m) => Some(m),
        None => f.int("max_tokens", limit)?,
    };
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top = f.int("top_logprobs", 0..=MAX_LOGPROBS as i64)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "'top_logprobs' needs 'logprobs': true",
        ));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = api::include_usage(&mut f, stream)?;
    let stop = api::stops(&mut f)?;
    if let Some(format) = f.take("response_format") {
        if format.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::invalid(
                "response_format",
                "only {\"type\": \"text\"} is supported",
            ));
        }
    }
    for unsupported in ["tools", "tool_choice", "functions", "function_call"] {
        if f.take(unsupported).is_some() {
            return Err(ApiError::invalid(
                unsupported,
                format!("'{unsupported}' is not supported: this model has no tool calling"),
            ));
        }
    }
    f.finish()?;
    let prompt = s.chat_prompt(&messages, max_tokens.unwrap_or(1) as usize)?;
    let max_tokens = max_tokens.map_or(s.block - prompt.len(), |m| m as usize);
    s.check_length(prompt.len(), max_tokens, "messages")?;
    Ok(Request {
        api: Api::Chat,
        generation: Generation {
            prompts: vec![prompt],
            n,
            max_tokens,
            sampling,
            stop,
            logprobs: logprobs.then(|| top.unwrap_or(0) as usize),
            echo: false,
        },
        stream,
        include_usage,
    })
}

impl Model {
    /// `text` in the model's tokens, as `sample` encodes a prompt.
    pub fn encode(&self, text: &str, param: &str) -> Result<Vec<u32>, ApiError> {
        let ids = self
            .tokenizer
            .encode_prompt(text)
            .map_err(|e| ApiError::invalid(param, format!("'{param}' cannot be tokenised: {e}")))?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab) {
            return Err(ApiError::invalid(
                param,
                format!(
                    "'{param}' encodes to token {id}, beyond this model's vocabulary of {}",
                    self.vocab
                ),
            ));
        }
        Ok(ids)
    }

    /// 400 unless a prompt of `len` tokens and `max_tokens` more fit the block.
    fn check_length(&self, len: usize, max_tokens: usize, param: &str) -> Result<(), ApiError> {
        if len == 0 {
            return Err(ApiError::invalid(param, format!("'{param}' is empty")));
        }
        if len + max_tokens > self.block {
            return Err(ApiError::invalid(
                param,
                format!(
                    "This model's maximum context length is {} tokens. However, you requested {} tokens ({len} in the {param}, {max_tokens} in the completion). Please reduce the length of the {param} or the completion.",
                    self.block,
                    len + max_tokens
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Ok(())
    }

    /// The tokens of a conversation in the model's chat template, ending where the
    /// assistant's reply begins: system messages first, then user and assistant
    /// turns in order, the last one the user's.
    fn chat_prompt(&self, messages: &[Message], reply: usize) -> Result<Vec<u32>, ApiError> {
        let shape = || {
            ApiError::invalid(
                "messages",
                "this model's chat template needs system messages first, then user and assistant messages in turn, ending with a user message",
            )
        };
        let system: Vec<&str> = messages
            .iter()
            .take_while(|m| m.role == "system")
            .map(|m| m.content.as_str())
            .collect();
        let turns = &messages[system.len()..];
        let (Some(last), rest) = (turns.last(), turns.len().saturating_sub(1)) else {
            return Err(shape());
        };
        if last.role != "user" || rest % 2 != 0 {
            return Err(shape());
        }
        let system = (!system.is_empty()).then(|| system.join("\n"));
        let mut conversation = Conversation::new(self.template, system);
        for pair in turns[..rest].chunks_exact(2) {
            if pair[0].role != "user" || pair[1].role != "assistant" {
                return Err(shape());
            }
            conversation.push(pair[0].content.clone(), pair[1].content.clone());
        }
        let eot = self.eot.ok_or_else(|| {
            ApiError::bad_request(
                "this model's tokenizer has no end-of-text token, which its chat template needs",
            )
        })?;
        let budget = self.block.saturating_sub(reply);
        let context = conversation
            .context(&last.content, &self.tokenizer, eot, budget)
            .map_err(|e| {
                ApiError::invalid("messages", format!("'messages' cannot be tokenised: {e:#}"))
            })?;
        if context.dropped > 0 || context.ids.len() > budget {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "This model's maximum context length is {} tokens; the messages need {} and the reply {reply}. Shorten the messages.",
                    self.block,
                    conversation.context(&last.content, &self.tokenizer, eot, usize::MAX).map_or(0, |c| c.ids.len()),
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Ok(context.ids)
    }
}
