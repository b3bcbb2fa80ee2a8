//! Text data: preparing token files from text and feeding them to training.
//!
//! - [`prepare()`] turns a text source (the bundled Shakespeare, `.txt`, `.jsonl` or
//!   `.parquet` files) into nanoGPT's format: `train.bin` / `val.bin` (little-endian
//!   token ids, uint16 where the vocabulary fits, else uint32: [`TokenDtype`]) plus a
//!   [`Meta`] file, `meta.json`. Instruction
//!   examples ([`instruct`]: Alpaca or chat `.jsonl`) also get `train.mask` /
//!   `val.mask` ([`mask`]: one byte per token, 1 = trained).
//! - [`Tokenizer`] encodes prompts and decodes samples for a prepared dataset.
//! - [`loader`] reads the `.bin` files window by window and cuts them into batches that are a
//!   pure function of `(seed, iteration)`.
//! - [`find_or_prepare_dataset`] maps a config's `dataset` key to its prepared
//!   directory, preparing the bundled Shakespeare on first use.

mod bundled;
pub mod chat_template;
mod cuts;
pub mod gpt2_vocab;
pub mod hub;
pub mod instruct;
pub mod loader;
pub mod mask;
mod meta;
mod prepare;
pub mod readers;
#[cfg(test)]
mod testutil;
mod token_writer;
pub mod tokenizer;

pub use bundled::find_or_prepare_dataset;
pub use chat_template::{ChatTemplate, RenderOptions};
pub use instruct::DataFormat;
pub use loader::{
    batch_offsets, eval_window_count, eval_window_offsets, fill_batch, Draw, TokenFile,
};
pub use mask::TokenMask;
pub use meta::{Meta, TokenDtype, TokenizerKind, GPT2_EOT, GPT2_VOCAB_SIZE};
pub use prepare::{
    prepare, prepare_source, PrepareOptions, PrepareSummary, TokenizerSpec, DATASET,
};
pub use readers::SHAKESPEARE_TEXT;
pub use tokenizer::files::TokenizerFiles;
pub use tokenizer::hf::HfTokenizer;
pub use tokenizer::{StreamDecoder, Tokenizer};

/// The two token files of a prepared dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Val,
}

impl Split {
    /// The file name nanoGPT uses for this split.
    pub fn file_name(self) -> &'static str {
        match self {
            Split::Train => "train.bin",
            Split::Val => "val.bin",
        }
    }
}
