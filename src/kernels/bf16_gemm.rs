//! The bf16 matmuls of `dtype = "bfloat16"` and the choice of their kernel. Large
//! products run on the AMX-BF16 kernel ([`super::bf16_amx`]) where the CPU has AMX and
//! the OS lets the process use its tiles; elsewhere on the f32 GEMM over bf16-valued
//! operands ([`super::matmul::matmul`]), which computes the same products.
//! `NANOGPT_BF16_GEMM=f32` forces the f32 GEMM ([`kernel`]), for A/B runs.
//!
//! An AVX512-BF16 (`vdpbf16ps`) kernel lived here as an opt-in until it was measured
//! against the f32 GEMM it would replace on CPUs without AMX: it never won (slower
//! on the quick-start shapes, no faster on GPT-2 124M; docs/PERFORMANCE.md), so it
//! was removed.

use super::bf16::Bf16;
use super::bf16_amx;
use super::matmul::{matmul, Mat};
use std::cell::RefCell;
use std::sync::OnceLock;

/// Below this many multiply-adds (m·n·k) packing costs more than it saves.
const MIN_MACS: usize = 1 << 20;

/// Which kernel runs the large bf16 matmuls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AMX-BF16 tiles ([`super::bf16_amx`]).
    Amx,
    /// The f32 GEMM over bf16-valued operands.
    F32,
}

/// The kernel for large bf16 matmuls, chosen once: the f32 GEMM when
/// `NANOGPT_BF16_GEMM=f32`; otherwise (unset, `amx`, or any other value) AMX where
/// the CPU has it and the process may use it, else the f32 GEMM.
pub fn kernel() -> Kernel {
    #[cfg(test)]
    if let Some(k) = FORCED.get() {
        return k;
    }
    static K: OnceLock<Kernel> = OnceLock::new();
    *K.get_or_init(|| match std::env::var("NANOGPT_BF16_GEMM").as_deref() {
        Ok("f32") => Kernel::F32,
        _ if bf16_amx::permitted() => Kernel::Amx,
        _ => Kernel::F32,
    })
}

