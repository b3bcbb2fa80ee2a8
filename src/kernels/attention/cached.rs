//! Causal attention of new positions against a key/value cache, for generation:
//! each new query attends to every cached position up to its own, and the new keys
//! and values join the cache first.

use rayon::prelude::*;

use super::forward::{for_each_query_block, FwdTask, KeyRows};
use super::isa::Isa;
use super::{check_heads, kv_head, score_scale, SharedMut, NO_MASK};
use crate::kernels::fastmath::{exp_fast, simd_fn, Simd};
use crate::kernels::Dims;

/// Up to this many new rows per sequence (decoding steps) each query attends on its
/// own ([`attend_one`]); more (a prompt) run the blocked pass of training's forward
/// ([`forward_block`](super::forward::forward_block)), whose query blocks of
/// [`BQ`](super::BQ) rows would be mostly padding for a few rows.
const ROWWISE_MAX_T: usize = 8;

/// One layer's key and value caches, each `(B, KV, max_len, HS)`: key/value head `g`
/// of sequence `b` keeps the key of position `pos` at `((b·KV + g)·max_len + pos)·HS`,
/// so each head's keys (and values) are contiguous.
pub struct KvCache<'a> {
    pub keys: &'a mut [f32],
    pub values: &'a mut [f32],
    /// Positions the cache holds per sequence.
    pub max_len: usize,
}

/// Causal attention of `T = d.t` new rows per sequence, at absolute positions
/// `start..start + T`, against one layer's cache (no dropout: this is inference).
///
/// - `qkv`: `(B, T, (NH + 2·KV)·HS)` the new rows' queries, keys and values, laid out
///   as for [`attention_forward`](super::attention_forward); the keys and values are
///   first copied into `cache` at positions `start..start + T`.
/// - `out`: `(B, T, NH·HS)` written: the row at absolute position `pos` is the softmax
///   (scale 1/√HS, max-subtracted) of its scores against its key/value head's cached
///   keys `0..=pos`, applied to the matching values.
/// - `scores`: `(B, NH, max_len)` scratch.
///
/// Up to 8 new rows (`ROWWISE_MAX_T`), parallel over (sequence, head), each query on its
/// own; more, parallel over (sequence, head, block of queries) on the flash-style
/// tiles of training's forward pass (the same results up to summation order).
pub fn cached_attention(
    out: &mut [f32],
    qkv: &[f32],
    cache: KvCache,
    scores: &mut [f32],
    d: Dims,
    start: usize,
) {
    let _t = crate::profile::scope(crate::profile::Section::Attention);
    check_shapes(out, qkv, &cache, scores, d, start);
    let span = cache.max_len * d.hs;
    append(qkv, &mut *cache.keys, &mut *cache.values, span, d, start);
    let (keys, values) = (&*cache.keys, &*cache.values);
    if d.t <= ROWWISE_MAX_T {
        rowwise(out, qkv, (keys, values, span), scores, d, start);
    } else {
        blocked(out, qkv, (keys, values, span), scores, d, start);
    }
}

/// Copies the new rows' keys and values into the caches at positions
/// `start..start + T`, in parallel over (sequence, key/value head).
fn append(qkv: &[f32], keys: &mut [f32], values: &mut [f32], span: usize, d: Dims, start: usize) {
    let (new, w, hs) = (d.t, d.qkv_width(), d.hs);
    keys.par_chunks_exact_mut(span)
        .zip(values.par_chunks_exact_mut(span))
        .enumerate()
        .for_each(|(bg, (keys, values))| {
            let (b, g) = (bg / d.kv, bg % d.kv);
            let (k, v) = ((d.nh + g) * hs, (d.nh + d.kv + g) * hs);
            let rows = &qkv[b * new * w..(b + 1) * new * w];
            for (i, row) in rows.chunks_exact(w).enumerate() {
                let at = (start + i) * hs..(start + i + 1) * hs;
                keys[at.clone()].copy_from_slice(&row[k..k + hs]);
                values[at].copy_from_slice(&row[v..v + hs]);
            }
        });
}

