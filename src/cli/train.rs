//! `nanogpt train [CONFIG.toml] [key=value ...]`.

use crate::config::TrainConfig;
use crate::train::Trainer;
use anyhow::Result;
use clap::Args;
use std::path::Path;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A TOML config (nanoGPT's key names), then `key=value` overrides. With no
    /// config, the quick start: a small character-level GPT on the bundled Shakespeare.
    #[arg(value_name = "CONFIG.toml | key=value")]
    pub args: Vec<String>,
}

/// Characters of the sample printed after the quick start.
const QUICK_START_SAMPLE_TOKENS: usize = 300;

pub fn run(args: TrainArgs) -> Result<()> {
    let (config_path, overrides) = split_args(&args.args);
    let cfg = match config_path {
        Some(path) => TrainConfig::load(Some(Path::new(path)), overrides)?,
        None => TrainConfig::quick_start_with(overrides)?,
    };
    let threads = crate::threads::init_pool(cfg.threads);
    println!(
        "training: {} threads, {} tokens per iteration ({} micro-steps × {} × {})",
        threads,
        cfg.tokens_per_iter(),
        cfg.gradient_accumulation_steps,
        cfg.batch_size,
        cfg.block_size
    );
    let mut trainer = Trainer::new(cfg)?;
    println!(
        "model: {:.2}M parameters, data: {} train / {} val tokens ({} tokenizer)",
        trainer.model.config.num_params() as f64 / 1e6,
        trainer.meta.train_tokens,
        trainer.meta.val_tokens,
        trainer.meta.tokenizer
    );
    let outcome = trainer.run()?;
    if let Some((train_loss, val_loss)) = outcome.last_eval {
        println!("done: train loss {train_loss:.4}, val loss {val_loss:.4}");
    }
    if config_path.is_none() && !trainer.cfg.eval_only {
        println!("\nA sample from the trained model:\n");
        super::sample::print_sample(&mut trainer, QUICK_START_SAMPLE_TOKENS)?;
    }
    println!(
        "\nsample more with: nanogpt sample --out-dir {}",
        outcome.out_dir.display()
    );
    Ok(())
}

/// The config file (a first argument that is not `key=value`) and the overrides.
fn split_args(args: &[String]) -> (Option<&str>, &[String]) {
    match args.first() {
        Some(first) if !first.contains('=') => (Some(first.as_str()), &args[1..]),
        _ => (None, args),
    }
}
