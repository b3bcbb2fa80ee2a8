//! Instruction data: examples in the Alpaca or chat form, their prompt templates, and
//! their tokens with a loss mask (1 = the token is trained as a target).
//!
//! - **Alpaca** (`{"instruction", "input"?, "output"}`): the prompt is Stanford
//!   Alpaca's template ([`ALPACA_PROMPT_INPUT`] when `input` is non-empty, else
//!   [`ALPACA_PROMPT_NO_INPUT`]), the response is `output`, followed by end-of-text.
//! - **Chat** (`{"messages": [{"role", "content"}, ...]}`, roles `system`, `user`,
//!   `assistant`): each message is `<|ROLE|>\n` then its content; a system or user
//!   message ends with `\n`, an assistant message with end-of-text. Only the assistant
//!   contents and their end-of-text are trained:
//!
//! ```text
//! <|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!<|endoftext|><|user|>\n...
//!                                                 ^^^^^^^^^^^^^^^^^^^^ trained
//! ```
//!
//! Prompt and response parts are tokenized separately and concatenated, so the
//! boundary of the mask falls exactly between them. End-of-text is GPT-2's
//! `<|endoftext|>` (id 50256), a model's `eos_token` with its own tokenizer; a
//! char-level vocabulary uses the character U+0003 (END OF TEXT), which `prepare`
//! adds to the vocabulary of instruction data. The `<|user|>`-style role tags are
//! ordinary text (several tokens each).
//!
//! With a model's own tokenizer that has a chat template, a chat example is instead
//! the template's text of its `messages` (and `tools`, where the record has them),
//! as transformers' `apply_chat_template` writes it, tokenized whole; the trained
//! tokens are each assistant message's after its header, up to and including its
//! end-of-turn token ([`ChatTemplate::assistant_spans`]). Messages then may have any
//! role and fields the template reads (`tool_calls`, `reasoning_content`).

use std::fmt;
use std::str::FromStr;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

use super::chat_template::{ChatTemplate, RenderOptions};
use super::tokenizer::hf::HfTokenizer;
use super::tokenizer::Tokenizer;

/// Stanford Alpaca's prompt for an example with a non-empty `input`.
pub const ALPACA_PROMPT_INPUT: &str = "Below is an instruction that describes a task, paired \
with an input that provides further context. Write a response that appropriately completes \
the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:";
/// Stanford Alpaca's prompt for an example without `input`.
pub const ALPACA_PROMPT_NO_INPUT: &str = "Below is an instruction that describes a task. \
Write a response that appropriately completes the request.\n\n### Instruction:\n\
{instruction}\n\n### Response:";

/// The end-of-text character of a char-level vocabulary (U+0003, END OF TEXT).
pub const CHAR_EOT: char = '\u{3}';

/// How the lines of a `.jsonl` file are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataFormat {
    /// Plain documents in a string field (`--text-column`), trained on every token.
    Text,
    /// `instruction`, optional `input`, `output`.
    Alpaca,
    /// `messages`: a list of `{role, content}`.
    Chat,
}

impl DataFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            DataFormat::Text => "text",
            DataFormat::Alpaca => "alpaca",
            DataFormat::Chat => "chat",
        }
    }

    /// The format of a file whose first record is `object`: `messages` (or ShareGPT's
    /// `conversations`) means chat, `instruction` and `output` mean Alpaca, anything
    /// else plain text.
    pub fn detect(object: &Map<String, Value>) -> DataFormat {
        if object.contains_key("messages") || object.contains_key("conversations") {
            DataFormat::Chat
        } else if object.contains_key("instruction") && object.contains_key("output") {
            DataFormat::Alpaca
        } else {
            DataFormat::Text
        }
    }
}

impl fmt::Display for DataFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DataFormat {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "text" => Ok(DataFormat::Text),
            "alpaca" => Ok(DataFormat::Alpaca),
            "chat" => Ok(DataFormat::Chat),
            other => bail!("unknown format `{other}`: use `alpaca`, `chat` or `text`"),
        }
    }
}

/// One part of an example: prompt text (context, not trained) or a response (trained,
/// and followed by end-of-text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Prompt(String),
    Response(String),
}

/// An instruction example: its parts in order, ending with a response.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    /// The parts in nanogpt's own templates (empty when the record cannot be written
    /// in them: see `unsupported`).
    pub parts: Vec<Part>,
    /// A chat record as written, for a model's chat template.
    pub chat: Option<ChatRecord>,
    /// Why the record has no parts in nanogpt's chat template (a role other than
    /// system, user and assistant, content that is not text).
    pub unsupported: Option<String>,
    /// Where it comes from (`FILE line N`), for messages; empty when made here.
    pub origin: String,
}

