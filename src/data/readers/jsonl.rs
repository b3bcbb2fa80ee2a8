//! JSON Lines: one document per line, in a string field (default `text`).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::{not_utf8, open, Piece};

/// JSON Lines documents, one per non-blank line.
pub(super) struct JsonlDocs {
    files: std::vec::IntoIter<PathBuf>,
    field: String,
    current: Option<JsonlFile>,
    failed: bool,
}

struct JsonlFile {
    path: PathBuf,
    reader: BufReader<File>,
    line: u64,
    offset: u64,
}

impl JsonlDocs {
    pub(super) fn new(files: Vec<PathBuf>, field: String) -> Self {
        JsonlDocs {
            files: files.into_iter(),
            field,
            current: None,
            failed: false,
        }
    }

    fn next_doc(&mut self) -> Result<Option<Piece>> {
        loop {
            let file = match &mut self.current {
                Some(file) => file,
                None => match self.files.next() {
                    Some(path) => self.current.insert(JsonlFile {
                        reader: BufReader::with_capacity(1 << 20, open(&path)?),
                        path,
                        line: 0,
                        offset: 0,
                    }),
                    None => return Ok(None),
                },
            };
            match file.next_line(&self.field)? {
                Some(piece) => return Ok(Some(piece)),
                None => self.current = None,
            }
        }
    }
}

impl JsonlFile {
    /// The next document of this file, or `None` at its end.
    fn next_line(&mut self, field: &str) -> Result<Option<Piece>> {
        let mut bytes = Vec::new();
        let mut progress = 0;
        loop {
            bytes.clear();
            let read = self
                .reader
                .read_until(b'\n', &mut bytes)
                .with_context(|| format!("cannot read {}", self.path.display()))?;
            if read == 0 {
                return Ok(None);
            }
            self.line += 1;
            progress += read as u64;
            let start = self.offset;
            self.offset += read as u64;
            let line = std::str::from_utf8(&bytes).map_err(|e| {
                not_utf8(
                    &self.path.display().to_string(),
                    start + e.valid_up_to() as u64,
                )
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let text = self.field_of(line, field)?;
            return Ok(Some(Piece { text, progress }));
        }
    }

    fn field_of(&self, line: &str, field: &str) -> Result<String> {
        let at = || format!("{} line {}", self.path.display(), self.line);
        let mut object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(line)
            .with_context(|| format!("{}: not a JSON object; each line must be one", at()))?;
        match object.remove(field) {
            Some(serde_json::Value::String(text)) => Ok(text),
            Some(serde_json::Value::Null) => Ok(String::new()),
            Some(other) => bail!(
                "{}: field `{field}` holds {}, not a string",
                at(),
                json_kind(&other)
            ),
            None => {
                let keys: Vec<&str> = object.keys().map(String::as_str).collect();
                bail!(
                    "{}: no field `{field}` (fields: {}); choose the text field with \
                     --text-column NAME",
                    at(),
                    keys.join(", ")
                )
            }
        }
    }
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

impl Iterator for JsonlDocs {
    type Item = Result<Piece>;

    fn next(&mut self) -> Option<Result<Piece>> {
        if self.failed {
            return None;
        }
        let next = self.next_doc().transpose();
        self.failed = matches!(next, Some(Err(_)));
        next
    }
}

#[cfg(test)]
mod tests {
    use crate::data::readers::Source;
    use crate::data::testutil::{texts, texts_err, TempDir};

    #[test]
    fn jsonl_reads_text_field_per_line() {
        let dir = TempDir::new("readers-jsonl");
        let path = dir.write(
            "docs.jsonl",
            "{\"text\": \"one\", \"id\": 1}\n\n{\"id\": 2, \"text\": \"two\\nlines\"}\r\n",
        );
        let source = Source::resolve(path.to_str().unwrap(), "text").unwrap();
        assert_eq!(texts(&source), ["one", "two\nlines"]);
    }

    #[test]
    fn jsonl_errors_name_line_and_field() {
        let dir = TempDir::new("readers-jsonl-bad");
        let path = dir.write("docs.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
        let source = Source::resolve(path.to_str().unwrap(), "text").unwrap();
        let err = source
            .pieces()
            .unwrap()
            .nth(1)
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2") && err.contains("body"), "{err}");
        assert!(err.contains("--text-column"), "{err}");

        let path = dir.write("num.jsonl", "{\"text\": 5}\n");
        let err = texts_err(&Source::resolve(path.to_str().unwrap(), "text").unwrap());
        assert!(err.contains("line 1") && err.contains("a number"), "{err}");
    }
}
