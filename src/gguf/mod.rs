//! GGUF, the model file of llama.cpp, Ollama and LM Studio: read, written, and
//! mapped to and from nanogpt's models.
//!
//! The format (version 3, little-endian): the magic `GGUF`, the version, the tensor
//! and metadata counts, the metadata (typed key-value pairs: integers, floats,
//! booleans, strings, arrays), one description per tensor (name, dimensions in
//! ggml's order, type, offset), then the tensors' data, each aligned to
//! `general.alignment` (32 bytes by default).
//!
//! - [`types`]: value and tensor types.
//! - [`read`](mod@read): a file's header parsed and checked, its tensors read from a
//!   memory map and dequantized.
//! - [`write`](mod@write): a file written as a stream, atomically.
//! - [`quants`]: ggml's encodings to and from f32.
//! - [`model`]: nanogpt's GPT-2 in llama.cpp's names, layouts and metadata, exported
//!   from a parameter arena and imported into one.
//! - [`vocab`]: tokenizers in GGUF metadata.
//! - [`adapter`]: LoRA adapters as llama.cpp's GGUF adapter files, out and in.

pub mod adapter;
pub mod llama;
pub mod model;
pub mod quants;
pub mod read;
pub mod types;
pub mod vocab;
pub mod write;

pub use model::{ExportOptions, GgufModel, OutType};
pub use read::{is_gguf, GgufFile, Header, TensorInfo};
pub use types::{GgmlType, Value, ValueType};
pub use write::{GgufWriter, TensorSpec};

#[cfg(test)]
mod tests;
