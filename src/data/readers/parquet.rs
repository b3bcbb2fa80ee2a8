//! Parquet, the form Hugging Face datasets come in: one document per row of a
//! string column, read through the row API with only that column decoded.

use std::fs::File;
use std::path::{Path, PathBuf};

use ::parquet::basic::Type as PhysicalType;
use ::parquet::errors::Result as ParquetResult;
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use ::parquet::record::reader::RowIter;
use ::parquet::record::{Field, Row};
use ::parquet::schema::types::Type as SchemaType;
use anyhow::{bail, Context, Result};

use super::{not_utf8, open, Examples, Piece, Pieces};
use crate::data::instruct::{DataFormat, Example};
use serde_json::{Map, Value};

fn open_parquet(path: &Path) -> Result<SerializedFileReader<File>> {
    let file = open(path)?;
    let what = path.display().to_string();
    survive_panic(&what, || {
        SerializedFileReader::new(file).with_context(|| {
            format!(
                "{what} is not a readable parquet file (or uses a compression other than \
                 snappy, gzip or zstd)"
            )
        })
    })
}

pub(super) fn parquet_rows(path: &Path) -> Result<u64> {
    let rows = open_parquet(path)?.metadata().file_metadata().num_rows();
    Ok(rows.max(0) as u64)
}

/// The rows of one parquet file, reading only the text column.
pub(super) fn parquet_docs(path: PathBuf, column: &str) -> Result<Pieces> {
    let reader = open_parquet(&path)?;
    let projection = text_projection(&path, reader.metadata().file_metadata().schema(), column)?;
    let what = format!("{}: cannot read column `{column}`", path.display());
    rows(path, reader, Some(projection), what, row_piece)
}

/// The format of a parquet file's rows, from its top-level column names as
/// [`DataFormat::detect`] reads a JSON object's keys.
pub(super) fn detect_format(path: &Path) -> Result<DataFormat> {
    let reader = open_parquet(path)?;
    let schema = reader.metadata().file_metadata().schema();
    let columns = (schema.get_fields().iter())
        .map(|f| (f.name().to_string(), Value::Null))
        .collect();
    Ok(DataFormat::detect(&columns))
}

/// The rows of one parquet file as instruction examples of `format`, each row's
/// columns its fields (a chat dataset's `messages`, a list of `{role, content}`, as
/// the Hub's parquet holds it); progress counts rows.
pub(super) fn parquet_examples(path: PathBuf, format: DataFormat) -> Result<Examples> {
    let reader = open_parquet(&path)?;
    let what = format!("{}: cannot read its rows", path.display());
    let example = move |name: &str, row, result| row_example(name, row, result, format);
    rows(path, reader, None, what, example)
}

/// The rows of `reader` (the file `path`), of the columns `projection` (all with
/// `None`), each turned into an item by `item(file name, row index, row)`. Each row
/// is decoded under `survive_panic`; after an error the reader's state is unknown,
/// so the stream ends there.
fn rows<T: 'static>(
    path: PathBuf,
    reader: SerializedFileReader<File>,
    projection: Option<SchemaType>,
    cannot: String,
    item: impl Fn(&str, usize, ParquetResult<Row>) -> Result<T> + Send + 'static,
) -> Result<Box<dyn Iterator<Item = Result<T>> + Send>> {
    let name = path.display().to_string();
    let rows = survive_panic(&name, || {
        RowIter::from_file_into(Box::new(reader))
            .project(projection)
            .context(cannot)
    })?;
    let mut rows = rows.enumerate();
    let mut done = false;
    Ok(Box::new(std::iter::from_fn(move || {
        if done {
            return None;
        }
        let next = survive_panic(&name, || Ok(rows.next()))
            .and_then(|next| {
                next.map(|(row, result)| item(&name, row, result))
                    .transpose()
            })
            .transpose();
        done = !matches!(next, Some(Ok(_)));
        next
    })))
}

/// Row `row` of the parquet file `name` as an example of `format`.
fn row_example(
    name: &str,
    row: usize,
    result: ParquetResult<Row>,
    format: DataFormat,
) -> Result<(Example, u64)> {
    let at = format!("{name} row {}", row + 1);
    let row = result.map_err(|e| anyhow::anyhow!("{at}: {}", short(&e.to_string())))?;
    let mut fields = Map::new();
    for (column, field) in row.get_column_iter() {
        fields.insert(
            column.clone(),
            json(field).with_context(|| format!("{at}, column `{column}`"))?,
        );
    }
    let mut example = Example::from_json(format, &fields)
        .with_context(|| format!("{at} ({} example)", format.as_str()))?;
    example.origin = at;
    Ok((example, 1))
}

/// A parquet value as JSON: strings (and UTF-8 bytes) as strings, lists as arrays,
/// groups and maps as objects, numbers and booleans as themselves, other kinds (dates,
/// decimals) as their text.
fn json(field: &Field) -> Result<Value> {
    Ok(match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(bytes) => match std::str::from_utf8(bytes.data()) {
            Ok(text) => Value::String(text.to_string()),
            Err(e) => bail!("not valid UTF-8 at byte offset {}", e.valid_up_to()),
        },
        Field::Int(n) => Value::from(*n),
        Field::Long(n) => Value::from(*n),
        Field::Double(x) => Value::from(*x),
        Field::Float(x) => Value::from(*x),
        Field::Group(row) => {
            let entries = row
                .get_column_iter()
                .map(|(k, v)| Ok((k.clone(), json(v)?)));
            Value::Object(entries.collect::<Result<_>>()?)
        }
        Field::ListInternal(list) => {
            Value::Array(list.elements().iter().map(json).collect::<Result<_>>()?)
        }
        Field::MapInternal(map) => {
            let key = |k: &Field| -> Result<String> {
                Ok(match json(k)? {
                    Value::String(s) => s,
                    other => other.to_string(),
                })
            };
            let entries = map.entries().iter().map(|(k, v)| Ok((key(k)?, json(v)?)));
            Value::Object(entries.collect::<Result<_>>()?)
        }
        other => Value::String(other.to_string()),
    })
}