#[cfg(test)]
thread_local! {
    /// A kernel forced for bf16 matmuls dispatched from this thread (tests only).
    static FORCED: std::cell::Cell<Option<Kernel>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the bf16 matmuls it dispatches from this thread on `k` (tests only;
/// `k` must be usable on this machine).
#[cfg(test)]
pub(crate) fn with_kernel<R>(k: Kernel, f: impl FnOnce() -> R) -> R {
    let before = FORCED.replace(Some(k));
    let r = f();
    FORCED.set(before);
    r
}

/// `dst = a · b` (or `+=` when `accumulate`) for operands that hold bf16 values
/// (exactly representable; other values are rounded to nearest even while packing).
/// Large products run on the [`kernel`] chosen, the rest on the f32 GEMM; all
/// accumulate in f32.
pub fn matmul_bf16(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    let macs = a.rows * a.cols * b.cols;
    match kernel() {
        _ if macs < MIN_MACS => matmul(dst, a, b, accumulate),
        Kernel::Amx => amx(dst, a, b, accumulate),
        Kernel::F32 => matmul(dst, a, b, accumulate),
    }
}

/// The AMX path of [`matmul_bf16`], on this thread's packing buffers; the caller
/// checked [`bf16_amx::permitted`].
pub(crate) fn amx(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    PACKS.with_borrow_mut(|(pa, pb)| bf16_amx::matmul(dst, a, b, accumulate, pa, pb));
}

/// [`matmul_bf16`] with a right-hand operand packed beforehand for AMX (the caller
/// made the pack because [`kernel`] is [`Kernel::Amx`]).
pub fn matmul_bf16_packed(dst: &mut [f32], a: Mat, b: &bf16_amx::PackedB, accumulate: bool) {
    PACKS.with_borrow_mut(|(pa, _)| bf16_amx::matmul_packed(dst, a, b, accumulate, pa));
}

thread_local! {
    /// Packing buffers of the calling thread, grown to the largest product and
    /// reused, so a training step allocates nothing once warm.
    static PACKS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Two bf16 values in one 32-bit lane: `lo` is element `2p`, `hi` element `2p + 1`
/// (the pair layout the AMX kernel packs into).
#[inline]
pub(super) fn pair(lo: f32, hi: f32) -> u32 {
    Bf16::from_f32(lo).0 as u32 | (Bf16::from_f32(hi).0 as u32) << 16
}

/// Element `(i, j)` of `m`, or 0 outside it (the zero padding of the packs).
#[inline]
pub(super) fn at(m: &Mat, i: usize, j: usize) -> f32 {
    if i < m.rows && j < m.cols {
        m.data[i * m.rs + j * m.cs]
    } else {
        0.0
    }
}

/// How bf16 matmuls run on this machine, for the start-of-run report.
pub fn path() -> &'static str {
    match kernel() {
        Kernel::Amx => "AMX-BF16 (tdpbf16ps) for the large linear layers, f32 GEMM over bf16 values elsewhere",
        Kernel::F32 if std::env::var("NANOGPT_BF16_GEMM").is_ok_and(|v| v == "f32") => {
            "emulated via f32 GEMM (bf16 operands, f32 accumulation), as NANOGPT_BF16_GEMM=f32 asks"
        }
        Kernel::F32 if bf16_amx::cpu_has_amx() => {
            "emulated via f32 GEMM (bf16 operands, f32 accumulation); the CPU has AMX but the OS refused the tile permission"
        }
        Kernel::F32 => {
            "emulated via f32 GEMM (bf16 operands, f32 accumulation); no AMX on this CPU"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round;
    use crate::kernels::testutil::*;

    fn rounded(n: usize, seed: u64) -> Vec<f32> {
        rand_vec(n, seed).into_iter().map(round).collect()
    }

    #[test]
    fn small_products_take_the_f32_gemm() {
        // Below MIN_MACS (and whenever AMX is not the kernel), matmul_bf16 is the f32
        // GEMM, bit for bit.
        let (m, k, n) = (16, 16, 48);
        let (a, b) = (rounded(m * k, 6), rounded(k * n, 7));
        let (mut x, mut y) = (vec![0.0; m * n], vec![0.0; m * n]);
        matmul(&mut x, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        matmul_bf16(&mut y, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        assert_eq!(x, y);
    }

    /// Timing, not correctness: `cargo test --release --lib bf16_gemm -- --ignored
    /// --nocapture`. Alternates the two paths on GPT-2 124M shapes (B·T = 1024).
    #[test]
    #[ignore]
    fn amx_kernel_speed() {
        if !bf16_amx::permitted() {
            eprintln!("no usable AMX here: nothing to time");
            return;
        }
        {
            // Peak of one 32 × 32 AMX block, on cache-resident packs.
            let kc = 24;
            let p = vec![0x3F80_3F80u32; 2 * kc * 256];
            let mut c = [[0.0f32; 32]; 32];
            let reps = 20_000;
            // SAFETY: permitted() checked; the config is loaded on this thread before
            // the blocks and released after.
            let t = unsafe {
                bf16_amx::x86::configure();
                let s = std::time::Instant::now();
                for _ in 0..reps {
                    bf16_amx::x86::block(kc, std::hint::black_box(&p), &p, &mut c);
                }
                let t = s.elapsed().as_secs_f64();
                bf16_amx::x86::release();
                t
            };
            let flops = (reps * 2 * 32 * 32 * 32 * kc) as f64;
            println!(
                "AMX block alone, one thread: {:.1} GFLOP/s",
                flops / t / 1e9
            );
        }
        // (m, k, n, A transposed, B transposed) as the linear layers pass them:
        // forward x · Wᵀ, dinp = dout · W, dweight = doutᵀ · x.
        let shapes = [
            (1024, 768, 2304, false, true),
            (1024, 768, 3072, false, true),
            (1024, 3072, 768, false, true),
            (1024, 2304, 768, false, false),
            (1024, 768, 3072, false, false),
            (768, 1024, 3072, true, false),
            (3072, 1024, 768, true, false),
        ];
        for (m, k, n, ta, tb) in shapes {
            let (a, b) = (rounded(m * k, 1), rounded(k * n, 2));
            let mut out = vec![0.0; m * n];
            let am = if ta {
                Mat::new(&a, k, m).t()
            } else {
                Mat::new(&a, m, k)
            };
            let bm = if tb {
                Mat::new(&b, n, k).t()
            } else {
                Mat::new(&b, k, n)
            };
            let mut t = [Vec::new(), Vec::new()];
            for _ in 0..7 {
                let s = std::time::Instant::now();
                matmul(&mut out, am, bm, false);
                t[0].push(s.elapsed().as_secs_f64());
                let s = std::time::Instant::now();
                amx(&mut out, am, bm, false);
                t[1].push(s.elapsed().as_secs_f64());
            }
            let gf = |t: &mut Vec<f64>| {
                t.sort_by(f64::total_cmp);
                2.0 * (m * n * k) as f64 / t[t.len() / 2] / 1e9
            };
            let (f32, amx) = (gf(&mut t[0]), gf(&mut t[1]));
            println!(
                "{m}×{k}×{n} (Aᵀ {ta}, Bᵀ {tb}): f32 GEMM {f32:.1}, AMX-BF16 {amx:.1} GFLOP/s \
                 (medians of 7, alternating)"
            );
        }
    }
}
