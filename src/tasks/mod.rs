//! Multiple-choice benchmarks: HellaSwag, and tasks of the user's own, scored the way
//! EleutherAI's lm-evaluation-harness scores them, so the accuracies are comparable.
//!
//! A question is a context and its choices. Each choice is a continuation `" " +
//! choice` of the context (the harness's `target_delimiter`), scored by the sum of
//! its tokens' log-probabilities after the context ([`encode`] says how the text is
//! cut into context and continuation tokens). From these sums:
//!
//! | metric | the choice predicted |
//! |---|---|
//! | `acc` | the largest sum |
//! | `acc_norm` | the largest sum per character of the choice (the harness's) |
//! | `acc_bytes` | the largest sum per UTF-8 byte of the choice |
//! | `acc_token` | the largest mean per token of the continuation (llm.c's `acc_norm`) |
//!
//! each the fraction of questions whose prediction is the label, with the standard
//! error of that mean as the harness computes it (sample standard deviation / √n).
//! Ties go to the first choice, as `numpy.argmax` gives them.
//!
//! A question's context is computed once: its choices continue a copy of the
//! context's key/value cache, batched ([`score::Scorer`]).

pub mod hellaswag;
pub mod score;

use crate::data::Tokenizer;
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fmt;
use std::path::{Path, PathBuf};

pub use score::{Scorer, Tally};

/// What a task file holds, one JSON object per line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    /// HellaSwag's own format (`ctx_a`, `ctx_b`, `activity_label`, `endings`,
    /// `label`), preprocessed as the harness's `hellaswag` task does.
    Hellaswag,
    /// `{"context": "...", "choices": ["...", ...], "label": 0}`, used as written.
    Choice,
}

impl TaskKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskKind::Hellaswag => "hellaswag",
            TaskKind::Choice => "choice",
        }
    }
}

impl fmt::Display for TaskKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A task to evaluate: its kind and file (`hellaswag:PATH` or `choice:PATH` in the
/// `eval_tasks` training key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskSpec {
    pub kind: TaskKind,
    pub path: PathBuf,
}

impl TaskSpec {
    /// Reads `KIND:PATH`.
    pub fn parse(spec: &str) -> Result<TaskSpec> {
        let kind = match spec.split_once(':') {
            Some(("hellaswag", _)) => TaskKind::Hellaswag,
            Some(("choice", _)) => TaskKind::Choice,
            _ => bail!(
                "task `{spec}` is not KIND:PATH with KIND hellaswag or choice, e.g. \
                 \"hellaswag:data/hellaswag_val.jsonl\""
            ),
        };
        let path = &spec[kind.as_str().len() + 1..];
        if path.is_empty() {
            bail!("task `{spec}` names no file after `{kind}:`");
        }
        Ok(TaskSpec {
            kind,
            path: PathBuf::from(path),
        })
    }

    /// The name results are reported under: the kind, and for `choice` tasks the
    /// file's stem (`choice/arc_easy`).
    pub fn name(&self) -> String {
        match self.kind {
            TaskKind::Hellaswag => "hellaswag".into(),
            TaskKind::Choice => {
                let stem = self.path.file_stem().unwrap_or_default().to_string_lossy();
                format!("choice/{stem}")
            }
        }
    }
}

/// One multiple-choice question, as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Question {
    pub context: String,
    pub choices: Vec<String>,
    /// Index of the right choice.
    pub label: usize,
}

/// Reads the first `limit` questions (all with `None`) of a task file.
pub fn read_questions(kind: TaskKind, path: &Path, limit: Option<usize>) -> Result<Vec<Question>> {
    crate::fsutil::check_regular_file(path, "the task file")?;
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read the task file {}", path.display()))?;
    parse_questions(kind, &bytes, &path.display().to_string(), limit)
}