/// The text of row `row` of the parquet file `name`.
fn row_piece(name: &str, row: usize, result: ParquetResult<Row>) -> Result<Piece> {
    let field = result
        .map_err(|e| anyhow::anyhow!("{name} row {row}: {}", short(&e.to_string())))?
        .into_columns()
        .pop()
        .map(|(_, field)| field);
    let text = match field {
        Some(Field::Str(text)) => text,
        Some(Field::Bytes(bytes)) => String::from_utf8(bytes.data().to_vec()).map_err(|e| {
            not_utf8(
                &format!("{name} row {row}"),
                e.utf8_error().valid_up_to() as u64,
            )
        })?,
        _ => String::new(),
    };
    Ok(Piece { text, progress: 1 })
}

/// A schema holding only the top-level string column `column`.
fn text_projection(path: &Path, schema: &SchemaType, column: &str) -> Result<SchemaType> {
    let fields = schema.get_fields();
    let Some(field) = fields.iter().find(|f| f.name() == column) else {
        let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
        bail!(
            "{} has no column `{column}` (columns: {}); choose the text column with \
             --text-column NAME",
            path.display(),
            names.join(", ")
        );
    };
    if !field.is_primitive() || field.get_physical_type() != PhysicalType::BYTE_ARRAY {
        bail!(
            "{}: column `{column}` does not hold strings; choose the text column with \
             --text-column NAME",
            path.display()
        );
    }
    SchemaType::group_type_builder(schema.name())
        .with_fields(vec![field.clone()])
        .build()
        .with_context(|| format!("{}: cannot select column `{column}`", path.display()))
}

/// Runs `read` on the parquet file `what`, turning a panic of the parquet crate into
/// an error. The crate indexes into page data without checking it in places (e.g.
/// a dictionary page shorter than it says: found by fuzzing), so a damaged file can
/// panic it; that must read as a damaged file, not as a crash with a backtrace.
fn survive_panic<T>(what: &str, read: impl FnOnce() -> Result<T>) -> Result<T> {
    install_quiet_hook();
    QUIET_PANICS.with(|quiet| quiet.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
    QUIET_PANICS.with(|quiet| quiet.set(false));
    result.unwrap_or_else(|payload| {
        let reason = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        bail!(
            "{what} is a damaged parquet file (the parquet reader failed: {}); export it \
             again, or convert the data to .jsonl",
            short(&reason)
        )
    })
}

thread_local! {
    /// Set while this thread reads parquet under [`survive_panic`]: its panics are
    /// expected and reported as errors, so the panic hook stays silent.
    static QUIET_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Wraps the process's panic hook once so that it skips panics of a thread inside
/// [`survive_panic`]; every other panic is reported as before.
fn install_quiet_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET_PANICS.with(|quiet| quiet.get()) {
                previous(info);
            }
        }));
    });
}

/// Keeps error messages readable when a library quotes a whole value.
fn short(message: &str) -> String {
    const LIMIT: usize = 300;
    match message.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}…", &message[..cut]),
        None => message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{texts, texts_err};
    use crate::data::readers::{ProgressUnit, Source};
    use crate::data::testutil::{write_parquet, TempDir};

    #[test]
    fn parquet_reads_text_column_for_each_codec() {
        use parquet::basic::{Compression, GzipLevel, ZstdLevel};
        let dir = TempDir::new("readers-parquet");
        let codecs = [
            Compression::SNAPPY,
            Compression::GZIP(GzipLevel::default()),
            Compression::ZSTD(ZstdLevel::default()),
        ];
        for (i, codec) in codecs.into_iter().enumerate() {
            write_parquet(
                &dir.path().join(format!("part-{i}.parquet")),
                &["alpha", "beta"],
                codec,
            );
        }
        let source = Source::resolve(dir.path().to_str().unwrap(), "body").unwrap();
        assert_eq!(texts(&source), ["alpha", "beta"].repeat(3));
        assert_eq!(source.progress_total().unwrap(), (6, ProgressUnit::Rows));
    }

    /// Found by fuzzing (`prepare_readers`): a dictionary page shorter than its
    /// header says made the parquet crate index past its data and panic.
    #[test]
    fn a_panic_of_the_parquet_reader_is_a_damaged_file_error() {
        let dir = TempDir::new("readers-parquet-panic");
        let path = dir.path().join("damaged.parquet");
        let bytes =
            include_bytes!("../../../tests/fixtures/fuzz/parquet_short_dictionary_page.parquet");
        std::fs::write(&path, bytes).unwrap();
        let source = Source::resolve(path.to_str().unwrap(), "text").unwrap();
        let err = texts_err(&source);
        assert!(
            err.contains("damaged.parquet is a damaged parquet file")
                && err.contains("convert the data to .jsonl"),
            "{err}"
        );
    }

    #[test]
    fn parquet_wrong_column_lists_columns() {
        let dir = TempDir::new("readers-parquet-col");
        let path = dir.path().join("x.parquet");
        write_parquet(&path, &["a"], parquet::basic::Compression::UNCOMPRESSED);
        let err = texts_err(&Source::resolve(path.to_str().unwrap(), "text").unwrap());
        assert!(
            err.contains("no column `text`") && err.contains("id, body"),
            "{err}"
        );
        let err = texts_err(&Source::resolve(path.to_str().unwrap(), "id").unwrap());
        assert!(err.contains("`id` does not hold strings"), "{err}");
    }
}
