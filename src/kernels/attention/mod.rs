//! Causal multi-head self-attention, flash-style: forward and backward without any
//! `T × T` matrix.
//!
//! The forward pass walks each head's queries in blocks of `BQ` rows and its keys in
//! blocks of `BK` rows with an online (running-max) softmax; it keeps only the
//! per-row log-sum-exp. The backward pass recomputes the probabilities of each
//! (query block, key block) tile from that log-sum-exp.
//!
//! Both passes are built from one register-tiled matrix kernel, `gemm_acc`, over
//! fixed-size stack tiles, so nothing is allocated on the heap. On x86-64 everything is
//! compiled three times (baseline, AVX2 + FMA, AVX-512) and the variant is picked at
//! run time. Each task performs its floating-point operations in a fixed order, so the
//! results do not depend on the number of threads.

mod backward;
mod forward;
mod isa;
#[cfg(test)]
mod tests;
mod tiles;

use super::dropout::Dropout;
use super::Dims;
use backward::backward_impl;
use forward::forward_impl;
use isa::Isa;

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
/// - `qkv`: `(B, T, 3C)`; token `(b, t)` holds q in channels `[0, C)`, k in `[C, 2C)`,
///   v in `[2C, 3C)`, and head `h` uses channels `h·HS..(h+1)·HS` of each (`HS = C/NH`).
/// - `out`: `(B, T, C)`, heads concatenated the same way; overwritten.
/// - `lse`: `(B, NH, T)`, the log-sum-exp of the scaled scores `q_t·k_s / √HS` over
///   the causal keys `s <= t` (without dropout); overwritten, and needed by backward.
/// - `dropout`: applied to the attention probabilities; element `(b, h, t, s)` uses
///   mask index `((b·NH + h)·T + t)·T + s`.
///
/// Parallel over `(b, h, query block)`; results do not depend on the thread count.
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    d: Dims,
    dropout: Option<Dropout>,
) {
    let _t = crate::profile::scope(crate::profile::Section::Attention);
    forward_impl(Isa::detect(), out, lse, qkv, d, dropout);
}

/// Causal self-attention backward, recomputing the probabilities from `lse`.
///
/// `dout`: `(B, T, C)`; `qkv`, `out`, `lse` and `dropout` exactly as given to and
/// produced by [`attention_forward`]; `dqkv`: `(B, T, 3C)`, **overwritten**.
///
/// Parallel over `(b, h)`; results do not depend on the thread count.
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    d: Dims,
    dropout: Option<Dropout>,
) {
    let _t = crate::profile::scope(crate::profile::Section::AttentionBackward);
    backward_impl(Isa::detect(), dqkv, dout, qkv, out, lse, d, dropout);
}

/// Panics unless `C` splits into `NH` heads.
fn check_heads(d: Dims) {
    let (c, nh) = (d.c, d.nh);
    assert!(
        nh > 0 && c > 0 && c.is_multiple_of(nh),
        "C = {c} must be a positive multiple of NH = {nh}"
    );
}

/// The factor of the scores, `1 / √HS`.
fn score_scale(d: Dims) -> f32 {
    1.0 / (d.hs() as f32).sqrt()
}

/// Index in `qkv`/`dqkv` of channel 0 of head `h`'s query at token `(b, 0)`, where
/// `bh = b·NH + h`; keys are `C` further on, values `2C`, and token `s` is `s·3C`
/// further on.
fn qkv_base(d: Dims, bh: usize) -> usize {
    let (b, h) = (bh / d.nh, bh % d.nh);
    b * d.t * 3 * d.c + h * d.hs()
}

/// Index in `out`/`dout` of channel 0 of head `h` at token `(b, 0)`, `bh = b·NH + h`.
fn out_base(d: Dims, bh: usize) -> usize {
    let (b, h) = (bh / d.nh, bh % d.nh);
    b * d.t * d.c + h * d.hs()
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

/// Pointer to an output buffer that parallel tasks write in disjoint pieces.
///
/// Sound because the task for batch element `b` and head `h` (and, in the forward
/// pass, one query block) reads and writes only channels `h·HS..(h+1)·HS` (of q, k and
/// v, for `dqkv`) of its own rows of batch element `b`: distinct tasks touch disjoint
/// elements, and the `&mut` slice the pointer came from is not used while they run,
/// so there is no data race and no aliasing `&mut`.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);

// SAFETY: see the type's documentation; tasks write disjoint elements only.
unsafe impl Send for SharedMut {}
// SAFETY: as above.
unsafe impl Sync for SharedMut {}

impl SharedMut {
    fn get(self) -> *mut f32 {
        self.0
    }

    /// The `len` floats at offset `off`, as a slice.
    ///
    /// # Safety
    /// They must lie in the buffer, and no one else may access them while the slice
    /// lives (in practice: they are channels of the calling task's own head).
    #[inline(always)]
    unsafe fn run<'a>(self, off: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(off), len)
    }
}
