//! A model's chat template (Jinja, from `tokenizer_config.json` or
//! `chat_template.jinja`), rendered with minijinja exactly as transformers'
//! `apply_chat_template` renders it, and the spans of a rendered conversation that
//! are the assistant's (what `prepare --format chat` trains).
//!
//! transformers renders in a sandboxed Jinja2 environment with `trim_blocks` and
//! `lstrip_blocks`, the loop controls (`break`, `continue`), a `tojson` filter that is
//! Python's `json.dumps` (not HTML-escaping), and two functions, `raise_exception(msg)`
//! and `strftime_now(format)`; the template sees `messages`, `tools`, `documents`,
//! `add_generation_prompt`, the special tokens by name (`bos_token`, `eos_token`, ...)
//! and any extra variables (Qwen3's `enable_thinking`). Here the same environment is
//! minijinja with Python's string methods (minijinja-contrib's pycompat, with
//! `strip`/`lstrip`/`rstrip` and the `trim` filter on Python's idea of whitespace)
//! and values printed as Python's `str()` prints them (`True`, `None`). The
//! `{% generation %}` blocks some templates carry for transformers' assistant masks
//! render their contents, as in transformers.

mod python;

use std::ops::Range;

use anyhow::{anyhow, bail, Result};
use minijinja::value::{Kwargs, Rest, Serde, Value};
use minijinja::{Environment, Error, ErrorKind, State};
use serde_json::{Map, Value as Json};

use python::{json_dumps, strip, Ends, JsonStyle};

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it comes from, for messages (`DIR/tokenizer_config.json`).
    origin: String,
    /// `bos_token`, `eos_token`, ... by name, as transformers passes them.
    special_tokens: Map<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate({})", self.origin)
    }
}

/// What a conversation is rendered with besides its messages.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions<'a> {
    /// End with the header of an assistant reply, for the model to write it.
    pub add_generation_prompt: bool,
    /// Tool definitions (JSON schemas), as transformers' `tools=`.
    pub tools: Option<&'a Json>,
    /// Further template variables (`enable_thinking`, `date_string`, ...); they win
    /// over the special tokens of the same name, as in transformers.
    pub variables: Option<&'a Map<String, Json>>,
}

/// The error `raise_exception` makes, recognised when a render fails.
#[derive(Debug)]
struct Raised;

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for Raised {}