/// The caches after [`append`], and the floats of one head's part of each.
type Cached<'a> = (&'a [f32], &'a [f32], usize);

/// Each new query on its own ([`attend_one`]): one task per (sequence, query head).
fn rowwise(out: &mut [f32], qkv: &[f32], cache: Cached, scores: &mut [f32], d: Dims, start: usize) {
    let (keys, values, span) = cache;
    let (new, c, w, hs, max_len) = (d.t, d.q_width(), d.qkv_width(), d.hs, span / d.hs);
    let out_ptr = SharedMut::new(out);
    let (scale, simd) = (score_scale(d), Simd::detect());
    scores
        .par_chunks_exact_mut(max_len)
        .enumerate()
        .for_each(|(bh, scores)| {
            let (b, h) = (bh / d.nh, bh % d.nh);
            let head = kv_head(d, bh) * span..(kv_head(d, bh) + 1) * span;
            let (keys, values) = (&keys[head.clone()], &values[head]);
            let rows = &qkv[b * new * w..(b + 1) * new * w];
            for (i, row) in rows.chunks_exact(w).enumerate() {
                let q = &row[h * hs..(h + 1) * hs];
                let n_keys = start + i + 1;
                // SAFETY: this task alone writes channels h·HS..(h+1)·HS of its
                // sequence b's rows of `out`, so the slices of distinct tasks are
                // disjoint.
                let o = unsafe { out_ptr.slice((b * new + i) * c + h * hs, hs) };
                let ctx = HeadCache { keys, values, hs };
                attend_one(simd, o, q, ctx, &mut scores[..n_keys], scale);
            }
        });
}

/// The new queries in blocks of [`BQ`](super::BQ) against the cached keys, on the f32 tiles of
/// training's forward pass: one task per (sequence, head, query block).
fn blocked(out: &mut [f32], qkv: &[f32], cache: Cached, scores: &mut [f32], d: Dims, start: usize) {
    let (keys, values, span) = cache;
    let isa = Isa::detect();
    // The pass's per-row log-sum-exp is not needed here: it lands in `scores`.
    let lse = &mut scores[..d.b * d.nh * d.t];
    let out = SharedMut::new(out);
    for_each_query_block(lse, d.t, |bh, i0, lse_blk| {
        let head = kv_head(d, bh) * span..(kv_head(d, bh) + 1) * span;
        isa.forward::<false>(FwdTask {
            d,
            qkv,
            out,
            lse: lse_blk,
            bh,
            i0,
            mask: NO_MASK,
            kv: &[],
            keys: KeyRows {
                keys: &keys[head.clone()],
                values: &values[head],
                rs: d.hs,
                pos0: start,
            },
        })
    });
}

/// Panics unless the buffers have the shapes [`cached_attention`] documents.
fn check_shapes(out: &[f32], qkv: &[f32], cache: &KvCache, scores: &[f32], d: Dims, start: usize) {
    check_heads(d);
    let w = d.qkv_width();
    assert_eq!(qkv.len(), d.bt() * w, "qkv must be (B, T, (NH + 2·KV)·HS)");
    assert_eq!(out.len(), d.bt() * d.q_width(), "out must be (B, T, NH·HS)");
    let max_len = cache.max_len;
    let floats = d.b * d.kv * max_len * d.hs;
    assert!(
        cache.keys.len() == floats && cache.values.len() == floats,
        "the caches must be (B, KV, max_len, HS)"
    );
    assert_eq!(
        scores.len(),
        d.b * d.nh * max_len,
        "scores must be (B, NH, max_len)"
    );
    assert!(start + d.t <= max_len, "positions beyond the cache");
}

/// One head's cached keys and values, each (max_len, HS).
#[derive(Clone, Copy)]
struct HeadCache<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    hs: usize,
}

