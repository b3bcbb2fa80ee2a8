//! `nanogpt export --from OUT_DIR --to HF_DIR`: a trained model as a Hugging Face
//! model directory (GPT-2, or the Llama family it came from); `--to FILE.gguf`: a GPT-2
//! or a Llama-family model (llama, mistral, qwen2, qwen3) as a GGUF file for llama.cpp
//! and Ollama.

use crate::gguf::{ExportOptions, OutType};
use crate::hf::export;
use crate::model::lora::LoraState;
use crate::model_source::{load_adapters, load_model_with_adapter, LoadedModel};
use anyhow::{bail, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A training run's out_dir (or any model --init-from accepts: a Hugging Face
    /// model directory, a .safetensors file, gpt2, ...).
    #[arg(long)]
    pub from: String,
    /// The Hugging Face model directory to write (new, empty, or a previous export),
    /// or a GGUF file (a path ending in .gguf: new, or a previous export).
    #[arg(long)]
    pub to: PathBuf,
    /// GGUF only: how the weights are stored, as llama.cpp's converter names it:
    /// f32, f16 (default), bf16 or q8_0. Norms, biases and the position table stay
    /// f32.
    #[arg(long)]
    pub outtype: Option<OutType>,
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
    let gguf = is_gguf_path(&args.to);
    if args.outtype.is_some() && !gguf {
        bail!(
            "--outtype applies to GGUF files: give --to a path ending in .gguf, or leave \
             --outtype out for a Hugging Face folder"
        );
    }
    if args.adapter_only {
        return export_adapter(&args);
    }
    let loaded = load_model_with_adapter(&args.from, args.adapter.as_deref())?;
    if gguf {
        return export_gguf(&args, &loaded);
    }
    let summary = export(
        &loaded.params,
        &loaded.config,
        Some(&loaded.tokenizer),
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
        c.context_length(),
        summary.dir.display(),
        summary.files.join(", ")
    );
    if loaded.meta.tokenizer == crate::data::TokenizerKind::Char {
        crate::outln!(
            "note: the model uses a {} tokenizer, which Hugging Face's GPT-2 has no files for: \
             the weights load, but encode text yourself (meta.json of the dataset lists the vocabulary)",
            loaded.meta.tokenizer
        );
    }
    crate::outln!(
        "load it with: AutoModelForCausalLM.from_pretrained(\"{}\")",
        summary.dir.display()
    );
    Ok(())
}

/// `--adapter-only`: a LoRA run's adapters as a PEFT adapter directory, or as a
/// GGUF adapter file for llama.cpp's `--lora`.
fn export_adapter(args: &ExportArgs) -> Result<()> {
    let (state, model, layout, weights) = load_adapters(&args.from)?;
    if is_gguf_path(&args.to) {
        let outtype = args.outtype.unwrap_or(OutType::F16);
        let name = format!("{} LoRA", gguf_name(args));
        let out = crate::gguf::adapter::write_adapter(
            &args.to, &model, &state, &layout, &weights, outtype, &name,
        )?;
        crate::outln!(
            "exported {} to {} ({outtype}, {:.1} MB)",
            adapters_of(args, &state),
            out.path.display(),
            out.bytes as f64 / 1e6
        );
        let base = match state.base.as_str() {
            "scratch" => "BASE.gguf".to_string(),
            name => name.to_string(),
        };
        crate::outln!(
            "run it with: llama-cli -m {base} --lora {} (the base as GGUF: nanogpt export --from \
             BASE --to BASE.gguf)",
            out.path.display()
        );
        return Ok(());
    }
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
        "exported {} to {}: {}",
        adapters_of(args, &state),
        args.to.display(),
        files.join(", ")
    );
    crate::outln!(
        "load it with: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(\"{}\"), \"{}\")",
        state.base,
        args.to.display()
    );
    Ok(())
}

/// What `--adapter-only` exports, as its messages name it: "the LoRA adapters of FROM
/// (rank R, alpha A, on TARGETS)".
fn adapters_of(args: &ExportArgs, state: &LoraState) -> String {
    let c = &state.config;
    format!(
        "the LoRA adapters of {} (rank {}, alpha {}, on {})",
        args.from,
        c.rank,
        c.alpha,
        c.targets.join(", ")
    )
}

/// Whether `to` names a GGUF file rather than a folder.
fn is_gguf_path(to: &Path) -> bool {
    to.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The model as one GGUF file (see [`crate::gguf::model`]).
fn export_gguf(args: &ExportArgs, loaded: &LoadedModel) -> Result<()> {
    let started = Instant::now();
    let outtype = args.outtype.unwrap_or(OutType::F16);
    let source = Path::new(&args.from);
    // A GGUF source's chat template travels with the weights.
    let template = match crate::gguf::is_gguf(source) && source.is_file() {
        true => crate::gguf::GgufModel::open(source)?
            .chat_template()
            .map(str::to_string),
        false => None,
    };
    let name = gguf_name(args);
    let opts = ExportOptions {
        outtype,
        name: &name,
        tokenizer: &loaded.tokenizer,
        chat_template: template.as_deref(),
    };
    let out = crate::gguf::model::export(&loaded.params, &loaded.config, &opts, &args.to)?;
    let c = &loaded.config;
    crate::outln!(
        "exported {} ({} parameters: {} layers, {} heads, {} wide, vocabulary {}, context {}) to \
         {} ({outtype}, {:.1} MB, {} tensors) in {:.1} s",
        args.from,
        out.parameters,
        c.n_layer,
        c.n_head,
        c.n_embd,
        c.vocab_size,
        c.context_length(),
        out.path.display(),
        out.bytes as f64 / 1e6,
        out.tensors,
        started.elapsed().as_secs_f64()
    );
    crate::outln!(
        "run it with: llama-cli -m {} (llama.cpp), or in Ollama with a Modelfile `FROM {}`",
        out.path.display(),
        out.path.display()
    );
    Ok(())
}

/// `general.name` of an export: the source's folder or file name.
fn gguf_name(args: &ExportArgs) -> String {
    Path::new(&args.from)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| args.from.clone())
}
