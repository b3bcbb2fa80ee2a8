//! Training-run metrics: `out_dir/metrics.jsonl` (one JSON object per line) and the
//! `out_dir/loss.png` loss curve ([`plot_loss`]).
//!
//! Line formats (keys in this order; floats that are not finite are written as `null`
//! and read back as NaN):
//!
//! ```text
//! {"iter":10,"loss":4.21,"lr":0.0006,"ms":812.5,"tokens_per_sec":20164.0}
//! {"iter":10,"loss":4.21,"lr":0.0006,"ms":812.5,"tokens_per_sec":20164.0,"mfu":0.31,"grad_norm":1.02}
//! {"iter":250,"train_loss":3.98,"val_loss":4.05}
//! {"iter":250,"task":"hellaswag","examples":1000,"acc":0.29,"acc_norm":0.31,"acc_bytes":0.31,"acc_token":0.3}
//! ```
//!
//! `mfu` and `grad_norm` are optional and only written when given. A row with a `task`
//! key is a task row (the fractions right of a multiple-choice task, see
//! [`crate::tasks`]); one with a `loss` key is a step row; one with `train_loss` and
//! `val_loss` is an eval row. Unknown extra
//! keys are ignored when reading, so later additions do not break old readers.
//!
//! Crash safety: [`MetricsLog::append`] writes each line with a single `write` call, so a
//! crash loses at most the line being written, and [`read_rows`] ignores a truncated last
//! line. Resuming ([`MetricsLog::open`] with `Some(k)`) rewrites the file atomically
//! ([`crate::fsutil`]), dropping rows a crashed run logged at or past its checkpoint.

mod accuracy;
mod plot;
mod style;
mod text;

pub use plot::{plot_loss, PLOT_HEIGHT, PLOT_WIDTH};

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use serde_json::{Map, Value};

/// File name of the metrics log inside `out_dir`.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// File name of the loss plot inside `out_dir`.
pub const LOSS_PLOT_FILE: &str = "loss.png";

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Row {
    /// One optimizer step.
    Step {
        iter: u64,
        loss: f32,
        lr: f32,
        /// Wall time of the step, milliseconds.
        ms: f64,
        tokens_per_sec: f64,
        /// Model FLOPs utilisation (fraction of peak), when known.
        #[serde(skip_serializing_if = "Option::is_none")]
        mfu: Option<f64>,
        /// Global gradient norm before clipping, when known.
        #[serde(skip_serializing_if = "Option::is_none")]
        grad_norm: Option<f32>,
    },
    /// One evaluation (mean loss over eval batches of each split).
    Eval {
        iter: u64,
        train_loss: f32,
        val_loss: f32,
    },
    /// One multiple-choice task scored (`eval_tasks`): the fraction of its
    /// `examples` questions each metric got right.
    Task {
        iter: u64,
        task: String,
        examples: u64,
        acc: f64,
        acc_norm: f64,
        acc_bytes: f64,
        acc_token: f64,
    },
}

impl Row {
    /// The iteration this row belongs to.
    pub fn iter(&self) -> u64 {
        match self {
            Row::Step { iter, .. } | Row::Eval { iter, .. } | Row::Task { iter, .. } => *iter,
        }
    }

    /// The row as one JSON line, without the trailing newline.
    pub fn to_json_line(&self) -> String {
        // Serializing plain numbers/options into a String cannot fail; serde_json writes
        // non-finite floats as `null`.
        serde_json::to_string(self).expect("serializing numbers to a String cannot fail")
    }

    /// Parses one JSON line (without the newline).
    pub fn from_json_line(line: &str) -> Result<Row> {
        let value: Value = serde_json::from_str(line)?;
        let Value::Object(obj) = value else {
            bail!("expected a JSON object");
        };
        let iter = match obj.get("iter") {
            Some(v) => v
                .as_u64()
                .ok_or_else(|| anyhow!("\"iter\" must be a non-negative integer, got {v}"))?,
            None => bail!("missing key \"iter\""),
        };
        if let Some(task) = obj.get("task") {
            let Some(task) = task.as_str() else {
                bail!("\"task\" must be a string, got {task}");
            };
            let examples = match obj.get("examples") {
                Some(v) => v.as_u64().ok_or_else(|| {
                    anyhow!("\"examples\" must be a non-negative integer, got {v}")
                })?,
                None => bail!("missing key \"examples\""),
            };
            Ok(Row::Task {
                iter,
                task: task.to_string(),
                examples,
                acc: req_f64(&obj, "acc")?,
                acc_norm: req_f64(&obj, "acc_norm")?,
                acc_bytes: req_f64(&obj, "acc_bytes")?,
                acc_token: req_f64(&obj, "acc_token")?,
            })
        } else if obj.contains_key("loss") {
            Ok(Row::Step {
                iter,
                loss: req_f64(&obj, "loss")? as f32,
                lr: req_f64(&obj, "lr")? as f32,
                ms: req_f64(&obj, "ms")?,
                tokens_per_sec: req_f64(&obj, "tokens_per_sec")?,
                mfu: opt_f64(&obj, "mfu")?,
                grad_norm: opt_f64(&obj, "grad_norm")?.map(|g| g as f32),
            })
        } else if obj.contains_key("train_loss") || obj.contains_key("val_loss") {
            Ok(Row::Eval {
                iter,
                train_loss: req_f64(&obj, "train_loss")? as f32,
                val_loss: req_f64(&obj, "val_loss")? as f32,
            })
        } else {
            bail!(
                "neither a step row (no \"loss\") nor an eval row (no \"train_loss\"/\"val_loss\")"
            )
        }
    }
}

