//! Tests of the flash-style passes: forward against [`naive_forward`], backward against
//! central differences and [`naive_backward`], on every instruction-set variant this
//! CPU has; and the properties the model relies on (dropout, thread-count independence).

use super::*;
use crate::kernels::testutil::{assert_close, dot, numeric_grad, rand_vec, to_f64};
use crate::kernels::Dims;

fn inputs(b: usize, t: usize, c: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    // Scaled up so that attention is far from uniform.
    let qkv: Vec<f32> = rand_vec(b * t * 3 * c, seed)
        .iter()
        .map(|v| 2.0 * v)
        .collect();
    (qkv, rand_vec(b * t * c, seed + 1))
}

/// Checks forward against [`naive_forward`], and backward against central differences
/// of `L = Σ out · w` (on every coordinate, or on `subset` of them if given) and
/// against [`naive_backward`] (on every coordinate).
fn check(
    (b, t, c, nh): (usize, usize, usize, usize),
    mask: Option<Dropout>,
    seed: u64,
    subset: Option<usize>,
) {
    let d = Dims { b, t, c, nh };
    let (qkv, w) = inputs(b, t, c, seed);
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
        let what = format!("B={b} T={t} C={c} NH={nh} mask={mask:?} {isa:?}");
        let mut out = vec![f32::NAN; b * t * c];
        let mut lse = vec![f32::NAN; b * nh * t];
        forward_impl(isa, &mut out, &mut lse, &qkv, d, mask);
        assert_close(&format!("{what}: out"), &out, &want_out, 1e-5, 1e-6);
        assert_close(&format!("{what}: lse"), &lse, &want_lse, 1e-5, 1e-6);
        let mut dqkv = vec![f32::NAN; qkv.len()];
        backward_impl(isa, &mut dqkv, &w, &qkv, &out, &lse, d, mask, false);
        // bf16 autocast's variant rounds each block of rows as it is final: the
        // same bits as rounding the finished gradient in a pass of its own.
        let mut rounded = vec![f32::NAN; qkv.len()];
        backward_impl(isa, &mut rounded, &w, &qkv, &out, &lse, d, mask, true);
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
        let d = Dims {
            b: 2,
            t: 6,
            c: 12,
            nh: 2,
        };
        let (qkv, w) = inputs(d.b, d.t, d.c, seed);
        let qkv = to_f64(&qkv);
        let loss = |x: &[f64]| dot(&naive_forward(x, d, mask).0, &w);
        let want = numeric_grad(loss, &qkv, 1e-5);
        let got = naive_backward(&to_f64(&w), &qkv, d, mask);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-8 * (1.0 + w.abs()),
                "{mask:?}: {i}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn small_two_heads() {
    check((2, 7, 16, 2), None, 1, None);
    check((2, 7, 16, 2), DROP, 2, None);
}

#[test]
fn single_token() {
    check((1, 1, 16, 2), None, 3, None);
    check((1, 1, 16, 2), DROP, 4, None);
}

#[test]
fn several_blocks_ragged_tail() {
    // T = 70 is more than two blocks and not a multiple of the block size; HS = 8.
    check((1, 70, 16, 2), None, 5, None);
    check((1, 70, 16, 2), DROP, 6, None);
}

#[test]
fn one_head() {
    // HS = 24: a 16-wide strip plus an 8-wide one.
    check((2, 33, 24, 1), None, 7, None);
    check((2, 33, 24, 1), DROP, 8, None);
}

#[test]
fn head_size_16() {
    check((2, 9, 48, 3), None, 9, None);
    check((2, 9, 48, 3), DROP, 10, None);
}

#[test]
fn head_size_64() {
    check((2, 65, 128, 2), None, 11, Some(500));
    check((2, 65, 128, 2), DROP, 12, Some(500));
}

#[test]
fn head_size_80() {
    check((1, 40, 160, 2), None, 13, Some(400));
    check((1, 40, 160, 2), DROP, 14, Some(400));
}

#[test]
fn head_larger_than_tile() {
    // HS = 136 > DT: channels go through the transposed tiles in two chunks.
    const { assert!(136 > DT) };
    check((1, 35, 136, 1), None, 15, Some(400));
    check((1, 35, 136, 1), DROP, 16, Some(400));
}

#[test]
fn dropout_changes_output() {
    let (b, t, c, nh) = (1, 20, 16, 2);
    let d = Dims { b, t, c, nh };
    let (qkv, _) = inputs(b, t, c, 17);
    let run = |mask| {
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        attention_forward(&mut out, &mut lse, &qkv, d, mask);
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
    let d = Dims { b, t, c, nh };
    let (qkv, dout) = inputs(b, t, c, 18);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut out = vec![0.0; b * t * c];
            let mut lse = vec![0.0; b * nh * t];
            attention_forward(&mut out, &mut lse, &qkv, d, DROP);
            let mut dqkv = vec![0.0; qkv.len()];
            attention_backward::<false>(&mut dqkv, &dout, &qkv, &out, &lse, d, DROP);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&out), bits(&lse), bits(&dqkv))
        })
    };
    let one = run(1);
    assert!(one.2.iter().any(|&x| x != 0));
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}