/// A chat record's messages and tools, as the file holds them.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRecord {
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
}

/// The roles of a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    fn parse(name: &str) -> Option<Role> {
        match name {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            _ => None,
        }
    }

    /// The tag that opens a message of this role: `<|user|>\n`.
    pub fn tag(self) -> &'static str {
        match self {
            Role::System => "<|system|>\n",
            Role::User => "<|user|>\n",
            Role::Assistant => "<|assistant|>\n",
        }
    }
}

/// The Alpaca prompt for `instruction` and `input` (empty: the no-input template).
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    match input.is_empty() {
        true => ALPACA_PROMPT_NO_INPUT.replacen("{instruction}", instruction, 1),
        false => {
            // Filled in one pass so that braces inside the instruction stay as they are.
            let (head, rest) = ALPACA_PROMPT_INPUT
                .split_once("{instruction}")
                .expect("template has {instruction}");
            let (mid, tail) = rest.split_once("{input}").expect("template has {input}");
            format!("{head}{instruction}{mid}{input}{tail}")
        }
    }
}

/// The text of a chat message that is not a trained response: `<|user|>\nHi\n`.
pub fn chat_prompt_message(role: Role, content: &str) -> String {
    format!("{}{content}\n", role.tag())
}

impl Example {
    /// Reads one record of `format` (not [`DataFormat::Text`]). The error says which
    /// field is missing or wrong; the caller adds the file and line.
    pub fn from_json(format: DataFormat, object: &Map<String, Value>) -> Result<Example> {
        match format {
            DataFormat::Alpaca => alpaca(object),
            DataFormat::Chat => chat(object),
            DataFormat::Text => bail!("plain text has no instruction example"),
        }
    }

    /// All the text, prompt and response, as the model sees it (end-of-text
    /// omitted): for counting characters.
    pub fn full_text(&self) -> String {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Prompt(t) | Part::Response(t) => t.as_str(),
            })
            .collect()
    }

    /// An example of nanogpt's own templates.
    pub fn from_parts(parts: Vec<Part>) -> Example {
        Example {
            parts,
            chat: None,
            unsupported: None,
            origin: String::new(),
        }
    }

    /// The example's tokens and mask (1 = trained): a chat record in the model's
    /// chat template where `tokenizer` has one (`variables` are the template's extra
    /// variables); else each part tokenized on its own, each response followed by
    /// `eot`.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        eot: u32,
        variables: &Map<String, Value>,
    ) -> Result<(Vec<u32>, Vec<u8>)> {
        let at = |e: anyhow::Error| match self.origin.is_empty() {
            true => e,
            false => e.context(self.origin.clone()),
        };
        if let (Some(chat), Some(hf)) = (&self.chat, tokenizer.hf()) {
            if let Some(template) = hf.template() {
                return encode_chat(chat, hf, template, variables).map_err(at);
            }
        }
        if let Some(why) = &self.unsupported {
            return Err(at(anyhow!(
                "{why}; only a model's own chat template (prepare --tokenizer MODEL_DIR) \
                 writes such messages"
            )));
        }
        self.encode_parts(tokenizer, eot).map_err(at)
    }

    fn encode_parts(&self, tokenizer: &Tokenizer, eot: u32) -> Result<(Vec<u32>, Vec<u8>)> {
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        for part in &self.parts {
            let (text, trained) = match part {
                Part::Prompt(t) => (t, 0),
                Part::Response(t) => (t, 1),
            };
            let part_ids = tokenizer.encode(text)?;
            mask.resize(mask.len() + part_ids.len(), trained);
            ids.extend(part_ids);
            if trained == 1 {
                ids.push(eot);
                mask.push(1);
            }
        }
        Ok((ids, mask))
    }
}