/// [`read_questions`] from the file's bytes; `origin` names it in errors.
pub fn parse_questions(
    kind: TaskKind,
    bytes: &[u8],
    origin: &str,
    limit: Option<usize>,
) -> Result<Vec<Question>> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{origin} is not UTF-8 text (invalid byte at offset {}); convert it, e.g. with iconv -t UTF-8",
            e.valid_up_to()
        )
    })?;
    let mut questions = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|n| questions.len() >= n) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{origin} line {}", i + 1);
        let object: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(line).with_context(|| format!("{}: not a JSON object", at()))?;
        let question = match kind {
            TaskKind::Hellaswag => hellaswag::question(&object),
            TaskKind::Choice => choice_question(&object),
        };
        questions.push(question.with_context(at)?);
    }
    if questions.is_empty() {
        bail!("{origin} holds no questions (one JSON object per line)");
    }
    Ok(questions)
}

/// A `{"context", "choices", "label"}` line.
fn choice_question(object: &serde_json::Map<String, serde_json::Value>) -> Result<Question> {
    let context = string_field(object, "context")?;
    let choices = strings_field(object, "choices")?;
    let label = label_field(object, "label", choices.len())?;
    Ok(Question {
        context,
        choices,
        label,
    })
}

/// The string `key` of a task line.
pub(crate) fn string_field(
    object: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Result<String> {
    match object.get(key) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(other) => bail!("\"{key}\" must be a string, got {other}"),
        None => bail!("no \"{key}\" key"),
    }
}

/// The non-empty list of strings `key` of a task line.
pub(crate) fn strings_field(
    object: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Result<Vec<String>> {
    let Some(serde_json::Value::Array(items)) = object.get(key) else {
        bail!("\"{key}\" must be a list of strings");
    };
    let strings: Option<Vec<String>> = items.iter().map(|v| v.as_str().map(String::from)).collect();
    match strings {
        Some(s) if !s.is_empty() => Ok(s),
        Some(_) => bail!("\"{key}\" is empty; a question needs at least one choice"),
        None => bail!("\"{key}\" must be a list of strings"),
    }
}

/// The label `key`: an index below `choices`, as a number or a string of digits
/// (the Hugging Face copy of HellaSwag writes `"label": "3"`).
pub(crate) fn label_field(
    object: &serde_json::Map<String, serde_json::Value>,
    key: &str,
    choices: usize,
) -> Result<usize> {
    let label = match object.get(key) {
        Some(serde_json::Value::Number(n)) => n.as_u64(),
        Some(serde_json::Value::String(s)) => s.trim().parse::<u64>().ok(),
        Some(_) => None,
        None => bail!("no \"{key}\" key (a test split without answers cannot be scored)"),
    };
    match label {
        Some(l) if (l as usize) < choices => Ok(l as usize),
        _ => bail!(
            "\"{key}\" must be the index of the right choice, 0 to {}, got {}",
            choices - 1,
            object[key]
        ),
    }
}

/// A question as tokens: what the model scores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    /// The context's tokens (never empty).
    pub context: Vec<u32>,
    /// Each choice's continuation tokens (never empty).
    pub choices: Vec<Vec<u32>>,
    /// Each choice's length in characters and in UTF-8 bytes (without the space
    /// before it): what `acc_norm` and `acc_bytes` divide by.
    pub chars: Vec<usize>,
    pub bytes: Vec<usize>,
    pub label: usize,
}

