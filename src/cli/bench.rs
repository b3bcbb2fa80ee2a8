//! `nanogpt bench`.

use crate::bench::{
    run as run_bench, run_sample as run_sample_bench_with, BenchOptions, SampleBenchOptions,
};
use crate::model::Dtype;
use crate::model::ModelConfig;
use anyhow::{bail, Context};
use clap::Args;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl), or a Hugging Face
    /// model directory or its config.json (any family nanogpt loads: its
    /// architecture, with weights initialised here).
    #[arg(long, default_value = "gpt2")]
    pub model: String,
    /// Architecture overrides, e.g. `n_layer=4 n_embd=128 n_head=4 vocab_size=65`,
    /// `activation_checkpointing=true`, and LoRA: `lora_rank=8 lora_alpha=16
    /// lora_targets=c_attn` (adapters trained, the model frozen).
    pub overrides: Vec<String>,
    #[arg(long, default_value_t = 4)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 256)]
    pub block_size: usize,
    /// Timed steps; the median is reported.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Matmul precision: float32, or bfloat16 (autocast: bf16 operands, f32
    /// accumulation, f32 master weights and optimizer state).
    #[arg(long, default_value = "float32", value_parser = clap::builder::PossibleValuesParser::new(Dtype::NAMES))]
    pub dtype: String,
    /// With --dtype bfloat16: the kernel of the bf16 products (auto: the fastest this
    /// CPU has; amx, avx512bf16, onednn or f32 ask for one, as `bf16_kernel` does).
    #[arg(long, default_value = "auto", value_parser = clap::builder::PossibleValuesParser::new(crate::kernels::bf16::Kernel::REQUEST_NAMES))]
    pub bf16_kernel: String,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// GFLOP/s counted as 100 % MFU (default: measure this machine's GEMM peak in the
    /// precision that runs, --dtype, with the kernel its matmuls use).
    #[arg(long)]
    pub peak_gflops: Option<f64>,
    /// Also report the time per step of each kernel family.
    #[arg(long)]
    pub profile: bool,
    /// Time `sample`'s greedy generation of this many new tokens instead of training
    /// steps: --batch-size samples, a prompt of --block-size tokens, --steps runs,
    /// --dtype the weights' precision (as `sample --dtype`).
    #[arg(long, value_name = "NEW_TOKENS")]
    pub sample: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The LoRA keys among the overrides (`lora_rank` > 0 turns LoRA on).
fn lora_config(args: &BenchArgs) -> anyhow::Result<Option<crate::model::lora::LoraConfig>> {
    let (mut rank, mut alpha, mut targets) = (0usize, 8.0f32, "c_attn".to_string());
    for (key, value) in args.overrides.iter().filter_map(|kv| kv.split_once('=')) {
        let bad = || format!("{key} must be a number, got '{value}'");
        match key {
            "lora_rank" => rank = value.parse().with_context(bad)?,
            "lora_alpha" => alpha = value.parse().with_context(bad)?,
            "lora_targets" => targets = value.to_string(),
            _ => {}
        }
    }
    let lora = (rank > 0).then(|| crate::model::lora::LoraConfig::new(rank, alpha, 0.0, &targets));
    lora.transpose()
}

/// The architecture `--model` names: a preset, or a Hugging Face config.json (of a
/// directory, or the file itself) with `block_size` positions.
fn architecture(model: &str, block_size: usize) -> anyhow::Result<ModelConfig> {
    if let Some(preset) = ModelConfig::preset(model) {
        return Ok(preset);
    }
    crate::hf::local_architecture(model, block_size, 0.0).unwrap_or_else(|| {
        bail!(
            "--model {model}: not a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl), nor a \
             Hugging Face model directory or config.json"
        )
    })
}

fn model_config(args: &BenchArgs) -> anyhow::Result<ModelConfig> {
    let mut cfg = architecture(&args.model, args.block_size)?;
    for kv in &args.overrides {
        let (key, value) = kv
            .split_once('=')
            .with_context(|| format!("'{kv}' is not key=value (e.g. n_layer=4)"))?;
        let num = || -> anyhow::Result<usize> {
            value
                .parse()
                .with_context(|| format!("{key} must be a whole number, got '{value}'"))
        };
        match key {
            "n_layer" => cfg.n_layer = num()?,
            "n_head" => cfg.n_head = num()?,
            "n_embd" => cfg.n_embd = num()?,
            "vocab_size" => cfg.vocab_size = num()?,
            "bias" => cfg.bias = parse_bool(key, value)?,
            "activation_checkpointing" => {
                parse_bool(key, value)?;
            }
            "lora_rank" | "lora_alpha" | "lora_targets" => {}
            _ => bail!(
                "unknown key '{key}': use n_layer, n_head, n_embd, vocab_size, bias, \
                 activation_checkpointing, lora_rank, lora_alpha or lora_targets"
            ),
        }
    }
    cfg.block_size = cfg.block_size.max(args.block_size);
    cfg.validate()?;
    Ok(cfg)
}

fn parse_bool(key: &str, value: &str) -> anyhow::Result<bool> {
    value
        .parse()
        .with_context(|| format!("{key} must be true or false, got '{value}'"))
}

