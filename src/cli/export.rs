//! `nanogpt export --from OUT_DIR --to HF_DIR`: a trained model as a Hugging Face
//! GPT-2 model directory.

use crate::hf::export;
use crate::model_source::{load_adapters, load_model_with_adapter};
use anyhow::{bail, Result};
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
    /// A PEFT LoRA adapter directory to merge into the model first.
    #[arg(long, conflicts_with = "adapter_only")]
    pub adapter: Option<PathBuf>,
    /// For a LoRA run: write only its adapters, as a PEFT adapter directory
    /// (adapter_config.json, adapter_model.safetensors) for its base model.
    #[arg(long)]
    pub adapter_only: bool,
}

pub fn run(args: ExportArgs) -> Result<()> {
    crate::fault::init()?;
    if args.adapter_only {
        return export_adapter(&args);
    }
    let loaded = load_model_with_adapter(&args.from, args.adapter.as_deref())?;
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

/// `--adapter-only`: a LoRA run's adapters as a PEFT adapter directory.
fn export_adapter(args: &ExportArgs) -> Result<()> {
    let (state, _, layout, weights) = load_adapters(&args.from)?;
    if state.base == "scratch" {
        bail!(
            "the LoRA adapters of {} were trained on a randomly initialised base \
             (init_from=scratch), which PEFT cannot rebuild, so no PEFT model could load them; \
             export the whole model instead: nanogpt export --from {} --to DIR",
            args.from,
            args.from
        );
    }
    let files = crate::hf::adapter::write_adapter(&args.to, &state, &layout, &weights)?;
    crate::outln!(
        "exported the LoRA adapters of {} (rank {}, alpha {}, on {}) to {}: {}",
        args.from,
        state.config.rank,
        state.config.alpha,
        state.config.targets.join(", "),
        args.to.display(),
        files.join(", ")
    );
    crate::outln!(
        "load it with: PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(\"{}\"), \"{}\")",
        state.base,
        args.to.display()
    );
    Ok(())
}
