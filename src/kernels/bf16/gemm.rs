//! The bf16 matmuls of `dtype = "bfloat16"` and the choice of their kernel.
//!
//! A product runs on the AMX-BF16 kernel ([`super::amx`]) when all of these hold, and
//! on the f32 GEMM over bf16-valued operands ([`matmul`], the same products up to
//! summation order) otherwise:
//! - `NANOGPT_BF16_GEMM` is not `f32` (`f32` forces the f32 GEMM for A/B runs; unset,
//!   `amx` or any other value leaves the choice to the next two);
//! - the CPU has AMX-BF16 and Linux grants the process the tile permission;
//! - the product has at least 2^20 multiply-adds (below that, packing the operands
//!   into tiles costs more than it saves).
//!
//! The first two are decided once per process ([`kernel`]), the last per product.
//!
//! An AVX512-BF16 (`vdpbf16ps`) kernel was an opt-in here until it was measured
//! against the f32 GEMM it would replace on CPUs without AMX: it never won (slower on
//! the quick-start shapes, no faster on GPT-2 124M; docs/PERFORMANCE.md), so it was
//! removed.

use super::amx::{self, PackedB};
use crate::kernels::matmul::{matmul, Mat};
use std::sync::OnceLock;

/// Below this many multiply-adds (m·n·k) packing costs more than it saves.
const MIN_MACS: usize = 1 << 20;

/// Which kernel runs the large bf16 matmuls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AMX-BF16 tiles ([`super::amx`]).
    Amx,
    /// The f32 GEMM over bf16-valued operands.
    F32,
}

/// Whether `NANOGPT_BF16_GEMM=f32` asks for the f32 GEMM.
pub fn f32_requested() -> bool {
    std::env::var("NANOGPT_BF16_GEMM").is_ok_and(|v| v == "f32")
}

/// The kernel for large bf16 matmuls, chosen once (see the module comment).
pub fn kernel() -> Kernel {
    #[cfg(test)]
    if let Some(k) = FORCED.get() {
        return k;
    }
    static K: OnceLock<Kernel> = OnceLock::new();
    *K.get_or_init(|| match f32_requested() || !amx::permitted() {
        true => Kernel::F32,
        false => Kernel::Amx,
    })
}

#[cfg(test)]
thread_local! {
    /// A kernel forced for bf16 matmuls dispatched from this thread (tests only).
    static FORCED: std::cell::Cell<Option<Kernel>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the bf16 matmuls it dispatches from this thread on `k`: for a model
/// test that checks the rounding points on the f32 GEMM whatever the machine has
/// (tests only; `k` must be usable on this machine).
#[cfg(test)]
pub(crate) fn with_kernel<R>(k: Kernel, f: impl FnOnce() -> R) -> R {
    let before = FORCED.replace(Some(k));
    let r = f();
    FORCED.set(before);
    r
}

/// `dst = a · b` (or `+=` when `accumulate`) for operands that hold bf16 values
/// (exactly representable; on AMX other values are rounded to nearest even while
/// packing). Large products run on the [`kernel`] chosen, the rest on the f32 GEMM;
/// all accumulate in f32.
pub fn matmul_bf16(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    let macs = a.rows * a.cols * b.cols;
    match kernel() {
        Kernel::Amx if macs >= MIN_MACS => amx::matmul(dst, a, b, accumulate),
        _ => matmul(dst, a, b, accumulate),
    }
}

/// [`matmul_bf16`] with a right-hand operand packed beforehand for AMX (the caller
/// made the pack because [`kernel`] is [`Kernel::Amx`]).
pub fn matmul_bf16_packed(dst: &mut [f32], a: Mat, b: &PackedB, accumulate: bool) {
    amx::matmul_packed(dst, a, b, accumulate);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round;
    use crate::kernels::testutil::*;

    #[test]
    fn small_products_take_the_f32_gemm() {
        // Below MIN_MACS (and whenever AMX is not the kernel), matmul_bf16 is the f32
        // GEMM, bit for bit.
        let (m, k, n) = (16, 16, 48);
        let a: Vec<f32> = rand_vec(m * k, 6).into_iter().map(round).collect();
        let b: Vec<f32> = rand_vec(k * n, 7).into_iter().map(round).collect();
        let (mut x, mut y) = (vec![0.0; m * n], vec![0.0; m * n]);
        matmul(&mut x, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        matmul_bf16(&mut y, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        assert_eq!(x, y);
    }
}