/// A number, or `null` for a non-finite value (NaN).
fn num(v: &Value, key: &str) -> Result<f64> {
    match v {
        Value::Null => Ok(f64::NAN),
        Value::Number(n) => n
            .as_f64()
            .ok_or_else(|| anyhow!("\"{key}\" is not representable as a float: {n}")),
        other => bail!("\"{key}\" must be a number or null, got {other}"),
    }
}

fn req_f64(obj: &Map<String, Value>, key: &str) -> Result<f64> {
    match obj.get(key) {
        Some(v) => num(v, key),
        None => bail!("missing key \"{key}\""),
    }
}

fn opt_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    obj.get(key).map(|v| num(v, key)).transpose()
}

/// Reads every row of a metrics file.
///
/// A last line without its newline that does not parse (a crash mid-write) is ignored;
/// blank lines are skipped; anything else that does not parse is an error naming the file
/// and the 1-based line number.
pub fn read_rows(path: &Path) -> Result<Vec<Row>> {
    let file = crate::fsutil::open_regular(path, "metrics log")?;
    parse_rows(BufReader::new(file), path)
}

fn parse_rows(mut reader: impl BufRead, path: &Path) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let mut line = Vec::new();
    let mut line_no = 0usize;
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok(rows);
        }
        line_no += 1;
        let complete = line.last() == Some(&b'\n');
        let parsed = std::str::from_utf8(&line)
            .map_err(|e| anyhow!("not UTF-8: {e}"))
            .and_then(|s| {
                let s = s.trim();
                if s.is_empty() {
                    Ok(None)
                } else {
                    Row::from_json_line(s).map(Some)
                }
            });
        match parsed {
            Ok(Some(row)) => rows.push(row),
            Ok(None) => {}
            // Truncated by a crash while writing the last line: drop it.
            Err(_) if !complete => {}
            Err(e) => bail!("{}:{line_no}: bad metrics line: {e:#}", path.display()),
        }
    }
}

/// Append-only writer of `out_dir/metrics.jsonl`, also holding every row logged (for the
/// plot). A row is 56 bytes: a million steps hold 56 MB.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    file: File,
    rows: Vec<Row>,
}

impl MetricsLog {
    /// Opens `out_dir/metrics.jsonl` (creating `out_dir` if needed).
    ///
    /// * `None` (fresh run): starts an empty file, discarding any previous one.
    /// * `Some(k)` (resuming at iteration `k`): keeps the rows with `iter < k` and drops
    ///   the rest (a crashed run may have logged past its last checkpoint), rewriting the
    ///   file atomically; a missing file starts empty. A file with garbage before its last
    ///   line is an error (see [`read_rows`]) and is left untouched.
    pub fn open(out_dir: &Path, resume_from: Option<u64>) -> Result<MetricsLog> {
        fs::create_dir_all(out_dir)
            .with_context(|| format!("creating output directory {}", out_dir.display()))?;
        let path = out_dir.join(METRICS_FILE);
        // Appending through a link would write outside out_dir.
        if fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            bail!(
                "{} is a symbolic link; nanogpt writes only inside out_dir: remove the link \
                 (or choose another out_dir)",
                path.display()
            );
        }
        let rows = match resume_from {
            None => Vec::new(),
            Some(k) => {
                let logged = match fs::read(&path) {
                    Ok(bytes) => bytes,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                    Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
                };
                let mut rows =
                    parse_rows(&logged[..], &path).context("resuming the metrics log")?;
                rows.retain(|r| r.iter() < k);
                let mut text = String::with_capacity(rows.len() * 96);
                for row in &rows {
                    text.push_str(&row.to_json_line());
                    text.push('\n');
                }
                // Rewritten only when something goes (rows past the resume point, a
                // truncated last line): a log that keeps every row is left as it is.
                if text.as_bytes() != logged.as_slice() {
                    crate::fsutil::write_bytes_atomic(&path, text)?;
                }
                rows
            }
        };
        let file = if resume_from.is_some() {
            OpenOptions::new().append(true).create(true).open(&path)
        } else {
            File::create(&path)
        }
        .with_context(|| {
            format!(
                "cannot write {}: check that out_dir {} is writable, or choose another out_dir",
                path.display(),
                out_dir.display()
            )
        })?;
        Ok(MetricsLog { path, file, rows })
    }

    /// Writes one row as a line and hands it to the OS (no user-space buffering), so a
    /// crash loses at most the line being written.
    pub fn append(&mut self, row: Row) -> Result<()> {
        let mut line = row.to_json_line();
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .with_context(|| format!("writing {}", self.path.display()))?;
        self.rows.push(row);
        Ok(())
    }

    /// Everything logged: rows kept on resume, then rows appended since.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// Path of the metrics file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests;