/// `activation_checkpointing=...` among the overrides (checked by [`model_config`]).
fn checkpointing(args: &BenchArgs) -> anyhow::Result<bool> {
    let mut on = false;
    for kv in &args.overrides {
        if let Some(("activation_checkpointing", value)) = kv.split_once('=') {
            on = parse_bool("activation_checkpointing", value)?;
        }
    }
    Ok(on)
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.steps == 0 || args.batch_size == 0 || args.block_size == 0 {
        bail!("--steps, --batch-size and --block-size must be at least 1");
    }
    crate::threads::init_pool(args.threads, 1)?;
    if let Some(new_tokens) = args.sample {
        return run_sample_bench(&args, new_tokens);
    }
    let opts = BenchOptions {
        model: model_config(&args)?,
        batch_size: args.batch_size,
        block_size: args.block_size,
        steps: args.steps,
        warmup: args.warmup,
        peak_gflops: args.peak_gflops,
        profile: args.profile,
        activation_checkpointing: checkpointing(&args)?,
        dtype: dtype(&args),
        backend: super::bf16_backend(&args.bf16_kernel),
        lora: lora_config(&args)?,
    };
    if opts.dtype == Dtype::Bfloat16 {
        eprintln!("bf16 matmuls: {}", opts.backend.describe());
    }
    if let Some(line) = crate::tuning::announcement() {
        eprintln!("{line}");
    }
    let r = run_bench(&opts)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{} params, {}, B={} T={}, {} threads: {:.1} ms/step (median of {}, min {:.1}), {:.0} tokens/s, \
             {:.1} GFLOP/s = {:.1}% MFU of {:.1} GFLOP/s ({}), peak RSS {:.0} MB, activations {:.0} MB{}",
            r.params, r.dtype.as_str(), r.batch_size, r.block_size, r.threads, r.ms_per_step, args.steps, r.ms_per_step_min,
            r.tokens_per_sec, r.achieved_gflops, 100.0 * r.mfu, r.peak_gflops, peak_source(&r),
            r.peak_rss_mb, r.activation_mb,
            if r.activation_checkpointing { " (checkpointed)" } else { "" }
        );
        if r.mfu > 1.0 {
            eprintln!("note: MFU above 100 %: {}", above_peak_cause(&r));
        }
        print_profile(&r.profile, r.ms_per_step_mean);
    }
    Ok(())
}

fn dtype(args: &BenchArgs) -> Dtype {
    match args.dtype.as_str() {
        "bfloat16" => Dtype::Bfloat16,
        _ => Dtype::Float32,
    }
}

/// Why a step could beat its peak, for the note under the report line.
fn above_peak_cause(r: &crate::bench::BenchReport) -> &'static str {
    match r.peak_gflops_f32 {
        Some(_) => "other work on the machine slowed both probes of the GEMM peak; rerun on a quiet machine or pass --peak-gflops",
        None => "the step ran faster than --peak-gflops; pass this machine's peak",
    }
}

/// Where the MFU's 100 % came from, for the report line.
fn peak_source(r: &crate::bench::BenchReport) -> String {
    match (r.peak_gflops_f32, r.peak_gflops_bf16) {
        (Some(f32), Some(bf16)) => format!(
            "the measured {} GEMM peak; f32 {f32:.0}, bf16 {bf16:.0} GFLOP/s",
            r.dtype.as_str()
        ),
        _ => "--peak-gflops".into(),
    }
}

/// `bench --sample`: greedy generation's prefill and decoding speed.
fn run_sample_bench(args: &BenchArgs, new_tokens: usize) -> anyhow::Result<()> {
    let mut model = model_config(args)?;
    model.block_size = model.block_size.max(args.block_size + new_tokens);
    let r = run_sample_bench_with(&SampleBenchOptions {
        model,
        num_samples: args.batch_size,
        prompt: args.block_size,
        new_tokens,
        runs: args.steps,
        profile: args.profile,
        dtype: dtype(args),
        backend: super::bf16_backend(&args.bf16_kernel),
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "greedy sampling, {} weights, {} sample(s), prompt {} + {} new tokens, {} threads: prefill {:.1} ms \
             ({:.0} tokens/s), decoding {:.2} ms/token ({:.1} tokens/s, {:.0} MB of weights read \
             per step = {:.1} GB/s), peak RSS {:.0} MB",
            r.dtype.as_str(), r.num_samples, r.prompt_tokens, r.new_tokens, r.threads, r.prefill_ms,
            r.prefill_tokens_per_sec, r.decode_ms_per_token, r.decode_tokens_per_sec,
            r.weight_mb_per_step, r.weight_mb_per_step / r.decode_ms_per_token, r.peak_rss_mb
        );
        if r.bf16_copy_ms > 0.0 {
            println!(
                "the bf16 weight copy, made once when the model is loaded (not in the prefill): {:.1} ms",
                r.bf16_copy_ms
            );
        }
        if !r.prefill_profile.is_empty() {
            println!("the last run's prefill, {:.1} ms:", r.last_prefill_ms);
            print_profile(&r.prefill_profile, r.last_prefill_ms);
            println!("its decoding steps:");
        }
        print_profile(&r.profile, r.decode_ms_per_token);
    }
    Ok(())
}

fn print_profile(rows: &[(&str, f64)], step_ms: f64) {
    if rows.is_empty() {
        return;
    }
    // Rows are means over the timed steps (or the one prefill), so they are shares of
    // the mean step.
    println!("{:<24} {:>10} {:>7}", "kernel family", "ms/step", "share");
    for (name, ms) in rows {
        println!("{name:<24} {ms:>10.2} {:>6.1}%", 100.0 * ms / step_ms);
    }
    let covered: f64 = rows.iter().map(|r| r.1).sum();
    println!(
        "{:<24} {:>10.2} {:>6.1}%",
        "(other)",
        step_ms - covered,
        100.0 * (step_ms - covered) / step_ms
    );
}
