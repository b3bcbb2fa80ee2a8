//! Text sources for `nanogpt prepare`, read as a stream of [`Piece`]s so that a
//! corpus of many gigabytes never sits in memory at once.
//!
//! Multi-document sources (a directory of `.txt`, `.jsonl`, `.parquet`) yield one
//! piece per document. Single-document sources (the bundled Shakespeare, one
//! `.txt`) yield the document in chunks cut just before a line break that follows
//! printable ASCII: GPT-2's pre-tokenizer always ends a token there, so encoding
//! chunk by chunk gives exactly the tokens of encoding the whole text.

mod jsonl;
pub use jsonl::json_kind;
mod parquet;
mod text;

use std::fs::File;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::instruct::{DataFormat, Example};
use jsonl::{JsonlDocs, JsonlExamples};
use text::TextChunks;

/// Karpathy's tiny Shakespeare (1,115,394 characters), embedded so that the quick
/// start works from any directory.
pub const SHAKESPEARE_TEXT: &str = include_str!("../../../data/shakespeare/input.txt");

/// Name that selects the bundled tiny Shakespeare text.
pub const BUNDLED_SHAKESPEARE: &str = "shakespeare";

/// A run of text from a source, with how far it advanced the source's progress.
#[derive(Debug)]
pub struct Piece {
    pub text: String,
    /// Progress made by reading this piece, in the source's [`ProgressUnit`].
    pub progress: u64,
}

/// What a source's progress counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressUnit {
    Bytes,
    Rows,
}

/// A stream of pieces; errors name the file and position.
pub type Pieces = Box<dyn Iterator<Item = Result<Piece>> + Send>;

/// A stream of instruction examples, each with the bytes read for it.
pub type Examples = Box<dyn Iterator<Item = Result<(Example, u64)>> + Send>;

/// Where `nanogpt prepare` reads text from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The tiny Shakespeare text built into the binary (one document).
    Bundled,
    /// One `.txt` file, read as one document.
    TextFile(PathBuf),
    /// `.txt` files, each one document, in name order.
    TextFiles(Vec<PathBuf>),
    /// JSON Lines files: one document per line, in the string field `field`.
    Jsonl { files: Vec<PathBuf>, field: String },
    /// Parquet files: one document per row, in the string column `column`.
    Parquet { files: Vec<PathBuf>, column: String },
    /// Instruction examples, each file Alpaca or chat: JSON Lines (one per line) or
    /// parquet (one per row, its columns the fields).
    Instruct { files: Vec<(PathBuf, DataFormat)> },
}

impl Source {
    /// Interprets the SOURCE argument: `shakespeare`, a file, or a directory.
    /// `text_column` names the JSONL field / parquet column holding the text.
    pub fn resolve(spec: &str, text_column: &str) -> Result<Source> {
        Self::resolve_as(spec, text_column, None)
    }

    /// [`Source::resolve`] with the format of `.jsonl` and `.parquet` files given
    /// (`--format`), or with `None`, detected per file from the keys of its first line
    /// or its columns.
    pub fn resolve_as(spec: &str, text_column: &str, format: Option<DataFormat>) -> Result<Source> {
        let source = Self::resolve_text(spec, text_column)?;
        match source {
            Source::Jsonl { files, field } => {
                Ok(match Self::formats(&files, format, jsonl::detect_format)? {
                    Some(formats) => Source::instruct(files, formats),
                    None => Source::jsonl(files, &field),
                })
            }
            Source::Parquet { files, column } => Self::parquet_as(files, &column, format),
            other => match format {
                Some(f) if f != DataFormat::Text => bail!(
                    "--format {f} reads .jsonl and .parquet files, but the source {} is \
                     neither; convert the examples to JSON Lines or drop --format",
                    other.describe()
                ),
                _ => Ok(other),
            },
        }
    }

