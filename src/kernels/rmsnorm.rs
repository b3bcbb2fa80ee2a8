//! RMS normalisation (Llama, Qwen): `out = x · rstd · weight` with
//! `rstd = 1 / √(mean(x²) + eps)` over the channels of each row; no mean is
//! subtracted and there is no bias. Computed in f32 as Hugging Face's `LlamaRMSNorm`
//! does (`x · rsqrt(variance + eps)`, then times the weight).
//!
//! Also Qwen3's q/k norm ([`qk_norm_forward`]): the same normalisation over each
//! attention head's `HS` channels of the queries and keys, before RoPE.

use super::bf16;
use super::fastmath::simd_fn;
use super::fastmath::Simd;
use super::{norm_rows, Dims, SharedMut};
use rayon::prelude::*;

/// An RMS norm's parameters: `weight` (C) and its `eps`.
#[derive(Clone, Copy)]
pub struct RmsNorm<'a> {
    pub weight: &'a [f32],
    pub eps: f32,
}

/// `out = x · rstd · weight`, row by row. With `BF16` the output is rounded to bf16
/// (it is a bf16 matmul operand), row by row while it is in cache.
///
/// inp, out: (N, C); rstd: (N) written, kept for backward.
pub fn rmsnorm_forward<const BF16: bool>(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    w: RmsNorm,
) {
    norm_rows(
        out,
        inp,
        w.weight.len(),
        rstd.par_iter_mut(),
        |simd, o, x, r| {
            *r = row_rstd(simd, x, w.eps);
            apply_row(simd, o, x, *r, w.weight, BF16);
        },
    );
}

/// The output of [`rmsnorm_forward`] again from its saved `rstd` (bit-identical: the
/// same arithmetic on the same values), for a backward pass that recomputes it.
pub fn rmsnorm_recompute<const BF16: bool>(out: &mut [f32], inp: &[f32], rstd: &[f32], w: RmsNorm) {
    norm_rows(
        out,
        inp,
        w.weight.len(),
        rstd.par_iter(),
        |simd, o, x, &r| apply_row(simd, o, x, r, w.weight, BF16),
    );
}

/// Independent partial sums per lane, so that the row reductions vectorise; their
/// order is fixed, so results do not depend on the thread count.
const LANES: usize = 16;

/// `Σ a_i · b_i` over one row in [`LANES`] partial sums.
#[inline(always)]
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest: f32 = (ca.remainder().iter().zip(cb.remainder()))
        .map(|(&x, &y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + rest
}

simd_fn! {
    /// `1 / √(mean(x²) + eps)` of one row.
    fn row_rstd(x: &[f32], eps: f32) -> f32 {
        1.0 / (lane_dot(x, x) / x.len() as f32 + eps).sqrt()
    }
}

simd_fn! {
    /// `o = (x · rs) · w` for one row, rounded to bf16 when `round`.
    fn apply_row(o: &mut [f32], x: &[f32], rs: f32, w: &[f32], round: bool) {
        for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
            let v = x * rs * w;
            *o = if round { bf16::round(v) } else { v };
        }
    }
}

simd_fn! {
    /// One row of the input gradient, `dx = rs · (g − xhat · mean(g · xhat))` with
    /// `g = dy · w` and `xhat = x · rs`, added to `di` (`accumulate`) or written.
    fn backward_row(di: &mut [f32], dy: &[f32], x: &[f32], w: &[f32], rs: f32, accumulate: bool) {
        let c = x.len();
        // mean(g · xhat) = rs · Σ dy·w·x / C.
        let mut lanes = [0.0f32; LANES];
        let chunks = dy.chunks_exact(LANES).zip(x.chunks_exact(LANES));
        for ((dy, x), w) in chunks.zip(w.chunks_exact(LANES)) {
            for i in 0..LANES {
                lanes[i] += dy[i] * w[i] * x[i];
            }
        }
        let tail = c - c % LANES;
        let rest: f32 = (dy[tail..].iter().zip(&x[tail..]).zip(&w[tail..]))
            .map(|((&dy, &x), &w)| dy * w * x)
            .sum();
        let mean_gx = (lanes.iter().sum::<f32>() + rest) * rs / c as f32;
        for (((di, &dy), &x), &w) in di.iter_mut().zip(dy).zip(x).zip(w) {
            let v = rs * (dy * w - x * rs * mean_gx);
            *di = if accumulate { *di + v } else { v };
        }
    }
}

