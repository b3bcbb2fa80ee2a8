//! Reading a GGUF file: the header (metadata and tensor infos) parsed and checked
//! from the bytes, the tensor data read in place from a memory map.
//!
//! Every count, length and offset is checked against the bytes that are there
//! before anything is allocated or sliced by it, so a truncated or damaged file is
//! refused with one message naming the file and what is wrong; it never panics.

use super::quants;
use super::types::{GgmlType, Value, ValueType};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The file's first four bytes.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// The alignment of tensor data when `general.alignment` does not say otherwise.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The most dimensions a tensor has in ggml.
pub const MAX_DIMS: usize = 4;
/// Arrays nested deeper than this are refused (the format allows nesting; no model
/// file uses more than one level, and unbounded recursion could exhaust the stack).
const MAX_NESTING: usize = 8;

/// One tensor's description in the header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's order: `dims[0]` is the length of a row (the fastest-varying index),
    /// so a PyTorch `[out, in]` weight has `dims = [in, out]`.
    pub dims: Vec<u64>,
    /// The stored type code; [`TensorInfo::ty`] is `None` for a code this version
    /// does not know.
    pub type_code: u32,
    pub ty: Option<GgmlType>,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        // Checked when the header was parsed.
        self.dims.iter().product()
    }

    /// Bytes of the data, for a known type (checked when the header was parsed).
    pub fn n_bytes(&self) -> Option<u64> {
        let (block, size) = self.ty?.block();
        Some(self.n_elements() / block as u64 * size as u64)
    }

    /// The shape in PyTorch's order (outermost first).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// The type's name, or its code when it is unknown.
    pub fn type_name(&self) -> String {
        match self.ty {
            Some(t) => t.name(),
            None => format!("type code {}", self.type_code),
        }
    }
}

/// A parsed header: what precedes the tensor data.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    pub version: u32,
    /// Key-value pairs in file order (keys are unique).
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Where the data section starts in the file.
    pub data_start: u64,
}