    /// Parquet files (a Hub dataset's, say) as plain text in `column`, or as
    /// instruction examples where `format` or their columns say so.
    pub fn parquet_as(
        files: Vec<PathBuf>,
        column: &str,
        format: Option<DataFormat>,
    ) -> Result<Source> {
        Ok(
            match Self::formats(&files, format, parquet::detect_format)? {
                Some(formats) => Source::instruct(files, formats),
                None => Source::parquet(files, column),
            },
        )
    }

    /// Each file's format (`format`, or `detect`ed), or `None` where all are plain
    /// text; refused where some are and some are not.
    fn formats(
        files: &[PathBuf],
        format: Option<DataFormat>,
        detect: fn(&Path) -> Result<DataFormat>,
    ) -> Result<Option<Vec<DataFormat>>> {
        let formats = files
            .iter()
            .map(|f| format.map_or_else(|| detect(f), Ok))
            .collect::<Result<Vec<_>>>()?;
        let text = formats.iter().filter(|&&f| f == DataFormat::Text).count();
        if text == files.len() {
            return Ok(None);
        }
        if text > 0 {
            let name = |want: bool| {
                let i = formats
                    .iter()
                    .position(|&f| (f == DataFormat::Text) == want)
                    .expect("both kinds present");
                files[i].display().to_string()
            };
            bail!(
                "{} holds plain text but {} holds instruction examples; prepare them \
                 separately, or pass --format to read them all one way",
                name(true),
                name(false)
            );
        }
        Ok(Some(formats))
    }

    fn instruct(files: Vec<PathBuf>, formats: Vec<DataFormat>) -> Source {
        Source::Instruct {
            files: files.into_iter().zip(formats).collect(),
        }
    }

    fn resolve_text(spec: &str, text_column: &str) -> Result<Source> {
        let path = Path::new(spec);
        if !path.exists() {
            if spec == BUNDLED_SHAKESPEARE {
                return Ok(Source::Bundled);
            }
            bail!(
                "source `{spec}` does not exist; give a .txt, .jsonl or .parquet file, a \
                 directory of them, or `{BUNDLED_SHAKESPEARE}` for the bundled text"
            );
        }
        if path.is_dir() {
            return Self::from_dir(path, text_column);
        }
        crate::fsutil::check_regular_file(path, "source")?;
        match extension(path).as_str() {
            "txt" => Ok(Source::TextFile(path.to_path_buf())),
            "jsonl" => Ok(Source::jsonl(vec![path.to_path_buf()], text_column)),
            "parquet" => Ok(Source::parquet(vec![path.to_path_buf()], text_column)),
            _ => bail!(
                "source {}: unsupported file type; use a .txt, .jsonl or .parquet file \
                 (rename a plain-text file to .txt)",
                path.display()
            ),
        }
    }

    fn jsonl(files: Vec<PathBuf>, field: &str) -> Source {
        Source::Jsonl {
            files,
            field: field.to_string(),
        }
    }

    fn parquet(files: Vec<PathBuf>, column: &str) -> Source {
        Source::Parquet {
            files,
            column: column.to_string(),
        }
    }