/// Backward of [`rmsnorm_forward`] (for either precision: the output's rounding is not
/// differentiated, as autocast does not).
///
/// `dinp` **accumulates** (`+=`): it is the residual stream's gradient, which already
/// holds the skip connection's part. `dweight` accumulates as always.
/// dinp, dout, inp: (N, C); weight, dweight: (C); rstd: (N) as forward saved it.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
) {
    let _t = crate::profile::scope(crate::profile::Section::LayerNorm);
    let c = weight.len();
    let n = inp.len() / c;
    assert!(dinp.len() == n * c && dout.len() == n * c && rstd.len() == n);
    assert_eq!(dweight.len(), c);
    let simd = Simd::detect();
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(rstd.par_iter())
        .for_each(|((di, (dy, x)), &rs)| backward_row(simd, di, dy, x, weight, rs, true));
    // The weight's gradient, parallel over channel blocks so no two tasks share an
    // element; each sums its rows in row order.
    let dw = SharedMut::new(dweight);
    (0..c.div_ceil(BLOCK)).into_par_iter().for_each(|blk| {
        let (lo, hi) = (blk * BLOCK, ((blk + 1) * BLOCK).min(c));
        let mut acc = [0.0f32; BLOCK];
        weight_grad_block(simd, &mut acc, dout, inp, rstd, (lo, hi, c));
        // SAFETY: this task alone owns channels [lo, hi) of dweight.
        let dw = unsafe { dw.slice(lo, hi - lo) };
        for (d, &a) in dw.iter_mut().zip(&acc) {
            *d += a;
        }
    });
}

/// Channels per task of the weight's gradient.
const BLOCK: usize = 32;

simd_fn! {
    /// `acc[i] = Σ_rows dy · x · rstd` for channels `lo..hi` (of `c`) of rows of
    /// `(dout, inp)` with their `rstd`, in row order.
    fn weight_grad_block(
        acc: &mut [f32; BLOCK],
        dout: &[f32],
        inp: &[f32],
        rstd: &[f32],
        cols: (usize, usize, usize),
    ) {
        let (lo, hi, c) = cols;
        for (row, &rs) in rstd.iter().enumerate() {
            let dy = &dout[row * c + lo..row * c + hi];
            let x = &inp[row * c + lo..row * c + hi];
            for (i, (&dy, &x)) in dy.iter().zip(x).enumerate() {
                acc[i] += dy * (x * rs);
            }
        }
    }
}

/// Qwen3's q/k norm: every query head of a `qkv` row RMS-normalised over its `HS`
/// channels with the weight `q` (HS), every key head with `k` (HS); the values are
/// copied unchanged.
///
/// inp, out: (B, T, (NH + 2·KV)·HS), laid out as attention reads them; rstd:
/// (B·T, NH + KV) written, kept for backward.
pub fn qk_norm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    d: Dims,
    q: RmsNorm,
    k: RmsNorm,
) {
    let _t = crate::profile::scope(crate::profile::Section::LayerNorm);
    let (w, hs, heads) = (d.qkv_width(), d.hs, d.nh + d.kv);
    assert!(q.weight.len() == hs && k.weight.len() == hs);
    assert!(out.len() == d.bt() * w && inp.len() == out.len() && rstd.len() == d.bt() * heads);
    let simd = Simd::detect();
    out.par_chunks_mut(w)
        .zip(inp.par_chunks(w))
        .zip(rstd.par_chunks_mut(heads))
        .for_each(|((o, x), r)| {
            let (o_heads, o_values) = o.split_at_mut(heads * hs);
            let heads_in = x[..heads * hs].chunks_exact(hs);
            for (i, ((o, x), r)) in o_heads
                .chunks_exact_mut(hs)
                .zip(heads_in)
                .zip(r)
                .enumerate()
            {
                let norm = if i < d.nh { q } else { k };
                *r = row_rstd(simd, x, norm.eps);
                apply_row(simd, o, x, *r, norm.weight, false);
            }
            o_values.copy_from_slice(&x[heads * hs..]);
        });
}

