//! The OpenAI API's request bodies as `nanogpt serve` reads them, and its error
//! shape. Every field is checked here, before a request is queued: a wrong type, a
//! value out of range, an unknown field or a prompt the model cannot take is a 400
//! naming the field (`param`), as OpenAI answers.

use crate::data::readers::json_kind;
use serde_json::{json, Map, Value};

/// Most samples per prompt (`n`).
pub const MAX_N: usize = 16;
/// Most alternatives per token (`logprobs`, `top_logprobs`): OpenAI's 20.
pub const MAX_LOGPROBS: usize = 20;
/// Most stop strings.
pub const MAX_STOPS: usize = 16;
/// Most prompts in one completions request.
pub const MAX_PROMPTS: usize = 256;

/// An error answered in OpenAI's shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400, about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// 400 about the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn with_status(mut self, status: u16, kind: &'static str) -> ApiError {
        self.status = status;
        self.kind = kind;
        self
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn to_json(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// A request body: a JSON object whose fields are taken one by one; what is left at
/// the end was not understood.
pub struct Fields(Map<String, Value>);

impl Fields {
    /// The body as a JSON object.
    pub fn parse(body: &[u8]) -> Result<Fields, ApiError> {
        let text = std::str::from_utf8(body).map_err(|e| {
            ApiError::bad_request(format!(
                "the request body is not UTF-8 (invalid byte at offset {})",
                e.valid_up_to()
            ))
        })?;
        if text.trim().is_empty() {
            return Err(ApiError::bad_request(
                "the request body is empty; send a JSON object",
            ));
        }
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => Ok(Fields(map)),
            Ok(other) => Err(ApiError::bad_request(format!(
                "the request body must be a JSON object, got {}",
                json_kind(&other)
            ))),
            Err(e) => Err(ApiError::bad_request(format!(
                "the request body is not valid JSON: {e}"
            ))),
        }
    }

    /// Takes `key` (absent or null: `None`).
    pub fn take(&mut self, key: &str) -> Option<Value> {
        self.0.remove(key).filter(|v| !v.is_null())
    }

    pub fn string(&mut self, key: &str) -> Result<Option<String>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(key, "a string", &v)),
        }
    }

    pub fn bool(&mut self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(wrong_type(key, "true or false", &v)),
        }
    }

    /// An integer in `range`.
    pub fn int(
        &mut self,
        key: &str,
        range: std::ops::RangeInclusive<i64>,
    ) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.take(key) else {
            return Ok(None);
        };
        let Some(i) = v.as_i64() else {
            return Err(wrong_type(key, "an integer", &v));
        };
        if !range.contains(&i) {
            return Err(ApiError::invalid(
                key,
                format!(
                    "'{key}' must be between {} and {}, got {i}",
                    range.start(),
                    range.end()
                ),
            ));
        }
        Ok(Some(i))
    }

    /// A number in `range`.
    pub fn number(
        &mut self,
        key: &str,
        range: std::ops::RangeInclusive<f64>,
    ) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.take(key) else {
            return Ok(None);
        };
        let Some(x) = v.as_f64() else {
            return Err(wrong_type(key, "a number", &v));
        };
        if !range.contains(&x) {
            return Err(ApiError::invalid(
                key,
                format!(
                    "'{key}' must be between {} and {}, got {x}",
                    range.start(),
                    range.end()
                ),
            ));
        }
        Ok(Some(x))
    }

    /// Refuses whatever was not taken: OpenAI's "Unrecognized request argument".
    pub fn finish(self) -> Result<(), ApiError> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(key) => Err(ApiError::invalid(
                key,
                format!("Unrecognized request argument supplied: {key}"),
            )),
        }
    }
}

pub fn wrong_type(key: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        key,
        format!("'{key}' must be {want}, got {}", json_kind(got)),
    )
}

