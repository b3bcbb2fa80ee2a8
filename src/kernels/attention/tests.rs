//! Tests of the flash-style passes: forward against [`naive_forward`], backward against
//! central differences and [`naive_backward`], on every instruction-set variant this
//! CPU has; and the properties the model relies on (dropout, thread-count independence).

use super::*;
use crate::kernels::bf16::Kernel;
use crate::kernels::testutil::{assert_close, dot, numeric_grad, rand_vec, to_f64};
use crate::kernels::Dims;

/// This machine's bf16 back-end, as `train` would pick it without a request.
fn here() -> Backend {
    Backend::detect(None)
}

/// Random `qkv` `(B, T, (NH + 2·KV)·HS)` and an output gradient `(B, T, NH·HS)`.
fn inputs_of(d: Dims, seed: u64) -> (Vec<f32>, Vec<f32>) {
    // Scaled up so that attention is far from uniform.
    let qkv: Vec<f32> = rand_vec(d.bt() * d.qkv_width(), seed)
        .iter()
        .map(|v| 2.0 * v)
        .collect();
    (qkv, rand_vec(d.bt() * d.q_width(), seed + 1))
}

/// [`inputs_of`] multi-head attention over `C` in `NH` heads.
fn inputs(b: usize, t: usize, c: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    inputs_of(Dims::new(b, t, c, 1), seed)
}

/// `(B, T, C, NH)`: NH heads of C / NH channels.
type Shape = (usize, usize, usize, usize);

/// [`check_dims`] for multi-head attention of a [`Shape`].
fn check((b, t, c, nh): Shape, mask: Option<Dropout>, seed: u64, subset: Option<usize>) {
    check_dims(Dims::new(b, t, c, nh), mask, seed, subset)
}

