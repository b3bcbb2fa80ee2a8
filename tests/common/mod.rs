//! Helpers shared by the integration tests that run the `nanogpt` binary.

// Each test crate includes this module and uses a different part of it.
#![allow(dead_code)]

use std::path::Path;

pub const BIN: &str = env!("CARGO_BIN_EXE_nanogpt");

/// A scratch directory `nanogpt-<tag>-…` under the system temp dir, removed on drop.
pub fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("nanogpt-{tag}-"))
        .tempdir()
        .expect("temp dir")
}

/// A process's output stream as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `(iter, value)` of every row of `out_dir/metrics.jsonl` that has `key` (a value
/// logged as null, i.e. not finite, reads as NaN).
pub fn metric(out_dir: &Path, key: &str) -> Vec<(u64, f64)> {
    let path = out_dir.join("metrics.jsonl");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|row| row.get(key).is_some())
        .map(|row| {
            let value = row[key].as_f64().unwrap_or(f64::NAN);
            (row["iter"].as_u64().unwrap(), value)
        })
        .collect()
}