/// A completions prompt before tokenisation.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of lists of
/// token ids; ids below `vocab`.
pub fn prompts(value: Value, vocab: usize) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    };
    let list = match value {
        Value::String(s) => return Ok(vec![Prompt::Text(s)]),
        Value::Array(items) => items,
        _ => return Err(bad()),
    };
    if list.is_empty() {
        return Err(ApiError::invalid("prompt", "'prompt' is an empty list"));
    }
    if list.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "'prompt' holds {} prompts, more than the {MAX_PROMPTS} one request may hold",
                list.len()
            ),
        ));
    }
    if list.iter().all(Value::is_number) {
        return Ok(vec![Prompt::Tokens(token_ids(&list, vocab)?)]);
    }
    list.into_iter()
        .map(|item| match item {
            Value::String(s) => Ok(Prompt::Text(s)),
            Value::Array(ids) if !ids.is_empty() => Ok(Prompt::Tokens(token_ids(&ids, vocab)?)),
            Value::Array(_) => Err(ApiError::invalid(
                "prompt",
                "'prompt' holds an empty list of tokens",
            )),
            _ => Err(bad()),
        })
        .collect()
}

fn token_ids(items: &[Value], vocab: usize) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| match v.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            _ => Err(ApiError::invalid(
                "prompt",
                format!(
                    "token {v} is not an id of this model's vocabulary (0 to {})",
                    vocab - 1
                ),
            )),
        })
        .collect()
}

/// `stop`: a string or a list of non-empty strings.
pub fn stops(fields: &mut Fields) -> Result<Vec<String>, ApiError> {
    let stops = match fields.take("stop") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                other => Err(wrong_type("stop", "a string or a list of strings", &other)),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(wrong_type("stop", "a string or a list of strings", &other)),
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "'stop' may hold at most {MAX_STOPS} strings, got {}",
                stops.len()
            ),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "'stop' holds an empty string"));
    }
    Ok(stops)
}

/// `logit_bias`: token id (as a string key) → bias in [-100, 100].
pub fn logit_bias(fields: &mut Fields, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match fields.take("logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(wrong_type(
                "logit_bias",
                "an object of token id → bias",
                &other,
            ))
        }
    };
    map.into_iter()
        .map(|(key, v)| {
            let id = key.parse::<u32>().ok().filter(|&id| (id as usize) < vocab);
            let bias = v.as_f64().filter(|b| (-100.0..=100.0).contains(b));
            match (id, bias) {
                (Some(id), Some(bias)) => Ok((id, bias as f32)),
                (None, _) => Err(ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' key {key:?} is not a token id below {vocab}"),
                )),
                (_, None) => Err(ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' values must be numbers from -100 to 100, got {v}"),
                )),
            }
        })
        .collect()
}

/// `stream_options`: `{"include_usage": bool}`; whether to send the usage chunk.
pub fn include_usage(fields: &mut Fields, stream: bool) -> Result<bool, ApiError> {
    let Some(v) = fields.take("stream_options") else {
        return Ok(false);
    };
    if !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "'stream_options' is only allowed with 'stream': true",
        ));
    }
    let Value::Object(map) = v else {
        return Err(wrong_type("stream_options", "an object", &v));
    };
    let mut options = Fields(map);
    let usage = options.bool("include_usage")?.unwrap_or(false);
    options.finish()?;
    Ok(usage)
}

/// A chat message: its role and its text.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// `messages`: a non-empty list of `{"role", "content"}` (content a string or a list
/// of text parts; `name` allowed). Roles system/developer, user, assistant.
pub fn messages(value: Value) -> Result<Vec<Message>, ApiError> {
    let Value::Array(items) = value else {
        return Err(wrong_type("messages", "a list of messages", &value));
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' is empty"));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| message(i, item))
        .collect()
}

fn message(i: usize, item: Value) -> Result<Message, ApiError> {
    let param = format!("messages[{i}]");
    let Value::Object(map) = item else {
        return Err(wrong_type(&param, "an object", &item));
    };
    let mut fields = Fields(map);
    let role = fields
        .string("role")
        .map_err(|e| ApiError {
            param: Some(format!("{param}.role")),
            ..e
        })?
        .ok_or_else(|| {
            ApiError::invalid(&format!("{param}.role"), format!("'{param}' has no 'role'"))
        })?;
    let role = match role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        other => {
            return Err(ApiError::invalid(
                &format!("{param}.role"),
                format!("'{param}.role' must be system, developer, user or assistant, got {other:?} (tools are not supported)"),
            ))
        }
    };
    let content = match fields.take("content") {
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => text_parts(&param, parts)?,
        // As OpenAI's API: an assistant turn may carry no text, a question must.
        None | Some(Value::Null) if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid(
                &format!("{param}.content"),
                format!("'{param}' has no 'content'"),
            ))
        }
        Some(other) => {
            return Err(wrong_type(
                &format!("{param}.content"),
                "a string or a list of text parts",
                &other,
            ))
        }
    };
    let _ = fields.string("name")?;
    fields.finish().map_err(|e| ApiError {
        message: format!("{param}: {}", e.message),
        ..e
    })?;
    Ok(Message {
        role: role.to_string(),
        content,
    })
}