/// Checks forward against [`naive_forward`], and backward against central differences
/// of `L = Σ out · w` (on every coordinate, or on `subset` of them if given) and
/// against [`naive_backward`] (on every coordinate).
fn check_dims(d: Dims, mask: Option<Dropout>, seed: u64, subset: Option<usize>) {
    let Dims {
        b, t, nh, kv, hs, ..
    } = d;
    let (qkv, w) = inputs_of(d, seed);
    let qkv64 = to_f64(&qkv);
    let (want_out, want_lse) = naive_forward(&qkv64, d, mask);
    let loss = |x: &[f64]| dot(&naive_forward(x, d, mask).0, &w);
    let eps = 1e-5;
    let (indices, want_grad): (Vec<usize>, Vec<f64>) = match subset {
        None => ((0..qkv.len()).collect(), numeric_grad(loss, &qkv64, eps)),
        Some(n) => {
            let stride = (qkv.len() / n).max(1) | 1;
            let idx: Vec<usize> = (0..qkv.len()).step_by(stride).collect();
            let mut x = qkv64.clone();
            let grad = idx
                .iter()
                .map(|&i| {
                    let orig = x[i];
                    x[i] = orig + eps;
                    let plus = loss(&x);
                    x[i] = orig - eps;
                    let minus = loss(&x);
                    x[i] = orig;
                    (plus - minus) / (2.0 * eps)
                })
                .collect();
            (idx, grad)
        }
    };
    let want_dqkv = naive_backward(&to_f64(&w), &qkv64, d, mask);
    for isa in Isa::available() {
        let what = format!("B={b} T={t} NH={nh} KV={kv} HS={hs} mask={mask:?} {isa:?}");
        let mut out = vec![f32::NAN; d.bt() * d.q_width()];
        let mut lse = vec![f32::NAN; b * nh * t];
        forward_impl(isa, &mut out, &mut lse, &qkv, d, mask, false);
        assert_close(&format!("{what}: out"), &out, &want_out, 1e-5, 1e-6);
        assert_close(&format!("{what}: lse"), &lse, &want_lse, 1e-5, 1e-6);
        let mut dqkv = vec![f32::NAN; qkv.len()];
        backward_impl(isa, &mut dqkv, &w, &qkv, &out, &lse, d, mask, false, false);
        // bf16 autocast's variant rounds each block of rows as it is final: the
        // same bits as rounding the finished gradient in a pass of its own.
        let mut rounded = vec![f32::NAN; qkv.len()];
        backward_impl(
            isa,
            &mut rounded,
            &w,
            &qkv,
            &out,
            &lse,
            d,
            mask,
            true,
            false,
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut want_rounded = dqkv.clone();
        crate::kernels::bf16::round_in_place(&mut want_rounded);
        assert_eq!(bits(&rounded), bits(&want_rounded), "{what}: rounded dqkv");
        assert_ne!(bits(&rounded), bits(&dqkv), "{what}: rounding changes bits");
        let got: Vec<f32> = indices.iter().map(|&i| dqkv[i]).collect();
        assert_close(&format!("{what}: dqkv"), &got, &want_grad, 1e-4, 1e-5);
        assert_close(
            &format!("{what}: dqkv (naive)"),
            &dqkv,
            &want_dqkv,
            1e-4,
            1e-5,
        );
    }
}

const DROP: Option<Dropout> = Some(Dropout { p: 0.25, seed: 99 });

#[test]
fn naive_backward_is_the_gradient_of_naive_forward() {
    for (mask, seed) in [(None, 19), (DROP, 20)] {
        // Multi-head, and grouped-query with HS != C / NH.
        for d in [
            Dims::new(2, 6, 12, 2),
            Dims::new(2, 6, 12, 4).with_heads(2, 5),
        ] {
            let (qkv, w) = inputs_of(d, seed);
            let qkv = to_f64(&qkv);
            let loss = |x: &[f64]| dot(&naive_forward(x, d, mask).0, &w);
            let want = numeric_grad(loss, &qkv, 1e-5);
            let got = naive_backward(&to_f64(&w), &qkv, d, mask);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-8 * (1.0 + w.abs()),
                    "{d:?} {mask:?}: {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// Shapes `(B, T, C, NH)` [`check`]ed without and with dropout (seeds `2i + 1` and
/// `2i + 2` for case `i`), each with how many coordinates the finite differences
/// take (None: all): two heads; one token; T = 70, more than two blocks with a
/// ragged tail (HS = 8); one head of HS = 24, a 16-wide strip plus an 8-wide one;
/// HS = 16, 64 and 80; HS = 136 > DT, whose channels go through the transposed
/// tiles in two chunks.
const SHAPES: [(Shape, Option<usize>); 8] = [
    ((2, 7, 16, 2), None),
    ((1, 1, 16, 2), None),
    ((1, 70, 16, 2), None),
    ((2, 33, 24, 1), None),
    ((2, 9, 48, 3), None),
    ((2, 65, 128, 2), Some(500)),
    ((1, 40, 160, 2), Some(400)),
    ((1, 35, 136, 1), Some(400)),
];

#[test]
fn matches_the_references_on_each_shape() {
    const { assert!(136 > DT) };
    for (i, &(shape, subset)) in SHAPES.iter().enumerate() {
        let seed = 2 * i as u64 + 1;
        check(shape, None, seed, subset);
        check(shape, DROP, seed + 1, subset);
    }
}

#[test]
fn grouped_query_three_to_one() {
    // 6 query heads over 2 key/value heads, HS = 8; more than one key block.
    let d = Dims::new(2, 37, 48, 6).with_heads(2, 8);
    check_dims(d, None, 41, None);
    check_dims(d, DROP, 42, Some(600));
}

#[test]
fn one_key_value_head() {
    // Multi-query: every query head reads the one key/value head; HS = 12.
    let d = Dims::new(2, 20, 48, 4).with_heads(1, 12);
    check_dims(d, None, 43, None);
    check_dims(d, DROP, 44, None);
}

#[test]
fn head_size_independent_of_channels() {
    // Qwen3's shape: HS = 128 > C / NH (here C = 64 in 4 heads), 2:1 groups; and a
    // head wider than a tile with one key/value head.
    let qwen3 = Dims::new(1, 35, 64, 4).with_heads(2, 128);
    check_dims(qwen3, None, 45, Some(500));
    check_dims(qwen3, DROP, 46, Some(500));
    let wide = Dims::new(1, 35, 64, 2).with_heads(1, 136);
    check_dims(wide, None, 47, Some(400));
}

/// Forward, then backward, with [`DROP`] on the f32 products: `(out, lse, dqkv)`.
fn pass(d: Dims, qkv: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let backend = Backend::portable();
    let mut out = vec![0.0; d.bt() * d.q_width()];
    let mut lse = vec![0.0; d.b * d.nh * d.t];
    attention_forward::<false>(&mut out, &mut lse, qkv, d, DROP, &backend);
    let mut dqkv = vec![0.0; qkv.len()];
    attention_backward::<false>(&mut dqkv, dout, qkv, &out, &lse, d, DROP, &backend, true);
    (out, lse, dqkv)
}

/// [`pass`] on a pool of `threads` threads, its results as bits.
fn pass_bits(threads: usize, d: Dims, qkv: &[f32], dout: &[f32]) -> [Vec<u32>; 3] {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let (out, lse, dqkv) = pool.install(|| pass(d, qkv, dout));
    [out, lse, dqkv].map(|v| v.iter().map(|x| x.to_bits()).collect())
}

#[test]
fn grouped_query_does_not_depend_on_the_thread_count() {
    let d = Dims::new(2, 70, 64, 6).with_heads(2, 16);
    let (qkv, dout) = inputs_of(d, 48);
    let one = pass_bits(1, d, &qkv, &dout);
    assert_eq!(one, pass_bits(2, d, &qkv, &dout));
    assert_eq!(one, pass_bits(3, d, &qkv, &dout));
}

#[test]
fn multi_head_is_grouped_query_with_groups_of_one() {
    // Dims::new's heads and the same heads spelled out agree bit for bit.
    let d = Dims::new(2, 40, 48, 3);
    let spelled = Dims::new(2, 40, 0, 3).with_heads(3, 16);
    let (qkv, dout) = inputs_of(d, 49);
    assert_eq!(pass(d, &qkv, &dout), pass(spelled, &qkv, &dout));
}

#[test]
fn grouped_query_matches_transformers() {
    // transformers' eager attention (repeat_kv, causal mask) on 3:1 groups, one
    // key/value head, and Qwen3's head_dim 128.
    let f = crate::kernels::testutil::LlamaFixture::load();
    for name in ["gqa3", "mqa", "qwen3"] {
        let d = f.dims(&format!("attn.{name}.dims"));
        let qkv = f.f32(&format!("attn.{name}.qkv"));
        let dout = f.f32(&format!("attn.{name}.dout"));
        for isa in Isa::available() {
            let what = format!("{name} {isa:?}");
            let mut out = vec![f32::NAN; d.bt() * d.q_width()];
            let mut lse = vec![f32::NAN; d.b * d.nh * d.t];
            forward_impl(isa, &mut out, &mut lse, &qkv, d, None, false);
            let want = f.f64(&format!("attn.{name}.out"));
            assert_close(&format!("{what}: out"), &out, &want, 1e-5, 1e-6);
            let mut dqkv = vec![f32::NAN; qkv.len()];
            backward_impl(
                isa, &mut dqkv, &dout, &qkv, &out, &lse, d, None, false, false,
            );
            let want = f.f64(&format!("attn.{name}.dqkv"));
            assert_close(&format!("{what}: dqkv"), &dqkv, &want, 1e-4, 1e-6);
        }
    }
}

#[test]
fn dropout_changes_output() {
    let (b, t, c, nh) = (1, 20, 16, 2);
    let d = Dims::new(b, t, c, nh);
    let (qkv, _) = inputs(b, t, c, 17);
    let run = |mask| {
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        attention_forward::<false>(&mut out, &mut lse, &qkv, d, mask, &Backend::portable());
        (out, lse)
    };
    let (plain, plain_lse) = run(None);
    let (dropped, dropped_lse) = run(DROP);
    assert_ne!(plain, dropped);
    assert_eq!(plain_lse, dropped_lse, "lse must not depend on dropout");
    assert_eq!(plain, run(Some(Dropout { p: 0.0, seed: 5 })).0);
}

#[test]
fn deterministic_across_thread_counts() {
    let (b, t, c, nh) = (2, 100, 64, 4);
    let d = Dims::new(b, t, c, nh);
    let (qkv, dout) = inputs(b, t, c, 18);
    let one = pass_bits(1, d, &qkv, &dout);
    assert!(one[2].iter().any(|&x| x != 0));
    assert_eq!(one, pass_bits(2, d, &qkv, &dout));
    assert_eq!(one, pass_bits(3, d, &qkv, &dout));
}

/// bf16's unit roundoff: with 8 significant bits, rounding to nearest changes a
/// normal value by at most half an ulp, `2^-8` of it.
const BF16_U: f64 = 1.0 / 256.0;

/// What rounding the bf16 products' operands can move each output by, in units of
/// [`BF16_U`], in the notation of [`naive_backward`] (q, k, v and dO already hold bf16
/// values, so only P̃ and dS are rounded):
/// - `out_t`: `Σ_s p_s·m_s·|v_s|` (each term of `Σ p_s·m_s·v_s` moves by at most
///   `U·p_s·m_s·|v_s|`; the running-max factor of P̃ and `1 / l` are exact scalings);
/// - `dv_s`: `Σ_t p_s·m_s·|dout_t|`, `dq_t`: `Σ_s |dx_s|·|k_s|`, `dk_s`: `Σ_t |dx_s|·|q_t|`.
fn bf16_bounds(dout: &[f64], qkv: &[f64], d: Dims, dropout: Option<Dropout>) -> [Vec<f64>; 2] {
    let (hs, qw) = (d.hs, d.q_width());
    let scale = 1.0 / (hs as f64).sqrt();
    let mut out = vec![0.0; dout.len()];
    let mut dqkv = vec![0.0; qkv.len()];
    for query in naive_queries(d) {
        let (b, h, t) = query;
        let (p, _) = naive_probs(qkv, d, query);
        let o = (b * d.t + t) * qw + h * hs;
        let q = naive_at(d, query, 0);
        let m: Vec<f64> = (0..p.len())
            .map(|s| naive_mask(dropout, d, query, s))
            .collect();
        let dp: Vec<f64> = (0..p.len())
            .map(|s| m[s] * naive_dot(&dout[o..o + hs], &qkv[naive_at(d, (b, h, s), 2)..][..hs]))
            .collect();
        let p_dp = naive_dot(&p, &dp);
        for (s, &ps) in p.iter().enumerate() {
            let (k, v) = (naive_at(d, (b, h, s), 1), naive_at(d, (b, h, s), 2));
            let dx = (ps * (dp[s] - p_dp) * scale).abs();
            for i in 0..hs {
                out[o + i] += ps * m[s] * qkv[v + i].abs();
                dqkv[v + i] += ps * m[s] * dout[o + i].abs();
                dqkv[q + i] += dx * qkv[k + i].abs();
                dqkv[k + i] += dx * qkv[q + i].abs();
            }
        }
    }
    [out, dqkv]
}

/// Checks `got` against `want` within `U·bound` plus f32 noise (`rtol·|want| + atol`);
/// returns the largest error as a fraction of `U·bound`.
fn within_bound(
    what: &str,
    got: &[f32],
    want: &[f64],
    bound: &[f64],
    (rtol, atol): (f64, f64),
) -> f64 {
    assert_eq!(got.len(), want.len());
    let mut worst = 0.0f64;
    for (i, ((&g, &w), &b)) in got.iter().zip(want).zip(bound).enumerate() {
        let err = (g as f64 - w).abs();
        let tol = BF16_U * b + rtol * w.abs() + atol;
        assert!(
            err <= tol,
            "{what}: element {i} is {g} but should be {w} ± {tol} (bound {b})"
        );
        if b > 0.0 {
            worst = worst.max(err / (BF16_U * b));
        }
    }
    worst
}

/// bf16 attention against [`naive_forward`] and [`naive_backward`] on bf16-valued q, k,
/// v and dout, within [`bf16_bounds`]. Where the products can run on `vdpbf16ps`
/// ([`bf16_capable`]; run here whatever T) the rounding must also show (some error
/// beyond f32 noise); elsewhere, or with `bf16_kernel = f32`, the f32 passes run
/// and must be as close as in [`check`].
fn check_bf16((b, t, c, nh): Shape, mask: Option<Dropout>, seed: u64) {
    check_bf16_dims(Dims::new(b, t, c, nh), mask, seed)
}

/// [`check_bf16`] for any heads.
fn check_bf16_dims(d: Dims, mask: Option<Dropout>, seed: u64) {
    let Dims {
        b, t, nh, kv, hs, ..
    } = d;
    let (qkv, dout) = inputs_of(d, seed);
    let (qkv, dout) = (bf16_values(&qkv), bf16_values(&dout));
    let (qkv64, dout64) = (to_f64(&qkv), to_f64(&dout));
    let (want_out, want_lse) = naive_forward(&qkv64, d, mask);
    let want_dqkv = naive_backward(&dout64, &qkv64, d, mask);
    let [out_bound, dqkv_bound] = bf16_bounds(&dout64, &qkv64, d, mask);
    let bf16 = bf16_capable(d, &here());
    let what = format!("bf16 products {bf16}: B={b} T={t} NH={nh} KV={kv} HS={hs} mask={mask:?}");
    let mut out = vec![f32::NAN; d.bt() * d.q_width()];
    let mut lse = vec![f32::NAN; b * nh * t];
    forward_impl(Isa::detect(), &mut out, &mut lse, &qkv, d, mask, bf16);
    assert_close(&format!("{what}: lse"), &lse, &want_lse, 1e-5, 1e-6);
    // The backward from the exact forward, so that its own roundings are what is
    // measured.
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let mut dqkv = vec![f32::NAN; qkv.len()];
    let (exact_out, exact_lse) = (f32s(&want_out), f32s(&want_lse));
    backward_impl(
        Isa::detect(),
        &mut dqkv,
        &dout,
        &qkv,
        &exact_out,
        &exact_lse,
        d,
        mask,
        false,
        bf16,
    );
    if !bf16 {
        assert_close(&format!("{what}: out"), &out, &want_out, 1e-5, 1e-6);
        assert_close(&format!("{what}: dqkv"), &dqkv, &want_dqkv, 1e-4, 1e-5);
        return;
    }
    let fwd = within_bound(
        &format!("{what}: out"),
        &out,
        &want_out,
        &out_bound,
        (1e-5, 1e-6),
    );
    let bwd = within_bound(
        &format!("{what}: dqkv"),
        &dqkv,
        &want_dqkv,
        &dqkv_bound,
        (1e-4, 1e-5),
    );
    println!("{what}: largest error / bound: out {fwd:.3}, dqkv {bwd:.3}");
    if t > 1 {
        // f32 products would stay below 1 % of the bound (~1e-7 against ~1e-4).
        assert!(
            fwd > 0.05 && bwd > 0.05,
            "{what}: no bf16 rounding seen ({fwd}, {bwd})"
        );
    }
}

fn bf16_values(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| crate::kernels::bf16::round(v)).collect()
}

#[test]
fn bf16_products_head_size_64() {
    for (t, seed) in [(1, 21), (17, 22), (65, 23)] {
        check_bf16((2, t, 128, 2), None, seed);
        check_bf16((2, t, 128, 2), DROP, seed + 10);
    }
}

#[test]
fn bf16_products_odd_head_sizes() {
    // HS = 13: an odd number of channels (a half pair) and a partial 16-lane vector;
    // HS = 40 and 128: column strips of 32 + 8 and of two full 64s.
    for (c, nh, t) in [(16, 2, 8), (26, 2, 17), (80, 2, 65), (128, 1, 40)] {
        check_bf16((1, t, c, nh), None, 31);
        check_bf16((1, t, c, nh), DROP, 32);
    }
}

#[test]
fn bf16_products_grouped_query() {
    // 3:1 groups and one key/value head; HS = 128 (Qwen3) with a ragged T.
    for (d, t) in [
        (Dims::new(2, 0, 48, 6).with_heads(2, 8), 65),
        (Dims::new(1, 0, 48, 4).with_heads(1, 12), 40),
        (Dims::new(1, 0, 64, 4).with_heads(2, 128), 33),
    ] {
        check_bf16_dims(Dims { t, ..d }, None, 51);
        check_bf16_dims(Dims { t, ..d }, DROP, 52);
    }
}

#[test]
fn bf16_products_do_not_depend_on_the_thread_count() {
    let (b, t, c, nh) = (2, 100, 64, 4);
    let d = Dims::new(b, t, c, nh);
    let (qkv, dout) = inputs(b, t, c, 24);
    let (qkv, dout) = (bf16_values(&qkv), bf16_values(&dout));
    let bf16 = bf16_capable(d, &here());
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut out = vec![0.0; b * t * c];
            let mut lse = vec![0.0; b * nh * t];
            forward_impl(Isa::detect(), &mut out, &mut lse, &qkv, d, DROP, bf16);
            let mut dqkv = vec![0.0; qkv.len()];
            let isa = Isa::detect();
            backward_impl(isa, &mut dqkv, &dout, &qkv, &out, &lse, d, DROP, true, bf16);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&out), bits(&lse), bits(&dqkv))
        })
    };
    let one = run(1);
    assert!(one.2.iter().any(|&x| x != 0));
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}