/// The harness's split of `context` and each `" " + choice` into tokens (its
/// `_encode_pair`): whitespace at the end of the context moves to the start of the
/// continuation; the context is encoded alone, context and continuation together,
/// and the continuation's tokens are those of the whole past the context's count.
/// An empty context becomes the end-of-text token, as the harness's prefix token.
/// Text is encoded as prompts are: `<|endoftext|>` written in it is that token, as
/// the harness's Hugging Face tokenizer reads it.
///
/// Fails when a choice encodes to no tokens, or a token is beyond `vocab`.
pub fn encode(question: &Question, tokenizer: &Tokenizer, vocab: usize) -> Result<Encoded> {
    let mut encoded = Encoded {
        context: Vec::new(),
        choices: Vec::with_capacity(question.choices.len()),
        chars: question.choices.iter().map(|c| c.chars().count()).collect(),
        bytes: question.choices.iter().map(String::len).collect(),
        label: question.label,
    };
    for (k, choice) in question.choices.iter().enumerate() {
        let continuation = format!(" {choice}");
        let (context, continuation) = match question.context.as_str() {
            "" => empty_context_pair(tokenizer, &continuation)?,
            text => split_pair(tokenizer, text, &continuation)?,
        };
        if continuation.is_empty() {
            bail!("choice {k} ({choice:?}) encodes to no tokens after its context");
        }
        // The context's encoding does not depend on the choice (only on where its
        // trailing whitespace goes, the same for every choice).
        encoded.context = context;
        encoded.choices.push(continuation);
    }
    let ids = encoded
        .context
        .iter()
        .chain(encoded.choices.iter().flatten());
    if let Some(&id) = ids.clone().find(|&&id| id as usize >= vocab) {
        bail!("the question encodes to token {id}, beyond the model's vocabulary of {vocab}");
    }
    Ok(encoded)
}

/// `(context tokens, continuation tokens)` of a non-empty context, as the harness's
/// `_encode_pair` for decoder-only models.
fn split_pair(
    tokenizer: &Tokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let kept = context.trim_end_matches(is_python_space);
    let moved = format!("{}{continuation}", &context[kept.len()..]);
    let whole = tokenizer.encode_prompt(&format!("{kept}{moved}"))?;
    let context = tokenizer.encode_prompt(kept)?;
    if context.is_empty() {
        // A context of whitespace only: the end-of-text token stands for it, as for
        // an empty one, and the whitespace stays with the continuation (the harness
        // would score the first continuation token with no context at all).
        return empty_context_pair(tokenizer, &moved);
    }
    let continuation = whole.get(context.len()..).unwrap_or_default().to_vec();
    Ok((context, continuation))
}

/// The harness's pair for an empty context: the end-of-text token, then the
/// continuation (whose own first token is the context if it is end-of-text).
fn empty_context_pair(tokenizer: &Tokenizer, continuation: &str) -> Result<(Vec<u32>, Vec<u32>)> {
    let Some(eot) = tokenizer.eot() else {
        bail!("an empty context needs an end-of-text token to stand for it, and this tokenizer has none; give every question a context");
    };
    let tokens = tokenizer.encode_prompt(continuation)?;
    Ok(match tokens.first() {
        Some(&first) if first == eot => (vec![eot], tokens[1..].to_vec()),
        _ => (vec![eot], tokens),
    })
}

/// Python's `str.isspace`: Unicode whitespace, and the separators U+001C..U+001F.
pub(crate) fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Reads and encodes a task's questions for a model of `config` with `tokenizer`.
/// Fails where a choice has more tokens than the model's block: it cannot be scored.
pub fn load_task(
    spec: &TaskSpec,
    bytes: &[u8],
    limit: Option<usize>,
    tokenizer: &Tokenizer,
    config: &ModelConfig,
) -> Result<Vec<Encoded>> {
    let origin = spec.path.display().to_string();
    let questions = parse_questions(spec.kind, bytes, &origin, limit)?;
    let block = config.block_size;
    let encode_one = |q: &Question| {
        let encoded = encode(q, tokenizer, config.vocab_size)?;
        let mut lengths = encoded.choices.iter().map(Vec::len).enumerate();
        if let Some((k, m)) = lengths.find(|&(_, m)| m > block) {
            bail!(
                "choice {k} encodes to {m} tokens, more than the block of {block} the model \
                 scores it in (`block_size`): raise block_size or shorten the choice"
            );
        }
        Ok(encoded)
    };
    questions
        .iter()
        .enumerate()
        .map(|(i, q)| encode_one(q).with_context(|| format!("{origin}: question {}", i + 1)))
        .collect()
}

