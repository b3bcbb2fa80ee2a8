//! Writing safetensors files whose bytes depend on their contents alone.
//!
//! The `safetensors` crate takes the header's `__metadata__` as a `HashMap`, which it
//! writes in the map's iteration order: random from one process to the next once
//! there are two keys, so two exports of the same checkpoint differed. Here the
//! metadata is a `BTreeMap` (keys in order) and the tensors come in the crate's own
//! order (descending dtype alignment, then name), so that equal inputs give equal
//! files. The layout is the format's: the header's length (u64, little-endian), the
//! JSON header padded with spaces to a multiple of 8 bytes, then the tensors' bytes.

use safetensors::tensor::TensorInfo;
use safetensors::View;
use serde::ser::{SerializeMap, Serializer};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

/// Writes `tensors` and `metadata` to `path` as a safetensors file (created or
/// truncated); the same arguments always give the same bytes.
pub fn write<V: View>(
    tensors: Vec<(String, V)>,
    metadata: &BTreeMap<String, String>,
    path: &Path,
) -> io::Result<()> {
    let mut tensors = tensors;
    tensors.sort_by(|(a, ta), (b, tb)| tb.dtype().cmp(&ta.dtype()).then(a.cmp(b)));
    let mut out = BufWriter::new(File::create(path)?);
    out.write_all(&prefix(&tensors, metadata)?)?;
    for (_, t) in &tensors {
        out.write_all(&t.data())?;
    }
    out.flush()
}

/// The bytes before the tensors' data of a file holding `tensors` (already in the
/// file's order) and `metadata`: the header's length, then the header.
pub fn prefix<V: View>(
    tensors: &[(String, V)],
    metadata: &BTreeMap<String, String>,
) -> io::Result<Vec<u8>> {
    let header = header(tensors, metadata)?;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    Ok(bytes)
}

/// The JSON header, padded with spaces to a multiple of 8 bytes.
fn header<V: View>(
    tensors: &[(String, V)],
    metadata: &BTreeMap<String, String>,
) -> io::Result<Vec<u8>> {
    let mut json = Vec::new();
    let mut ser = serde_json::Serializer::new(&mut json);
    let mut map = ser.serialize_map(Some(tensors.len() + 1))?;
    if !metadata.is_empty() {
        map.serialize_entry("__metadata__", metadata)?;
    }
    let mut offset = 0;
    for (name, t) in tensors {
        let info = TensorInfo {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data_offsets: (offset, offset + t.data_len()),
        };
        offset += t.data_len();
        map.serialize_entry(name, &info)?;
    }
    map.end()?;
    json.resize(json.len().next_multiple_of(8), b' ');
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::{Dtype, SafeTensors};

    fn tensors(data: &[f32]) -> Vec<(String, safetensors::tensor::TensorView<'_>)> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let view = |range: std::ops::Range<usize>, shape: Vec<usize>| {
            safetensors::tensor::TensorView::new(Dtype::F32, shape, &bytes[range]).unwrap()
        };
        vec![
            ("b".to_string(), view(0..8, vec![2])),
            ("a".to_string(), view(8..24, vec![2, 2])),
        ]
    }

    #[test]
    fn equal_inputs_give_equal_files_that_safetensors_reads() {
        let dir = tempfile::tempdir().unwrap();
        let data = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        // Many keys: a HashMap would almost surely order two writes differently.
        let metadata: BTreeMap<String, String> = (0..16)
            .map(|i| (format!("k{i}"), format!("v{i}")))
            .collect();
        let (p, q) = (dir.path().join("p"), dir.path().join("q"));
        write(tensors(&data), &metadata, &p).unwrap();
        write(tensors(&data).into_iter().rev().collect(), &metadata, &q).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(bytes, std::fs::read(&q).unwrap());
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
        assert!(
            header.starts_with(r#"{"__metadata__":{"k0":"v0","k1":"v1","k10":"#),
            "{header}"
        );
        let (_, read) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(read.metadata().clone().unwrap().len(), 16);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let a = st.tensor("a").unwrap();
        assert_eq!(a.shape(), [2, 2]);
        assert_eq!(
            bytemuck::cast_slice::<u8, f32>(a.data()),
            [3.0, 4.0, 5.0, 6.0]
        );
        assert_eq!(
            bytemuck::cast_slice::<u8, f32>(st.tensor("b").unwrap().data()),
            [1.0, 2.0]
        );
    }
}
