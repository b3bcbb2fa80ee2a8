//! Layer normalisation over the channel dimension.

use super::bf16;
use super::fastmath::{simd_fn, Simd};
use super::{norm_rows, SharedMut};
use rayon::prelude::*;

/// A layer norm's parameters: `weight` (C) and `bias` (C), or no bias (empty), and
/// the `eps` added to the variance (the model's: GPT-2's 1e-5).
#[derive(Clone, Copy)]
pub struct Norm<'a> {
    pub weight: &'a [f32],
    pub bias: &'a [f32],
    pub eps: f32,
}

/// Where a layer norm's parameter gradients accumulate: `dweight` (C) and `dbias` (C),
/// or no bias (empty).
pub struct NormGrads<'a> {
    pub dweight: &'a mut [f32],
    pub dbias: &'a mut [f32],
}

/// `out = (inp - mean) · rstd · weight + bias`, row by row. With `BF16` the output is
/// rounded to bf16 (it is a bf16 matmul operand), row by row while it is in cache.
///
/// inp, out: (N, C); mean, rstd: (N) written, kept for backward.
pub fn layernorm_forward<const BF16: bool>(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    w: Norm,
) {
    let stats = mean.par_iter_mut().zip_eq(rstd);
    norm_rows(out, inp, w.weight.len(), stats, |simd, o, x, (m, r)| {
        (*m, *r) = forward_row(simd, o, x, w, BF16)
    });
}

simd_fn! {
    /// One row of [`layernorm_forward`]: its `(mean, rstd)`, and `o` written.
    fn forward_row(o: &mut [f32], x: &[f32], w: Norm, round: bool) -> (f32, f32) {
        let c = x.len();
        let mu = lane_sum(x, |v| v) / c as f32;
        let var = lane_sum(x, |v| (v - mu) * (v - mu)) / c as f32;
        let rs = 1.0 / (var + w.eps).sqrt();
        apply_row(o, x, mu, rs, w, round);
        (mu, rs)
    }
}

simd_fn! {
    /// One row of [`layernorm_recompute`].
    fn recompute_row(o: &mut [f32], x: &[f32], mu: f32, rs: f32, w: Norm, round: bool) {
        apply_row(o, x, mu, rs, w, round);
    }
}

/// The output of [`layernorm_forward`] again, from its saved `mean` and `rstd`
/// (bit-identical: the same arithmetic on the same values), for a backward pass that
/// recomputes a layer norm's output instead of keeping it.
pub fn layernorm_recompute<const BF16: bool>(
    out: &mut [f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    w: Norm,
) {
    let stats = mean.par_iter().zip_eq(rstd);
    norm_rows(out, inp, w.weight.len(), stats, |simd, o, x, (&mu, &rs)| {
        recompute_row(simd, o, x, mu, rs, w, BF16)
    });
}

/// `o = (x − mu) · rs · weight + bias` for one row (no bias when `bias` is empty),
/// rounded to bf16 when `round` (in the same pass, so the compiled variant rounds
/// with its own vectors).
#[inline(always)]
fn apply_row(o: &mut [f32], x: &[f32], mu: f32, rs: f32, w: Norm, round: bool) {
    let finish = |v: f32| if round { bf16::round(v) } else { v };
    if w.bias.is_empty() {
        for ((o, &x), &w) in o.iter_mut().zip(x).zip(w.weight) {
            *o = finish((x - mu) * rs * w);
        }
    } else {
        for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w.weight).zip(w.bias) {
            *o = finish((x - mu) * rs * w + b);
        }
    }
}

/// Independent partial sums per lane, so that the row reductions vectorise; their
/// order is fixed, so results do not depend on the thread count.
const LANES: usize = 16;

/// `Σ f(x_i)` over one row.
#[inline(always)]
fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (s, &v) in lanes.iter_mut().zip(chunk) {
            *s += f(v);
        }
    }
    let rest: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    lanes.iter().sum::<f32>() + rest
}

/// `(Σ dnorm_i, Σ dnorm_i · xhat_i)` over one row, with `dnorm = dy · w` and
/// `xhat = (x − mean) · rstd`.
#[inline(always)]
fn dnorm_sums(dy: &[f32], x: &[f32], w: &[f32], mu: f32, rs: f32) -> (f32, f32) {
    let (mut s1, mut s2) = ([0.0f32; LANES], [0.0f32; LANES]);
    let rows = dy.chunks_exact(LANES).zip(x.chunks_exact(LANES));
    for ((dy, x), w) in rows.zip(w.chunks_exact(LANES)) {
        for i in 0..LANES {
            let dnorm = dy[i] * w[i];
            s1[i] += dnorm;
            s2[i] += dnorm * (x[i] - mu) * rs;
        }
    }
    let tail = dy.len() - dy.len() % LANES;
    let (mut r1, mut r2) = (0.0f32, 0.0f32);
    for ((&dy, &x), &w) in dy[tail..].iter().zip(&x[tail..]).zip(&w[tail..]) {
        let dnorm = dy * w;
        r1 += dnorm;
        r2 += dnorm * (x - mu) * rs;
    }
    (s1.iter().sum::<f32>() + r1, s2.iter().sum::<f32>() + r2)
}

