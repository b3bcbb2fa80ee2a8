//! `nanogpt train [CONFIG.toml] [key=value ...]`.

use crate::train::{TrainOutcome, Trainer};
use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A TOML config (nanoGPT's key names), then `key=value` overrides. With no
    /// config, the quick start: a small character-level GPT on the bundled Shakespeare.
    #[arg(value_name = "CONFIG.toml | key=value")]
    pub args: Vec<String>,
}

/// Characters of the sample printed after the quick start.
const QUICK_START_SAMPLE_TOKENS: usize = 300;

/// Trains; returns the process's exit status (0, or 130/143/138 when SIGINT/SIGTERM/SIGUSR1
/// stopped the run after writing a checkpoint).
pub fn run(args: TrainArgs) -> Result<i32> {
    // First, so that every later error can name this rank and abort the job.
    let comm = crate::dist::init()?;
    crate::fault::init()?;
    let (config_path, overrides) = split_args(&args.args);
    // Rank 0 reads the config; every other rank trains with rank 0's.
    let cfg = crate::dist::preflight::shared_config(&*comm, config_path, overrides)?;
    let (root, world) = (comm.rank() == 0, comm.world_size());
    let threads = crate::threads::init_pool(cfg.threads, comm.local_size())?;
    crate::dist::preflight::report_placement(&*comm, threads);
    let launched = crate::dist::launched_by_mpi();
    if let Some(warning) = launched
        .then(|| crate::threads::binding_warning(comm.local_size()))
        .flatten()
    {
        match world {
            1 => crate::errln!("warning: {warning}"),
            _ => crate::errln!("warning: rank {} of {world}: {warning}", comm.rank()),
        }
    }
    if root {
        crate::outln!(
            "training: {} threads, {} tokens per iteration ({} micro-steps × {} × {})",
            threads,
            cfg.tokens_per_iter(),
            cfg.gradient_accumulation_steps,
            cfg.batch_size,
            cfg.block_size
        );
        if world > 1 {
            crate::outln!(
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
        crate::outln!(
            "model: {:.2}M parameters, data: {} train / {} val tokens ({} tokenizer)",
            trainer.model.config().num_params() as f64 / 1e6,
            trainer.meta.train_tokens,
            trainer.meta.val_tokens,
            trainer.meta.tokenizer
        );
        crate::outln!(
            "mfu: against this machine's {} GEMM peak, {:.0} GFLOP/s per rank, measured now",
            trainer.cfg.dtype.as_str(),
            trainer.peak_gflops()
        );
        if trainer.cfg.dtype == crate::model::Dtype::Bfloat16 {
            crate::outln!("bf16 matmuls: {}", trainer.backend.describe());
        }
        if let Some(line) = crate::tuning::announcement() {
            crate::outln!("{line}");
        }
    }
    if !trainer.cfg.eval_only {
        // From here on, SIGINT/SIGTERM/SIGUSR1 end the run at a step boundary with a checkpoint.
        crate::shutdown::install()?;
    }
    let outcome = trainer.run()?;
    if outcome.already_complete {
        // Said when the checkpoint was opened; exit 0, so that a requeue loop ends.
        trainer.wait_for_root();
        return Ok(0);
    }
    if let Some((signal, path)) = &outcome.stopped {
        if root {
            crate::outln!(
                "stopped by {} after iteration {}: checkpoint written to {}; continue with \
                 init_from=resume",
                signal.name(),
                outcome.iter_num - 1,
                path.display()
            );
        }
        // No rank may end before rank 0's checkpoint is on disk: a launcher (Open
        // MPI's) kills the whole job as soon as one rank exits with a failure code.
        trainer.wait_for_root();
        return Ok(signal.exit_code());
    }
    // The quick start (no config file) ends with a sample, but not for a chat model
    // (its tokenizer has a chat template): it is met through `chat`, and text sampled
    // from a newline says little about it and takes long at its sizes.
    let chat_model = trainer.tokenizer().chat_template().is_some();
    let closing_sample = config_path.is_none() && !trainer.cfg.eval_only && !chat_model;
    trainer.gather_final_weights(closing_sample);
    if root {
        report_outcome(&mut trainer, &outcome, closing_sample, chat_model)?;
    }
    trainer.wait_for_root();
    Ok(0)
}

/// Rank 0's closing lines: the last evaluation, the closing sample, the command to try
/// the model with (`chat` for a chat model).
fn report_outcome(
    trainer: &mut Trainer,
    outcome: &TrainOutcome,
    closing_sample: bool,
    chat_model: bool,
) -> Result<()> {
    if let Some(losses) = &outcome.last_eval {
        let loss = |x: f32| match x.is_nan() {
            true => "n/a".to_string(),
            false => format!("{x:.4}"),
        };
        crate::outln!(
            "done: train loss {}, val loss {}",
            loss(losses.train),
            loss(losses.val)
        );
    }
    for report in &outcome.last_tasks {
        crate::outln!("done: {}", report.summary());
    }
    if closing_sample {
        crate::outln!("\nA sample from the trained model:\n");
        super::sample::print_sample(trainer, QUICK_START_SAMPLE_TOKENS)?;
    }
    let out_dir = outcome.out_dir.display();
    match chat_model {
        true => crate::outln!("\nchat with it: {} chat --out-dir {out_dir}", invoked_as()),
        false => crate::outln!(
            "\nsample more with: {} sample --out-dir {out_dir}",
            invoked_as()
        ),
    }
    Ok(())
}

/// The config file (a first argument that is not `key=value`) and the overrides.
pub(super) fn split_args(args: &[String]) -> (Option<&str>, &[String]) {
    match args.first() {
        Some(first) if !first.contains('=') => (Some(first.as_str()), &args[1..]),
        _ => (None, args),
    }
}

/// The binary as the user invoked it (`nanogpt`, `./nanogpt`,
/// `target/release/nanogpt`), so that a hint can be pasted; quoted if needed.
pub fn invoked_as() -> String {
    let arg0 = std::env::args_os()
        .next()
        .map(|a| a.to_string_lossy().into_owned())
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| "nanogpt".into());
    if arg0
        .chars()
        .any(|c| c.is_whitespace() || "'\"$`\\".contains(c))
    {
        format!("'{}'", arg0.replace('\'', "'\\''"))
    } else {
        arg0
    }
}