impl Header {
    /// Parses and checks the header of the GGUF file `bytes` (the whole file: the
    /// tensors' data ranges are checked against its length). The error says what
    /// is wrong; the caller names the file.
    pub fn parse(bytes: &[u8]) -> Result<Header> {
        let mut c = Cursor { bytes, pos: 0 };
        let magic = c.take(4, "the magic number")?;
        if magic != MAGIC {
            bail!(
                "it does not start with GGUF's magic number (found {:?})",
                String::from_utf8_lossy(magic)
            );
        }
        let version = c.u32("the version")?;
        match version {
            2 | 3 => {}
            1 => bail!(
                "it is GGUF version 1, which llama.cpp stopped reading in 2023; convert it again"
            ),
            v if v.swap_bytes() <= 3 => {
                bail!("it is a big-endian GGUF file, which nanogpt does not read")
            }
            v => bail!("it is GGUF version {v}; nanogpt reads versions 2 and 3"),
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;
        // Each entry takes at least 13 bytes (key length, type, one value byte) and
        // each tensor info at least 24: counts past that are damage, not models.
        c.check_count(n_kv, 13, "metadata entries")?;
        c.check_count(n_tensors, 24, "tensors")?;
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut keys: HashMap<String, ()> = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("the key of metadata entry {i}"))?;
            let what = || format!("the value of {key}");
            let code = c.u32(&what())?;
            let ty = ValueType::from_code(code)
                .ok_or_else(|| anyhow!("{key} has unknown value type {code}"))?;
            let value = c.value(ty, &what, 0)?;
            if keys.insert(key.clone(), ()).is_some() {
                bail!("metadata key {key} appears twice");
            }
            metadata.push((key, value));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                _ => bail!("general.alignment is {v:?}; it must be a power of two"),
            },
        };
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names: HashMap<String, ()> = HashMap::new();
        for i in 0..n_tensors {
            let t = c.tensor_info(i)?;
            if names.insert(t.name.clone(), ()).is_some() {
                bail!("tensor {} appears twice", t.name);
            }
            tensors.push(t);
        }
        let data_start = (c.pos as u64).next_multiple_of(alignment);
        let header = Header {
            version,
            metadata,
            tensors,
            alignment,
            data_start,
        };
        header.check_data(bytes.len() as u64)?;
        Ok(header)
    }

    /// Every known tensor's data lies inside a file of `len` bytes.
    fn check_data(&self, len: u64) -> Result<()> {
        for t in &self.tensors {
            let Some(n_bytes) = t.n_bytes() else { continue };
            let end = self
                .data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(n_bytes));
            if end.is_none_or(|end| end > len) {
                bail!(
                    "tensor {} ({} {:?}, {n_bytes} bytes at offset {}) lies past the end of the \
                     file ({len} bytes): the file is truncated or damaged",
                    t.name,
                    t.type_name(),
                    t.shape(),
                    self.data_start.saturating_add(t.offset)
                );
            }
        }
        Ok(())
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A position in the header's bytes; every read checks that its bytes are there.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            bail!(
                "it ends at byte {} while reading {what} ({n} bytes needed): the file is \
                 truncated or damaged",
                self.bytes.len()
            );
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        Ok(s.try_into().expect("take returns N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Refuses a count of items of at least `min_size` bytes each that the
    /// remaining bytes cannot hold.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<()> {
        if count > self.remaining() as u64 / min_size {
            bail!(
                "it claims {count} {what}, more than its {} remaining bytes can hold: the file \
                 is truncated or damaged",
                self.remaining()
            );
        }
        Ok(())
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(&what())?;
        if len > self.remaining() as u64 {
            bail!(
                "{} claims {len} bytes but only {} remain: the file is truncated or damaged",
                what(),
                self.remaining()
            );
        }
        let bytes = self.take(len as usize, &what())?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(e) => bail!("{} is not valid UTF-8 ({e})", what()),
        }
    }

    fn value(&mut self, ty: ValueType, what: &dyn Fn() -> String, depth: usize) -> Result<Value> {
        let w = what();
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&w)?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(&w)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&w)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&w)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&w)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&w)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&w)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&w)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&w)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&w)?)),
            ValueType::Bool => match self.array::<1>(&w)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => bail!("{w} is a boolean stored as {b} (only 0 and 1 are booleans)"),
            },
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                if depth >= MAX_NESTING {
                    bail!("{w} nests arrays more than {MAX_NESTING} deep");
                }
                let code = self.u32(&w)?;
                let elem = ValueType::from_code(code)
                    .ok_or_else(|| anyhow!("{w} is an array of unknown value type {code}"))?;
                let n = self.u64(&w)?;
                // A string takes at least its 8-byte length, an array 12 bytes.
                let min = match elem {
                    ValueType::String => 8,
                    ValueType::Array => 12,
                    fixed => fixed.fixed_size().unwrap_or(1) as u64,
                };
                self.check_count(n, min, &format!("elements in {w}"))?;
                let mut items = Vec::with_capacity(n as usize);
                for i in 0..n {
                    let item = || format!("{w}[{i}]");
                    items.push(self.value(elem, &item, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }

    fn tensor_info(&mut self, i: u64) -> Result<TensorInfo> {
        let name = self.string(&|| format!("the name of tensor {i}"))?;
        let n_dims = self.u32(&format!("the dimension count of tensor {name}"))? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            bail!("tensor {name} has {n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}");
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(self.u64(&format!("the dimensions of tensor {name}"))?);
        }
        let type_code = self.u32(&format!("the type of tensor {name}"))?;
        let offset = self.u64(&format!("the offset of tensor {name}"))?;
        let ty = GgmlType::from_code(type_code);
        let n = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .filter(|&n| n < 1 << 48);
        let Some(n) = n else {
            bail!("tensor {name} has impossible dimensions {dims:?}");
        };
        if let Some(ty) = ty {
            let (block, _) = ty.block();
            if dims[0] % block as u64 != 0 {
                bail!(
                    "tensor {name} is {ty} with rows of {} elements, which is not a whole number \
                     of its {block}-element blocks",
                    dims[0]
                );
            }
            debug_assert!(n.is_multiple_of(block as u64));
        }
        Ok(TensorInfo {
            name,
            dims,
            type_code,
            ty,
            offset,
        })
    }
}