/// The name the template is stored under in its environment.
const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `origin` names the file it comes from, `special_tokens` are
    /// the strings of `bos_token`, `eos_token`, ... (absent ones left out).
    pub fn new(
        source: &str,
        origin: impl Into<String>,
        special_tokens: Map<String, Json>,
    ) -> Result<ChatTemplate> {
        let origin = origin.into();
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters");
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(|out, state, value| match python::python_str(value) {
            Some(text) => out.write_str(&text).map_err(Error::from),
            None => minijinja::escape_formatter(out, state, value),
        });
        env.add_filter("tojson", tojson);
        env.add_filter("trim", |s: &str, chars: Option<&str>| {
            strip(s, chars, Ends::Both).to_string()
        });
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message).with_source(Raised))
            },
        );
        let now = chrono::Local::now();
        env.add_function(
            "strftime_now",
            move |format: &str| -> Result<String, Error> { strftime(&now, format) },
        );
        env.add_template_owned(NAME, without_generation_tags(source))
            .map_err(|e| anyhow!("the chat template in {origin} is not valid Jinja: {e:#}"))?;
        Ok(ChatTemplate {
            env,
            origin,
            special_tokens,
        })
    }

    /// Where the template comes from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The text of `messages` (a list of `{role, content, ...}` objects) in the template.
    pub fn render(&self, messages: &[Json], opts: &RenderOptions) -> Result<String> {
        let mut context = self.special_tokens.clone();
        context.insert("messages".into(), Json::Array(messages.to_vec()));
        context.insert("tools".into(), opts.tools.cloned().unwrap_or(Json::Null));
        context.insert("documents".into(), Json::Null);
        context.insert(
            "add_generation_prompt".into(),
            Json::Bool(opts.add_generation_prompt),
        );
        if let Some(variables) = opts.variables {
            context.extend(variables.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        let template = self.env.get_template(NAME).expect("added in new");
        template
            .render(Value::from(Serde(&context)))
            .map_err(|e| self.render_error(e))
    }

    fn render_error(&self, e: Error) -> anyhow::Error {
        let raised = std::error::Error::source(&e).is_some_and(|s| s.is::<Raised>());
        match (raised, e.detail()) {
            (true, Some(message)) => anyhow!(
                "the chat template in {} raised an error: {message}",
                self.origin
            ),
            _ => anyhow!("cannot render the chat template in {}: {e:#}", self.origin),
        }
    }

    /// The byte ranges of `render(messages)` (no generation prompt) that are the
    /// assistant's: for each assistant message, what follows its header up to and
    /// including the first of `stops` (the model's end-of-turn tokens, as text).
    ///
    /// The header of a message is what the generation prompt writes: the text of
    /// `messages[..i]` with `add_generation_prompt` extends that of `messages[..i]`
    /// without it by the header (`<|im_start|>assistant\n`), and the assistant's span
    /// begins where the whole conversation's text stops agreeing with that header.
    /// So a template whose generation prompt also opens an empty think block
    /// (Qwen3 with `enable_thinking` false) leaves that block untrained, and one whose
    /// prompt stops at the header trains the reasoning too. A template must render
    /// the first messages of a conversation as the start of the whole one, or the
    /// turns cannot be told apart: that is an error naming the message.
    pub fn assistant_spans(
        &self,
        messages: &[Json],
        opts: &RenderOptions,
        stops: &[String],
    ) -> Result<(String, Vec<Range<usize>>)> {
        let plain = |n: usize, prompt: bool| {
            let opts = RenderOptions {
                add_generation_prompt: prompt,
                ..opts.clone()
            };
            self.render(&messages[..n], &opts)
        };
        let whole = plain(messages.len(), false)?;
        let mut spans = Vec::new();
        for (i, message) in messages.iter().enumerate() {
            if message.get("role").and_then(Json::as_str) != Some("assistant") {
                continue;
            }
            let (before, prompted) = match i {
                0 => (String::new(), String::new()),
                _ => (plain(i, false)?, plain(i, true)?),
            };
            let Some(header) = prompted.strip_prefix(before.as_str()) else {
                bail!(
                    "the chat template in {} does not write the generation prompt after the \
                     messages before message {i}: cannot tell which tokens are the assistant's",
                    self.origin
                );
            };
            let Some(rest) = whole.strip_prefix(before.as_str()) else {
                bail!(
                    "the chat template in {} renders the messages before message {i} otherwise \
                     than as the start of the whole conversation: cannot tell which tokens are \
                     the assistant's",
                    self.origin
                );
            };
            let start = before.len() + common_prefix(rest, header);
            let end = stops
                .iter()
                .filter_map(|stop| Some(start + whole[start..].find(stop.as_str())? + stop.len()))
                .min()
                .ok_or_else(|| {
                    anyhow!(
                        "message {i} (assistant) ends with none of the end-of-turn tokens {stops:?} \
                         in the chat template of {}: cannot tell where its tokens end",
                        self.origin
                    )
                })?;
            spans.push(start..end);
        }
        Ok((whole, spans))
    }
}

/// A `--template-var KEY=VALUE`: the value read as JSON where it is JSON (`false`,
/// `3`, `"x"`, `[1, 2]`), else as a string.
pub fn parse_variable(s: &str) -> Result<(String, Json)> {
    let Some((key, value)) = s.split_once('=') else {
        bail!("--template-var takes KEY=VALUE (e.g. enable_thinking=false), got `{s}`");
    };
    if key.is_empty() {
        bail!("--template-var `{s}` names no variable before `=`");
    }
    let value = serde_json::from_str(value).unwrap_or_else(|_| Json::String(value.into()));
    Ok((key.to_string(), value))
}

/// The length in bytes of the longest common prefix of `a` and `b`, on a character
/// boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((at, _), _)| at)
}

/// `source` with transformers' `{% generation %}` / `{% endgeneration %}` tags turned
/// into an always-true `if` block, which trims whitespace the same way.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..close];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(body) => (&inner[..1], body),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replaced = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replaced {
            Some(word) => out.push_str(&format!("{{%{lead} {word} {trail}%}}")),
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    out
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, positional or by keyword.
fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let arg = |i: usize| -> Result<Option<Value>, Error> {
        match (args.get(i), kwargs.get::<Option<Value>>(names[i])?) {
            (Some(_), Some(_)) => Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson got {} twice", names[i]),
            )),
            (Some(v), None) => Ok(Some(v.clone()).filter(|v| !v.is_none())),
            (None, Some(v)) => Ok(Some(v).filter(|v| !v.is_none())),
            (None, None) => Ok(None),
        }
    };
    let indent = match arg(1)? {
        None => None,
        Some(v) if v.as_str().is_some() => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => Some(" ".repeat(usize::try_from(v.clone()).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: indent {v} is not a count"),
            )
        })?)),
    };
    let mut style = JsonStyle::new(indent);
    style.ensure_ascii = arg(0)?.is_some_and(|v| v.is_true());
    style.sort_keys = arg(3)?.is_some_and(|v| v.is_true());
    if let Some(separators) = arg(2)? {
        let pair: Vec<Value> = separators.try_iter()?.collect();
        match pair.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                style.separators = (item.to_string(), key.to_string());
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be two strings",
                ))
            }
        }
    }
    kwargs.assert_all_used()?;
    json_dumps(&value, &style)
}