    fn from_dir(dir: &Path, text_column: &str) -> Result<Source> {
        let mut files = Vec::new();
        for entry in
            std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?
        {
            let path = entry
                .with_context(|| format!("cannot list {}", dir.display()))?
                .path();
            if path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        let of_kind = |ext: &str| -> Vec<PathBuf> {
            files
                .iter()
                .filter(|p| extension(p) == ext)
                .cloned()
                .collect()
        };
        let (txt, jsonl, parquet) = (of_kind("txt"), of_kind("jsonl"), of_kind("parquet"));
        let kinds = [!txt.is_empty(), !jsonl.is_empty(), !parquet.is_empty()];
        match kinds {
            [true, false, false] => Ok(Source::TextFiles(txt)),
            [false, true, false] => Ok(Source::jsonl(jsonl, text_column)),
            [false, false, true] => Ok(Source::parquet(parquet, text_column)),
            [false, false, false] => bail!(
                "directory {} holds no .txt, .jsonl or .parquet files; pass the folder \
                 that directly contains them",
                dir.display()
            ),
            _ => bail!(
                "directory {} mixes .txt, .jsonl and .parquet files; put each kind in its \
                 own folder and prepare one of them",
                dir.display()
            ),
        }
    }

    /// True when the source is one document, split into train/val by position.
    pub fn is_single_document(&self) -> bool {
        matches!(self, Source::Bundled | Source::TextFile(_))
    }

    /// True for instruction examples (written with a loss mask).
    pub fn is_instruct(&self) -> bool {
        matches!(self, Source::Instruct { .. })
    }

    /// The instruction examples of an [`Source::Instruct`] (nothing for the others).
    pub fn examples(&self) -> Examples {
        match self {
            Source::Instruct { files } if self.is_parquet() => flatten_files(
                (files.clone().into_iter())
                    .map(|(path, format)| parquet::parquet_examples(path, format)),
            ),
            Source::Instruct { files } => Box::new(JsonlExamples::new(files.clone())),
            _ => Box::new(std::iter::empty()),
        }
    }

    /// Read from parquet files, as text or as instruction examples (a source holds
    /// one kind of file: a folder mixing kinds is refused).
    fn is_parquet(&self) -> bool {
        let Source::Instruct { files } = self else {
            return matches!(self, Source::Parquet { .. });
        };
        files
            .first()
            .is_some_and(|(f, _)| extension(f) == "parquet")
    }

    /// A short description for `meta.json`.
    pub fn describe(&self) -> String {
        let list = |files: &[PathBuf]| match files {
            [] => "no files".to_string(),
            [one] => one.display().to_string(),
            [first, ..] => format!(
                "{} ({} files)",
                first.parent().unwrap_or(Path::new(".")).display(),
                files.len()
            ),
        };
        match self {
            Source::Bundled => "bundled tiny Shakespeare".to_string(),
            Source::TextFile(path) => path.display().to_string(),
            Source::TextFiles(files) => list(files),
            Source::Jsonl { files, field } => format!("{} (field `{field}`)", list(files)),
            Source::Parquet { files, column } => format!("{} (column `{column}`)", list(files)),
            Source::Instruct { files } => {
                let paths: Vec<PathBuf> = files.iter().map(|(p, _)| p.clone()).collect();
                let mut kinds: Vec<&str> = files.iter().map(|(_, f)| f.as_str()).collect();
                kinds.dedup();
                format!("{} ({} examples)", list(&paths), kinds.join(" + "))
            }
        }
    }

    /// Total progress the pieces will add up to, for a progress bar.
    pub fn progress_total(&self) -> Result<(u64, ProgressUnit)> {
        let bytes = |files: &[PathBuf]| -> Result<u64> { files.iter().map(|f| file_len(f)).sum() };
        let rows = |files: &[PathBuf]| -> Result<u64> {
            files.iter().map(|f| parquet::parquet_rows(f)).sum()
        };
        Ok(match self {
            Source::Bundled => (SHAKESPEARE_TEXT.len() as u64, ProgressUnit::Bytes),
            Source::TextFile(path) => (file_len(path)?, ProgressUnit::Bytes),
            Source::TextFiles(files) | Source::Jsonl { files, .. } => {
                (bytes(files)?, ProgressUnit::Bytes)
            }
            Source::Instruct { files } => {
                let paths: Vec<PathBuf> = files.iter().map(|(p, _)| p.clone()).collect();
                match self.is_parquet() {
                    true => (rows(&paths)?, ProgressUnit::Rows),
                    false => (bytes(&paths)?, ProgressUnit::Bytes),
                }
            }
            Source::Parquet { files, .. } => (rows(files)?, ProgressUnit::Rows),
        })
    }

    /// Opens the source for one pass over its text (for instruction examples, the
    /// whole text of each, prompt and response).
    pub fn pieces(&self) -> Result<Pieces> {
        Ok(match self {
            Source::Instruct { .. } => Box::new(self.examples().map(|e| {
                e.map(|(example, progress)| Piece {
                    text: example.full_text(),
                    progress,
                })
            })),
            Source::Bundled => Box::new(TextChunks::new(
                Cursor::new(SHAKESPEARE_TEXT.as_bytes()),
                "bundled Shakespeare".into(),
            )),
            Source::TextFile(path) => {
                Box::new(TextChunks::new(open(path)?, path.display().to_string()))
            }
            Source::TextFiles(files) => Box::new(
                files
                    .clone()
                    .into_iter()
                    .map(|path| text::read_text_file(&path)),
            ),
            Source::Jsonl { files, field } => {
                Box::new(JsonlDocs::new(files.clone(), field.clone()))
            }
            Source::Parquet { files, column } => {
                let column = column.clone();
                flatten_files(
                    (files.clone().into_iter())
                        .map(move |path| parquet::parquet_docs(path, &column)),
                )
            }
        })
    }
}

/// One stream of the items of several files, opened one after the other as `files`
/// yields them; a file that cannot be opened is one error in the stream.
fn flatten_files<T: Send + 'static>(
    files: impl Iterator<Item = Result<Box<dyn Iterator<Item = Result<T>> + Send>>> + Send + 'static,
) -> Box<dyn Iterator<Item = Result<T>> + Send> {
    Box::new(files.flat_map(|items| match items {
        Ok(items) => items,
        Err(e) => Box::new(std::iter::once(Err(e))),
    }))
}

