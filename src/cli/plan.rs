//! `nanogpt plan [CONFIG.toml] [key=value ...] [--world-size N] [--json]`.

use crate::config::TrainConfig;
use crate::plan::{self, MemoryPlan, PlanInput};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::Path;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A TOML config and `key=value` overrides, as `train` takes them.
    #[arg(value_name = "CONFIG.toml | key=value")]
    pub args: Vec<String>,
    /// Ranks of the run.
    #[arg(long, default_value_t = 1)]
    pub world_size: usize,
    /// Ranks sharing one host's memory (default: 1).
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub json: bool,
}

/// Prints the plan; fails (exit 1) when the run would not fit, as `train` would.
pub fn run(args: PlanArgs) -> Result<()> {
    if args.world_size == 0 || args.ranks_per_host == 0 {
        bail!("--world-size and --ranks-per-host must be at least 1");
    }
    if args.ranks_per_host > args.world_size {
        bail!(
            "--ranks-per-host {} is more than the {} ranks of the job (--world-size); give \
             the ranks that share one host, at most --world-size",
            args.ranks_per_host,
            args.world_size
        );
    }
    let (config_path, overrides) = match args.args.first() {
        Some(first) if !first.contains('=') => (Some(first.as_str()), &args.args[1..]),
        _ => (None, &args.args[..]),
    };
    let cfg = match config_path {
        Some(path) => TrainConfig::load(Some(Path::new(path)), overrides)?,
        None => TrainConfig::quick_start_with(overrides)?,
    };
    cfg.check_world_size(args.world_size)?;
    let model = plan::model_of(&cfg)?;
    if !cfg.adapter.is_empty() && cfg.init() != crate::config::InitFrom::Resume {
        // The adapter's own settings decide what is trained: one that cannot be read
        // would be planned as a full fine-tune.
        crate::hf::adapter::read_adapter(Path::new(&cfg.adapter), &model)
            .with_context(|| format!("adapter={}: cannot load the LoRA adapter", cfg.adapter))?;
    }
    let backend = super::bf16_backend(&cfg.bf16_kernel);
    let input = PlanInput::of(&cfg, model, args.world_size, args.ranks_per_host, &backend);
    let memory = MemoryPlan::new(&input, plan::available()?);
    let refusal = plan::refusal(&memory, &input, cfg.gradient_accumulation_steps);
    if args.json {
        println!("{}", serde_json::to_string(&memory)?);
    } else {
        for line in memory.summary() {
            println!("{line}");
        }
        for r in &memory.ranks {
            match r.rank {
                0 => println!("rank 0:"),
                n => println!("other ranks (the largest, rank {n}):"),
            }
            // The frozen base only exists with LoRA.
            for p in r
                .parts
                .iter()
                .filter(|p| p.name != plan::FROZEN || p.bytes > 0)
                .filter(|p| p.name != plan::MPI_REDUCE || p.bytes > 0)
            {
                println!("  {:<24} {:>10.1} MB", p.name, p.bytes as f64 / 1e6);
            }
            println!("  {:<24} {:>10.1} MB", "peak", r.peak_rss_mb);
        }
    }
    match refusal {
        Some(msg) => bail!(msg),
        None => Ok(()),
    }
}
