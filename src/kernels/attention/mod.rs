//! Causal multi-head self-attention, and its grouped-query form.
//!
//! Query head `h` reads key/value head `g = h / (NH / KV)`: with `KV = NH` this is
//! GPT-2's multi-head attention, with fewer key/value heads grouped-query attention
//! (Llama, Qwen; `KV = 1` is multi-query). A row of `qkv` holds the `NH` query heads,
//! then the `KV` key heads, then the `KV` value heads, `HS` channels each (width
//! `(NH + 2·KV)·HS`, GPT-2's `3C`); the output holds the `NH` heads (width `QW`).
//!
//! For each sequence `b`, head `h` and position `t`, with `q_t` the head's `HS`
//! channels of the query of position `t`, `k_s` and `v_s` its key/value head's key and
//! value of position `s`:
//!
//! ```text
//! x_s   = q_t · k_s / √HS           for the causal keys s <= t
//! lse_t = log Σ_s exp(x_s)
//! p_s   = exp(x_s − lse_t)          the softmax over s
//! out_t = Σ_s p_s · m_s · v_s       m_s: the dropout factor, 0 or 1 / (1 − p)
//! ```
//!
//! [`naive_forward`] and [`naive_backward`] are that algorithm written out plainly,
//! with the whole `T × T` matrix of scores, in f64: the definition to read first, and
//! the reference the tests hold the fast kernels to.
//!
//! [`attention_forward`] and [`attention_backward`] compute the same flash-style,
//! without any `T × T` matrix. The forward pass walks each head's queries in blocks
//! of `BQ` rows and its keys in blocks of `BK` rows with an online (running-max)
//! softmax; it keeps only the per-row log-sum-exp. The backward pass recomputes the
//! probabilities of each (query block, key block) tile from that log-sum-exp, one task
//! per key/value head, which sums the key and value gradients of its query heads.
//!
//! Both passes are built from one register-tiled matrix kernel, `gemm_acc`, over
//! fixed-size stack tiles, so nothing is allocated on the heap. On x86-64 everything is
//! compiled three times (baseline, AVX2 + FMA, AVX-512) and the variant is picked at
//! run time. Each task performs its floating-point operations in a fixed order, so the
//! results do not depend on the number of threads.
//!
//! Under bf16 autocast (`attention_forward::<true>`, `attention_backward::<true>`)
//! q, k and v already hold bf16 values, and on a CPU with AVX512-BF16 the products run
//! on `vdpbf16ps` (`pairs.rs`) for long sequences, where that measured faster
//! ([`bf16_forward_products`]: T >= 2048; [`bf16_backward_products`]: T >= 512), with
//! the same tiles, task split and fixed operation order. Exactly what is rounded to bf16 (round to nearest even):
//! - forward: S = Q·Kᵀ multiplies the bf16 values of q and k exactly (scaled by
//!   `1/√HS` in f32 afterwards); for O += P̃·V the operand rounded is
//!   P̃ = exp(x − m)·m_s, the running-max (unnormalised) probability times the
//!   dropout factor, not the normalised `p` that PyTorch's autocast rounds: the same
//!   relative error (at most 2^-8 per element), not the same bits. The row sums `l`
//!   add the unrounded values; the max, `l`, lse and O accumulate in f32.
//! - backward: dO is rounded (PyTorch's autocast rounds it too: it is the gradient of
//!   a bf16 matmul's output) for dP̃ = dO·Vᵀ and dV += (P∘M)ᵀ·dO; P∘M (the
//!   recomputed probability times the dropout factor) and `scale·dS` are rounded before
//!   their products dV += (P∘M)ᵀ·dO, dK += (scale·dS)ᵀ·Q and dQ += (scale·dS)·K.
//!   D = dO·O, the softmax's backward and every accumulation stay f32.
//!
//! Keys and values (forward) and a head's Q and dO (backward) are packed into bf16
//! pairs once per call in per-thread buffers that are kept and reused (no allocation
//! once warm); everything per tile lives on the stack. f32 attention, CPUs without
//! AVX512-BF16, heads larger than `DT` channels, and a back-end on the f32 GEMM
//! (`bf16_kernel = f32` forces the f32 products for the matmuls and the attention alike,
//! [`Backend::attention_pairs`]) keep the f32 passes, which are exact on bf16-valued q/k/v up to summation order.
//!
//! [`cached_attention`] is the same attention for generation: new positions against
//! a cache of keys and values.
//!
//! Files: `forward.rs` and `backward.rs` hold the passes, `tiles.rs` the products and
//! transposes they are built from, `pairs.rs` the bf16 pair packing and `vdpbf16ps`
//! kernel, `isa.rs` the instruction-set variants, `cached.rs` the cached attention, and
//! `tests.rs` the tests of the passes.

