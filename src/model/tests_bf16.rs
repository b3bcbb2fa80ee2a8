//! `dtype = "bfloat16"` of the whole model: the loss against an independent f64
//! reference that rounds at the same places, and the gradients against f32.

use super::layout::{LinearSpans, NormSpans};
use super::tests::random_model as model;
use super::*;
use crate::kernels::bf16::{round, Kernel};

/// This machine's bf16 back-end, as a run without a `bf16_kernel` request gets it.
fn here() -> Backend {
    Backend::detect(None)
}

/// The f32 GEMM for every bf16 product (`bf16_kernel = f32`).
fn on_f32_gemm() -> Backend {
    Backend::with_kernel(Kernel::F32).expect("the f32 GEMM runs everywhere")
}

/// The model tests' tiny model without dropout.
fn tiny(bias: bool) -> ModelConfig {
    super::tests::tiny(bias, 0.0)
}

/// Large enough that the big matmuls take the AMX kernel where it is usable
/// (m·n·k ≥ 2^20 at B·T = 128; the tests that need the f32 GEMM ask for it).
fn medium(bias: bool) -> ModelConfig {
    ModelConfig {
        vocab_size: 37,
        block_size: 16,
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        bias,
        dropout: 0.0,
        llama: None,
    }
}

fn batch(b: usize, t: usize, v: usize) -> (Vec<u32>, Vec<i32>) {
    let x = (0..b * t).map(|i| ((i * 11 + 5) % v) as u32).collect();
    let y = (0..b * t).map(|i| ((i * 7 + 2) % v) as i32).collect();
    (x, y)
}

/// Rounds to bf16 when `bf16`, else leaves the value alone.
fn rd(bf16: bool, v: f64) -> f64 {
    if bf16 {
        round(v as f32) as f64
    } else {
        v
    }
}

fn layernorm(x: &[f64], w: &[f64], b: &[f64], c: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(c) {
        let mu = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
        let rs = 1.0 / (var + 1e-5).sqrt();
        for i in 0..c {
            out.push((row[i] - mu) * rs * w[i] + b.get(i).copied().unwrap_or(0.0));
        }
    }
    out
}

/// `x · wᵀ + b`; x: (N, C), w: (OC, C).
fn linear(x: &[f64], w: &[f64], b: &[f64], c: usize) -> Vec<f64> {
    let oc = w.len() / c;
    let mut out = Vec::with_capacity(x.len() / c * oc);
    for row in x.chunks(c) {
        for o in 0..oc {
            let dot: f64 = (0..c).map(|i| row[i] * w[o * c + i]).sum();
            out.push(dot + b.get(o).copied().unwrap_or(0.0));
        }
    }
    out
}

fn gelu(x: f64) -> f64 {
    let s = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (s * (x + 0.044715 * x * x * x)).tanh())
}

