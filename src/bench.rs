//! `nanogpt bench`: time training steps (forward, backward, clipping, AdamW) on
//! synthetic tokens, and report ms/step, tokens/s, MFU and peak RSS.

use crate::dist::{clip_and_step, Single, StepSettings};
use crate::kernels::bf16::gemm::matmul_bf16;
use crate::kernels::bf16::Backend;
use crate::kernels::mat::{matmul, Mat};
use crate::model::decode::Decoder;
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
    /// The FLOP/s that count as 100 % MFU; `None` measures this machine's GEMM peak
    /// in the precision that runs (`dtype`).
    pub peak_gflops: Option<f64>,
    /// Time the step by kernel family (see [`crate::profile`]).
    pub profile: bool,
    /// Matmul precision (bfloat16: autocast, see [`Gpt::set_dtype`]).
    pub dtype: Dtype,
    /// The kernel of the bf16 products.
    pub backend: Backend,
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
    /// What counts as 100 % MFU: `--peak-gflops`, or the measured peak of `dtype`'s
    /// GEMM (one of the two below).
    pub peak_gflops: f64,
    /// This machine's measured GEMM peaks, f32 and bf16 (the latter through
    /// `matmul_bf16`, the kernel bf16 runs use), in this run's threads; `None` (not
    /// measured) when `--peak-gflops` was given.
    pub peak_gflops_f32: Option<f64>,
    pub peak_gflops_bf16: Option<f64>,
    /// `achieved_gflops / peak_gflops`.
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
    // The peaks are probed before and after the timed steps and the better kept: on a
    // shared machine one probe alone can meet a busy moment and make MFU exceed 100 %.
    let probe = || {
        let measure = opts.peak_gflops.is_none();
        let f32 = measure.then(|| gemm_peak_gflops(Dtype::Float32, &opts.backend));
        (
            f32,
            measure.then(|| gemm_peak_gflops(Dtype::Bfloat16, &opts.backend)),
        )
    };
    let before = probe();
    let mut gpt = Gpt::new(opts.model.clone(), b, t)?;
    gpt.init_gpt2(1337);
    if let Some(lora) = &opts.lora {
        lora.check(&opts.model)?;
        gpt = gpt.with_lora(lora.clone(), ("scratch", 1337), 1337);
    }
    gpt.set_activation_checkpointing(opts.activation_checkpointing);
    // One micro-step per optimizer step, as timed (`Gpt::set_micro_steps`).
    gpt.set_micro_steps(1);
    // As `train` holds a LoRA base (`Gpt::release_frozen_linears`).
    gpt.release_frozen_linears();
    gpt.set_dtype(opts.dtype, &opts.backend);
    let mut opt = AdamW::new(&gpt.layout.decay_ranges(), AdamWConfig::default());
    let v = opts.model.vocab_size;
    let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7919 % v) as u32).collect();
    let targets: Vec<i32> = (0..b * t).map(|i| ((i + 1) * 7919 % v) as i32).collect();
    let mut times = Vec::with_capacity(opts.steps);
    // As in training: an applied step's fused AdamW pass zeroes the gradients and
    // refreshes the bf16 copy; a skipped one leaves both to be done here.
    let mut fused = false;
    for step in 0..opts.warmup + opts.steps {
        if step == opts.warmup && opts.profile {
            crate::profile::enable();
        }
        let start = Instant::now();
        if !fused {
            let _t = crate::profile::scope(crate::profile::Section::ZeroGrad);
            gpt.zero_grad();
        }
        let loss = gpt.forward(&inputs, &targets, b, t);
        gpt.backward();
        let settings = StepSettings {
            lr: 1e-4,
            grad_clip: 1.0,
        };
        fused = clip_and_step(
            None,
            &Single,
            &mut gpt,
            &mut opt,
            settings,
            loss.is_finite(),
        )
        .fused;
        if !fused {
            gpt.sync_bf16_weights();
        }
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
    // Read before the second probe, whose 50 MB of operands are not the model's.
    let peak_rss_mb = peak_rss_bytes().map_or(f64::NAN, |r| r as f64 / 1e6);
    let after = probe();
    let better = |x: Option<f64>, y: Option<f64>| x.zip(y).map(|(x, y)| x.max(y));
    let peak_f32 = better(before.0, after.0);
    let peak_bf16 = better(before.1, after.1);
    let own = match opts.dtype {
        Dtype::Float32 => peak_f32,
        Dtype::Bfloat16 => peak_bf16,
    };
    let peak = opts.peak_gflops.or(own).expect("a peak given or measured");
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
        peak_gflops_f32: peak_f32,
        peak_gflops_bf16: peak_bf16,
        mfu: achieved / peak,
        peak_rss_mb,
        activation_mb: gpt.activation_bytes() as f64 / 1e6,
        profile,
    })
}

