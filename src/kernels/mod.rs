//! Forward and backward kernels of GPT-2, as plain functions over flat `f32` slices.
//!
//! Shapes are written with these letters throughout:
//! `B` batch, `T` sequence length, `C` channels (`n_embd`, `hidden_size`), `NH` query
//! heads, `KV` key/value heads (`NH` for multi-head attention, fewer for grouped-query
//! attention, which `NH / KV` query heads share), `HS` head size (`C / NH` for GPT-2,
//! independent of it in Qwen3), `QW = NH·HS` the query (and attention output) width,
//! `I` the MLP's hidden width, `V` real vocabulary, `Vp` padded vocabulary, `N = B·T`
//! rows, `OC` output channels of a linear layer.
//! All tensors are row-major; `(B, T, C)` means index `(b·T + t)·C + c`.
//!
//! Gradient conventions (every kernel documents which applies):
//! - parameter gradients (`dweight`, `dbias`, `dwte`, ...) always **accumulate** (`+=`),
//!   so gradient accumulation and weight tying need nothing special;
//! - input gradients (`dinp`, ...) are **overwritten**, except where a kernel says it
//!   accumulates (layer norm adds into the residual-stream gradient).
//!
//! Kernels parallelise with rayon on the current pool.

pub mod attention;
pub mod bf16;
pub mod classifier;
pub mod cpu;
pub mod dropout;
pub mod encoder;
pub(crate) mod fastmath;
pub mod gelu;
pub mod gemv;
pub mod layernorm;
pub mod mat;
pub mod matmul;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;

#[cfg(test)]
pub(crate) mod testutil;

use std::marker::PhantomData;

use fastmath::Simd;
use rayon::prelude::*;

/// The shape of one pass: `B` sequences of `T` positions, `C` channels; attention in
/// `NH` query heads and `KV` key/value heads of `HS` channels each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub kv: usize,
    pub hs: usize,
}

impl Dims {
    /// Multi-head attention over `C` split into `NH` heads (GPT-2): `KV = NH`,
    /// `HS = C / NH`.
    pub fn new(b: usize, t: usize, c: usize, nh: usize) -> Dims {
        let hs = c.checked_div(nh).unwrap_or(0);
        Dims {
            b,
            t,
            c,
            nh,
            kv: nh,
            hs,
        }
    }

    /// The same pass with `kv` key/value heads of `hs` channels (grouped-query
    /// attention, a head size independent of `C / NH`).
    pub fn with_heads(self, kv: usize, hs: usize) -> Dims {
        Dims { kv, hs, ..self }
    }

    /// Rows of a `(B, T, ·)` tensor: `N = B·T`.
    pub fn bt(self) -> usize {
        self.b * self.t
    }

    /// Channels of the queries and of the attention's output: `QW = NH·HS`.
    pub fn q_width(self) -> usize {
        self.nh * self.hs
    }

    /// Channels of a row of queries, keys and values: `(NH + 2·KV)·HS`.
    pub fn qkv_width(self) -> usize {
        (self.nh + 2 * self.kv) * self.hs
    }

    /// Query heads per key/value head: `NH / KV`.
    pub fn group(self) -> usize {
        self.nh / self.kv
    }
}

/// A mutable buffer that parallel tasks write in disjoint pieces.
///
/// It holds the `&'a mut [f32]` it was made from for `'a`, so the buffer cannot be
/// used otherwise, or freed, while any copy of it lives; the copies may go to other
/// threads. Each task takes the pieces it owns with [`SharedMut::slice`].
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<'a> {
    ptr: *mut f32,
    len: usize,
    buf: PhantomData<&'a mut [f32]>,
}

// SAFETY: a `SharedMut` is a `&mut [f32]` whose elements are reached only through
// `slice` and `ptr`, whose callers promise that pieces in use at the same time are
// disjoint; so sharing it between threads races on nothing.
unsafe impl Send for SharedMut<'_> {}
// SAFETY: as above.
unsafe impl Sync for SharedMut<'_> {}

impl<'a> SharedMut<'a> {
    pub(crate) fn new(buf: &'a mut [f32]) -> Self {
        SharedMut {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            buf: PhantomData,
        }
    }

    /// The `len` elements from `start`, for the calling task to write.
    ///
    /// # Panics
    /// If they are not all in the buffer.
    ///
    /// # Safety
    /// The caller owns them: no two pieces of one buffer that are in use at the same
    /// time (slices from this function, or elements written through [`Self::ptr`])
    /// may overlap. In practice the tasks partition the buffer, and each takes only
    /// pieces of its own part; every use site says why its pieces are disjoint.
    #[inline]
    pub(crate) unsafe fn slice(self, start: usize, len: usize) -> &'a mut [f32] {
        assert!(
            start <= self.len && len <= self.len - start,
            "{len} elements from {start} exceed the buffer's {}",
            self.len
        );
        // SAFETY: in bounds (asserted), borrowed for 'a, and owned by this caller alone.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }

    /// The start of the buffer, for writes in a pattern no slice can describe (the
    /// strided rows of a head in attention). Writing through it is bound by the
    /// contract of [`Self::slice`], and must stay within the buffer.
    pub(crate) fn ptr(self) -> *mut f32 {
        self.ptr
    }

    /// Elements in the buffer.
    pub(crate) fn len(self) -> usize {
        self.len
    }
}

/// Runs `row(simd, o, x, s)` on each row of a norm's output `out` and input `inp`,
/// (N, C), with that row's item `s` of `stats` (N items): the loop a norm's forward
/// (which writes its statistics) and its recompute (which reads them) share, timed
/// as the layer norm's section. Results do not depend on the thread count.
pub(crate) fn norm_rows<S: IndexedParallelIterator>(
    out: &mut [f32],
    inp: &[f32],
    c: usize,
    stats: S,
    row: impl Fn(Simd, &mut [f32], &[f32], S::Item) + Sync + Send,
) {
    let _t = crate::profile::scope(crate::profile::Section::LayerNorm);
    assert!(out.len() == inp.len() && inp.len() == stats.len() * c);
    let simd = Simd::detect();
    out.par_chunks_mut(c)
        .zip(inp.par_chunks(c))
        .zip(stats)
        .for_each(|((o, x), s)| row(simd, o, x, s));
}

#[cfg(test)]
mod tests {
    use super::SharedMut;
    use rayon::prelude::*;

    #[test]
    fn shared_mut_hands_out_disjoint_pieces() {
        let mut buf = vec![0.0f32; 10];
        let shared = SharedMut::new(&mut buf);
        (0..5).into_par_iter().for_each(|i| {
            // SAFETY: task i alone takes elements 2i and 2i + 1.
            let piece = unsafe { shared.slice(2 * i, 2) };
            piece.fill(i as f32);
        });
        assert_eq!(buf, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]);
    }

    #[test]
    #[should_panic(expected = "2 elements from 3 exceed the buffer's 4")]
    fn shared_mut_checks_bounds() {
        let mut buf = vec![0.0f32; 4];
        let shared = SharedMut::new(&mut buf);
        // SAFETY: the only piece taken.
        let _ = unsafe { shared.slice(3, 2) };
    }
}
