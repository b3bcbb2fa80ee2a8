//! `nanogpt prepare SOURCE --out DIR`.

use crate::data::{prepare, DataFormat, PrepareOptions, TokenizerKind};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// `shakespeare` (bundled), a .txt file, a folder of .txt files, a .jsonl file
    /// (one "text" per line) or .parquet file(s).
    pub source: String,
    /// Where train.bin, val.bin and meta.json go.
    #[arg(long)]
    pub out: PathBuf,
    /// gpt2 (BPE, 50257 tokens) or char (one token per character).
    #[arg(long, default_value = "gpt2")]
    pub tokenizer: TokenizerKind,
    /// Share of the data for val.bin (default 0.1 for one document, 0.0005 for many).
    #[arg(long)]
    pub val_fraction: Option<f64>,
    /// JSONL field or parquet column holding the text.
    #[arg(long, default_value = "text")]
    pub text_column: String,
    /// How .jsonl lines are read: alpaca ({"instruction", "input"?, "output"}), chat
    /// ({"messages": [{"role", "content"}]}) or text. Default: detected per file from
    /// the keys of its first line. Alpaca and chat write train.mask / val.mask too
    /// (loss on the responses only; see docs/finetune.md).
    #[arg(long)]
    pub format: Option<DataFormat>,
}

pub fn run(args: PrepareArgs) -> Result<()> {
    let opts = PrepareOptions {
        tokenizer: args.tokenizer,
        val_fraction: args.val_fraction,
        text_column: args.text_column,
        format: args.format,
        ..PrepareOptions::new(args.source, args.out)
    };
    let summary = prepare(&opts)?;
    crate::outln!("{summary}");
    Ok(())
}
