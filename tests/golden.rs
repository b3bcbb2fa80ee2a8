//! Golden tests: the Rust engine against PyTorch.
//!
//! The fixtures in `tests/fixtures/` come from `scripts/reference/gpt_reference.py`
//! (see `scripts/reference/README.md`): a small GPT-2 (V=101, padded to 128 here;
//! 2 layers, 4 heads, C=64, B=4, T=16, ~10% ignored targets), with and without
//! biases. Each file holds the parameters, the batch, PyTorch's logits, loss and
//! gradients, and a 10-step AdamW run (losses, gradient norms before and after
//! clipping, learning rates, final parameters). The config and hyper-parameters are
//! read from the file's `__metadata__`. No Python is needed to run these tests; run
//! with `-- --nocapture` to see the per-tensor errors.

use nanogpt::model::{Gpt, ModelConfig};
use nanogpt::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;

// ---------------------------------------------------------------------------------
// Tolerances, about 10x the errors observed (Linux x86-64, this engine vs the float32
// PyTorch fixtures), which are themselves the size of the reference's own rounding
// noise (float32 PyTorch vs a float64 run of the same model: logits 3e-7, gradients
// 6e-7, losses 1e-7, norms 5e-7 relative to the tensor's largest entry).

/// Logits: elementwise |got - want| <= LOGITS_ATOL + LOGITS_RTOL * |want|
/// (observed: max abs 3.0e-7, logits up to 1.1).
const LOGITS_RTOL: f64 = 1e-5;
const LOGITS_ATOL: f64 = 3e-6;
/// Loss at the initial parameters, relative (observed 1.0e-7).
const LOSS_RTOL: f64 = 1e-6;
/// Gradients, per tensor: max |got - want| / max |want| (observed <= 6.0e-7).
/// Elementwise relative error means nothing for entries that are rounding noise,
/// e.g. the key bias, whose true gradient is exactly zero.
const GRAD_TOL: f64 = 5e-6;
/// AdamW run, relative, every iteration: losses (observed 1.2e-7), gradient norms
/// before and after clipping (observed 2.7e-7).
const TRAIN_LOSS_RTOL: f64 = 1e-6;
const GRAD_NORM_RTOL: f64 = 2e-6;
/// Learning rates from `LrSchedule` against the fixture's `get_lr`, relative
/// (float32 rounding: 8e-8).
const LR_RTOL: f64 = 1e-6;
/// Final parameters, two checks per tensor:
/// - elementwise |got - want| <= FINAL_ATOL (observed 1.4e-5). Adam divides by
///   sqrt(v), so entries whose gradient is rounding noise take noise-driven steps:
///   float32 and float64 PyTorch already differ by up to 2.5e-5.
/// - the update (final - initial) agrees in relative L2 norm within
///   FINAL_UPDATE_RTOL (observed 2.6e-5; float32 vs float64 PyTorch 8.8e-5). A bug
///   moves it far more: no weight decay 3.8e-3, no clipping 1.5e-2, decay on every
///   tensor 0.16. The key third of `c_attn.bias` is left out of this norm: its true
///   gradient is zero, so its whole update is amplified noise (rel L2 ~1e-3); it is
///   still held to FINAL_ATOL.
const FINAL_ATOL: f64 = 1e-4;
const FINAL_UPDATE_RTOL: f64 = 5e-4;

const FIXTURES: [&str; 2] = ["gpt_small_bias", "gpt_small_nobias"];

// ---------------------------------------------------------------------------------
// Loading helpers

enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

struct Tensor {
    shape: Vec<usize>,
    data: Data,
}

/// One fixture file, decoded.
struct Fixture {
    name: String,
    meta: HashMap<String, String>,
    tensors: HashMap<String, Tensor>,
}