/// A metric's value and the standard error of that mean.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Metric {
    pub value: f64,
    /// NaN (`null` in JSON) with one question.
    pub stderr: f64,
}

impl Metric {
    /// `hits` right out of `n` (n ≥ 1): the mean of n values of 0 or 1, and the
    /// harness's `mean_stderr` of them, √(p(1−p)/(n−1)).
    pub fn of_hits(hits: f64, n: f64) -> Metric {
        let p = hits / n;
        Metric {
            value: p,
            stderr: (p * (1.0 - p) / (n - 1.0)).sqrt(),
        }
    }
}

/// A task's results.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TaskReport {
    pub task: String,
    /// Questions scored.
    pub examples: usize,
    pub acc: Metric,
    pub acc_norm: Metric,
    pub acc_bytes: Metric,
    pub acc_token: Metric,
}

impl TaskReport {
    /// The report of a tally summed over every rank (at least one question).
    pub fn new(task: String, tally: &Tally) -> TaskReport {
        let n = tally.questions;
        TaskReport {
            task,
            examples: n as usize,
            acc: Metric::of_hits(tally.acc, n),
            acc_norm: Metric::of_hits(tally.acc_norm, n),
            acc_bytes: Metric::of_hits(tally.acc_bytes, n),
            acc_token: Metric::of_hits(tally.acc_token, n),
        }
    }

    /// `hellaswag: acc 0.2950 ± 0.0144, acc_norm 0.3110 ± 0.0146 (1000 examples)`.
    pub fn summary(&self) -> String {
        format!(
            "{}: acc {:.4} ± {:.4}, acc_norm {:.4} ± {:.4} ({} examples)",
            self.task,
            self.acc.value,
            self.acc.stderr,
            self.acc_norm.value,
            self.acc_norm.stderr,
            self.examples
        )
    }