mod backward;
mod cached;
mod forward;
mod isa;
#[cfg(target_arch = "x86_64")]
mod pairs;
#[cfg(test)]
mod tests;
mod tiles;

use super::bf16::Backend;
use super::dropout::Dropout;
use super::{Dims, SharedMut};
use backward::backward_impl;
use forward::forward_impl;
use isa::Isa;

pub use cached::{cached_attention, KvCache};

/// Causal attention the plain way, in f64, as defined in the [module docs](self):
/// returns `(out, lse)`, shaped and laid out like [`attention_forward`]'s outputs.
///
/// A reference for reading and for tests: it allocates, and takes `O(T²·HS)` time
/// per head.
pub fn naive_forward(qkv: &[f64], d: Dims, dropout: Option<Dropout>) -> (Vec<f64>, Vec<f64>) {
    let (hs, qw) = (d.hs, d.q_width());
    let mut out = vec![0.0; d.bt() * qw];
    let mut lse = vec![0.0; d.b * d.nh * d.t];
    for query in naive_queries(d) {
        let (b, h, t) = query;
        let (p, l) = naive_probs(qkv, d, query);
        lse[(b * d.nh + h) * d.t + t] = l;
        let o = &mut out[(b * d.t + t) * qw + h * hs..][..hs];
        for (s, &ps) in p.iter().enumerate() {
            let pm = ps * naive_mask(dropout, d, query, s);
            let v = &qkv[naive_at(d, (b, h, s), 2)..][..hs];
            for (od, &vd) in o.iter_mut().zip(v) {
                *od += pm * vd;
            }
        }
    }
    (out, lse)
}

/// The gradient of [`naive_forward`]: `dqkv` for `dout`, both laid out like
/// [`attention_backward`]'s. Per query, with the notation of the [module docs](self):
///
/// ```text
/// dv_s += p_s · m_s · dout_t
/// dp_s  = m_s · (dout_t · v_s)
/// dx_s  = p_s · (dp_s − Σ_r p_r · dp_r)     the softmax's backward
/// dq_t += Σ_s dx_s · k_s / √HS
/// dk_s += dx_s · q_t / √HS
/// ```
pub fn naive_backward(dout: &[f64], qkv: &[f64], d: Dims, dropout: Option<Dropout>) -> Vec<f64> {
    let (hs, qw) = (d.hs, d.q_width());
    let scale = 1.0 / (hs as f64).sqrt();
    let mut dqkv = vec![0.0; qkv.len()];
    for query in naive_queries(d) {
        let (b, h, t) = query;
        let (p, _) = naive_probs(qkv, d, query);
        let dy = &dout[(b * d.t + t) * qw + h * hs..][..hs];
        let mut dp = vec![0.0; p.len()];
        for (s, &ps) in p.iter().enumerate() {
            let m = naive_mask(dropout, d, query, s);
            let v = naive_at(d, (b, h, s), 2);
            dp[s] = m * naive_dot(dy, &qkv[v..][..hs]);
            for (dv, &g) in dqkv[v..][..hs].iter_mut().zip(dy) {
                *dv += ps * m * g;
            }
        }
        let p_dp = naive_dot(&p, &dp);
        let q = naive_at(d, query, 0);
        for (s, (&ps, &dps)) in p.iter().zip(&dp).enumerate() {
            let dx = ps * (dps - p_dp) * scale;
            let k = naive_at(d, (b, h, s), 1);
            for i in 0..hs {
                dqkv[q + i] += dx * qkv[k + i];
                dqkv[k + i] += dx * qkv[q + i];
            }
        }
    }
    dqkv
}

/// A query of the plain algorithm: sequence `b`, head `h`, position `t`.
type Query = (usize, usize, usize);

/// Every query, in memory order of `lse`.
fn naive_queries(d: Dims) -> impl Iterator<Item = Query> {
    (0..d.b).flat_map(move |b| (0..d.nh).flat_map(move |h| (0..d.t).map(move |t| (b, h, t))))
}

/// Index in a `(B, T, (NH + 2·KV)·HS)` tensor of channel 0 at token `(b, s)` of query
/// head `h` (`part` 0), or of its key/value head's key (1) or value (2).
fn naive_at(d: Dims, (b, h, s): Query, part: usize) -> usize {
    let head = match part {
        0 => h,
        _ => d.nh + (part - 1) * d.kv + h / d.group(),
    };
    (b * d.t + s) * d.qkv_width() + head * d.hs
}