/// The text of `[{"type": "text", "text": ...}, ...]`, concatenated.
fn text_parts(param: &str, parts: Vec<Value>) -> Result<String, ApiError> {
    let mut text = String::new();
    for part in parts {
        match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(t)) => text.push_str(t),
            _ => {
                return Err(ApiError::invalid(
                    &format!("{param}.content"),
                    format!("'{param}.content' parts must be {{\"type\": \"text\", \"text\": ...}}: this model reads text only"),
                ))
            }
        }
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_typed_ranged_and_all_understood() {
        let mut f =
            Fields::parse(br#"{"n": 2, "t": 0.5, "s": "x", "b": true, "z": null, "extra": 1}"#)
                .unwrap();
        assert_eq!(f.int("n", 1..=16).unwrap(), Some(2));
        assert_eq!(f.number("t", 0.0..=2.0).unwrap(), Some(0.5));
        assert_eq!(f.string("s").unwrap(), Some("x".into()));
        assert_eq!(f.bool("b").unwrap(), Some(true));
        assert_eq!(f.int("z", 0..=1).unwrap(), None);
        let e = f.finish().unwrap_err();
        assert_eq!((e.param.as_deref(), e.status), (Some("extra"), 400));
        let mut f = Fields::parse(br#"{"n": 1.5, "m": -1, "t": "hot"}"#).unwrap();
        assert!(f
            .int("n", 1..=16)
            .unwrap_err()
            .message
            .contains("an integer"));
        assert!(f
            .int("m", 0..=16)
            .unwrap_err()
            .message
            .contains("between 0 and 16"));
        assert!(f
            .number("t", 0.0..=2.0)
            .unwrap_err()
            .message
            .contains("a number"));
        for bad in [&b"[1]"[..], b"{", b"", b"\xff{}"] {
            assert_eq!(
                Fields::parse(bad).err().map(|e| e.status),
                Some(400),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn prompts_take_every_openai_form() {
        let p = |v: Value| prompts(v, 100);
        assert_eq!(p(json!("hi")).unwrap(), vec![Prompt::Text("hi".into())]);
        assert_eq!(p(json!([1, 2])).unwrap(), vec![Prompt::Tokens(vec![1, 2])]);
        assert_eq!(
            p(json!(["a", [3]])).unwrap(),
            vec![Prompt::Text("a".into()), Prompt::Tokens(vec![3])]
        );
        for bad in [
            json!([]),
            json!([[]]),
            json!([100]),
            json!([-1]),
            json!(7),
            json!([{"a": 1}]),
            json!([1.5]),
        ] {
            assert!(p(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn messages_read_text_and_refuse_the_rest() {
        let m = messages(json!([
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}], "name": "ann"},
        ]))
        .unwrap();
        assert_eq!(m[0].role, "system");
        assert_eq!(m[1].content, "Hi there");
        let turns = [
            json!({"role": "user", "content": "a"}),
            json!({"role": "assistant"}),
        ];
        let m = messages(json!([turns[0], turns[1], {"role": "assistant", "content": null}]));
        assert_eq!(m.unwrap()[2].content, "");
        for bad in [
            json!([]),
            json!([{"role": "tool", "content": "x"}]),
            json!([{"content": "x"}]),
            json!([{"role": "user"}]),
            json!([{"role": "system", "content": null}]),
            json!([{"role": "user", "content": [{"type": "image_url"}]}]),
            json!([{"role": "user", "content": "x", "tool_calls": []}]),
            json!("hi"),
        ] {
            assert!(messages(bad.clone()).is_err(), "{bad}");
        }
    }
}