/// The machine's practical matmul peak for `dtype`, in GFLOP/s: the best of repeated
/// 2048³ products through the GEMM that precision's matmuls run on — [`matmul`] for
/// f32, [`matmul_bf16`] on `backend`'s kernel for bf16 — so MFU is against what the
/// run's own products could reach.
pub fn gemm_peak_gflops(dtype: Dtype, backend: &Backend) -> f64 {
    gemm_peak(2048, dtype, backend)
}

/// A quicker estimate from 1024³ products (a few tenths of a second), for MFU in logs.
pub fn gemm_peak_gflops_quick(dtype: Dtype, backend: &Backend) -> f64 {
    gemm_peak(1024, dtype, backend)
}

/// Best GFLOP/s of repeated `n³` products: at least 3 and at most 12 of them, for
/// about half a second, so one that a busy neighbour slowed does not set the peak.
/// The operands (1 and 0.5) are exact in bf16, as bf16 matmuls require.
fn gemm_peak(n: usize, dtype: Dtype, backend: &Backend) -> f64 {
    let a = vec![1.0f32; n * n];
    let b = vec![0.5f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let product = |c: &mut [f32], a: Mat, b: Mat| match dtype {
        Dtype::Float32 => matmul(c, a, b, false),
        Dtype::Bfloat16 => matmul_bf16(backend, c, a, b, false),
    };
    let started = Instant::now();
    let mut best = 0.0f64;
    for rep in 0..12 {
        if rep >= 3 && started.elapsed().as_secs_f64() > 0.5 {
            break;
        }
        let start = Instant::now();
        product(&mut c, Mat::new(&a, n, n), Mat::new(&b, n, n));
        best = best.max(2.0 * (n * n * n) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    assert_eq!(
        c[0],
        0.5 * n as f32,
        "the peak's product computed a wrong value"
    );
    best
}

/// The process's peak resident set size (Linux `VmHWM`), if the OS tells.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// What `nanogpt bench --sample` times: `nanogpt sample`'s greedy generation
/// ([`crate::sample::generate`] at temperature 0) from random GPT-2-style weights.
/// Each timed run makes its decoder (caches, buffers) afresh; with bf16 weights the
/// bf16 copy of the weights is made once, before the runs, and timed on its own:
/// it is part of loading a model in bf16 (`sample` makes it once per run, `chat`
/// once per session), as transformers converts its weights once at load.
#[derive(Clone, Debug)]
pub struct SampleBenchOptions {
    pub model: ModelConfig,
    /// Sequences generated together (B).
    pub num_samples: usize,
    /// Prompt tokens per sequence.
    pub prompt: usize,
    /// New tokens per sequence (at least 2: one prefill pick, then decoding steps).
    pub new_tokens: usize,
    /// Timed generations (after one short untimed one); medians are reported.
    pub runs: usize,
    /// Time the last run's prefill and decoding steps by kernel family (see
    /// [`crate::profile`]).
    pub profile: bool,
    /// Weights the matmuls read: f32, or bf16 (`sample --dtype bfloat16`).
    pub dtype: Dtype,
    /// The kernel of a bf16 prompt's products.
    pub backend: Backend,
}

/// What was measured, split like `generate` spends it.
#[derive(Clone, Debug, Serialize)]
pub struct SampleBenchReport {
    pub dtype: Dtype,
    pub threads: usize,
    pub num_samples: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// bf16 weights: making their bf16 copy, once per loaded model (0 in f32).
    pub bf16_copy_ms: f64,
    /// Start of `generate` to its first new token: the prompt's forward and one pick.
    pub prefill_ms: f64,
    pub prefill_tokens_per_sec: f64,
    /// First to last new token, per decoding step (each adds one token per sequence).
    pub decode_ms_per_token: f64,
    /// New tokens per second of the decoding steps, all sequences together.
    pub decode_tokens_per_sec: f64,
    pub total_ms: f64,
    /// Bytes of weights one decoding step reads (every matmul weight once).
    pub weight_mb_per_step: f64,
    pub peak_rss_mb: f64,
    /// With `profile`: (kernel family, ms per decoding step), largest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<(&'static str, f64)>,
    /// With `profile`: (kernel family, ms) of the last run's prefill, largest first;
    /// what they leave of `last_prefill_ms` is outside the instrumented kernels.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prefill_profile: Vec<(&'static str, f64)>,
    /// The last run's prefill, which `prefill_profile` splits.
    pub last_prefill_ms: f64,
}

/// Times greedy generation (see [`SampleBenchOptions`]) in the current rayon pool.
pub fn run_sample(opts: &SampleBenchOptions) -> anyhow::Result<SampleBenchReport> {
    let (b, p, new) = (opts.num_samples, opts.prompt, opts.new_tokens);
    anyhow::ensure!(
        b > 0 && p > 0 && new >= 2 && opts.runs > 0,
        "bench --sample needs at least 1 sample, 1 prompt token, 2 new tokens and 1 run"
    );
    anyhow::ensure!(
        p + new <= opts.model.block_size,
        "the prompt ({p}) and new tokens ({new}) exceed the block size ({})",
        opts.model.block_size
    );
    let mut gpt = Gpt::new(opts.model.clone(), 1, 1)?;
    gpt.init_gpt2(1337);
    let cfg = gpt.config().clone();
    let prompt: Vec<u32> = (0..p).map(|i| (i * 7919 % cfg.vocab_size) as u32).collect();
    let bf16 = opts.dtype == Dtype::Bfloat16;
    let made = Instant::now();
    // As `sample`, `chat` and `serve` make it: the f32 matrices given back.
    let mut copy = bf16.then(|| Decoder::bf16_copy_releasing(&mut gpt.params, &gpt.layout));
    let copy_secs = match bf16 {
        true => made.elapsed().as_secs_f64(),
        false => 0.0,
    };
    let mut prefill_profile = Vec::new();
    let mut time_one = |new_tokens: usize| {
        let o = crate::sample::SampleOptions {
            num_samples: b,
            max_new_tokens: new_tokens,
            temperature: 0.0,
            bf16_weights: bf16.then_some(opts.backend),
            ..Default::default()
        };
        let mut stamps = Vec::with_capacity(new_tokens);
        if opts.profile {
            crate::profile::enable();
        }
        let start = Instant::now();
        // As `generate` makes it, but for the bf16 copy, made once above.
        let mut dec = crate::sample::decoder_for(&cfg, p, &o);
        if let Some(w) = copy.take() {
            dec = dec.with_bf16_copy(w, &opts.backend);
        }
        let params = &gpt.params;
        crate::sample::generate_in(&mut dec, params, &gpt.layout, &cfg, &prompt, &o, |i, _| {
            if i == 0 {
                stamps.push(start.elapsed().as_secs_f64());
                if opts.profile && stamps.len() == 1 {
                    // The prompt's share, then the decoding steps' from zero.
                    prefill_profile = crate::profile::totals();
                    crate::profile::enable();
                }
            }
            false
        });
        let total = start.elapsed().as_secs_f64();
        copy = dec.take_bf16_copy();
        (stamps[0], stamps[stamps.len() - 1] - stamps[0], total)
    };
    time_one(new.min(8));
    let runs: Vec<(f64, f64, f64)> = (0..opts.runs).map(|_| time_one(new)).collect();
    let prefill_profile = prefill_profile
        .into_iter()
        .map(|(name, secs)| (name, secs * 1e3))
        .collect();
    let median = |f: fn(&(f64, f64, f64)) -> f64| {
        let mut xs: Vec<f64> = runs.iter().map(f).collect();
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    let (prefill, decode, total) = (median(|r| r.0), median(|r| r.1), median(|r| r.2));
    let steps = (new - 1) as f64;
    let profile = match opts.profile {
        true => crate::profile::totals(),
        false => Vec::new(),
    };
    let profile = profile
        .into_iter()
        .map(|(name, secs)| (name, secs * 1e3 / steps));
    let weights = cfg.n_layer * 12 * cfg.n_embd * cfg.n_embd + cfg.vocab_size * cfg.n_embd;
    let weight_bytes = match opts.dtype {
        Dtype::Float32 => 4,
        Dtype::Bfloat16 => 2,
    };
    Ok(SampleBenchReport {
        dtype: opts.dtype,
        threads: rayon::current_num_threads(),
        num_samples: b,
        prompt_tokens: p,
        new_tokens: new,
        bf16_copy_ms: copy_secs * 1e3,
        prefill_ms: prefill * 1e3,
        prefill_tokens_per_sec: (b * p) as f64 / prefill,
        decode_ms_per_token: decode * 1e3 / steps,
        decode_tokens_per_sec: b as f64 * steps / decode,
        total_ms: total * 1e3,
        weight_mb_per_step: (weights * weight_bytes) as f64 / 1e6,
        peak_rss_mb: peak_rss_bytes().map_or(f64::NAN, |r| r as f64 / 1e6),
        profile: profile.collect(),
        prefill_profile,
        last_prefill_ms: runs[runs.len() - 1].0 * 1e3,
    })
}
