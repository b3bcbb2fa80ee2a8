//! `nanogpt serve --init-from SRC`: an OpenAI-compatible HTTP API for one model.

use crate::chat::ChatFormat;
use crate::cli::chat::TemplateArg;
use crate::model_source::load_model_with_adapter;
use crate::serve::{serve, ServeOptions};
use anyhow::{Context, Result};
use clap::Args;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A training run's out_dir, a Hugging Face model directory or name (gpt2, ...),
    /// or a .safetensors file.
    #[arg(long)]
    pub init_from: String,
    /// A PEFT LoRA adapter directory to merge into the model (its base).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// The address to listen on: loopback unless told otherwise (0.0.0.0 for every
    /// interface, with --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// 0 picks a free port (printed at start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every request but /health (default:
    /// the NANOGPT_API_KEY environment variable, which other users cannot see in
    /// the process list).
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model's name in /v1/models and in responses (default: the last part of
    /// --init-from).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Requests that may wait while the model works on another; more get 503.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// The chat template of /v1/chat/completions (the one the model was fine-tuned
    /// with).
    #[arg(long, default_value = "chat")]
    pub template: TemplateArg,
    /// Precision of the weight matrices: float32, or bfloat16 (their f32 copies
    /// freed: half the bytes per token and half the memory; activations stay f32).
    #[arg(long, default_value = "float32", value_parser = clap::builder::PossibleValuesParser::new(crate::model::Dtype::NAMES))]
    pub dtype: String,
    /// With --dtype bfloat16: the kernel of a prompt's bf16 products (auto: the
    /// fastest this CPU has; amx, avx512bf16, onednn or f32 ask for one).
    #[arg(long, default_value = "auto", value_parser = clap::builder::PossibleValuesParser::new(crate::kernels::bf16::Kernel::REQUEST_NAMES))]
    pub bf16_kernel: String,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

pub fn run(args: ServeArgs) -> Result<()> {
    crate::threads::init_pool(args.threads, 1)?;
    let model = load_model_with_adapter(&args.init_from, args.adapter.as_deref())
        .with_context(|| format!("cannot load the model {}", args.init_from))?;
    let model_name = args
        .model_name
        .clone()
        .unwrap_or_else(|| default_name(&args.init_from));
    let opts = ServeOptions {
        addr: SocketAddr::new(args.host, args.port),
        model_name,
        api_key: args
            .api_key
            .or_else(|| crate::tuning::env::get().api_key.clone())
            .filter(|k| !k.is_empty()),
        queue: args.queue,
        bf16: (args.dtype == "bfloat16").then(|| super::bf16_backend(&args.bf16_kernel)),
        template: match args.template {
            TemplateArg::Chat if model.tokenizer.chat_template().is_some() => ChatFormat::Model,
            TemplateArg::Chat => ChatFormat::Chat,
            TemplateArg::Alpaca => ChatFormat::Alpaca,
        },
    };
    serve(model, opts)
}

/// `out/ckpt.safetensors` → `out`; `models/gpt2/` → `gpt2`; `gpt2` → `gpt2`.
fn default_name(src: &str) -> String {
    let path = Path::new(src.trim_end_matches('/'));
    let path = match path.extension().is_some_and(|e| e == "safetensors") {
        true => path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(path),
        false => path,
    };
    path.file_name()
        .map_or_else(|| src.to_string(), |n| n.to_string_lossy().into_owned())
}
