//! The instruction-set variants: the passes and the matrix kernel are generic over a
//! [`Variant`], compiled once per variant, and [`Isa`] picks one at run time (each
//! pass compiles itself for the variants: `Isa::forward` in forward.rs,
//! `Isa::backward` in backward.rs).

use super::tiles::{gemm_acc, Gemm};
use crate::kernels::cpu;
#[cfg(target_arch = "x86_64")]
pub(super) use x86::{Avx2, Avx512};

/// An instruction-set variant: the code of the passes is generic over it.
pub(super) trait Variant {
    /// Whether to use fused multiply-adds (only where they are instructions).
    const FMA: bool;
    /// Whether AVX is available (for the 8 × 8 transposes).
    const AVX: bool;

    /// Runs `g` with [`gemm_acc`] compiled for this variant.
    ///
    /// # Safety
    /// The variant's features must be available, and `g` must meet [`gemm_acc`]'s
    /// requirements.
    unsafe fn gemm(g: Gemm);
}

/// Baseline x86-64 (SSE2), or any other architecture. AArch64 always has NEON with
/// fused multiply-adds and 32 vector registers, so it gets those and a wider tile.
pub(super) struct Base;

impl Variant for Base {
    const FMA: bool = cfg!(target_arch = "aarch64");
    const AVX: bool = false;

    unsafe fn gemm(g: Gemm) {
        #[cfg(target_arch = "aarch64")]
        gemm_acc::<true, 4, 16>(g);
        #[cfg(not(target_arch = "aarch64"))]
        gemm_acc::<false, 4, 8>(g);
    }
}

/// Instruction-set variants, chosen once per call.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Isa {
    Base,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    pub(super) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                if is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                return Isa::Avx2;
            }
        }
        Isa::Base
    }

    /// Every variant this CPU can run.
    #[cfg(test)]
    pub(super) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Base];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
                if is_x86_feature_detected!("avx512f") {
                    v.push(Isa::Avx512);
                }
            }
        }
        v
    }
}

/// Whether this CPU runs the bf16 variants: AVX512-BF16 on top of the AVX-512 one.
pub(super) fn bf16_usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        Isa::detect() == Isa::Avx512 && cpu::avx512_bf16()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The matrix kernel compiled with AVX2 + FMA and with AVX-512. Every
/// `#[inline(always)]` helper it calls is compiled into it with these features.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{gemm_acc, Gemm, Variant};

    pub(crate) struct Avx2;
    pub(crate) struct Avx512;

    impl Variant for Avx2 {
        const FMA: bool = true;
        const AVX: bool = true;

        unsafe fn gemm(g: Gemm) {
            gemm_avx2(g)
        }
    }

    impl Variant for Avx512 {
        const FMA: bool = true;
        const AVX: bool = true;

        unsafe fn gemm(g: Gemm) {
            gemm_avx512(g)
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA, and `g` must meet [`gemm_acc`]'s requirements.
    #[target_feature(enable = "avx2,fma")]
    #[inline(never)]
    unsafe fn gemm_avx2(g: Gemm) {
        gemm_acc::<true, 4, 16>(g)
    }

    /// # Safety
    /// The CPU must have AVX-512F, AVX2 and FMA, and `g` must meet [`gemm_acc`]'s
    /// requirements.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline(never)]
    unsafe fn gemm_avx512(g: Gemm) {
        gemm_acc::<true, 4, 32>(g)
    }
}
