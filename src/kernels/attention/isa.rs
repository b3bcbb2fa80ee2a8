//! The instruction-set variants: the passes and the matrix kernel are generic over a
//! [`Variant`], compiled once per variant, and [`Isa`] picks one at run time.

use super::backward::{backward_head, BwdTask};
use super::forward::{forward_block, FwdTask};
use super::tiles::{gemm_acc, Gemm};
use crate::kernels::bf16::dpbf16;

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
struct Base;

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

    pub(super) fn forward<const DROP: bool>(self, task: FwdTask) {
        match self {
            Isa::Base => forward_block::<Base, DROP>(task),
            // SAFETY: `Isa::detect` found these features on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::forward_avx2::<DROP>(task) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::forward_avx512::<DROP>(task) },
        }
    }

    pub(super) fn backward<const DROP: bool>(self, task: BwdTask) {
        match self {
            Isa::Base => backward_head::<Base, DROP>(task),
            // SAFETY: `Isa::detect` found these features on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::backward_avx2::<DROP>(task) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::backward_avx512::<DROP>(task) },
        }
    }
}

/// One forward task of bf16 attention on `vdpbf16ps`. Panics without AVX512-BF16.
pub(super) fn forward_bf16<const DROP: bool>(task: FwdTask) {
    assert!(bf16_usable(), "bf16 attention needs AVX512-BF16");
    // SAFETY: AVX-512 F, AVX2, FMA and AVX512-BF16 were checked just above.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        x86::forward_bf16::<DROP>(task)
    }
}

/// One backward task of bf16 attention on `vdpbf16ps`. Panics without AVX512-BF16.
pub(super) fn backward_bf16<const DROP: bool>(task: BwdTask) {
    assert!(bf16_usable(), "bf16 attention needs AVX512-BF16");
    // SAFETY: AVX-512 F, AVX2, FMA and AVX512-BF16 were checked just above.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        x86::backward_bf16::<DROP>(task)
    }
}

/// Whether this CPU runs the bf16 variants: AVX512-BF16 on top of the AVX-512 one.
pub(super) fn bf16_usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        Isa::detect() == Isa::Avx512 && dpbf16::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The passes and the matrix kernel compiled with AVX2 + FMA and with AVX-512. Every
/// `#[inline(always)]` helper they call is compiled into them with these features.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::backward::backward_head_bf16;
    use super::super::forward::forward_block_bf16;
    use super::{backward_head, forward_block, gemm_acc, BwdTask, FwdTask, Gemm, Variant};

    pub(super) struct Avx2;
    pub(super) struct Avx512;

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

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn forward_avx2<const DROP: bool>(task: FwdTask) {
        forward_block::<Avx2, DROP>(task)
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn forward_avx512<const DROP: bool>(task: FwdTask) {
        forward_block::<Avx512, DROP>(task)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn backward_avx2<const DROP: bool>(task: BwdTask) {
        backward_head::<Avx2, DROP>(task)
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn backward_avx512<const DROP: bool>(task: BwdTask) {
        backward_head::<Avx512, DROP>(task)
    }

    /// # Safety
    /// The CPU must have AVX-512 F, AVX512-BF16, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
    pub(super) unsafe fn forward_bf16<const DROP: bool>(task: FwdTask) {
        // SAFETY: the features are enabled here (caller).
        unsafe { forward_block_bf16::<DROP>(task) }
    }

    /// # Safety
    /// The CPU must have AVX-512 F, AVX512-BF16, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
    pub(super) unsafe fn backward_bf16<const DROP: bool>(task: BwdTask) {
        // SAFETY: the features are enabled here (caller).
        unsafe { backward_head_bf16::<DROP>(task) }
    }
}