/// Backward of [`qk_norm_forward`], in place: `d` holds the gradient of its output on
/// entry, and that of its input on return (the values' part passes through). The
/// weights' gradients `dq` and `dk` (HS each) accumulate.
///
/// d, inp: (B, T, (NH + 2·KV)·HS); rstd: (B·T, NH + KV) as forward saved it.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_backward(
    d_io: &mut [f32],
    (dq, dk): (&mut [f32], &mut [f32]),
    inp: &[f32],
    rstd: &[f32],
    d: Dims,
    q_weight: &[f32],
    k_weight: &[f32],
) {
    let _t = crate::profile::scope(crate::profile::Section::LayerNorm);
    let (w, hs, heads) = (d.qkv_width(), d.hs, d.nh + d.kv);
    assert!(q_weight.len() == hs && k_weight.len() == hs && dq.len() == hs && dk.len() == hs);
    assert!(d_io.len() == d.bt() * w && inp.len() == d_io.len() && rstd.len() == d.bt() * heads);
    let simd = Simd::detect();
    // The weights' gradients first, while `d_io` still holds the output's gradient:
    // the query heads' rows and the key heads' rows, as (rows, HS) with their rstd.
    for (dweight, first, count) in [(dq, 0, d.nh), (dk, d.nh, d.kv)] {
        let dw = SharedMut::new(dweight);
        let dout: &[f32] = d_io;
        (0..hs.div_ceil(BLOCK)).into_par_iter().for_each(|blk| {
            let (lo, hi) = (blk * BLOCK, ((blk + 1) * BLOCK).min(hs));
            let mut acc = [0.0f32; BLOCK];
            for row in 0..d.bt() {
                for head in first..first + count {
                    let at = row * w + head * hs;
                    let rs = &rstd[row * heads + head..][..1];
                    let (dy, x) = (&dout[at..at + hs], &inp[at..at + hs]);
                    weight_grad_block(simd, &mut acc, dy, x, rs, (lo, hi, hs));
                }
            }
            // SAFETY: this task alone owns channels [lo, hi) of the weight's gradient.
            let dw = unsafe { dw.slice(lo, hi - lo) };
            for (d, &a) in dw.iter_mut().zip(&acc) {
                *d += a;
            }
        });
    }
    assert!(
        hs <= MAX_HS,
        "q/k norm over heads of more than {MAX_HS} channels"
    );
    d_io.par_chunks_mut(w)
        .zip(inp.par_chunks(w))
        .zip(rstd.par_chunks(heads))
        .for_each(|((io, x), r)| {
            let rows = io[..heads * hs]
                .chunks_exact_mut(hs)
                .zip(x.chunks_exact(hs));
            for (i, ((io, x), &rs)) in rows.zip(r).enumerate() {
                let weight = if i < d.nh { q_weight } else { k_weight };
                // The head's output gradient is read from a copy while `io` becomes
                // its input gradient.
                let mut copy = [0.0f32; MAX_HS];
                let dout = &mut copy[..hs];
                dout.copy_from_slice(io);
                backward_row(simd, io, dout, x, weight, rs, false);
            }
        });
}

