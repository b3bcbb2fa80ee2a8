//! `nanogpt prepare SOURCE --out DIR`.

use crate::data::chat_template::parse_variable;
use crate::data::readers::Source;
use crate::data::{hub, prepare, prepare_source, DataFormat, PrepareOptions, TokenizerSpec};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// `shakespeare` (bundled), a .txt file, a folder of .txt files, a .jsonl file
    /// (one "text" per line), .parquet file(s), or a Hugging Face Hub dataset
    /// `hf:OWNER/NAME` (or `hf:openwebtext`), from the cache or downloaded.
    pub source: String,
    /// Where train.bin, val.bin and meta.json go.
    #[arg(long)]
    pub out: PathBuf,
    /// gpt2 (BPE, 50257 tokens), char (one token per character), or a model's own:
    /// a model folder holding tokenizer.json (and tokenizer_config.json, the chat
    /// template), the path of a tokenizer.json, or a GGUF model file (its tokenizer
    /// and chat template). Vocabularies beyond 65,536 ids are written as uint32.
    #[arg(long, default_value = "gpt2")]
    pub tokenizer: TokenizerSpec,
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
    /// With `hf:`: the split whose parquet files are read.
    #[arg(long, default_value = "train")]
    pub split: String,
    /// A variable of the model's chat template for chat examples (repeatable), e.g.
    /// enable_thinking=false; VALUE is read as JSON where it is JSON.
    #[arg(long = "template-var", value_name = "KEY=VALUE", value_parser = parse_variable)]
    pub template_vars: Vec<(String, serde_json::Value)>,
}

/// A GGUF model file's tokenizer, read from its metadata; any other spec as it is.
fn gguf_tokenizer(spec: TokenizerSpec) -> Result<TokenizerSpec> {
    let TokenizerSpec::Model(path) = &spec else {
        return Ok(spec);
    };
    if !(path.is_file() && crate::gguf::is_gguf(path)) {
        return Ok(spec);
    }
    let tokenizer = crate::gguf::GgufModel::open(path)?.tokenizer()?;
    Ok(match tokenizer.hf() {
        Some(t) => TokenizerSpec::Files(Box::new(t.files().clone())),
        None => TokenizerSpec::Gpt2,
    })
}

pub fn run(args: PrepareArgs) -> Result<()> {
    crate::fault::init()?;
    let opts = PrepareOptions {
        tokenizer: gguf_tokenizer(args.tokenizer)?,
        val_fraction: args.val_fraction,
        text_column: args.text_column.clone(),
        format: args.format,
        template_variables: args.template_vars.iter().cloned().collect(),
        ..PrepareOptions::new(args.source, args.out)
    };
    let summary = match opts.source.starts_with(hub::PREFIX) {
        true => {
            let env = crate::hub::HubEnv::from_process_env();
            let files = hub::parquet_files(&opts.source, &args.split, &env)?;
            let source = Source::parquet_as(files, &opts.text_column, opts.format)?;
            prepare_source(&source, &opts)?
        }
        false => prepare(&opts)?,
    };
    crate::outln!("{summary}");
    Ok(())
}
