//! `nanogpt sample`: generate text from a trained model, streamed as it comes.

use crate::console::exit_if_closed;
use crate::data::{Meta, Tokenizer};
use crate::model::{ModelConfig, ParamLayout};
use crate::model_source::load_model_with_adapter;
use crate::sample::{generate, SampleOptions};
use crate::train::Trainer;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

/// nanoGPT sample.py's defaults.
#[derive(Args, Debug)]
pub struct SampleArgs {
    /// The training run to sample from.
    #[arg(long, default_value = "out")]
    pub out_dir: PathBuf,
    /// Another model source instead of --out-dir.
    #[arg(long, conflicts_with = "out_dir")]
    pub init_from: Option<String>,
    /// A PEFT LoRA adapter directory to merge into the model (its base).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// The prompt, or FILE:path to read it from a file.
    #[arg(long, default_value = "\n")]
    pub start: String,
    #[arg(long, default_value_t = 10)]
    pub num_samples: usize,
    #[arg(long, default_value_t = 500)]
    pub max_new_tokens: usize,
    /// Below 1 sharpens the distribution, above 1 flattens it; 0 is greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 keeps all).
    #[arg(long, default_value_t = 200)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

pub fn run(args: SampleArgs) -> Result<()> {
    crate::threads::init_pool(args.threads, 1)?;
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!(
            "--temperature must be 0 or more (0 is greedy), got {}",
            args.temperature
        );
    }
    let src = args
        .init_from
        .clone()
        .unwrap_or_else(|| args.out_dir.to_string_lossy().into_owned());
    let loaded = load_model_with_adapter(&src, args.adapter.as_deref())?;
    let prompt = read_prompt(&args.start)?;
    let opts = SampleOptions {
        num_samples: args.num_samples,
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: (args.top_k > 0).then_some(args.top_k),
        seed: args.seed,
    };
    let layout = ParamLayout::new(&loaded.config);
    stream(
        &loaded.params,
        &layout,
        &loaded.config,
        &loaded.meta,
        &prompt,
        &opts,
    )
}

/// Prints a short sample from the model being trained (the quick start's finale).
pub fn print_sample(trainer: &mut Trainer, max_new_tokens: usize) -> Result<()> {
    let opts = SampleOptions {
        num_samples: 1,
        max_new_tokens,
        temperature: 0.8,
        top_k: Some(200),
        seed: trainer.cfg.seed,
    };
    let m = &trainer.model;
    let prompt = closing_prompt(&trainer.meta)?;
    // With LoRA, the base with the adapters merged in.
    stream(
        &m.merged_params(),
        m.base_layout(),
        m.config(),
        &trainer.meta,
        &prompt,
        &opts,
    )
}

/// The closing sample's prompt: a newline, as nanoGPT's sample.py starts, or where
/// the vocabulary has none (a character set without `\n`), its first character.
fn closing_prompt(meta: &Meta) -> Result<String> {
    let tokenizer = Tokenizer::from_meta(meta)?;
    if tokenizer
        .encode_prompt("\n")
        .is_ok_and(|ids| !ids.is_empty())
    {
        return Ok("\n".into());
    }
    let first = tokenizer.decode(&[0]);
    Ok(first)
}

/// Generates all samples in one batch; the first is streamed token by token, the
/// others are printed when done.
fn stream(
    params: &[f32],
    layout: &ParamLayout,
    config: &ModelConfig,
    meta: &Meta,
    prompt: &str,
    opts: &SampleOptions,
) -> Result<()> {
    let tokenizer = Tokenizer::from_meta(meta)?;
    let ids = tokenizer
        .encode_prompt(prompt)
        .context("cannot encode the prompt")?;
    if ids.is_empty() {
        bail!("the prompt is empty after tokenisation; pass some text with --start");
    }
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= config.vocab_size) {
        bail!(
            "the prompt encodes to token {id}, beyond this model's vocabulary of {}; use a prompt the model's tokenizer covers",
            config.vocab_size
        );
    }
    // The samples are this command's product: a reader that has gone (`| head`) ends
    // the command at once, quietly (console::exit_if_closed).
    let mut out = std::io::stdout().lock();
    let mut print = |text: &str| exit_if_closed(write!(out, "{text}").and_then(|()| out.flush()));
    print(prompt)?;
    let mut live = tokenizer.stream_decoder();
    let mut streamed = Ok(());
    let samples = generate(params, layout, config, &ids, opts, |sample, token| {
        if sample == 0 && streamed.is_ok() {
            streamed = print(&live.push(token));
        }
    });
    streamed?;
    print(&format!("{}\n", live.finish()))?;
    for rest in samples.iter().skip(1) {
        print(&format!(
            "---------------\n{prompt}{}\n",
            tokenizer.decode(rest)
        ))?;
    }
    if samples.len() > 1 {
        print("---------------\n")?;
    }
    Ok(())
}

/// The `--start` text, or the contents of the file it names as `FILE:path`.
fn read_prompt(start: &str) -> Result<String> {
    match start.strip_prefix("FILE:") {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the prompt file {path} (must be UTF-8 text)")),
        None => Ok(start.to_string()),
    }
}