impl Fixture {
    fn load(stem: &str) -> Fixture {
        let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "fixtures"]
            .iter()
            .collect::<PathBuf>()
            .join(format!("{stem}.safetensors"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (regenerate with scripts/reference)",
                path.display()
            )
        });
        let (_, header) = SafeTensors::read_metadata(&bytes).expect("safetensors header");
        let meta = header.metadata().clone().expect("fixture has __metadata__");
        let st = SafeTensors::deserialize(&bytes).expect("safetensors file");
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            let words = view
                .data()
                .chunks_exact(4)
                .map(|b| [b[0], b[1], b[2], b[3]]);
            let data = match view.dtype() {
                Dtype::F32 => Data::F32(words.map(f32::from_le_bytes).collect()),
                Dtype::I32 => Data::I32(words.map(i32::from_le_bytes).collect()),
                other => panic!("{stem}: {name} has unexpected dtype {other:?}"),
            };
            let shape = view.shape().to_vec();
            tensors.insert(name, Tensor { shape, data });
        }
        Fixture {
            name: stem.to_string(),
            meta,
            tensors,
        }
    }

    /// A `__metadata__` value, parsed.
    fn meta<T: FromStr>(&self, key: &str) -> T {
        let text = self
            .meta
            .get(key)
            .unwrap_or_else(|| panic!("{}: no metadata key {key}", self.name));
        text.parse()
            .unwrap_or_else(|_| panic!("{}: metadata {key}={text} does not parse", self.name))
    }

    fn tensor(&self, key: &str) -> &Tensor {
        self.tensors
            .get(key)
            .unwrap_or_else(|| panic!("{}: no tensor {key}", self.name))
    }

    fn f32s(&self, key: &str) -> &[f32] {
        match &self.tensor(key).data {
            Data::F32(v) => v,
            Data::I32(_) => panic!("{}: {key} is not F32", self.name),
        }
    }

    fn i32s(&self, key: &str) -> &[i32] {
        match &self.tensor(key).data {
            Data::I32(v) => v,
            Data::F32(_) => panic!("{}: {key} is not I32", self.name),
        }
    }

    fn config(&self) -> ModelConfig {
        ModelConfig {
            vocab_size: self.meta("vocab_size"),
            block_size: self.meta("block_size"),
            n_layer: self.meta("n_layer"),
            n_head: self.meta("n_head"),
            n_embd: self.meta("n_embd"),
            bias: self.meta("bias"),
            dropout: 0.0,
            llama: None,
        }
    }

    fn batch(&self) -> (usize, usize) {
        (self.meta("B"), self.meta("T"))
    }

    fn inputs(&self) -> Vec<u32> {
        self.i32s("inputs")
            .iter()
            .map(|&x| u32::try_from(x).unwrap())
            .collect()
    }

    fn targets(&self) -> Vec<i32> {
        self.i32s("targets").to_vec()
    }

    /// Names of the model parameters (the keys without a prefix), sorted.
    fn param_names(&self) -> Vec<String> {
        let mut names: Vec<_> = self
            .tensors
            .keys()
            .filter(|k| k.starts_with("transformer."))
            .cloned()
            .collect();
        names.sort();
        names
    }
}

/// The fixture's model: a fresh `Gpt` with the reference parameters copied in by name.
/// `wte` fills the first V of the arena's Vp rows; the padding rows stay zero.
fn build_model(fx: &Fixture) -> Gpt {
    let cfg = fx.config();
    let (b, t) = fx.batch();
    let mut gpt = Gpt::new(cfg, b, t).expect("model from the fixture's config");
    let names = fx.param_names();
    assert_eq!(
        names.len(),
        gpt.layout.tensors.len(),
        "{}: fixture and layout disagree on the parameter set",
        fx.name
    );
    for name in &names {
        let want = fx.tensor(name);
        let info = gpt
            .layout
            .get(name)
            .unwrap_or_else(|| panic!("layout has no tensor {name}"))
            .clone();
        if name == "transformer.wte.weight" {
            assert_eq!(want.shape[1], info.shape[1]);
            assert_eq!(want.shape[0], gpt.config().vocab_size);
            assert_eq!(info.shape[0], gpt.config().padded_vocab_size());
        } else {
            assert_eq!(want.shape, info.shape, "{name}: shape");
        }
        let src = fx.f32s(name);
        gpt.params[info.offset..info.offset + src.len()].copy_from_slice(src);
    }
    gpt
}