    /// Every metric, one per line, for `nanogpt eval --task`.
    pub fn table(&self) -> String {
        let rows = [
            ("acc", self.acc, "sum of log-probabilities"),
            (
                "acc_norm",
                self.acc_norm,
                "per character (lm-evaluation-harness)",
            ),
            ("acc_bytes", self.acc_bytes, "per UTF-8 byte"),
            ("acc_token", self.acc_token, "per token (llm.c)"),
        ];
        let mut out = format!("{}: {} examples\n", self.task, self.examples);
        for (name, m, what) in rows {
            out.push_str(&format!(
                "  {name:<10} {:.4} ± {:.4}  {what}\n",
                m.value, m.stderr
            ));
        }
        out.pop();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(context: &str, choices: &[&str]) -> Question {
        Question {
            context: context.into(),
            choices: choices.iter().map(|c| c.to_string()).collect(),
            label: 0,
        }
    }

    #[test]
    fn specs_name_kind_and_file() {
        let s = TaskSpec::parse("hellaswag:data/h:v.jsonl").unwrap();
        assert_eq!(s.kind, TaskKind::Hellaswag);
        assert_eq!(s.path, PathBuf::from("data/h:v.jsonl"));
        assert_eq!(s.name(), "hellaswag");
        let c = TaskSpec::parse("choice:/x/arc_easy.jsonl").unwrap();
        assert_eq!(c.name(), "choice/arc_easy");
        for bad in ["hellaswag", "mmlu:x.jsonl", "choice:", "x.jsonl"] {
            assert!(TaskSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_context_of_whitespace_only_is_scored_after_end_of_text() {
        // Found by the task_file fuzz target: " " encoded to no context tokens, and
        // the scorer would have had no position to predict the first choice token.
        let gpt2 = Tokenizer::gpt2();
        let e = encode(&q(" ", &["Hello world."]), &gpt2, 50257).unwrap();
        assert_eq!(e.context, [50256]);
        let spaced = gpt2.encode_prompt("  Hello world.").unwrap();
        assert_eq!(e.choices[0], spaced);
        let empty = encode(&q("", &["Hello world."]), &gpt2, 50257).unwrap();
        assert_eq!(empty.context, [50256]);
    }

    #[test]
    fn pairs_split_as_the_harness_does() {
        let t = Tokenizer::gpt2();
        let e = encode(&q("The cat sat", &["on the mat.", "down"]), &t, 50257).unwrap();
        assert_eq!(e.context, t.encode("The cat sat").unwrap());
        assert_eq!(e.choices[0], t.encode(" on the mat.").unwrap());
        assert_eq!(
            (e.chars.clone(), e.bytes.clone()),
            (vec![11, 4], vec![11, 4])
        );
        // Trailing spaces of the context go to the continuation, encoded together.
        let e = encode(&q("Answer: ", &["yes"]), &t, 50257).unwrap();
        assert_eq!(e.context, t.encode("Answer:").unwrap());
        let whole = t.encode("Answer:  yes").unwrap();
        assert_eq!(e.choices[0], whole[e.context.len()..]);
        // An empty context is end-of-text.
        let e = encode(&q("", &["Hello"]), &t, 50257).unwrap();
        assert_eq!(
            (e.context.clone(), e.choices[0].clone()),
            (vec![50256], t.encode(" Hello").unwrap())
        );
        // Characters and bytes of the choice itself.
        let e = encode(&q("x", &["héé"]), &t, 50257).unwrap();
        assert_eq!((e.chars[0], e.bytes[0]), (3, 5));
        // Tokens beyond a small model's vocabulary are refused.
        let err = encode(&q("The cat", &["sat"]), &t, 100).unwrap_err();
        assert!(
            err.to_string().contains("beyond the model's vocabulary"),
            "{err}"
        );
    }

    #[test]
    fn choice_lines_are_checked() {
        let ok = br#"{"context": "2+2=", "choices": ["4", "5"], "label": 0}
{"context": "1+1=", "choices": ["3", "2"], "label": "1"}
"#;
        let qs = parse_questions(TaskKind::Choice, ok, "t.jsonl", None).unwrap();
        assert_eq!(qs.len(), 2);
        assert_eq!(qs[1].label, 1);
        assert_eq!(
            parse_questions(TaskKind::Choice, ok, "t", Some(1))
                .unwrap()
                .len(),
            1
        );
        let bad: [(&[u8], &str); 6] = [
            (
                br#"{"context": "a", "choices": ["b"], "label": 1}"#,
                "0 to 0",
            ),
            (
                br#"{"context": "a", "choices": [], "label": 0}"#,
                "is empty",
            ),
            (
                br#"{"context": 3, "choices": ["b"], "label": 0}"#,
                "must be a string",
            ),
            (br#"{"context": "a", "choices": ["b"]}"#, "no \"label\""),
            (b"[1, 2]", "not a JSON object"),
            (b"\n\n", "holds no questions"),
        ];
        for (text, want) in bad {
            let err = format!(
                "{:#}",
                parse_questions(TaskKind::Choice, text, "t.jsonl", None).unwrap_err()
            );
            assert!(err.contains(want), "{err}");
        }
        let err = parse_questions(TaskKind::Choice, b"{}\n\xff", "t.jsonl", None).unwrap_err();
        assert!(err.to_string().contains("not UTF-8"), "{err}");
    }

    #[test]
    fn standard_errors_are_the_harness_s() {
        // 1 right of 4: values [1, 0, 0, 0], sample sd √(0.25), / √4.
        let m = Metric::of_hits(1.0, 4.0);
        assert_eq!(m.value, 0.25);
        assert!((m.stderr - (0.25f64).sqrt() / 2.0).abs() < 1e-15);
        assert!(Metric::of_hits(1.0, 1.0).stderr.is_nan());
    }
}