/// Backward of [`layernorm_forward`] (for either precision: the output's rounding is
/// not differentiated, as autocast does not).
///
/// `dinp` **accumulates** (`+=`): it is the residual stream's gradient, which already
/// holds the skip connection's part. The parameter gradients accumulate as always.
/// dinp, dout, inp: (N, C); weight: (C); mean, rstd: (N) as forward saved them.
pub fn layernorm_backward(
    dinp: &mut [f32],
    g: NormGrads,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
) {
    let _t = crate::profile::scope(crate::profile::Section::LayerNorm);
    let NormGrads { dweight, dbias } = g;
    let c = weight.len();
    let n = inp.len() / c;
    assert!(dinp.len() == n * c && dout.len() == n * c && mean.len() == n);
    // Input gradient, row-parallel.
    let simd = Simd::detect();
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(mean.par_iter().zip(rstd))
        .for_each(|((di, (dy, x)), (&mu, &rs))| backward_row(simd, di, dy, x, weight, mu, rs));
    // Parameter gradients, parallel over channel blocks so no two tasks share an element.
    let has_bias = !dbias.is_empty();
    assert!(dweight.len() == c && (!has_bias || dbias.len() == c));
    let dw = SharedMut::new(dweight);
    let db = SharedMut::new(dbias);
    (0..c.div_ceil(BLOCK)).into_par_iter().for_each(|blk| {
        let (lo, hi) = (blk * BLOCK, ((blk + 1) * BLOCK).min(c));
        let (mut acc_w, mut acc_b) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
        let cols = (lo, hi, c);
        param_grads_block(simd, &mut acc_w, &mut acc_b, dout, inp, mean, rstd, cols);
        // SAFETY: this task alone owns channels [lo, hi) of dweight and dbias.
        let dw = unsafe { dw.slice(lo, hi - lo) };
        for (d, &a) in dw.iter_mut().zip(&acc_w) {
            *d += a;
        }
        if has_bias {
            // SAFETY: as above.
            let db = unsafe { db.slice(lo, hi - lo) };
            for (d, &a) in db.iter_mut().zip(&acc_b) {
                *d += a;
            }
        }
    });
}

simd_fn! {
    /// One row of the input gradient: `di += rs · (dy·w − mean(dnorm) − xhat ·
    /// mean(dnorm·xhat))`.
    fn backward_row(di: &mut [f32], dy: &[f32], x: &[f32], weight: &[f32], mu: f32, rs: f32) {
        let c = weight.len();
        let (sum_dnorm, sum_dnorm_xhat) = dnorm_sums(dy, x, weight, mu, rs);
        let mean_dnorm = sum_dnorm / c as f32;
        let mean_dnorm_xhat = sum_dnorm_xhat / c as f32;
        for (((di, &dy), &x), &w) in di.iter_mut().zip(dy).zip(x).zip(weight) {
            let xhat = (x - mu) * rs;
            *di += rs * (dy * w - mean_dnorm - xhat * mean_dnorm_xhat);
        }
    }
}

/// Channels per task of the parameter gradients.
const BLOCK: usize = 32;