/// A chat record in `template`: its text tokenized whole, and the mask of the
/// assistant's spans (a token is trained when its bytes overlap one, as transformers
/// maps characters to tokens for its assistant masks).
fn encode_chat(
    chat: &ChatRecord,
    hf: &HfTokenizer,
    template: &ChatTemplate,
    variables: &Map<String, Value>,
) -> Result<(Vec<u32>, Vec<u8>)> {
    let stops: Vec<String> = hf
        .stops()
        .iter()
        .filter_map(|&id| hf.token_text(id))
        .collect();
    let opts = RenderOptions {
        add_generation_prompt: false,
        tools: chat.tools.as_ref(),
        variables: Some(variables),
    };
    let (text, spans) = template.assistant_spans(&chat.messages, &opts, &stops)?;
    let (ids, offsets) = hf.encode_with_offsets(&text)?;
    let mask = offsets
        .iter()
        .map(|token| {
            let trained = spans
                .iter()
                .any(|s| token.start < s.end && token.end > s.start);
            u8::from(trained && !token.is_empty())
        })
        .collect();
    Ok((ids, mask))
}

/// The end-of-text id of instruction data under `tokenizer`.
pub fn instruct_eot(tokenizer: &Tokenizer) -> Result<u32> {
    match tokenizer {
        Tokenizer::Gpt2(_) => Ok(super::GPT2_EOT),
        Tokenizer::Hf(t) => t.eos().ok_or_else(|| {
            anyhow!(
                "{} names no eos_token, which instruction data ends each response with; \
                 add one to tokenizer_config.json",
                t.files().path_of(super::tokenizer::files::TOKENIZER_CONFIG)
            )
        }),
        Tokenizer::Char { chars } => match chars.binary_search(&CHAR_EOT) {
            Ok(id) => Ok(id as u32),
            Err(_) => bail!(
                "this char-level vocabulary has no end-of-text character (U+0003); \
                 prepare instruction data with `nanogpt prepare FILE.jsonl` so it is added"
            ),
        },
    }
}

fn string_field<'a>(object: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => bail!("field `{key}` holds {}, not a string", kind(other)),
    }
}

fn alpaca(object: &Map<String, Value>) -> Result<Example> {
    let need = |key: &str| -> Result<&str> {
        string_field(object, key)?.ok_or_else(|| {
            anyhow::anyhow!(
                "field `{key}` is missing (an Alpaca example needs `instruction` and \
                 `output`, `input` is optional)"
            )
        })
    };
    let instruction = need("instruction")?;
    let output = need("output")?;
    let input = string_field(object, "input")?.unwrap_or("");
    Ok(Example::from_parts(vec![
        Part::Prompt(alpaca_prompt(instruction, input)),
        Part::Response(output.to_string()),
    ]))
}

fn chat(object: &Map<String, Value>) -> Result<Example> {
    let converted;
    let messages = match (object.get("messages"), object.get("conversations")) {
        (Some(messages), _) => messages,
        (None, Some(conversations)) => {
            converted = sharegpt_messages(conversations)?;
            &converted
        }
        (None, None) => bail!(
            "field `messages` is missing (a chat example is {{\"messages\": [{{\"role\", \
             \"content\"}}, ...]}}, or ShareGPT's {{\"conversations\": [{{\"from\", \"value\"}}, ...]}})"
        ),
    };
    let Value::Array(messages) = messages else {
        bail!("field `messages` holds {}, not a list", kind(messages));
    };
    let mut roles = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(message) = message else {
            bail!("messages[{i}] holds {}, not an object", kind(message));
        };
        let role = string_field(message, "role")
            .map_err(|e| anyhow!("messages[{i}]: {e}"))?
            .ok_or_else(|| anyhow!("messages[{i}]: field `role` is missing"))?;
        let has_content = message.get("content").is_some_and(|c| !c.is_null());
        if !has_content && !message.contains_key("tool_calls") {
            bail!("messages[{i}]: field `content` is missing");
        }
        roles.push(role);
    }
    if !roles.contains(&"assistant") {
        bail!("`messages` has no assistant message, so nothing to train on");
    }
    let tools = match object.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => Some(Value::Array(tools.clone())),
        Some(other) => bail!("field `tools` holds {}, not a list", kind(other)),
    };
    let (parts, unsupported) = match chat_parts(messages) {
        Ok(parts) => (parts, None),
        Err(why) => (Vec::new(), Some(why.to_string())),
    };
    Ok(Example {
        parts,
        chat: Some(ChatRecord {
            messages: messages.clone(),
            tools,
        }),
        unsupported,
        origin: String::new(),
    })
}