simd_fn! {
    /// `out = softmax(scale · K q) · V` over the first `scores.len()` cached positions.
    ///
    /// out, q: (HS); scores: (n) scratch. Each loop is written to vectorise (eight
    /// partial sums where it adds up), in the same order on every instruction set.
    fn attend_one(out: &mut [f32], q: &[f32], head: HeadCache, scores: &mut [f32], scale: f32) {
        let hs = head.hs;
        for (sc, k) in scores.iter_mut().zip(head.keys.chunks_exact(hs)) {
            *sc = scale * dot(q, k);
        }
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for sc in scores.iter_mut() {
            *sc = exp_fast(false, *sc - max);
        }
        let sum = lane_sum(scores);
        out.fill(0.0);
        for (&w, v) in scores.iter().zip(head.values.chunks_exact(hs)) {
            for (o, &v) in out.iter_mut().zip(v) {
                *o += w * v;
            }
        }
        let inv = 1.0 / sum;
        out.iter_mut().for_each(|o| *o *= inv);
    }
}

/// Σ x in eight interleaved partial sums, so the loop vectorises.
#[inline(always)]
fn lane_sum(x: &[f32]) -> f32 {
    const LANES: usize = 8;
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    let mut acc = [0.0f32; LANES];
    for c in chunks {
        for j in 0..LANES {
            acc[j] += c[j];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Dot product with eight independent partial sums, so the loop vectorises.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    let mut acc = [0.0f32; LANES];
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::naive_forward;
    use crate::kernels::testutil::{assert_close, rand_vec, to_f64};

    #[test]
    fn dot_matches_a_plain_sum() {
        let (a, b) = (rand_vec(67, 1), rand_vec(67, 2));
        let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        assert!((dot(&a, &b) as f64 - want).abs() < 1e-5);
    }

    /// Rows `range` of every sequence of a `(B, T, w)` tensor, as `(B, range.len(), w)`.
    fn rows(x: &[f32], (t, w): (usize, usize), range: std::ops::Range<usize>) -> Vec<f32> {
        let seqs = x.chunks_exact(t * w);
        seqs.flat_map(|s| &s[range.start * w..range.end * w])
            .copied()
            .collect()
    }

    /// Feeds the `T` positions of `qkv` (`(B, T, (NH + 2·KV)·HS)`) through a cache of
    /// `max_len` positions in the given chunks of new positions; returns every
    /// position's output, `(B, T, NH·HS)`.
    fn feed(qkv: &[f32], d: Dims, max_len: usize, chunks: &[usize]) -> Vec<f32> {
        let c = d.q_width();
        let mut keys = vec![f32::NAN; d.b * d.kv * max_len * d.hs];
        let mut values = keys.clone();
        let mut scores = vec![f32::NAN; d.b * d.nh * max_len];
        let mut got = vec![f32::NAN; d.bt() * c];
        let mut start = 0;
        for &new in chunks {
            let qkv_new = rows(qkv, (d.t, d.qkv_width()), start..start + new);
            let mut out = vec![f32::NAN; d.b * new * c];
            let cache = KvCache {
                keys: &mut keys,
                values: &mut values,
                max_len,
            };
            let step = Dims { t: new, ..d };
            cached_attention(&mut out, &qkv_new, cache, &mut scores, step, start);
            for (seq, o) in out.chunks_exact(new * c).enumerate() {
                let at = (seq * d.t + start) * c;
                got[at..at + new * c].copy_from_slice(o);
            }
            start += new;
        }
        assert_eq!(start, d.t, "the chunks cover every position");
        got
    }

    /// Random `(B, T, (NH + 2·KV)·HS)` rows, with scores large enough for the softmax
    /// to matter, and their attention by the f64 reference, `(B, T, NH·HS)`.
    fn case(d: Dims, salt: u64) -> (Vec<f32>, Vec<f64>) {
        let qkv: Vec<f32> = rand_vec(d.bt() * d.qkv_width(), salt)
            .iter()
            .map(|v| 2.0 * v)
            .collect();
        let (want, _) = naive_forward(&to_f64(&qkv), d, None);
        (qkv, want)
    }

    #[test]
    fn prefill_then_steps_equal_full_causal_attention() {
        // HS = 12: one 8-lane chunk plus a tail in the dot product. Multi-head, then
        // grouped-query (3:1), one key/value head, and a head size of 20 != C / NH.
        let mha = Dims::new(2, 9, 36, 3);
        let gqa = Dims::new(2, 9, 36, 6).with_heads(2, 6);
        let mqa = mha.with_heads(1, 12);
        let wide = Dims::new(2, 9, 16, 4).with_heads(2, 20);
        for d in [mha, gqa, mqa, wide] {
            let (qkv, want) = case(d, 1);
            let max_len = d.t + 3;
            let stepped = feed(&qkv, d, max_len, &[4, 1, 1, 1, 1, 1]);
            assert_close(
                &format!("{d:?}: prefill 4, then steps"),
                &stepped,
                &want,
                1e-5,
                1e-6,
            );
            // Each row's arithmetic does not depend on how the positions arrived.
            let whole = feed(&qkv, d, max_len, &[3, 6]);
            assert_eq!(
                whole, stepped,
                "{d:?}: one prefill and prefill + steps agree bit for bit"
            );
        }
    }

    #[test]
    fn prompts_run_blocked_at_any_position() {
        // Chunks of more than ROWWISE_MAX_T rows take the blocked pass, here starting
        // at positions that are not multiples of its BQ-row blocks, over several
        // blocks, and mixed with single steps. HS = 12; multi-head, then 3 query heads
        // per key/value head.
        for d in [
            Dims::new(2, 83, 36, 3),
            Dims::new(2, 83, 36, 3).with_heads(1, 12),
        ] {
            let (qkv, want) = case(d, 2);
            let whole = feed(&qkv, d, d.t + 5, &[83]);
            assert_close("one prompt of 83", &whole, &want, 1e-5, 1e-6);
            for chunks in [&[9, 40, 1, 33][..], &[37, 46], &[1, 1, 10, 1, 70]] {
                let got = feed(&qkv, d, d.t + 5, chunks);
                assert_close(
                    &format!("{d:?}: chunks {chunks:?}"),
                    &got,
                    &want,
                    1e-5,
                    1e-6,
                );
            }
            // A blocked row's arithmetic does not depend on where its block started.
            assert_eq!(feed(&qkv, d, d.t, &[37, 46]), whole, "37 + 46 rows vs 83");
        }
    }

    #[test]
    fn one_query_is_the_same_on_every_instruction_set() {
        // A head of 64 channels and one of 80, the last of n rows of one head attending
        // to all n keys, against the f64 reference on the same rows.
        for (hs, n) in [(64, 45), (80, 33)] {
            let d = Dims::new(1, n, hs, 1);
            let (qkv, want) = case(d, 4);
            let rows = |part: usize| -> Vec<f32> {
                let rows = qkv.chunks_exact(3 * hs);
                rows.flat_map(|r| &r[part * hs..(part + 1) * hs])
                    .copied()
                    .collect()
            };
            let (keys, values) = (rows(1), rows(2));
            let q = &qkv[(n - 1) * 3 * hs..][..hs];
            let head = HeadCache {
                keys: &keys,
                values: &values,
                hs,
            };
            let run = |simd| {
                let (mut out, mut scores) = (vec![f32::NAN; hs], vec![f32::NAN; n]);
                attend_one(simd, &mut out, q, head, &mut scores, score_scale(d));
                out
            };
            let portable = run(Simd::available()[0]);
            for simd in Simd::available() {
                assert_eq!(run(simd), portable, "{simd:?}");
            }
            let last = &want[(n - 1) * hs..];
            assert_close(&format!("hs {hs}"), &portable, last, 1e-5, 1e-5);
        }
    }

    #[test]
    fn prompts_with_heads_wider_than_a_tile() {
        // HS = 136 > DT: the blocked pass walks the head's channels in pieces.
        let d = Dims::new(1, 45, 272, 2);
        let (qkv, want) = case(d, 3);
        let got = feed(&qkv, d, d.t, &[13, 32]);
        assert_close("13 + 32 rows, HS 136", &got, &want, 1e-5, 1e-6);
    }
}