/// The probabilities `p_s`, `s <= t`, of query `(b, h, t)`, and their `lse_t`.
fn naive_probs(qkv: &[f64], d: Dims, (b, h, t): Query) -> (Vec<f64>, f64) {
    let hs = d.hs;
    let scale = 1.0 / (hs as f64).sqrt();
    let q = &qkv[naive_at(d, (b, h, t), 0)..][..hs];
    let x: Vec<f64> = (0..=t)
        .map(|s| {
            let k = &qkv[naive_at(d, (b, h, s), 1)..][..hs];
            naive_dot(q, k) * scale
        })
        .collect();
    // log Σ exp(x_s), as max + log Σ exp(x_s − max) so that nothing overflows.
    let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + x.iter().map(|&v| (v - max).exp()).sum::<f64>().ln();
    (x.iter().map(|&v| (v - lse).exp()).collect(), lse)
}

/// The dropout factor `m_s` of query `(b, h, t)` and key `s`: mask index
/// `((b·NH + h)·T + t)·T + s`, as in [`attention_forward`]; 1 without dropout.
fn naive_mask(dropout: Option<Dropout>, d: Dims, (b, h, t): Query, s: usize) -> f64 {
    let index = (((b * d.nh + h) * d.t + t) * d.t + s) as u64;
    dropout.map_or(1.0, |m| m.factor(index) as f64)
}

fn naive_dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Query rows per block.
const BQ: usize = 32;
/// Key rows per block. Equal to [`BQ`], so query and key blocks line up and the only
/// partially masked tile of a query block is its diagonal one.
const BK: usize = BQ;
/// Head channels held in one stack tile. Larger heads are processed in chunks of this
/// many channels, re-transposing each chunk per tile and accumulating in the output.
const DT: usize = 128;

/// Causal self-attention forward (flash-style; no `T × T` buffer).
///
/// - `qkv`: `(B, T, (NH + 2·KV)·HS)`; token `(b, t)` holds the queries in channels
///   `[0, QW)` (head `h` in `h·HS..(h+1)·HS`), then the keys of the `KV` key/value
///   heads, then their values. GPT-2 (`KV = NH`, `QW = C`): q in `[0, C)`, k in
///   `[C, 2C)`, v in `[2C, 3C)`.
/// - `out`: `(B, T, QW)`, heads concatenated the same way; overwritten.
/// - `lse`: `(B, NH, T)`, the log-sum-exp of the scaled scores `q_t·k_s / √HS` over
///   the causal keys `s <= t` (without dropout); overwritten, and needed by backward.
/// - `dropout`: applied to the attention probabilities; element `(b, h, t, s)` uses
///   mask index `((b·NH + h)·T + t)·T + s`.
///
/// Parallel over `(b, h, query block)`; results do not depend on the thread count.
///
/// With `BF16` (bf16 autocast: q, k and v hold bf16 values), the products run on
/// `vdpbf16ps` where [`bf16_forward_products`] says so for `backend` (see the
/// [module docs](self)).
pub fn attention_forward<const BF16: bool>(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    d: Dims,
    dropout: Option<Dropout>,
    backend: &Backend,
) {
    let _t = crate::profile::scope(crate::profile::Section::Attention);
    let bf16 = bf16_forward_products::<BF16>(d, backend);
    forward_impl(Isa::detect(), out, lse, qkv, d, dropout, bf16);
}

/// Causal self-attention backward, recomputing the probabilities from `lse`.
///
/// `dout`: `(B, T, QW)`; `qkv`, `out`, `lse` and `dropout` exactly as given to and
/// produced by [`attention_forward`]; `dqkv`: like `qkv`, **overwritten** (a key/value
/// head's gradients sum over its query heads). With `BF16` and `round_dqkv`, `dqkv`
/// is rounded to bf16 (the operand of the bf16 matmuls that follow under autocast)
/// by each task as its rows are final and still in cache, instead of in a pass of
/// its own: the same bits. Without `round_dqkv` it is left unrounded also under
/// autocast, for what still runs between it and the projection's backward (RoPE's
/// backward, a q/k norm's), which rounds it after them. Under `BF16` the products
/// run on `vdpbf16ps` where [`bf16_backward_products`] says so for `backend`.
///
/// Parallel over `(b, g)` for the key/value heads `g`; results do not depend on the
/// thread count.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<const BF16: bool>(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    d: Dims,
    dropout: Option<Dropout>,
    backend: &Backend,
    round_dqkv: bool,
) {
    let _t = crate::profile::scope(crate::profile::Section::AttentionBackward);
    let bf16 = bf16_backward_products::<BF16>(d, backend);
    let round = BF16 && round_dqkv;
    backward_impl(
        Isa::detect(),
        dqkv,
        dout,
        qkv,
        out,
        lse,
        d,
        dropout,
        round,
        bf16,
    );
}