/// Python's string methods: `strip`, `lstrip`, `rstrip` on Python's whitespace, the
/// rest from minijinja-contrib's pycompat.
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let ends = match method {
        "strip" => Some(Ends::Both),
        "lstrip" => Some(Ends::Start),
        "rstrip" => Some(Ends::End),
        _ => None,
    };
    match (value.as_str(), ends) {
        (Some(s), Some(ends)) => {
            let (chars,): (Option<&str>,) = minijinja::value::from_args(args)?;
            Ok(Value::from(strip(s, chars, ends)))
        }
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// Python's `datetime.strftime(format)` of `now`.
fn strftime(now: &chrono::DateTime<chrono::Local>, format: &str) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item> = StrftimeItems::new(format).collect();
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a strftime format"),
        ));
    }
    let mut out = String::new();
    std::fmt::Write::write_fmt(
        &mut out,
        format_args!("{}", now.format_with_items(items.into_iter())),
    )
    .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now failed"))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        let mut specials = Map::new();
        specials.insert("bos_token".into(), "<s>".into());
        ChatTemplate::new(source, "test", specials).unwrap()
    }

    fn messages(json: &str) -> Vec<Json> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn renders_with_trimmed_blocks_python_values_and_tojson() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content|trim }}]\n  {% endif %}\n{% endfor %}{{ messages[0].x }} {{ messages[0].y }} {{ messages[0] | tojson }}",
        );
        let m = messages(r#"[{"role": "user", "content": " hi\u001c ", "x": true, "y": null}]"#);
        assert_eq!(
            t.render(&m, &RenderOptions::default()).unwrap(),
            "<s>[hi]\nTrue None {\"role\": \"user\", \"content\": \" hi\\u001c \", \"x\": true, \"y\": null}"
        );
    }

    #[test]
    fn python_methods_loop_controls_and_namespaces() {
        let t = template(
            "{%- set ns = namespace(n=0) %}{%- for m in messages[::-1] %}{%- if m.content.startswith('<') %}{% continue %}{% endif %}{%- set ns.n = ns.n + 1 %}{{ m.content.split('|')[-1].lstrip('-').upper() }}{%- if ns.n == 2 %}{% break %}{% endif %}{%- endfor %}",
        );
        let m = messages(
            r#"[{"content": "a|--b"}, {"content": "<x"}, {"content": "c|d"}, {"content": "e"}]"#,
        );
        assert_eq!(t.render(&m, &RenderOptions::default()).unwrap(), "ED");
    }

    #[test]
    fn raise_exception_and_bad_templates_name_the_file() {
        let t = template("{{ raise_exception('no system messages, please') }}");
        let err = t
            .render(&[], &RenderOptions::default())
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "the chat template in test raised an error: no system messages, please"
        );
        let err = ChatTemplate::new("{% for %}", "dir/tokenizer_config.json", Map::new())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("the chat template in dir/tokenizer_config.json is not valid Jinja")
        );
        let t = template("{{ messages[0].content.nope() }}");
        let err = t
            .render(
                &messages(r#"[{"content": "x"}]"#),
                &RenderOptions::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("cannot render the chat template in test"),
            "{err}"
        );
    }

    #[test]
    fn strftime_now_formats_the_local_date() {
        let t = template("{{ strftime_now('%d %b %Y') }}");
        let got = t.render(&[], &RenderOptions::default()).unwrap();
        let want = chrono::Local::now().format("%d %b %Y").to_string();
        // The render and `want` may straddle midnight; then they differ by a day.
        assert_eq!(got.len(), want.len(), "{got} vs {want}");
        let err = template("{{ strftime_now('%Q') }}")
            .render(&[], &RenderOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a strftime format"), "{err}");
    }

    #[test]
    fn generation_tags_render_their_contents() {
        let src = "{% for m in messages %}{%- generation -%}\n [{{ m.content }}] {% endgeneration %}\n{% endfor %}";
        assert_eq!(
            without_generation_tags(src),
            "{% for m in messages %}{%- if true -%}\n [{{ m.content }}] {% endif %}\n{% endfor %}"
        );
        let t = template(src);
        let m = messages(r#"[{"content": "a"}, {"content": "b"}]"#);
        assert_eq!(t.render(&m, &RenderOptions::default()).unwrap(), "[a] [b] ");
    }

    #[test]
    fn assistant_spans_cover_content_and_end_of_turn() {
        let t = template(
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
        );
        let m = messages(
            r#"[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
               {"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]"#,
        );
        let stops = vec!["<|end|>".to_string()];
        let (text, spans) = t
            .assistant_spans(&m, &RenderOptions::default(), &stops)
            .unwrap();
        let trained: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
        assert_eq!(trained, ["yo<|end|>", "!<|end|>"]);
        let err = t
            .assistant_spans(&m, &RenderOptions::default(), &["<|eot|>".to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("message 1 (assistant) ends with none"),
            "{err}"
        );
    }
}