/// The leading (real, unpadded) part of a parameter-shaped arena buffer.
fn arena_tensor<'a>(gpt: &Gpt, buf: &'a [f32], name: &str, real_len: usize) -> &'a [f32] {
    let info = gpt.layout.get(name).unwrap();
    &buf[info.offset..info.offset + real_len]
}

/// The padding rows of `wte` in an arena buffer (must stay zero).
fn wte_padding<'a>(gpt: &Gpt, buf: &'a [f32]) -> &'a [f32] {
    let info = gpt.layout.get("transformer.wte.weight").unwrap();
    let real = gpt.config().vocab_size * gpt.config().n_embd;
    &buf[info.offset + real..info.range().end]
}

// ---------------------------------------------------------------------------------
// Comparison helpers

/// Worst deviation of `got` from `want`.
struct Diff {
    max_abs: f64,
    /// max |want|
    scale: f64,
    worst: usize,
}

impl Diff {
    fn of(got: &[f32], want: &[f32]) -> Diff {
        assert_eq!(got.len(), want.len());
        let mut d = Diff {
            max_abs: 0.0,
            scale: 0.0,
            worst: 0,
        };
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let e = abs_err(g, w);
            if e > d.max_abs {
                d.max_abs = e;
                d.worst = i;
            }
            d.scale = d.scale.max((w as f64).abs());
        }
        d
    }

    /// max |got - want| / max |want|
    fn rel(&self) -> f64 {
        self.max_abs / self.scale.max(f64::MIN_POSITIVE)
    }
}

/// |got - want|, infinite when either is NaN (so a NaN always fails a bound).
fn abs_err(got: f32, want: f32) -> f64 {
    let e = (got as f64 - want as f64).abs();
    if e.is_nan() {
        f64::INFINITY
    } else {
        e
    }
}

fn rel_err(got: f64, want: f64) -> f64 {
    let e = (got - want).abs() / want.abs().max(f64::MIN_POSITIVE);
    if e.is_nan() {
        f64::INFINITY
    } else {
        e
    }
}

/// Checks a short series (losses, norms, rates) elementwise, relative.
fn assert_series(what: &str, got: &[f32], want: &[f32], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let errs: Vec<f64> = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| rel_err(g as f64, w as f64))
        .collect();
    let worst = errs.iter().cloned().fold(0.0, f64::max);
    let rows: Vec<String> = (0..got.len())
        .map(|i| {
            format!(
                "  {i:2}: got {:.8} want {:.8} rel {:.1e}",
                got[i], want[i], errs[i]
            )
        })
        .collect();
    println!("{what}: worst relative error {worst:.2e} (tol {rtol:.0e})");
    assert!(
        worst <= rtol,
        "{what}: worst relative error {worst:.2e} > {rtol:.0e}\n{}",
        rows.join("\n")
    );
}

