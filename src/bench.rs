//! `nanogpt bench`: time training steps (forward, backward, clipping, AdamW) on
//! synthetic tokens, and report ms/step, tokens/s, MFU and peak RSS.

use crate::dist::{clip_and_step, Single, StepSettings};
use crate::kernels::matmul::{matmul, Mat};
use crate::model::lora::LoraConfig;
use crate::model::Dtype;
use crate::model::{Gpt, ModelConfig};
use crate::optim::{AdamW, AdamWConfig};
use serde::Serialize;
use std::time::Instant;

/// What to time.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub model: ModelConfig,
    pub batch_size: usize,
    pub block_size: usize,
    /// Timed steps (after `warmup` untimed ones).
    pub steps: usize,
    pub warmup: usize,
    /// The FLOP/s that count as 100 % MFU; `None` measures this machine's f32 GEMM peak.
    pub peak_gflops: Option<f64>,
    /// Time the step by kernel family (see [`crate::profile`]).
    pub profile: bool,
    /// Matmul precision (bfloat16: autocast, see [`Gpt::set_dtype`]).
    pub dtype: Dtype,
    /// Train LoRA adapters on the frozen model instead of the whole model.
    pub lora: Option<LoraConfig>,
    /// Keep only each block's input; backward recomputes the rest.
    pub activation_checkpointing: bool,
}

/// What was measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub dtype: Dtype,
    pub activation_checkpointing: bool,
    pub threads: usize,
    pub batch_size: usize,
    pub block_size: usize,
    pub params: usize,
    /// Parameters trained: all of them, or with LoRA the adapters'.
    pub trained_params: usize,
    /// Median over the timed steps.
    pub ms_per_step: f64,
    pub ms_per_step_min: f64,
    /// Mean over the timed steps: what the profile rows (means too) add up to.
    pub ms_per_step_mean: f64,
    pub tokens_per_sec: f64,
    /// Training FLOPs per token (6·N + 12·L·C·T).
    pub flops_per_token: f64,
    pub achieved_gflops: f64,
    pub peak_gflops: f64,
    pub mfu: f64,
    pub peak_rss_mb: f64,
    pub activation_mb: f64,
    /// With `profile`: (kernel family, ms per step), largest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<(&'static str, f64)>,
}

/// Runs the benchmark in the current rayon pool.
pub fn run(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    let (b, t) = (opts.batch_size, opts.block_size);
    let mut gpt = Gpt::new(opts.model.clone(), b, t)?;
    gpt.init_gpt2(1337);
    if let Some(lora) = &opts.lora {
        gpt = gpt.with_lora(lora.clone(), ("scratch", 1337), 1337);
    }
    gpt.set_activation_checkpointing(opts.activation_checkpointing);
    gpt.set_dtype(opts.dtype);
    let mut opt = AdamW::new(&gpt.layout, AdamWConfig::default());
    let v = opts.model.vocab_size;
    let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7919 % v) as u32).collect();
    let targets: Vec<i32> = (0..b * t).map(|i| ((i + 1) * 7919 % v) as i32).collect();
    let mut times = Vec::with_capacity(opts.steps);
    for step in 0..opts.warmup + opts.steps {
        if step == opts.warmup && opts.profile {
            crate::profile::enable();
        }
        let start = Instant::now();
        {
            let _t = crate::profile::scope(crate::profile::Section::ZeroGrad);
            gpt.zero_grad();
        }
        let loss = gpt.forward(&inputs, &targets, b, t);
        gpt.backward();
        let settings = StepSettings {
            lr: 1e-4,
            grad_clip: 1.0,
        };
        clip_and_step(
            None,
            &Single,
            &mut gpt,
            &mut opt,
            settings,
            loss.is_finite(),
        );
        gpt.sync_bf16_weights();
        if step >= opts.warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens_per_sec = (b * t) as f64 / (median / 1e3);
    let flops_per_token = gpt.flops_per_token(t);
    let achieved = tokens_per_sec * flops_per_token / 1e9;
    let profile = crate::profile::totals()
        .into_iter()
        .map(|(name, secs)| (name, secs * 1e3 / opts.steps as f64))
        .collect();
    let peak = opts.peak_gflops.unwrap_or_else(gemm_peak_gflops);
    Ok(BenchReport {
        dtype: opts.dtype,
        activation_checkpointing: opts.activation_checkpointing,
        threads: rayon::current_num_threads(),
        batch_size: b,
        block_size: t,
        params: opts.model.num_params(),
        trained_params: gpt.layout.tensors.iter().map(|t| t.numel()).sum(),
        ms_per_step: median,
        ms_per_step_min: times[0],
        ms_per_step_mean: times.iter().sum::<f64>() / times.len() as f64,
        tokens_per_sec,
        flops_per_token,
        achieved_gflops: achieved,
        peak_gflops: peak,
        mfu: achieved / peak,
        peak_rss_mb: peak_rss_bytes().map_or(f64::NAN, |r| r as f64 / 1e6),
        activation_mb: gpt.activation_bytes() as f64 / 1e6,
        profile,
    })
}

/// Best of three 2048³ f32 GEMMs through the same library the model uses: the
/// machine's practical matmul peak, in GFLOP/s.
pub fn gemm_peak_gflops() -> f64 {
    gemm_peak(2048)
}

/// A quicker estimate from 1024³ GEMMs (a few tenths of a second), for MFU in logs.
pub fn gemm_peak_gflops_quick() -> f64 {
    gemm_peak(1024)
}

/// Best GFLOP/s of repeated `n³` products: at least 3 and at most 12 of them, for
/// about half a second, so one that a busy neighbour slowed does not set the peak.
fn gemm_peak(n: usize) -> f64 {
    let a = vec![1.0f32; n * n];
    let b = vec![0.5f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let started = Instant::now();
    let mut best = 0.0f64;
    for rep in 0..12 {
        if rep >= 3 && started.elapsed().as_secs_f64() > 0.5 {
            break;
        }
        let start = Instant::now();
        matmul(&mut c, Mat::new(&a, n, n), Mat::new(&b, n, n), false);
        best = best.max(2.0 * (n * n * n) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// The process's peak resident set size (Linux `VmHWM`), if the OS tells.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
