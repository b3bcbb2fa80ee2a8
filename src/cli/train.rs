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
    // First, so that every later error can name this rank and abort the job.
    let comm = crate::dist::init()?;
    let (config_path, overrides) = split_args(&args.args);
    let cfg = match config_path {
        Some(path) => TrainConfig::load(Some(Path::new(path)), overrides)?,
        None => TrainConfig::quick_start_with(overrides)?,
    };
    let (root, world) = (comm.rank() == 0, comm.world_size());
    let threads = crate::threads::init_pool(match cfg.threads {
        0 => crate::dist::default_threads(comm.local_size()),
        n => n,
    });
    let launched = crate::dist::launched_by_mpi();
    if let Some(warning) = launched
        .then(|| crate::dist::binding_warning(comm.local_size()))
        .flatten()
    {
        match world {
            1 => eprintln!("warning: {warning}"),
            _ => eprintln!("warning: rank {} of {world}: {warning}", comm.rank()),
        }
    }
    if root {
        println!(
            "training: {} threads, {} tokens per iteration ({} micro-steps × {} × {})",
            threads,
            cfg.tokens_per_iter(),
            cfg.gradient_accumulation_steps,
            cfg.batch_size,
            cfg.block_size
        );
        if world > 1 {
            println!(
                "data parallel: {world} ranks ({}), {} micro-steps each, {} threads per rank \
                 on this host, ZeRO stage {}",
                comm.describe(),
                cfg.gradient_accumulation_steps / world,
                threads,
                cfg.zero_stage
            );
        }
    }
    let mut trainer = Trainer::with_collective(cfg, comm)?;
    if root {
        println!(
            "model: {:.2}M parameters, data: {} train / {} val tokens ({} tokenizer)",
            trainer.model.config.num_params() as f64 / 1e6,
            trainer.meta.train_tokens,
            trainer.meta.val_tokens,
            trainer.meta.tokenizer
        );
        if trainer.cfg.dtype == crate::config::Dtype::Bfloat16 {
            println!("bf16 matmuls: {}", crate::kernels::bf16_gemm::path());
        }
    }
    let outcome = trainer.run()?;
    if !root {
        return Ok(());
    }
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