/// Formats one line per tensor, worst first.
fn table(rows: &mut [(String, f64, String)]) -> String {
    rows.sort_by(|a, b| b.1.total_cmp(&a.1));
    rows.iter()
        .map(|(name, e, extra)| format!("  {e:9.2e}  {name}  {extra}"))
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------------
// The reference training run

struct Hyper {
    learning_rate: f32,
    min_lr: f32,
    warmup_iters: u64,
    lr_decay_iters: u64,
    weight_decay: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    grad_clip: f32,
    iters: usize,
}

impl Hyper {
    fn of(fx: &Fixture) -> Hyper {
        Hyper {
            learning_rate: fx.meta("learning_rate"),
            min_lr: fx.meta("min_lr"),
            warmup_iters: fx.meta("warmup_iters"),
            lr_decay_iters: fx.meta("lr_decay_iters"),
            weight_decay: fx.meta("weight_decay"),
            beta1: fx.meta("beta1"),
            beta2: fx.meta("beta2"),
            eps: fx.meta("eps"),
            grad_clip: fx.meta("grad_clip"),
            iters: fx.f32s("adamw_losses").len(),
        }
    }
}

struct Run {
    losses: Vec<f32>,
    /// pre-clip global gradient norms, as `clip_grad_norm` returns them
    norms: Vec<f32>,
    /// global gradient norms after clipping, measured here
    clipped_norms: Vec<f32>,
    lrs: Vec<f32>,
}

/// nanoGPT's loop on the fixture's batch: lr, zero_grad, forward, backward, clip, step.
/// Returns the per-iteration series and the trained model.
fn train(fx: &Fixture) -> (Run, Gpt) {
    let h = Hyper::of(fx);
    let (b, t) = fx.batch();
    let (inputs, targets) = (fx.inputs(), fx.targets());
    let mut gpt = build_model(fx);
    gpt.set_training(true);
    let schedule = LrSchedule {
        learning_rate: h.learning_rate,
        min_lr: h.min_lr,
        warmup_iters: h.warmup_iters,
        lr_decay_iters: h.lr_decay_iters,
        decay_lr: true,
    };
    let config = AdamWConfig {
        beta1: h.beta1,
        beta2: h.beta2,
        eps: h.eps,
        weight_decay: h.weight_decay,
    };
    let mut opt = AdamW::new(&gpt.layout.decay_ranges(), config);
    let mut run = Run {
        losses: vec![],
        norms: vec![],
        clipped_norms: vec![],
        lrs: vec![],
    };
    for it in 0..h.iters {
        let lr = schedule.lr_at(it as u64);
        gpt.zero_grad();
        let loss = gpt.forward(&inputs, &targets, b, t);
        gpt.backward();
        let norm = clip_grad_norm(&mut gpt.grads, h.grad_clip);
        let clipped = gpt
            .grads
            .iter()
            .map(|&g| g as f64 * g as f64)
            .sum::<f64>()
            .sqrt();
        opt.step(&mut gpt.params, &gpt.grads, lr);
        run.losses.push(loss);
        run.norms.push(norm);
        run.clipped_norms.push(clipped as f32);
        run.lrs.push(lr);
    }
    (run, gpt)
}

// ---------------------------------------------------------------------------------
// The checks

fn check_forward_backward(stem: &str) {
    let fx = Fixture::load(stem);
    let (b, t) = fx.batch();
    let (inputs, targets) = (fx.inputs(), fx.targets());
    let mut gpt = build_model(&fx);

    // Logits (inference path).
    gpt.set_training(false);
    let logits = gpt.logits(&inputs, b, t);
    let want = fx.f32s("logits");
    assert_eq!(
        logits.len(),
        want.len(),
        "{stem}: logits length (B*T*V, real V)"
    );
    let d = Diff::of(&logits, want);
    let bad = logits
        .iter()
        .zip(want)
        .filter(|&(&g, &w)| abs_err(g, w) > LOGITS_ATOL + LOGITS_RTOL * (w as f64).abs())
        .count();
    println!(
        "{stem}: logits max abs error {:.2e} (max |logit| {:.3}, {:.2e} relative)",
        d.max_abs,
        d.scale,
        d.rel()
    );
    assert_eq!(
        bad,
        0,
        "{stem}: {bad} logits outside atol {LOGITS_ATOL:.0e} + rtol {LOGITS_RTOL:.0e}; worst at {}: got {} want {}",
        d.worst,
        logits[d.worst],
        want[d.worst]
    );

    // Loss and gradients (training path).
    gpt.set_training(true);
    gpt.zero_grad();
    let loss = gpt.forward(&inputs, &targets, b, t) as f64;
    gpt.backward();
    let want_loss = fx.f32s("loss")[0] as f64;
    let e = rel_err(loss, want_loss);
    println!("{stem}: loss {loss:.7} want {want_loss:.7} rel {e:.2e}");
    assert!(
        e <= LOSS_RTOL,
        "{stem}: loss {loss} vs {want_loss}: rel {e:.2e} > {LOSS_RTOL:.0e}"
    );

    let mut rows = Vec::new();
    for name in fx.param_names() {
        let want = fx.f32s(&format!("grad.{name}"));
        let got = arena_tensor(&gpt, &gpt.grads, &name, want.len());
        let d = Diff::of(got, want);
        let extra = format!(
            "(max abs {:.1e}, max |grad| {:.1e}; worst [{}]: got {:.6e} want {:.6e})",
            d.max_abs, d.scale, d.worst, got[d.worst], want[d.worst]
        );
        rows.push((name, d.rel(), extra));
    }
    let worst = rows.iter().map(|r| r.1).fold(0.0, f64::max);
    let report = table(&mut rows);
    println!("{stem}: gradients, max|err|/max|ref| per tensor:\n{report}");
    assert!(
        worst <= GRAD_TOL,
        "{stem}: gradient error {worst:.2e} > {GRAD_TOL:.0e} (max|err|/max|ref| per tensor):\n{report}"
    );
    let pad = wte_padding(&gpt, &gpt.grads);
    assert!(
        pad.iter().all(|&g| g == 0.0),
        "{stem}: padded wte rows got a gradient"
    );
}

fn check_training(stem: &str) {
    let fx = Fixture::load(stem);
    let (run, gpt) = train(&fx);

    assert_series(
        &format!("{stem}: lr"),
        &run.lrs,
        fx.f32s("adamw_lrs"),
        LR_RTOL,
    );
    assert_series(
        &format!("{stem}: adamw losses"),
        &run.losses,
        fx.f32s("adamw_losses"),
        TRAIN_LOSS_RTOL,
    );
    assert_series(
        &format!("{stem}: pre-clip grad norms"),
        &run.norms,
        fx.f32s("adamw_grad_norms"),
        GRAD_NORM_RTOL,
    );
    // Adam is almost blind to a per-step gradient scale, so check the clipping itself.
    assert_series(
        &format!("{stem}: post-clip grad norms"),
        &run.clipped_norms,
        fx.f32s("adamw_clipped_norms"),
        GRAD_NORM_RTOL,
    );

    let gpt = &gpt;
    let mut rows = Vec::new();
    let (mut worst_abs, mut worst_update) = (0.0f64, 0.0f64);
    for name in fx.param_names() {
        let init = fx.f32s(&name);
        let want = fx.f32s(&format!("adamw_final.{name}"));
        let got = arena_tensor(gpt, &gpt.params, &name, want.len());
        let d = Diff::of(got, want);
        // relative L2 error of the update (final - initial), key bias excluded
        let c = fx.config().n_embd;
        let key_bias = if name.ends_with("attn.c_attn.bias") {
            c..2 * c
        } else {
            0..0
        };
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for i in (0..want.len()).filter(|i| !key_bias.contains(i)) {
            let (g, w, p) = (got[i] as f64, want[i] as f64, init[i] as f64);
            num += (g - w) * (g - w);
            den += (w - p) * (w - p);
        }
        let update = (num / den.max(f64::MIN_POSITIVE)).sqrt();
        let update = if update.is_nan() {
            f64::INFINITY
        } else {
            update
        };
        worst_abs = worst_abs.max(d.max_abs);
        worst_update = worst_update.max(update);
        let extra = format!(
            "(update rel L2 {update:.1e}; worst [{}]: got {:.7} want {:.7})",
            d.worst, got[d.worst], want[d.worst]
        );
        rows.push((name, d.max_abs, extra));
    }
    let report = table(&mut rows);
    println!("{stem}: final parameters, max abs error per tensor:\n{report}");
    assert!(
        worst_abs <= FINAL_ATOL && worst_update <= FINAL_UPDATE_RTOL,
        "{stem}: final parameters off: max abs {worst_abs:.2e} (tol {FINAL_ATOL:.0e}), \
         update rel L2 {worst_update:.2e} (tol {FINAL_UPDATE_RTOL:.0e}):\n{report}"
    );
    let pad = wte_padding(gpt, &gpt.params);
    assert!(
        pad.iter().all(|&p| p == 0.0),
        "{stem}: padded wte rows were trained"
    );
}

#[test]
fn forward_and_backward_match_pytorch_with_bias() {
    check_forward_backward(FIXTURES[0]);
}

#[test]
fn forward_and_backward_match_pytorch_without_bias() {
    check_forward_backward(FIXTURES[1]);
}

#[test]
fn adamw_training_matches_pytorch_with_bias() {
    check_training(FIXTURES[0]);
}

#[test]
fn adamw_training_matches_pytorch_without_bias() {
    check_training(FIXTURES[1]);
}

#[test]
fn training_is_deterministic() {
    for stem in FIXTURES {
        let fx = Fixture::load(stem);
        let ((a, gpt_a), (b, gpt_b)) = (train(&fx), train(&fx));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&a.losses),
            bits(&b.losses),
            "{stem}: losses differ between runs"
        );
        assert_eq!(
            bits(&a.norms),
            bits(&b.norms),
            "{stem}: grad norms differ between runs"
        );
        assert!(
            bits(&gpt_a.params) == bits(&gpt_b.params),
            "{stem}: final parameters differ between runs"
        );
    }
}