fn extension(path: &Path) -> String {
    path.extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default()
}

fn file_len(path: &Path) -> Result<u64> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .len())
}

fn open(path: &Path) -> Result<File> {
    crate::fsutil::open_regular(path, "source")
}

/// The error for bytes that are not UTF-8, naming where and how to fix it.
fn not_utf8(name: &str, offset: u64) -> anyhow::Error {
    anyhow::anyhow!(
        "{name}: not valid UTF-8 at byte offset {offset}; convert the text to UTF-8 \
         first, e.g. `iconv -f LATIN1 -t UTF-8 INPUT > OUTPUT`"
    )
}

/// Every piece of `source`'s text, unwrapped (tests).
#[cfg(test)]
fn texts(source: &Source) -> Vec<String> {
    source
        .pieces()
        .expect("open source")
        .map(|p| p.expect("read piece").text)
        .collect()
}

/// The first error `source` yields while reading (tests).
#[cfg(test)]
fn texts_err(source: &Source) -> String {
    source
        .pieces()
        .expect("open source")
        .find_map(|p| p.err())
        .expect("an error")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::TempDir;

    #[test]
    fn txt_directory_reads_files_in_name_order() {
        let dir = TempDir::new("readers-dir");
        dir.write("b.txt", "second");
        dir.write("a.txt", "first");
        dir.write("notes.md", "ignored");
        let source = Source::resolve(dir.path().to_str().unwrap(), "text").unwrap();
        assert!(!source.is_single_document());
        assert_eq!(texts(&source), ["first", "second"]);
        assert_eq!(source.progress_total().unwrap(), (11, ProgressUnit::Bytes));
    }

    #[test]
    fn mixed_or_empty_directory_is_refused() {
        let dir = TempDir::new("readers-mixed");
        let err = Source::resolve(dir.path().to_str().unwrap(), "text").unwrap_err();
        assert!(
            err.to_string().contains("no .txt, .jsonl or .parquet"),
            "{err}"
        );
        dir.write("a.txt", "x");
        dir.write("b.jsonl", "{}");
        let err = Source::resolve(dir.path().to_str().unwrap(), "text").unwrap_err();
        assert!(err.to_string().contains("mixes"), "{err}");
    }

    #[test]
    fn unknown_source_and_extension_are_explained() {
        let err = Source::resolve("/no/such/corpus.txt", "text")
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
        let dir = TempDir::new("readers-ext");
        let path = dir.write("x.csv", "a,b");
        let err = Source::resolve(path.to_str().unwrap(), "text")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unsupported file type"), "{err}");
        assert_eq!(
            Source::resolve("shakespeare", "text").unwrap(),
            Source::Bundled
        );
    }
}
