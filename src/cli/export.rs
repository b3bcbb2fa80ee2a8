//! `nanogpt export --from OUT_DIR --to HF_DIR`: a trained model as a Hugging Face
//! GPT-2 model directory.

use crate::hf::export;
use crate::model_source::load_model;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A training run's out_dir (or any model --init-from accepts: a Hugging Face
    /// model directory, a .safetensors file, gpt2, ...).
    #[arg(long)]
    pub from: String,
    /// The Hugging Face model directory to write (new, empty, or a previous export).
    #[arg(long)]
    pub to: PathBuf,
}

pub fn run(args: ExportArgs) -> Result<()> {
    crate::fault::init()?;
    let loaded = load_model(&args.from)?;
    let summary = export(
        &loaded.params,
        &loaded.config,
        Some(loaded.meta.tokenizer),
        &args.to,
    )?;
    let c = &loaded.config;
    crate::outln!(
        "exported {} ({} parameters: {} layers, {} heads, {} wide, vocabulary {}, context {}) to {}: {}",
        args.from,
        summary.parameters,
        c.n_layer,
        c.n_head,
        c.n_embd,
        c.vocab_size,
        c.block_size,
        summary.dir.display(),
        summary.files.join(", ")
    );
    if loaded.meta.tokenizer != crate::data::TokenizerKind::Gpt2 {
        crate::outln!(
            "note: the model uses a {} tokenizer, which Hugging Face's GPT-2 has no files for: \
             the weights load, but encode text yourself (meta.json of the dataset lists the vocabulary)",
            loaded.meta.tokenizer
        );
    }
    crate::outln!(
        "load it with: GPT2LMHeadModel.from_pretrained(\"{}\")",
        summary.dir.display()
    );
    Ok(())
}