/// `dtype = "bfloat16"` against PyTorch's CPU autocast on the same fixtures
/// (`scripts/reference/bf16_autocast.py`). PyTorch rounds in more places (every
/// matmul output, the attention probabilities, GELU in bf16; see the script), so
/// this is a loose check: the losses agree to 5e-4 (the bf16 effect itself is ~1e-4
/// here, and both sides are within 1e-3 of the f32 loss), and the gradient of every
/// tensor has the same L2 norm to within 5 %.
#[test]
fn bfloat16_is_close_to_pytorch_autocast() {
    let path: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "tests/fixtures/bf16_autocast.json",
    ]
    .iter()
    .collect();
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for stem in FIXTURES {
        let fx = Fixture::load(stem);
        let want = &refs[stem];
        let mut gpt = build_model(&fx);
        let here = nanogpt::kernels::bf16::Backend::detect(None);
        gpt.set_dtype(nanogpt::model::Dtype::Bfloat16, &here);
        let (b, t) = fx.batch();
        gpt.zero_grad();
        let loss = gpt.forward(&fx.inputs(), &fx.targets(), b, t) as f64;
        gpt.backward();
        let torch_bf16 = want["loss_autocast_bf16"].as_f64().unwrap();
        let torch_f32 = want["loss_float32"].as_f64().unwrap();
        println!("{stem}: nanogpt bf16 {loss:.6}, torch autocast {torch_bf16:.6}, torch f32 {torch_f32:.6}");
        assert!(
            (loss - torch_bf16).abs() < 5e-4 && (loss - torch_f32).abs() < 1e-3,
            "{stem}: bf16 loss {loss} vs autocast {torch_bf16} (f32 {torch_f32})"
        );
        let norms = want["grad_norms_autocast_bf16"].as_object().unwrap();
        for (name, norm) in norms {
            let info = gpt.layout.get(name).unwrap().clone();
            let want_norm = norm.as_f64().unwrap();
            let n = match name.as_str() {
                "transformer.wte.weight" => gpt.config().vocab_size * gpt.config().n_embd,
                _ => info.numel(),
            };
            let g = &gpt.grads[info.offset..info.offset + n];
            let got = g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
            assert!(
                (got - want_norm).abs() <= 0.05 * want_norm,
                "{stem}: |grad {name}| = {got} vs autocast {want_norm}"
            );
        }
    }
}