/// Causal attention over qkv (B, T, 3C) → (B, T, C). With `probs`, rounds the
/// unnormalised probabilities `exp(x − max)` to bf16 before their product with v, as
/// the attention on `vdpbf16ps` does for T <= 32 (one key block: the running max is
/// the row's max), and divides by their unrounded sum.
fn attention(qkv: &[f64], (b, t, c, nh): (usize, usize, usize, usize), probs: bool) -> Vec<f64> {
    let hs = c / nh;
    let mut out = vec![0.0; b * t * c];
    for bi in 0..b {
        for h in 0..nh {
            let at = |tt: usize, part: usize, i: usize| {
                qkv[(bi * t + tt) * 3 * c + part * c + h * hs + i]
            };
            for tq in 0..t {
                let scores: Vec<f64> = (0..=tq)
                    .map(|tk| {
                        (0..hs).map(|i| at(tq, 0, i) * at(tk, 1, i)).sum::<f64>()
                            / (hs as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for i in 0..hs {
                    let y: f64 = (0..=tq)
                        .map(|tk| rd(probs, (scores[tk] - max).exp()) / sum * at(tk, 2, i))
                        .sum();
                    out[(bi * t + tq) * c + h * hs + i] = y;
                }
            }
        }
    }
    out
}

/// The mean loss in f64 from the model's f32 parameters. With `bf16`, rounds where
/// the bf16 model does: matmul weights, layer-norm outputs, q/k/v, the attention
/// output, the pre-GELU layer, the GELU output and the final layer norm's output;
/// with `probs` too, the attention probabilities (see [`attention`]).
fn reference_loss(
    gpt: &Gpt,
    x: &[u32],
    y: &[i32],
    (b, t): (usize, usize),
    bf16: bool,
    probs: bool,
) -> f64 {
    let cfg = gpt.config();
    let (c, v) = (cfg.n_embd, cfg.vocab_size);
    let get = |s: Span| -> Vec<f64> { gpt.params[s].iter().map(|&p| p as f64).collect() };
    let rounded = |v: Vec<f64>| -> Vec<f64> { v.into_iter().map(|p| rd(bf16, p)).collect() };
    let norm = |h: &[f64], n: NormSpans| layernorm(h, &get(n.weight), &get(n.bias), c);
    let dense = |x: &[f64], l: LinearSpans| linear(x, &rounded(get(l.weight)), &get(l.bias), l.c);
    let (wte, wpe) = (get(gpt.layout.wte), get(gpt.layout.wpe));
    let mut h = vec![0.0; b * t * c];
    for (row, &tok) in x.iter().enumerate() {
        for i in 0..c {
            h[row * c + i] = wte[tok as usize * c + i] + wpe[(row % t) * c + i];
        }
    }
    for r in &gpt.layout.layers {
        let ln1 = rounded(norm(&h, r.ln_1));
        let qkv = rounded(dense(&ln1, r.qkv));
        let atty = rounded(attention(&qkv, (b, t, c, cfg.n_head), probs));
        let proj = dense(&atty, r.attn_out);
        h.iter_mut().zip(proj).for_each(|(h, p)| *h += p);
        let ln2 = rounded(norm(&h, r.ln_2));
        let fc = rounded(dense(&ln2, r.mlp_up));
        let g = rounded(fc.into_iter().map(gelu).collect());
        let proj = dense(&g, r.mlp_down);
        h.iter_mut().zip(proj).for_each(|(h, p)| *h += p);
    }
    let lnf = rounded(norm(&h, gpt.layout.ln_f));
    let wte_r = rounded(wte[..v * c].to_vec());
    let logits = linear(&lnf, &wte_r, &[], c);
    let mut total = 0.0;
    for (row, &tg) in y.iter().enumerate() {
        let l = &logits[row * v..(row + 1) * v];
        let max = l.iter().cloned().fold(f64::MIN, f64::max);
        let lse = max + l.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
        total += lse - l[tg as usize];
    }
    total / y.len() as f64
}

#[test]
fn bf16_loss_matches_a_reference_that_rounds_the_same_way() {
    for (cfg, b, t) in [
        (tiny(true), 2, 8),
        (tiny(false), 2, 8),
        (medium(true), 8, 16),
    ] {
        let bias = cfg.bias;
        let mut gpt = model(cfg.clone(), b, t, 21);
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        gpt.set_training(false);
        let f32_loss = gpt.forward(&x, &y, b, t) as f64;
        gpt.set_dtype(Dtype::Bfloat16, &here());
        // The rounding points are checked on the f32 GEMM: its sums round like the
        // reference's here, so no bf16 rounding flips. Any other kernel sums in
        // another order and may flip a rounding or two (checked below). The model
        // is made on it: a model made for a packing kernel keeps no rounded copy,
        // which the f32 GEMM needs.
        let bf16_loss = {
            let mut on_f32 = model(cfg, b, t, 21);
            on_f32.set_training(false);
            on_f32.set_dtype(Dtype::Bfloat16, &on_f32_gemm());
            on_f32.forward(&x, &y, b, t)
        } as f64;
        let default_loss = gpt.forward(&x, &y, b, t) as f64;
        let want_bf16 = reference_loss(&gpt, &x, &y, (b, t), true, false);
        let want_f32 = reference_loss(&gpt, &x, &y, (b, t), false, false);
        // The default kernel's attention products may round the probabilities too.
        let dims = crate::kernels::Dims::new(b, t, gpt.config().n_embd, gpt.config().n_head);
        let probs = crate::kernels::attention::bf16_forward_products::<true>(dims, &here());
        let want_default = reference_loss(&gpt, &x, &y, (b, t), true, probs);
        println!(
            "bias {bias}: bf16 {bf16_loss} (ref {want_bf16}, default kernel {default_loss}, \
             ref {want_default}), f32 {f32_loss} (ref {want_f32})"
        );
        assert!(
            (f32_loss - want_f32).abs() < 1e-5,
            "f32 {f32_loss} vs {want_f32}"
        );
        // The roundings move the loss measurably (~1e-5 here); the model follows the
        // reference to within f32 noise (~1e-8; an f32/f64 difference may also flip
        // a rounding here and there).
        let effect = (want_bf16 - want_f32).abs();
        assert!(effect > 2e-6, "rounding effect {effect} too small to test");
        assert!(
            (bf16_loss - want_bf16).abs() < 0.05 * effect,
            "bf16 {bf16_loss} vs reference {want_bf16} (rounding moves it by {effect})"
        );
        // The default kernel (AMX where usable): as accurate per product (tested in
        // kernels::bf16::amx), but one flipped bf16 rounding of a q/k/v element moved
        // the medium model's loss by 1.1e-5 (a fifth of the whole rounding effect).
        assert!(
            (default_loss - want_default).abs() < 0.3 * effect,
            "default kernel {default_loss} vs reference {want_default} (effect {effect})"
        );
        // Back to f32: bit-identical to before.
        gpt.set_dtype(Dtype::Float32, &here());
        assert_eq!(gpt.forward(&x, &y, b, t) as f64, f32_loss);
    }
}

/// Cosine similarity and relative difference of two gradient slices.
fn compare(a: &[f32], b: &[f32]) -> (f64, f64) {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let na = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let nb = b.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let diff = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    (dot / (na * nb).max(1e-30), diff / nb.max(1e-30))
}

#[test]
fn bf16_gradients_are_close_to_f32_ones() {
    // Tolerance: each bf16 rounding has relative error ≤ 2^-9; over the few matmuls
    // of a 2-layer model the gradient of every tensor stays within 3 % (relative L2
    // norm) of f32's, with cosine similarity above 0.999.
    let dropout = ModelConfig {
        dropout: 0.2,
        ..tiny(true)
    };
    for (cfg, b, t) in [(tiny(true), 2, 8), (dropout, 2, 8), (medium(false), 8, 16)] {
        let mut gpt = model(cfg, b, t, 33);
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        let grads_of = |gpt: &mut Gpt| {
            gpt.zero_grad();
            gpt.set_dropout_seed(9);
            gpt.forward(&x, &y, b, t);
            gpt.backward();
            gpt.grads.clone()
        };
        let g32 = grads_of(&mut gpt);
        gpt.set_dtype(Dtype::Bfloat16, &here());
        let g16 = grads_of(&mut gpt);
        assert_ne!(g16, g32, "bf16 changed nothing");
        for tensor in &gpt.layout.tensors {
            let (cos, rel) = compare(&g16[tensor.range()], &g32[tensor.range()]);
            println!("{}: cos {cos:.6}, rel {rel:.4}", tensor.name);
            assert!(
                cos > 0.999 && rel < 0.03,
                "{}: cos {cos}, rel {rel}",
                tensor.name
            );
        }
    }
}

#[test]
fn bf16_weights_are_copied_once_per_sync() {
    // The matmuls read the copy or the packs made by sync_bf16_weights, not
    // `params` directly: whatever the kernel, a change to `params` is seen only
    // after the sync.
    let (b, t) = (1, 8);
    let mut gpt = model(tiny(true), b, t, 5);
    let (x, y) = batch(b, t, gpt.config().vocab_size);
    gpt.set_dtype(Dtype::Bfloat16, &here());
    gpt.set_training(false);
    let before = gpt.forward(&x, &y, b, t);
    let w = gpt.layout.layers[0].mlp_up.weight;
    gpt.params[w].iter_mut().for_each(|p| *p *= 1.5);
    assert_eq!(
        gpt.forward(&x, &y, b, t),
        before,
        "stale copy until the sync"
    );
    gpt.sync_bf16_weights();
    assert_ne!(gpt.forward(&x, &y, b, t), before);
}

#[test]
fn packing_weights_once_per_step_changes_no_bit() {
    // The classifier's products and the linear layers' forward and input-gradient
    // products (but the attention projection's, 2^19) at B·T = 128, C = 64, V = 160
    // are ≥ 2^20 multiply-adds, so where the kernel reads packs (AMX, AVX512-BF16)
    // they run on it, from the packs made once per refresh of the bf16 copy, or,
    // without them, packing per call. Every way the copy is refreshed repacks: the
    // fused AdamW step, `sync_bf16_weights`, and the forward that rounds each range as
    // it arrives (`refresh_bf16_at_next_forward`, ZeRO-1/2). Activation checkpointing
    // reads the packs again in backward's recompute.
    let cfg = ModelConfig {
        vocab_size: 160,
        ..medium(true)
    };
    let (b, t) = (8, 16);
    let (x, y) = batch(b, t, cfg.vocab_size);
    let run = |packed: bool| {
        let mut gpt = model(cfg.clone(), b, t, 41);
        gpt.set_activation_checkpointing(true);
        gpt.set_dtype(Dtype::Bfloat16, &here());
        assert_eq!(gpt.precision.packs.is_some(), here().reads_packs());
        if !packed {
            gpt.precision.packs = None;
        }
        let mut opt = crate::optim::AdamW::new(&gpt.layout.decay_ranges(), Default::default());
        let mut out = Vec::new();
        let mut pass = |gpt: &mut Gpt| {
            let loss = gpt.forward(&x, &y, b, t);
            gpt.backward();
            out.push((loss.to_bits(), gpt.grads.clone()));
        };
        // Two optimizer steps: the packs follow the weights the first one changed.
        for _ in 0..2 {
            pass(&mut gpt);
            gpt.step_adamw(&mut opt, 1e-2, 1.0);
        }
        let w = gpt.layout.layers[1].mlp_up.weight;
        gpt.params[w].iter_mut().for_each(|p| *p *= 1.5);
        gpt.sync_bf16_weights();
        pass(&mut gpt);
        gpt.zero_grad();
        gpt.params[w].iter_mut().for_each(|p| *p *= 1.5);
        gpt.refresh_bf16_at_next_forward();
        pass(&mut gpt);
        out
    };
    let unpacked = run(false);
    let packed = run(true);
    for (i, (p, u)) in packed.iter().zip(&unpacked).enumerate() {
        assert!(p == u, "pass {i}: the packed products differ");
    }
    // The products did run on the kernel that reads the packs: the f32 GEMM's sums
    // differ, and packs of other weights (zero) change the loss.
    if !here().reads_packs() {
        println!("no kernel reads packs here: only the unpacked path ran");
        return;
    }
    let mut gpt = model(cfg.clone(), b, t, 41);
    gpt.set_dtype(Dtype::Bfloat16, &here());
    gpt.set_training(false);
    let before = gpt.forward(&x, &y, b, t);
    let zero = vec![0.0; gpt.params.len()];
    let (layout, config) = (gpt.layout.clone(), cfg.clone());
    let packs = gpt.precision.packs.as_mut().expect("packs");
    // Block 1's packs from zero weights: its MLP and q/k/v products vanish.
    if packs.has_linears() {
        let block1 = layout.layers[1].span.range();
        packs.pack_range(block1, &zero, &layout, &config);
        assert_ne!(gpt.forward(&x, &y, b, t), before, "block packs unread");
    }
    // `wte`'s packs from zero: every logit 0.
    let packs = gpt.precision.packs.as_mut().expect("packs");
    packs.pack_range(0..1, &zero, &layout, &config);
    let uniform = (cfg.vocab_size as f32).ln();
    assert!(
        (gpt.forward(&x, &y, b, t) - uniform).abs() < 1e-6,
        "wte packs unread"
    );
    gpt.sync_bf16_weights();
    assert_eq!(gpt.forward(&x, &y, b, t), before, "sync repacks");
    gpt.set_training(true);
    let on_f32 = {
        let mut gpt = model(cfg.clone(), b, t, 41);
        gpt.set_activation_checkpointing(true);
        gpt.set_dtype(Dtype::Bfloat16, &on_f32_gemm());
        let loss = gpt.forward(&x, &y, b, t);
        gpt.backward();
        (loss.to_bits(), gpt.grads.clone())
    };
    assert_ne!(
        on_f32, unpacked[0],
        "the kernels agree here: pick another shape"
    );
}

#[test]
fn stale_packs_are_never_read() {
    // While the bf16 copy is owed (weights arriving), every pack is stale until the
    // forward packs its range; a product asking for a stale pack panics rather than
    // read old weights.
    if !here().reads_packs() {
        return;
    }
    let (b, t) = (1, 8);
    let mut gpt = model(medium(true), b, t, 5);
    gpt.set_dtype(Dtype::Bfloat16, &here());
    gpt.refresh_bf16_at_next_forward();
    let packs = gpt.precision.packs.as_ref().expect("packs");
    for read in [
        |p: &Packs| assert!(p.wte().bytes() > 0),
        |p: &Packs| _ = p.layer(1).filter(|_| p.has_linears()).expect("packed"),
    ] {
        let stale = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(packs)));
        assert!(stale.is_err(), "a stale pack was read");
    }
    let (x, y) = batch(b, t, gpt.config().vocab_size);
    gpt.forward(&x, &y, b, t);
    let packs = gpt.precision.packs.as_ref().expect("packs");
    let _fresh = (packs.wte(), packs.layer(1));
    assert_eq!(packs.layer(1).is_some(), packs.has_linears());
}