#[test]
fn bf16_products_run_from_the_measured_lengths_on() {
    let d = |t| Dims::new(1, t, 128, 2);
    let here = here();
    let capable = bf16_capable(d(1), &here);
    for t in [1, 256, 511, 512, 1024, 2047, 2048, 4096] {
        assert_eq!(
            bf16_forward_products::<true>(d(t), &here),
            capable && t >= 2048
        );
        assert_eq!(
            bf16_backward_products::<true>(d(t), &here),
            capable && t >= 512
        );
        assert!(
            !bf16_forward_products::<false>(d(t), &here)
                && !bf16_backward_products::<false>(d(t), &here)
        );
    }
    // Heads wider than a tile keep the f32 passes.
    let wide = Dims::new(1, 4096, 136, 1);
    assert!(
        !bf16_forward_products::<true>(wide, &here) && !bf16_backward_products::<true>(wide, &here)
    );
}

#[test]
fn bf16_falls_back_to_the_f32_products_when_forced() {
    // `bf16_kernel = f32` (a back-end on the f32 GEMM) runs bf16 attention on the f32
    // products: the f32 pass's bits, plus dqkv's rounding. T 512: long enough for the
    // backward's products to run on `vdpbf16ps` otherwise.
    let d = Dims::new(1, 512, 64, 2);
    let (qkv, dout) = inputs(d.b, d.t, d.c, 25);
    let qkv = bf16_values(&qkv);
    let run = |bf16: bool, backend: &Backend| {
        let mut out = vec![0.0; d.bt() * d.c];
        let mut lse = vec![0.0; d.b * d.nh * d.t];
        let mut dqkv = vec![0.0; qkv.len()];
        if bf16 {
            attention_forward::<true>(&mut out, &mut lse, &qkv, d, DROP, backend);
            attention_backward::<true>(&mut dqkv, &dout, &qkv, &out, &lse, d, DROP, backend, true);
        } else {
            attention_forward::<false>(&mut out, &mut lse, &qkv, d, DROP, backend);
            attention_backward::<false>(&mut dqkv, &dout, &qkv, &out, &lse, d, DROP, backend, true);
            crate::kernels::bf16::round_in_place(&mut dqkv);
        }
        (out, lse, dqkv)
    };
    let here = here();
    let f32_run = run(false, &here);
    let on_f32 = Backend::with_kernel(Kernel::F32).expect("the f32 GEMM runs everywhere");
    assert!(!bf16_capable(d, &on_f32));
    assert_eq!(run(true, &on_f32), f32_run);
    if bf16_backward_products::<true>(d, &here) {
        assert_ne!(
            run(true, &here).2,
            f32_run.2,
            "the bf16 products change dqkv"
        );
    }
}