/// The largest head [`qk_norm_backward`] takes (a row of it is copied onto the stack).
const MAX_HS: usize = 512;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    fn reference(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        let c = w.len();
        let mut out = vec![0.0; x.len()];
        for (o, x) in out.chunks_mut(c).zip(x.chunks(c)) {
            let ms = x.iter().map(|v| v * v).sum::<f64>() / c as f64;
            let rs = 1.0 / (ms + eps).sqrt();
            for i in 0..c {
                o[i] = x[i] * rs * w[i];
            }
        }
        out
    }

    fn check(n: usize, c: usize, eps: f32) {
        let x: Vec<f32> = rand_vec(n * c, 1).iter().map(|v| 2.0 * v).collect();
        let w: Vec<f32> = rand_vec(c, 2).iter().map(|v| 1.0 + 0.5 * v).collect();
        let g = rand_vec(n * c, 4);
        let (x64, w64) = (to_f64(&x), to_f64(&w));
        let norm = RmsNorm { weight: &w, eps };
        let mut out = vec![0.0; n * c];
        let mut rstd = vec![0.0; n];
        rmsnorm_forward::<false>(&mut out, &mut rstd, &x, norm);
        let want = reference(&x64, &w64, eps as f64);
        assert_close("out", &out, &want, 1e-5, 1e-6);
        let mut again = vec![f32::NAN; n * c];
        rmsnorm_recompute::<false>(&mut again, &x, &rstd, norm);
        assert_eq!(again, out, "the recomputed output is bit-identical");
        let mut rounded = out.clone();
        bf16::round_in_place(&mut rounded);
        let mut out16 = vec![f32::NAN; n * c];
        let mut rstd16 = vec![0.0; n];
        rmsnorm_forward::<true>(&mut out16, &mut rstd16, &x, norm);
        assert_eq!((&out16, &rstd16), (&rounded, &rstd));
        rmsnorm_recompute::<true>(&mut again, &x, &rstd, norm);
        assert_eq!(again, rounded);

        let prior = rand_vec(n * c, 5);
        let mut dx = prior.clone();
        let mut dw = vec![0.5; c];
        rmsnorm_backward(&mut dx, &mut dw, &g, &x, &w, &rstd);
        let loss = |x: &[f64], w: &[f64]| dot(&reference(x, w, eps as f64), &g);
        let mut want_dx = numeric_grad(|v| loss(v, &w64), &x64, 1e-5);
        for (d, &p) in want_dx.iter_mut().zip(&prior) {
            *d += p as f64; // dinp accumulates onto what was there
        }
        assert_close("dinp", &dx, &want_dx, 1e-4, 1e-5);
        let mut want_dw = numeric_grad(|v| loss(&x64, v), &w64, 1e-5);
        want_dw.iter_mut().for_each(|d| *d += 0.5);
        assert_close("dweight", &dw, &want_dw, 1e-4, 1e-5);
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        check(5, 8, 1e-5);
        check(3, 70, 1e-6); // a tail after the 16-lane sums
        check(4, 33, 0.5); // an eps large enough to matter
    }

    #[test]
    fn every_simd_level_gives_the_same_bits() {
        let c = 77;
        let x: Vec<f32> = rand_vec(c, 5).iter().map(|v| 3.0 * v + 0.5).collect();
        let (w, dy) = (rand_vec(c, 6), rand_vec(c, 8));
        let run = |simd: Simd| {
            let rs = row_rstd(simd, &x, 1e-6);
            let (mut o, mut o16) = (vec![0.0; c], vec![0.0; c]);
            apply_row(simd, &mut o, &x, rs, &w, false);
            apply_row(simd, &mut o16, &x, rs, &w, true);
            let mut di = vec![0.5; c];
            backward_row(simd, &mut di, &dy, &x, &w, rs, true);
            let mut acc = [0.0; BLOCK];
            weight_grad_block(simd, &mut acc, &dy, &x, &[rs], (64, 77, c));
            let all = [rs].into_iter().chain(o).chain(o16).chain(di).chain(acc);
            all.map(f32::to_bits).collect::<Vec<_>>()
        };
        let levels = Simd::available();
        let want = run(levels[0]);
        for simd in &levels[1..] {
            assert_eq!(run(*simd), want, "{simd:?}");
        }
    }

    /// Query and key heads of `(N, (NH + 2·KV)·HS)` rows normalised by the f64
    /// reference, values copied.
    fn qk_reference(x: &[f64], d: Dims, wq: &[f64], wk: &[f64], eps: f64) -> Vec<f64> {
        let (hs, w) = (d.hs, d.qkv_width());
        let mut out = x.to_vec();
        for row in 0..d.bt() {
            for head in 0..d.nh + d.kv {
                let weight = if head < d.nh { wq } else { wk };
                let at = row * w + head * hs;
                let normed = reference(&x[at..at + hs], weight, eps);
                out[at..at + hs].copy_from_slice(&normed);
            }
        }
        out
    }

    #[test]
    fn qk_norm_matches_reference_and_finite_differences() {
        // 4 query heads over 2 key/value heads of 12 channels.
        let d = Dims::new(2, 3, 0, 4).with_heads(2, 12);
        let (n, eps) = (d.bt() * d.qkv_width(), 1e-6);
        let x: Vec<f32> = rand_vec(n, 11).iter().map(|v| 2.0 * v).collect();
        let wq: Vec<f32> = rand_vec(d.hs, 12).iter().map(|v| 1.0 + 0.5 * v).collect();
        let wk: Vec<f32> = rand_vec(d.hs, 13).iter().map(|v| 1.0 + 0.5 * v).collect();
        let g = rand_vec(n, 14);
        let (x64, wq64, wk64) = (to_f64(&x), to_f64(&wq), to_f64(&wk));
        let (q, k) = (RmsNorm { weight: &wq, eps }, RmsNorm { weight: &wk, eps });
        let mut out = vec![f32::NAN; n];
        let mut rstd = vec![f32::NAN; d.bt() * (d.nh + d.kv)];
        qk_norm_forward(&mut out, &mut rstd, &x, d, q, k);
        let want = qk_reference(&x64, d, &wq64, &wk64, eps as f64);
        assert_close("out", &out, &want, 1e-5, 1e-6);

        let mut dx = g.clone();
        let (mut dq, mut dk) = (vec![0.25; d.hs], vec![-0.25; d.hs]);
        qk_norm_backward(&mut dx, (&mut dq, &mut dk), &x, &rstd, d, &wq, &wk);
        let loss =
            |x: &[f64], wq: &[f64], wk: &[f64]| dot(&qk_reference(x, d, wq, wk, eps as f64), &g);
        let want_dx = numeric_grad(|v| loss(v, &wq64, &wk64), &x64, 1e-5);
        assert_close("dinp", &dx, &want_dx, 1e-4, 1e-5);
        let mut want_dq = numeric_grad(|v| loss(&x64, v, &wk64), &wq64, 1e-5);
        want_dq.iter_mut().for_each(|d| *d += 0.25);
        assert_close("dq weight", &dq, &want_dq, 1e-4, 1e-5);
        let mut want_dk = numeric_grad(|v| loss(&x64, &wq64, v), &wk64, 1e-5);
        want_dk.iter_mut().for_each(|d| *d -= 0.25);
        assert_close("dk weight", &dk, &want_dk, 1e-4, 1e-5);
    }

    #[test]
    fn matches_transformers() {
        let f = LlamaFixture::load();
        let (x, w) = (f.f32("rmsnorm.x"), f.f32("rmsnorm.weight"));
        let norm = RmsNorm {
            weight: &w,
            eps: 1e-6,
        };
        let n = x.len() / w.len();
        let (mut out, mut rstd) = (vec![f32::NAN; x.len()], vec![f32::NAN; n]);
        rmsnorm_forward::<false>(&mut out, &mut rstd, &x, norm);
        assert_close("out", &out, &f.f64("rmsnorm.out"), 1e-5, 1e-7);
        let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; w.len()]);
        rmsnorm_backward(&mut dx, &mut dw, &f.f32("rmsnorm.dout"), &x, &w, &rstd);
        assert_close("dx", &dx, &f.f64("rmsnorm.dx"), 1e-4, 1e-6);
        assert_close("dweight", &dw, &f.f64("rmsnorm.dweight"), 1e-4, 1e-6);

        // Qwen3's q_norm and k_norm.
        let d = f.dims("qknorm.dims");
        let x = f.f32("qknorm.qkv");
        let (wq, wk) = (f.f32("qknorm.q_weight"), f.f32("qknorm.k_weight"));
        let (q, k) = (
            RmsNorm {
                weight: &wq,
                eps: 1e-6,
            },
            RmsNorm {
                weight: &wk,
                eps: 1e-6,
            },
        );
        let mut out = vec![f32::NAN; x.len()];
        let mut rstd = vec![f32::NAN; d.bt() * (d.nh + d.kv)];
        qk_norm_forward(&mut out, &mut rstd, &x, d, q, k);
        assert_close("q/k norm out", &out, &f.f64("qknorm.out"), 1e-5, 1e-7);
        let mut dx = f.f32("qknorm.dout");
        let (mut dq, mut dk) = (vec![0.0; d.hs], vec![0.0; d.hs]);
        qk_norm_backward(&mut dx, (&mut dq, &mut dk), &x, &rstd, d, &wq, &wk);
        assert_close("q/k norm dqkv", &dx, &f.f64("qknorm.dqkv"), 1e-4, 1e-6);
        assert_close("dq weight", &dq, &f.f64("qknorm.dq_weight"), 1e-4, 1e-6);
        assert_close("dk weight", &dk, &f.f64("qknorm.dk_weight"), 1e-4, 1e-6);
    }
}
