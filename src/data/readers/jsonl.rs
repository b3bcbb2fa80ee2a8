//! JSON Lines: one document per line, in a string field (default `text`).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

use super::{not_utf8, open, Piece};
use crate::data::instruct::{DataFormat, Example};

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
                    Some(path) => self.current.insert(JsonlFile::open(path)?),
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
    fn open(path: PathBuf) -> Result<JsonlFile> {
        Ok(JsonlFile {
            reader: BufReader::with_capacity(1 << 20, open(&path)?),
            path,
            line: 0,
            offset: 0,
        })
    }

    /// The next document of this file, or `None` at its end.
    fn next_line(&mut self, field: &str) -> Result<Option<Piece>> {
        match self.next_object()? {
            Some((object, progress)) => {
                let text = self.field_of(object, field)?;
                Ok(Some(Piece { text, progress }))
            }
            None => Ok(None),
        }
    }

    /// The next non-blank line as a JSON object, with the bytes read to reach it.
    fn next_object(&mut self) -> Result<Option<(Map<String, Value>, u64)>> {
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
            let mut start = self.offset;
            self.offset += read as u64;
            // A byte-order mark, which some editors write at the start of a file.
            if start == 0 && bytes.starts_with(crate::fsutil::BOM) {
                bytes.drain(..crate::fsutil::BOM.len());
                start = crate::fsutil::BOM.len() as u64;
            }
            let line = std::str::from_utf8(&bytes).map_err(|e| {
                not_utf8(
                    &self.path.display().to_string(),
                    start + e.valid_up_to() as u64,
                )
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let object = serde_json::from_str(line).with_context(|| {
                format!("{}: not a JSON object; each line must be one", self.at())
            })?;
            return Ok(Some((object, progress)));
        }
    }

    /// `FILE line N`, for messages.
    fn at(&self) -> String {
        format!("{} line {}", self.path.display(), self.line)
    }

    fn field_of(&self, mut object: Map<String, Value>, field: &str) -> Result<String> {
        let at = || self.at();
        match object.remove(field) {
            Some(Value::String(text)) => Ok(text),
            Some(Value::Null) => Ok(String::new()),
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

/// The format of a `.jsonl` file, read off the keys of its first record (see
/// [`DataFormat::detect`]); an empty file reads as plain text.
pub(super) fn detect_format(path: &Path) -> Result<DataFormat> {
    let mut file = JsonlFile::open(path.to_path_buf())?;
    Ok(match file.next_object()? {
        Some((object, _)) => DataFormat::detect(&object),
        None => DataFormat::Text,
    })
}

/// Instruction examples from JSON Lines files, one per non-blank line, each file in
/// its own format; errors name the file, the line and the field.
pub(super) struct JsonlExamples {
    files: std::vec::IntoIter<(PathBuf, DataFormat)>,
    current: Option<(JsonlFile, DataFormat)>,
    failed: bool,
}

impl JsonlExamples {
    pub(super) fn new(files: Vec<(PathBuf, DataFormat)>) -> Self {
        JsonlExamples {
            files: files.into_iter(),
            current: None,
            failed: false,
        }
    }

    fn next_example(&mut self) -> Result<Option<(Example, u64)>> {
        loop {
            let (file, format) = match &mut self.current {
                Some(current) => current,
                None => match self.files.next() {
                    Some((path, format)) => self.current.insert((JsonlFile::open(path)?, format)),
                    None => return Ok(None),
                },
            };
            match file.next_object()? {
                Some((object, progress)) => {
                    let mut example = Example::from_json(*format, &object)
                        .with_context(|| format!("{} ({} example)", file.at(), format.as_str()))?;
                    example.origin = file.at();
                    return Ok(Some((example, progress)));
                }
                None => self.current = None,
            }
        }
    }
}

impl Iterator for JsonlExamples {
    type Item = Result<(Example, u64)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let next = self.next_example().transpose();
        self.failed = matches!(next, Some(Err(_)));
        next
    }
}

/// "a string", "an array", ... for messages (the data's and `serve`'s requests').
pub fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
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
    use super::super::{texts, texts_err};
    use crate::data::readers::Source;
    use crate::data::testutil::TempDir;

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