/// Whether bf16 attention can run its products on `vdpbf16ps`: the back-end allows
/// it ([`Backend::attention_pairs`]) and heads have at most [`DT`] channels.
fn bf16_capable(d: Dims, backend: &Backend) -> bool {
    d.hs <= DT && backend.attention_pairs()
}

/// From this T on, bf16 attention's forward pass runs its products on `vdpbf16ps`.
/// Below it the packing costs more than the faster products save: one thread, GPT-2
/// 124M's heads, CPU time of the f32 pass over the `vdpbf16ps` one, 0.74–0.86× at
/// T 256, 0.88× at 512, 1.01× at 1024, 1.18–1.25× at 2048 (docs/PERFORMANCE.md).
const BF16_FORWARD_MIN_T: usize = 2048;

/// From this T on, bf16 attention's backward pass runs its products on `vdpbf16ps`:
/// measured as for [`BF16_FORWARD_MIN_T`], 0.82–0.90× at T 256, 1.13–1.15× at 512,
/// 1.31–1.36× at 1024, 1.73× at 2048.
const BF16_BACKWARD_MIN_T: usize = 512;

/// Whether bf16 attention's (`BF16`) forward pass runs its products on `vdpbf16ps`
/// (`BF16_FORWARD_MIN_T`).
pub fn bf16_forward_products<const BF16: bool>(d: Dims, backend: &Backend) -> bool {
    BF16 && d.t >= BF16_FORWARD_MIN_T && bf16_capable(d, backend)
}

/// Whether bf16 attention's (`BF16`) backward pass runs its products on `vdpbf16ps`
/// (`BF16_BACKWARD_MIN_T`).
pub fn bf16_backward_products<const BF16: bool>(d: Dims, backend: &Backend) -> bool {
    BF16 && d.t >= BF16_BACKWARD_MIN_T && bf16_capable(d, backend)
}

/// Panics unless the query heads split evenly over the key/value heads, of a
/// positive size.
fn check_heads(d: Dims) {
    let (nh, kv, hs) = (d.nh, d.kv, d.hs);
    assert!(
        nh > 0 && kv > 0 && hs > 0 && nh.is_multiple_of(kv),
        "NH = {nh} query heads must be a positive multiple of KV = {kv} key/value heads \
         of HS = {hs} > 0 channels"
    );
}

/// The factor of the scores, `1 / √HS`.
fn score_scale(d: Dims) -> f32 {
    1.0 / (d.hs as f32).sqrt()
}

/// Index in `qkv`/`dqkv` of channel 0 of query head `h` at token `(b, 0)`, where
/// `bh = b·NH + h`; token `s` is `s·(NH + 2·KV)·HS` further on.
fn qkv_base(d: Dims, bh: usize) -> usize {
    let (b, h) = (bh / d.nh, bh % d.nh);
    b * d.t * d.qkv_width() + h * d.hs
}

/// Index in `qkv`/`dqkv` of channel 0 of key/value head `g`'s key at token `(b, 0)`,
/// where `bg = b·KV + g`; its value is `KV·HS` further on.
fn key_base(d: Dims, bg: usize) -> usize {
    let (b, g) = (bg / d.kv, bg % d.kv);
    b * d.t * d.qkv_width() + (d.nh + g) * d.hs
}

/// Index in `out`/`dout` of channel 0 of head `h` at token `(b, 0)`, `bh = b·NH + h`.
fn out_base(d: Dims, bh: usize) -> usize {
    let (b, h) = (bh / d.nh, bh % d.nh);
    b * d.t * d.q_width() + h * d.hs
}

/// The key/value head `b·KV + g` that query head `bh = b·NH + h` reads.
fn kv_head(d: Dims, bh: usize) -> usize {
    let (b, h) = (bh / d.nh, bh % d.nh);
    b * d.kv + h / d.group()
}

/// The mask to apply, or `None` where it would be the identity.
fn effective(dropout: Option<Dropout>) -> Option<Dropout> {
    dropout.filter(|d| d.p > 0.0)
}

/// A stand-in mask for the instantiations without dropout, which never read it.
const NO_MASK: Dropout = Dropout { p: 0.0, seed: 0 };

/// The dropout factor of element `index` when `DROP`, else the constant 1.
#[inline(always)]
fn mask_factor<const DROP: bool>(mask: Dropout, index: u64) -> f32 {
    if DROP {
        mask.factor(index)
    } else {
        1.0
    }
}
