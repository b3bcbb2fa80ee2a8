//! Parquet, the form Hugging Face datasets come in: one document per row of a
//! string column, read through the row API with only that column decoded.

use std::fs::File;
use std::path::{Path, PathBuf};

use ::parquet::basic::Type as PhysicalType;
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use ::parquet::record::reader::RowIter;
use ::parquet::record::Field;
use ::parquet::schema::types::Type as SchemaType;
use anyhow::{bail, Context, Result};

use super::{not_utf8, open, Piece, Pieces};

fn open_parquet(path: &Path) -> Result<SerializedFileReader<File>> {
    SerializedFileReader::new(open(path)?).with_context(|| {
        format!(
            "{} is not a readable parquet file (or uses a compression other than \
             snappy, gzip or zstd)",
            path.display()
        )
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
    let rows = RowIter::from_file_into(Box::new(reader))
        .project(Some(projection))
        .with_context(|| format!("{}: cannot read column `{column}`", path.display()))?;
    let name = path.display().to_string();
    Ok(Box::new(rows.enumerate().map(move |(row, result)| {
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
    })))
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
    use crate::data::readers::{ProgressUnit, Source};
    use crate::data::testutil::{texts, texts_err, write_parquet, TempDir};

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
