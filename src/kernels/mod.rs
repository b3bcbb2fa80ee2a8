//! Forward and backward kernels of GPT-2, as plain functions over flat `f32` slices.
//!
//! Shapes are written with these letters throughout:
//! `B` batch, `T` sequence length, `C` channels (`n_embd`), `NH` heads,
//! `HS = C / NH` head size, `V` real vocabulary, `Vp` padded vocabulary,
//! `N = B·T` rows, `OC` output channels of a linear layer.
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
pub mod dropout;
pub mod encoder;
pub(crate) mod fastmath;
pub mod gelu;
pub mod layernorm;
pub mod matmul;
pub mod residual;

#[cfg(test)]
pub(crate) mod testutil;

/// The shape of one pass: `B` sequences of `T` positions, `C` channels in `NH` heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
}

impl Dims {
    /// Rows of a `(B, T, ·)` tensor: `N = B·T`.
    pub fn bt(self) -> usize {
        self.b * self.t
    }

    /// Channels per head: `HS = C / NH`.
    pub fn hs(self) -> usize {
        self.c / self.nh
    }
}

/// A raw pointer that parallel tasks may share because each writes a disjoint part.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(*mut f32);

// SAFETY: the pointer is only dereferenced by tasks that write disjoint elements, which
// each user documents at the point of use.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    pub(crate) fn new(slice: &mut [f32]) -> SharedMut {
        SharedMut(slice.as_mut_ptr())
    }

    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
