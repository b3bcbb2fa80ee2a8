//! Helpers shared by the data tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

/// A fresh directory `nanogpt-test-<label>-…` under the system temp dir, removed
/// on drop.
pub(crate) struct TempDir(tempfile::TempDir);

impl TempDir {
    pub(crate) fn new(label: &str) -> TempDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("nanogpt-test-{label}-"))
            .tempdir()
            .expect("create temp dir");
        TempDir(dir)
    }

    pub(crate) fn path(&self) -> &Path {
        self.0.path()
    }

    /// Writes `contents` to `name` inside the directory and returns its path.
    pub(crate) fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.path().join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("create parent dir");
        }
        std::fs::write(&path, contents).expect("write test file");
        path
    }
}

/// Writes a parquet file with an int64 `id` column and a string `body` column.
pub(crate) fn write_parquet(path: &Path, bodies: &[&str], compression: Compression) {
    let schema = Arc::new(
        parse_message_type("message doc { required int64 id; required binary body (UTF8); }")
            .expect("valid schema"),
    );
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(compression)
            .build(),
    );
    let file = std::fs::File::create(path).expect("create parquet file");
    let mut writer = SerializedFileWriter::new(file, schema, props).expect("parquet writer");
    let mut group = writer.next_row_group().expect("row group");
    let ids: Vec<i64> = (0..bodies.len() as i64).collect();
    let mut col = group.next_column().expect("id column").expect("id column");
    col.typed::<Int64Type>()
        .write_batch(&ids, None, None)
        .expect("write ids");
    col.close().expect("close ids");
    let values: Vec<ByteArray> = bodies.iter().map(|b| ByteArray::from(*b)).collect();
    let mut col = group
        .next_column()
        .expect("body column")
        .expect("body column");
    col.typed::<ByteArrayType>()
        .write_batch(&values, None, None)
        .expect("write bodies");
    col.close().expect("close bodies");
    group.close().expect("close row group");
    writer.close().expect("close parquet file");
}