/// ShareGPT's `conversations` (`[{"from": "human"|"gpt"|"system", "value"}]`, the
/// form of many Hub chat datasets) as `messages` (`[{"role", "content"}]`); `user`,
/// `assistant` and `chatgpt` are read too, other keys of a turn are dropped.
fn sharegpt_messages(conversations: &Value) -> Result<Value> {
    let Value::Array(turns) = conversations else {
        bail!(
            "field `conversations` holds {}, not a list",
            kind(conversations)
        );
    };
    let message = |i: usize, turn: &Value| -> Result<Value> {
        let Value::Object(turn) = turn else {
            bail!("conversations[{i}] holds {}, not an object", kind(turn));
        };
        let field = |key: &str| {
            string_field(turn, key)
                .map_err(|e| anyhow!("conversations[{i}]: {e}"))?
                .ok_or_else(|| anyhow!("conversations[{i}]: field `{key}` is missing"))
        };
        let role = match field("from")? {
            "system" => "system",
            "human" | "user" => "user",
            "gpt" | "assistant" | "chatgpt" => "assistant",
            other => bail!(
                "conversations[{i}]: `from` is `{other}`, not one of system, human, gpt \
                 (tool turns are not read from ShareGPT data)"
            ),
        };
        Ok(serde_json::json!({"role": role, "content": field("value")?}))
    };
    let messages = turns.iter().enumerate().map(|(i, t)| message(i, t));
    Ok(Value::Array(messages.collect::<Result<_>>()?))
}