/// CPU time of the calling thread, in seconds (what a loaded machine does not steal);
/// with `ATTN_THREADS` above 1, of the whole process (the test's other threads idle).
fn thread_cpu_seconds() -> f64 {
    let clock = match std::env::var("ATTN_THREADS").map_or(1, |t| t.parse().unwrap()) {
        1 => libc::CLOCK_THREAD_CPUTIME_ID,
        _ => libc::CLOCK_PROCESS_CPUTIME_ID,
    };
    crate::kernels::testutil::cpu_seconds(clock)
}

/// Timing, not correctness: `cargo test --release --lib bf16_attention_speed --
/// --ignored --nocapture`. One thread (so the thread's CPU time is the work's), GPT-2
/// 124M's heads (C = 768, NH = 12) on one sequence of T = 256 and 1024 (`ATTN_T`; with B
/// sequences, B times as long), alternating the f32 and the `vdpbf16ps` products;
/// medians of `ATTN_REPS` (5) runs, wall and CPU milliseconds (`ATTN_THREADS=2`: two
/// threads, the process's CPU time).
#[test]
#[ignore]
fn bf16_attention_speed() {
    if !isa::bf16_usable() {
        eprintln!("not timed: no AVX512-BF16 on this CPU");
        return;
    }
    let reps = std::env::var("ATTN_REPS").map_or(5, |r| r.parse().unwrap());
    let threads = std::env::var("ATTN_THREADS").map_or(1, |t| t.parse().unwrap());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    // ATTN_T=256,512 picks the sequence lengths.
    let ts = std::env::var("ATTN_T").unwrap_or("256,1024".into());
    for t in ts.split(',').map(|t| t.parse::<usize>().unwrap()) {
        let d = Dims::new(1, t, 768, 12);
        let (qkv, dout) = inputs(d.b, t, d.c, 40);
        let (qkv, dout) = (bf16_values(&qkv), bf16_values(&dout));
        let mut out = vec![0.0; d.bt() * d.c];
        let mut lse = vec![0.0; d.nh * t];
        let mut dqkv = vec![0.0; qkv.len()];
        // [f32, bf16] × [forward, backward] × [wall, cpu]
        let mut times = vec![vec![Vec::new(); 4]; 2];
        pool.install(|| {
            for _ in 0..reps {
                for (k, bf16) in [false, true].into_iter().enumerate() {
                    let (w, c) = (std::time::Instant::now(), thread_cpu_seconds());
                    forward_impl(Isa::detect(), &mut out, &mut lse, &qkv, d, None, bf16);
                    times[k][0].push(w.elapsed().as_secs_f64());
                    times[k][1].push(thread_cpu_seconds() - c);
                    let (w, c) = (std::time::Instant::now(), thread_cpu_seconds());
                    let isa = Isa::detect();
                    backward_impl(isa, &mut dqkv, &dout, &qkv, &out, &lse, d, None, true, bf16);
                    times[k][2].push(w.elapsed().as_secs_f64());
                    times[k][3].push(thread_cpu_seconds() - c);
                }
            }
        });
        let median = |v: &Vec<f64>| {
            let mut v = v.clone();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2] * 1e3
        };
        let [f, b] = [&times[0], &times[1]].map(|t| t.iter().map(median).collect::<Vec<_>>());
        println!(
            "T={t}: forward f32 {:.1} ms (cpu {:.1}), bf16 {:.1} ms (cpu {:.1}), {:.2}x by cpu; \
             backward f32 {:.1} ms (cpu {:.1}), bf16 {:.1} ms (cpu {:.1}), {:.2}x by cpu",
            f[0],
            f[1],
            b[0],
            b[1],
            f[1] / b[1],
            f[2],
            f[3],
            b[2],
            b[3],
            f[3] / b[3]
        );
    }
}