/// A GGUF file opened for reading: its header, and its bytes mapped.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    pub header: Header,
}

impl GgufFile {
    /// Opens and checks `path` (see [`Header::parse`]).
    pub fn open(path: &Path) -> Result<GgufFile> {
        crate::fsutil::check_regular_file(path, "the GGUF file")?;
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: a read-only private map. If another process truncates the file while
        // it is mapped, reads past the new end fault (SIGBUS): the same risk every
        // mmap-based model loader (llama.cpp included) accepts for multi-GB files.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("cannot read {}", path.display()))?;
        let header = Header::parse(&map)
            .with_context(|| format!("{} is not a valid GGUF file", path.display()))?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            header,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }

    /// The vocabulary size a model file holds: `token_embd.weight`'s second
    /// dimension, its first checked against the embedding length `n_embd` that the
    /// metadata key `width_key` gave.
    pub fn embedding_vocab(&self, n_embd: usize, width_key: &str) -> Result<usize> {
        let p = self.path.display();
        let embd = self
            .tensor("token_embd.weight")
            .with_context(|| format!("{p} has no token_embd.weight"))?;
        match embd.dims.as_slice() {
            [c, v] if *c as usize == n_embd => Ok(*v as usize),
            dims => {
                bail!("{p}: token_embd.weight has dimensions {dims:?}, but {width_key} is {n_embd}")
            }
        }
    }

    /// The stored bytes of `t` (checked to lie inside the file when it was opened);
    /// `None` for a type this version does not know.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Option<&[u8]> {
        let start = (self.header.data_start + t.offset) as usize;
        Some(&self.map[start..start + t.n_bytes()? as usize])
    }

    /// Dequantizes `t` into `out` (its element count long), refusing a type nanogpt
    /// does not read with a message naming the type, the tensor and the file.
    pub fn read_f32(&self, t: &TensorInfo, out: &mut [f32]) -> Result<()> {
        let (ty, bytes) = self.readable(t)?;
        if out.len() as u64 != t.n_elements() {
            bail!(
                "internal error: {} elements for tensor {} of {:?}",
                out.len(),
                t.name,
                t.shape()
            );
        }
        quants::dequantize(ty, bytes, out);
        crate::resident::release_mapped(&self.map, bytes);
        Ok(())
    }

    /// [`GgufFile::read_f32`] into a new vector.
    pub fn tensor_f32(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        self.readable(t)?;
        let mut out = vec![0.0; t.n_elements() as usize];
        self.read_f32(t, &mut out)?;
        Ok(out)
    }

    /// The type and bytes of `t`, if nanogpt reads its type.
    fn readable(&self, t: &TensorInfo) -> Result<(GgmlType, &[u8])> {
        match (t.ty.filter(|ty| ty.can_dequantize()), self.tensor_bytes(t)) {
            (Some(ty), Some(bytes)) => Ok((ty, bytes)),
            _ => bail!(
                "{}: tensor {} is stored as {}, which nanogpt cannot read (it reads F32, F16, \
                 BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K); convert or quantize \
                 the model to one of those (llama-quantize)",
                self.path.display(),
                t.name,
                t.type_name()
            ),
        }
    }
}

/// A `.gguf` file (by its name, or by its first bytes).
pub fn is_gguf(path: &Path) -> bool {
    let named = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    named || {
        let mut magic = [0u8; 4];
        std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .is_ok_and(|()| &magic == MAGIC)
    }
}