/// A chat record's parts in nanogpt's chat template: roles system, user and
/// assistant, text content.
fn chat_parts(messages: &[Value]) -> Result<Vec<Part>> {
    let mut parts = Vec::new();
    let mut prompt = String::new();
    for (i, message) in messages.iter().enumerate() {
        let message = message.as_object().context("checked by chat")?;
        let role_name = string_field(message, "role")?.unwrap_or_default();
        let role = Role::parse(role_name).ok_or_else(|| {
            anyhow!("messages[{i}]: role `{role_name}` is not one of system, user, assistant")
        })?;
        let content = string_field(message, "content")
            .map_err(|e| anyhow!("messages[{i}]: {e}"))?
            .ok_or_else(|| anyhow!("messages[{i}]: field `content` is missing"))?;
        match role {
            Role::Assistant => {
                prompt.push_str(role.tag());
                parts.push(Part::Prompt(std::mem::take(&mut prompt)));
                parts.push(Part::Response(content.to_string()));
            }
            _ => prompt.push_str(&chat_prompt_message(role, content)),
        }
    }
    // Messages after the last assistant answer are context for nothing: dropped.
    Ok(parts)
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn alpaca_uses_stanfords_templates() {
        let e = Example::from_json(
            DataFormat::Alpaca,
            &object(r#"{"instruction": "Add {x}.", "input": "2 3", "output": "5"}"#),
        )
        .unwrap();
        let want = "Below is an instruction that describes a task, paired with an input \
                    that provides further context. Write a response that appropriately \
                    completes the request.\n\n### Instruction:\nAdd {x}.\n\n### Input:\n2 3\
                    \n\n### Response:";
        assert_eq!(
            e.parts,
            [Part::Prompt(want.into()), Part::Response("5".into())]
        );
        let e = Example::from_json(
            DataFormat::Alpaca,
            &object(r#"{"instruction": "Say hi", "input": "", "output": "hi"}"#),
        )
        .unwrap();
        let want = "Below is an instruction that describes a task. Write a response that \
                    appropriately completes the request.\n\n### Instruction:\nSay hi\n\n\
                    ### Response:";
        assert_eq!(e.parts[0], Part::Prompt(want.into()));
    }

    #[test]
    fn chat_trains_assistant_turns_only() {
        let e = Example::from_json(
            DataFormat::Chat,
            &object(
                r#"{"messages": [{"role": "system", "content": "S"},
                {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "U2"}, {"role": "assistant", "content": "A2"},
                {"role": "user", "content": "dropped"}]}"#,
            ),
        )
        .unwrap();
        let p = |s: &str| Part::Prompt(s.into());
        let r = |s: &str| Part::Response(s.into());
        assert_eq!(
            e.parts,
            [
                p("<|system|>\nS\n<|user|>\nU1\n<|assistant|>\n"),
                r("A1"),
                p("<|user|>\nU2\n<|assistant|>\n"),
                r("A2")
            ]
        );
    }

    #[test]
    fn encode_masks_responses_and_their_eot() {
        let t = Tokenizer::char_level("abc:\u{3}".chars()).unwrap();
        let eot = instruct_eot(&t).unwrap();
        assert_eq!(eot, 0, "U+0003 sorts first");
        let e = Example::from_parts(vec![
            Part::Prompt("a:".into()),
            Part::Response("bc".into()),
            Part::Prompt("c:".into()),
            Part::Response("a".into()),
        ]);
        let (ids, mask) = e.encode(&t, eot, &Map::new()).unwrap();
        // Ids in code-point order: U+0003, `:`, a, b, c.
        assert_eq!(ids, [2, 1, 3, 4, 0, 4, 1, 2, 0]);
        assert_eq!(mask, [0, 0, 1, 1, 1, 0, 0, 1, 1]);
        let (ids, mask) = e.encode(&Tokenizer::gpt2(), 50256, &Map::new()).unwrap();
        let eots: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == 50256).collect();
        assert_eq!(eots.len(), 2);
        assert_eq!(*eots.last().unwrap(), ids.len() - 1);
        assert!(eots.iter().all(|&i| mask[i] == 1) && mask[0] == 0);
        let no_eot = Tokenizer::char_level("ab".chars()).unwrap();
        assert!(instruct_eot(&no_eot).is_err());
    }

    #[test]
    fn bad_records_name_the_field() {
        let err = |format, json: &str| {
            Example::from_json(format, &object(json))
                .unwrap_err()
                .to_string()
        };
        let e = err(DataFormat::Alpaca, r#"{"instruction": "x"}"#);
        assert!(e.contains("`output` is missing"), "{e}");
        let e = err(DataFormat::Alpaca, r#"{"instruction": 3, "output": "x"}"#);
        assert!(e.contains("`instruction` holds a number"), "{e}");
        let e = err(DataFormat::Chat, r#"{"messages": "hi"}"#);
        assert!(e.contains("not a list"), "{e}");
        // Any role reads (a model's template may know it); nanogpt's own template
        // refuses it when encoding, naming where it is.
        let mut bot = Example::from_json(
            DataFormat::Chat,
            &object(r#"{"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}"#),
        )
        .unwrap();
        bot.origin = "f.jsonl line 4".into();
        let e = format!(
            "{:#}",
            bot.encode(&Tokenizer::gpt2(), 50256, &Map::new())
                .unwrap_err()
        );
        assert!(
            e.contains("f.jsonl line 4") && e.contains("messages[0]") && e.contains("`bot`"),
            "{e}"
        );
        let e = err(DataFormat::Chat, r#"{"messages": [{"role": "user"}]}"#);
        assert!(e.contains("`content` is missing"), "{e}");
        let e = err(
            DataFormat::Chat,
            r#"{"messages": [{"role": "user", "content": "x"}]}"#,
        );
        assert!(e.contains("no assistant message"), "{e}");
    }

    #[test]
    fn sharegpt_conversations_read_as_the_same_messages() {
        let messages = object(
            r#"{"messages": [{"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}"#,
        );
        let sharegpt = object(
            r#"{"id": "x1", "conversations": [{"from": "system", "value": "Be kind."},
                {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello.", "weight": 1}]}"#,
        );
        let read = |o| Example::from_json(DataFormat::Chat, o).unwrap();
        assert_eq!(read(&sharegpt), read(&messages));
        for (json, says) in [
            (
                r#"{"conversations": [{"from": "tool", "value": "x"}]}"#,
                "`from` is `tool`",
            ),
            (
                r#"{"conversations": [{"from": "human"}]}"#,
                "conversations[0]: field `value`",
            ),
            (
                r#"{"conversations": "hi"}"#,
                "`conversations` holds a string",
            ),
            (r#"{"id": 1}"#, "ShareGPT's"),
        ] {
            let err = Example::from_json(DataFormat::Chat, &object(json)).unwrap_err();
            assert!(err.to_string().contains(says), "{json}: {err}");
        }
    }

    #[test]
    fn format_is_detected_from_keys() {
        let d = |json: &str| DataFormat::detect(&object(json));
        assert_eq!(d(r#"{"messages": []}"#), DataFormat::Chat);
        assert_eq!(d(r#"{"conversations": [], "id": 3}"#), DataFormat::Chat);
        assert_eq!(
            d(r#"{"instruction": "", "output": "", "text": ""}"#),
            DataFormat::Alpaca
        );
        assert_eq!(d(r#"{"instruction": "", "text": ""}"#), DataFormat::Text);
        assert_eq!("chat".parse::<DataFormat>().unwrap(), DataFormat::Chat);
        assert!("csv".parse::<DataFormat>().is_err());
    }
}