simd_fn! {
    /// The parameter gradients of channels `lo..hi` (of `c`) summed over all rows, in
    /// row order: `acc_w[i] = Σ dy · xhat`, `acc_b[i] = Σ dy`.
    #[allow(clippy::too_many_arguments)]
    fn param_grads_block(
        acc_w: &mut [f32; BLOCK],
        acc_b: &mut [f32; BLOCK],
        dout: &[f32],
        inp: &[f32],
        mean: &[f32],
        rstd: &[f32],
        cols: (usize, usize, usize),
    ) {
        let (lo, hi, c) = cols;
        for row in 0..mean.len() {
            let (mu, rs) = (mean[row], rstd[row]);
            let dy = &dout[row * c + lo..row * c + hi];
            let x = &inp[row * c + lo..row * c + hi];
            for (i, (&dy, &x)) in dy.iter().zip(x).enumerate() {
                acc_w[i] += dy * (x - mu) * rs;
                acc_b[i] += dy;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    /// GPT-2's eps; [`reference`] and the kernel both read it from here.
    const EPS: f32 = 1e-5;

    fn reference(x: &[f64], w: &[f64], b: &[f64], c: usize) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        for (o, x) in out.chunks_mut(c).zip(x.chunks(c)) {
            let mu = x.iter().sum::<f64>() / c as f64;
            let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
            let rs = 1.0 / (var + EPS as f64).sqrt();
            for i in 0..c {
                o[i] = (x[i] - mu) * rs * w[i] + b.get(i).copied().unwrap_or(0.0);
            }
        }
        out
    }

    fn check(n: usize, c: usize, with_bias: bool) {
        let x = rand_vec(n * c, 1);
        let w: Vec<f32> = rand_vec(c, 2).iter().map(|v| 1.0 + 0.5 * v).collect();
        let b = if with_bias { rand_vec(c, 3) } else { vec![] };
        let g = rand_vec(n * c, 4);
        let (x64, w64, b64) = (to_f64(&x), to_f64(&w), to_f64(&b));

        let norm = Norm {
            weight: &w,
            bias: &b,
            eps: EPS,
        };
        let mut out = vec![0.0; n * c];
        let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
        layernorm_forward::<false>(&mut out, &mut mean, &mut rstd, &x, norm);
        assert_close("out", &out, &reference(&x64, &w64, &b64, c), 1e-5, 1e-5);
        let mut again = vec![f32::NAN; n * c];
        layernorm_recompute::<false>(&mut again, &x, &mean, &rstd, norm);
        assert_eq!(again, out, "the recomputed output is bit-identical");
        // bf16 autocast's variants: the same output rounded, and recomputed alike.
        let mut rounded = out.clone();
        crate::kernels::bf16::round_in_place(&mut rounded);
        let (mut out16, mut again16) = (vec![f32::NAN; n * c], vec![f32::NAN; n * c]);
        let (mut mean16, mut rstd16) = (vec![0.0; n], vec![0.0; n]);
        layernorm_forward::<true>(&mut out16, &mut mean16, &mut rstd16, &x, norm);
        layernorm_recompute::<true>(&mut again16, &x, &mean, &rstd, norm);
        assert_eq!((&out16, &mean16, &rstd16), (&rounded, &mean, &rstd));
        assert_eq!(again16, rounded);
        assert_ne!(out16, out, "rounding changed some values");

        let prior = rand_vec(n * c, 5);
        let mut dx = prior.clone();
        let mut dw = vec![0.0; c];
        let mut db = vec![0.0; b.len()];
        let grads = NormGrads {
            dweight: &mut dw,
            dbias: &mut db,
        };
        layernorm_backward(&mut dx, grads, &g, &x, &w, &mean, &rstd);

        let loss = |x: &[f64], w: &[f64], b: &[f64]| dot(&reference(x, w, b, c), &g);
        let mut want_dx = numeric_grad(|v| loss(v, &w64, &b64), &x64, 1e-5);
        for (d, &p) in want_dx.iter_mut().zip(&prior) {
            *d += p as f64; // dinp accumulates onto what was there
        }
        assert_close("dinp", &dx, &want_dx, 1e-4, 1e-5);
        let want_dw = numeric_grad(|v| loss(&x64, v, &b64), &w64, 1e-5);
        assert_close("dweight", &dw, &want_dw, 1e-4, 1e-5);
        if with_bias {
            let want_db = numeric_grad(|v| loss(&x64, &w64, v), &b64, 1e-5);
            assert_close("dbias", &db, &want_db, 1e-4, 1e-5);
        }
    }

    #[test]
    fn every_simd_level_gives_the_same_bits() {
        let (n, c) = (3, 77); // a tail after the 16-lane sums and the vectors
        let x: Vec<f32> = rand_vec(n * c, 5).iter().map(|v| 3.0 * v + 0.5).collect();
        let (w, b, dy) = (rand_vec(c, 6), rand_vec(c, 7), rand_vec(n * c, 8));
        let norm = Norm {
            weight: &w,
            bias: &b,
            eps: EPS,
        };
        let run = |simd: Simd| {
            let mut bits = Vec::new();
            for round in [false, true] {
                for (x, dy) in x.chunks(c).zip(dy.chunks(c)) {
                    let mut o = vec![0.0; c];
                    let (mu, rs) = forward_row(simd, &mut o, x, norm, round);
                    let mut di = vec![0.5; c];
                    backward_row(simd, &mut di, dy, x, &w, mu, rs);
                    bits.extend([mu, rs].iter().chain(&o).chain(&di).map(|v| v.to_bits()));
                }
            }
            let (mean, rstd) = (vec![0.1, -0.2, 0.3], vec![1.5, 0.7, 2.0]);
            let (mut acc_w, mut acc_b) = ([0.0; BLOCK], [0.0; BLOCK]);
            param_grads_block(
                simd,
                &mut acc_w,
                &mut acc_b,
                &dy,
                &x,
                &mean,
                &rstd,
                (64, 77, c),
            );
            bits.extend(acc_w.iter().chain(&acc_b).map(|v| v.to_bits()));
            bits
        };
        let levels = Simd::available();
        let want = run(levels[0]);
        for simd in &levels[1..] {
            assert_eq!(run(*simd), want, "{simd:?}");
        }
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        check(5, 8, true);
        check(3, 70, true);
        check(4, 33, false);
    }
}
