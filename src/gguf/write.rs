//! Writing a GGUF file (version 3) as a stream: the header first, from the tensors'
//! descriptions, then each tensor's data as the caller hands it over, encoded on
//! the way, so that a model is never held a second time in memory. The file is an
//! [`AtomicFile`]: it appears whole at its destination on [`GgufWriter::finish`],
//! or not at all.

use super::quants;
use super::read::{DEFAULT_ALIGNMENT, MAGIC};
use super::types::{GgmlType, Value};
use crate::fsutil::AtomicFile;
use anyhow::{bail, ensure, Context, Result};
use std::io::Write;
use std::path::Path;

/// The version written.
pub const VERSION: u32 = 3;
/// Elements encoded per write: bounds the encoding buffer (a few MB).
const CHUNK: usize = 1 << 20;

/// A tensor to write: its name, its dimensions in ggml's order (`dims[0]` is the row
/// length; see [`super::TensorInfo::dims`]) and the type to store it as.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    /// A tensor of PyTorch shape `shape` (outermost first).
    pub fn new(name: impl Into<String>, shape: &[usize], ty: GgmlType) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            ty,
        }
    }

    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    pub fn n_bytes(&self) -> u64 {
        let (block, size) = self.ty.block();
        self.n_elements() / block as u64 * size as u64
    }
}

/// A GGUF file being written; see the module's description.
pub struct GgufWriter {
    file: AtomicFile,
    tensors: Vec<TensorSpec>,
    alignment: u64,
    /// The tensor being written, and how many of its elements are written.
    current: usize,
    done: u64,
    /// Encoding buffer, reused.
    buf: Vec<u8>,
}

impl GgufWriter {
    /// Starts `dest` (written under a temporary name until [`GgufWriter::finish`])
    /// with `metadata` and the descriptions of `tensors`, whose data is then given
    /// in this order. `general.alignment` in `metadata`, if there, sets the
    /// alignment of the data.
    pub fn create(
        dest: &Path,
        metadata: &[(String, Value)],
        tensors: Vec<TensorSpec>,
    ) -> Result<GgufWriter> {
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .context("general.alignment must be a power of two")?,
        };
        for t in &tensors {
            let (block, _) = t.ty.block();
            ensure!(
                quants::can_quantize(t.ty),
                "internal error: cannot write {} as {}",
                t.name,
                t.ty
            );
            ensure!(
                !t.dims.is_empty() && t.dims[0].is_multiple_of(block as u64),
                "internal error: {} has rows of {} elements, not whole {} blocks",
                t.name,
                t.dims.first().copied().unwrap_or(0),
                t.ty
            );
        }
        let header = header_bytes(metadata, &tensors, alignment)?;
        let mut file = AtomicFile::create(dest)?;
        file.writer()
            .write_all(&header)
            .with_context(|| format!("cannot write {}", dest.display()))?;
        let mut w = GgufWriter {
            file,
            tensors,
            alignment,
            current: 0,
            done: 0,
            buf: Vec::new(),
        };
        w.skip_empty();
        Ok(w)
    }

    /// The tensor whose data is due next, if any.
    pub fn next_tensor(&self) -> Option<&TensorSpec> {
        self.tensors.get(self.current)
    }

    /// Appends `data` to the tensor due, encoded as its type: a tensor may come in
    /// several calls, each a whole number of its rows' blocks (whole rows are).
    pub fn write_f32(&mut self, data: &[f32]) -> Result<()> {
        let Some(t) = self.tensors.get(self.current) else {
            bail!("internal error: data after the last tensor");
        };
        let (ty, total) = (t.ty, t.n_elements());
        let (block, size) = ty.block();
        ensure!(
            self.done + data.len() as u64 <= total && data.len().is_multiple_of(block),
            "internal error: {} elements for tensor {} ({} of {total} written)",
            data.len(),
            t.name,
            self.done
        );
        for chunk in data.chunks(CHUNK / block * block) {
            self.buf.resize(chunk.len() / block * size, 0);
            quants::quantize(ty, chunk, &mut self.buf);
            let dest = self.file.dest().display().to_string();
            self.file
                .writer()
                .write_all(&self.buf)
                .with_context(|| format!("cannot write {dest}"))?;
        }
        self.done += data.len() as u64;
        if self.done == total {
            self.end_tensor()?;
        }
        Ok(())
    }

    /// Pads the finished tensor to the alignment and moves to the next one.
    fn end_tensor(&mut self) -> Result<()> {
        let bytes = self.tensors[self.current].n_bytes();
        let pad = bytes.next_multiple_of(self.alignment) - bytes;
        let dest = self.file.dest().display().to_string();
        self.file
            .writer()
            .write_all(&vec![0u8; pad as usize])
            .with_context(|| format!("cannot write {dest}"))?;
        self.current += 1;
        self.done = 0;
        self.skip_empty();
        Ok(())
    }

    /// Tensors without elements have no data: skip past them.
    fn skip_empty(&mut self) {
        while self
            .tensors
            .get(self.current)
            .is_some_and(|t| t.n_elements() == 0)
        {
            self.current += 1;
        }
    }

    /// Checks that every tensor was written, then moves the file into place.
    pub fn finish(self) -> Result<()> {
        if let Some(t) = self.tensors.get(self.current) {
            bail!(
                "internal error: {} ended after {} of tensor {}'s {} elements",
                self.file.dest().display(),
                self.done,
                t.name,
                t.n_elements()
            );
        }
        self.file.commit()
    }
}

/// Everything before the data: magic, version, counts, metadata, tensor infos with
/// their offsets, padding to the alignment.
fn header_bytes(
    metadata: &[(String, Value)],
    tensors: &[TensorSpec],
    alignment: u64,
) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    let mut keys = std::collections::HashSet::new();
    for (key, value) in metadata {
        ensure!(keys.insert(key), "internal error: metadata key {key} twice");
        put_string(&mut out, key);
        out.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
        put_value(&mut out, value)?;
    }
    let mut offset = 0u64;
    for t in tensors {
        put_string(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.code().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset += t.n_bytes().next_multiple_of(alignment);
    }
    out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
    Ok(out)
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) -> Result<()> {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(*v as u8),
        Value::String(s) => put_string(out, s),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Array(ty, items) => {
            out.extend_from_slice(&(*ty as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                ensure!(
                    item.value_type() == *ty,
                    "internal error: a {:?} in an array of {ty:?}",
                    item.value_type()
                );
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}
