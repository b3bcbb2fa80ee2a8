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

use rayon::prelude::*;

use super::dropout::Dropout;
use super::fastmath::{exp_fast, fmadd};

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
    d: super::Dims,
    dropout: Option<Dropout>,
) {
    let (b, t, c, nh) = (d.b, d.t, d.c, d.nh);
    let _t = crate::profile::scope(crate::profile::Section::Attention);
    let g = Geom::new(t, c, nh);
    assert_eq!(qkv.len(), b * t * 3 * c, "qkv must be (B, T, 3C)");
    assert_eq!(out.len(), b * t * c, "out must be (B, T, C)");
    assert_eq!(lse.len(), b * nh * t, "lse must be (B, NH, T)");
    forward_impl(Isa::detect(), out, lse, qkv, g, dropout);
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
    d: super::Dims,
    dropout: Option<Dropout>,
) {
    let (b, t, c, nh) = (d.b, d.t, d.c, d.nh);
    let _t = crate::profile::scope(crate::profile::Section::AttentionBackward);
    let g = Geom::new(t, c, nh);
    assert_eq!(dqkv.len(), b * t * 3 * c, "dqkv must be (B, T, 3C)");
    assert_eq!(qkv.len(), b * t * 3 * c, "qkv must be (B, T, 3C)");
    assert_eq!(dout.len(), b * t * c, "dout must be (B, T, C)");
    assert_eq!(out.len(), b * t * c, "out must be (B, T, C)");
    assert_eq!(lse.len(), b * nh * t, "lse must be (B, NH, T)");
    backward_impl(Isa::detect(), dqkv, dout, qkv, out, lse, g, dropout);
}

/// The mask to apply, or `None` where it would be the identity.
fn effective(dropout: Option<Dropout>) -> Option<Dropout> {
    dropout.filter(|d| d.p > 0.0)
}

/// A stand-in mask for the instantiations without dropout, which never read it.
const NO_MASK: Dropout = Dropout { p: 0.0, seed: 0 };

fn forward_impl(
    isa: Isa,
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    g: Geom,
    dropout: Option<Dropout>,
) {
    if lse.is_empty() {
        return;
    }
    let mask = effective(dropout);
    let out = SharedMut(out.as_mut_ptr());
    lse.par_chunks_mut(g.t)
        .enumerate()
        .for_each(|(bh, lse_bh)| {
            lse_bh
                .par_chunks_mut(BQ)
                .enumerate()
                .for_each(|(qb, lse_blk)| {
                    let task = FwdTask {
                        g,
                        qkv,
                        out,
                        lse: lse_blk,
                        bh,
                        i0: qb * BQ,
                        mask: mask.unwrap_or(NO_MASK),
                    };
                    match mask {
                        Some(_) => isa.forward::<true>(task),
                        None => isa.forward::<false>(task),
                    }
                });
        });
}

#[allow(clippy::too_many_arguments)]
fn backward_impl(
    isa: Isa,
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    g: Geom,
    dropout: Option<Dropout>,
) {
    if lse.is_empty() {
        return;
    }
    let mask = effective(dropout);
    let dqkv = SharedMut(dqkv.as_mut_ptr());
    lse.par_chunks(g.t).enumerate().for_each(|(bh, lse_bh)| {
        let task = BwdTask {
            g,
            dqkv,
            dout,
            qkv,
            out,
            lse: lse_bh,
            bh,
            mask: mask.unwrap_or(NO_MASK),
        };
        match mask {
            Some(_) => isa.backward::<true>(task),
            None => isa.backward::<false>(task),
        }
    });
}

/// Shape of one call.
#[derive(Clone, Copy)]
struct Geom {
    t: usize,
    c: usize,
    nh: usize,
    hs: usize,
    scale: f32,
}

impl Geom {
    fn new(t: usize, c: usize, nh: usize) -> Self {
        assert!(
            nh > 0 && c > 0 && c.is_multiple_of(nh),
            "C = {c} must be a positive multiple of NH = {nh}"
        );
        let hs = c / nh;
        Geom {
            t,
            c,
            nh,
            hs,
            scale: 1.0 / (hs as f32).sqrt(),
        }
    }

    /// Index in `qkv`/`dqkv` of channel 0 of head `h`'s query at token `(b, 0)`;
    /// keys are `C` further on, values `2C`, and token `s` is `s·3C` further on.
    fn qkv_base(&self, bh: usize) -> usize {
        let (b, h) = (bh / self.nh, bh % self.nh);
        b * self.t * 3 * self.c + h * self.hs
    }

    /// Index in `out`/`dout` of channel 0 of head `h` at token `(b, 0)`.
    fn out_base(&self, bh: usize) -> usize {
        let (b, h) = (bh / self.nh, bh % self.nh);
        b * self.t * self.c + h * self.hs
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

/// A read-only strided matrix: element `(i, j)` is at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
struct Src {
    ptr: *const f32,
    rs: usize,
    cs: usize,
}

/// A writable matrix with contiguous rows: element `(i, j)` is at `ptr + i·rs + j`.
#[derive(Clone, Copy)]
struct Dst {
    ptr: *mut f32,
    rs: usize,
}

impl Src {
    fn rows(ptr: *const f32, rs: usize) -> Self {
        Src { ptr, rs, cs: 1 }
    }

    /// The transpose of a tile with rows `rs` apart: element `(i, j)` is at `j·rs + i`.
    fn cols(ptr: *const f32, rs: usize) -> Self {
        Src { ptr, rs: 1, cs: rs }
    }

    fn at(self, i: usize, j: usize) -> Self {
        Src {
            ptr: self.ptr.wrapping_add(i * self.rs + j * self.cs),
            ..self
        }
    }
}

impl Dst {
    fn at(self, i: usize, j: usize) -> Self {
        Dst {
            ptr: self.ptr.wrapping_add(i * self.rs + j),
            ..self
        }
    }
}

/// One matrix product `C (+)= A·B` of an `m × kn` by a `kn × n` matrix.
#[derive(Clone, Copy)]
struct Gemm {
    m: usize,
    n: usize,
    kn: usize,
    a: Src,
    b: Src,
    c: Dst,
    /// `C += A·B` if set, else `C = A·B`.
    add: bool,
}

/// An instruction-set variant: the code of the passes is generic over it.
trait Variant {
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
enum Isa {
    Base,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    fn detect() -> Self {
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

    fn forward<const DROP: bool>(self, task: FwdTask) {
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

    fn backward<const DROP: bool>(self, task: BwdTask) {
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

/// The passes and the matrix kernel compiled with AVX2 + FMA and with AVX-512. Every
/// `#[inline(always)]` helper they call is compiled into them with these features.
#[cfg(target_arch = "x86_64")]
mod x86 {
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
}

#[inline(always)]
fn fmax(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Dot product over 16 interleaved partial sums (vectorisable, fixed order).
#[inline(always)]
fn row_dot(fma: bool, a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for ((s, &xi), &yi) in acc.iter_mut().zip(x).zip(y) {
            *s = fmadd(fma, xi, yi, *s);
        }
    }
    for ((s, &xi), &yi) in acc.iter_mut().zip(ca.remainder()).zip(cb.remainder()) {
        *s = fmadd(fma, xi, yi, *s);
    }
    acc.iter().sum()
}

/// The dropout factor of element `index` when `DROP`, else the constant 1.
#[inline(always)]
fn mask_factor<const DROP: bool>(mask: Dropout, index: u64) -> f32 {
    if DROP {
        mask.factor(index)
    } else {
        1.0
    }
}

/// `C (+)= A·B` for an `R × W` block of `C` with `R` and `W` compile-time constants,
/// so that the accumulators live in registers.
///
/// # Safety
/// Elements `A[i][k]`, `B[k][j]`, `C[i][j]` for `i < R`, `j < W`, `k < kn` must lie in
/// live allocations, and no one else may access those `C` elements meanwhile.
#[inline(always)]
unsafe fn gemm_block<const FMA: bool, const R: usize, const W: usize>(
    kn: usize,
    a: Src,
    b: Src,
    c: Dst,
    add: bool,
) {
    let mut acc = [[0.0f32; W]; R];
    if add {
        for (i, row) in acc.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = *c.ptr.add(i * c.rs + j);
            }
        }
    }
    for k in 0..kn {
        let bk = b.ptr.add(k * b.rs);
        let mut bv = [0.0f32; W];
        for (j, v) in bv.iter_mut().enumerate() {
            *v = *bk.add(j);
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let aik = *a.ptr.add(i * a.rs + k * a.cs);
            for (v, &bkj) in row.iter_mut().zip(&bv) {
                *v = fmadd(FMA, aik, bkj, *v);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            *c.ptr.add(i * c.rs + j) = v;
        }
    }
}

/// Columns `j0..` of `g` in strips of width `W` while a whole strip fits; returns the
/// first column not done.
///
/// # Safety
/// As [`gemm_acc`].
#[inline(always)]
unsafe fn gemm_strips<const FMA: bool, const R: usize, const W: usize>(
    g: Gemm,
    mut j0: usize,
) -> usize {
    while j0 + W <= g.n {
        let mut i0 = 0;
        while i0 + R <= g.m {
            let (a, b, c) = (g.a.at(i0, 0), g.b.at(0, j0), g.c.at(i0, j0));
            gemm_block::<FMA, R, W>(g.kn, a, b, c, g.add);
            i0 += R;
        }
        while i0 < g.m {
            let (a, b, c) = (g.a.at(i0, 0), g.b.at(0, j0), g.c.at(i0, j0));
            gemm_block::<FMA, 1, W>(g.kn, a, b, c, g.add);
            i0 += 1;
        }
        j0 += W;
    }
    j0
}

/// `C[i][j] (+)= Σ_{k<kn} A[i][k] · B[k][j]` for `i < m`, `j < n` (see [`Gemm`]),
/// over `R × W` register blocks of `C`, then narrower strips for the last columns.
/// Each element sums its terms in a fixed order (k ascending).
///
/// # Safety
/// Elements `A[i][k]`, `B[k][j]`, `C[i][j]` for `i < m`, `j < n`, `k < kn` must lie in
/// live allocations, and no one else may access those `C` elements meanwhile.
#[inline(always)]
unsafe fn gemm_acc<const FMA: bool, const R: usize, const W: usize>(g: Gemm) {
    let j0 = gemm_strips::<FMA, R, W>(g, 0);
    let j0 = gemm_strips::<FMA, R, 16>(g, j0);
    let j0 = gemm_strips::<FMA, R, 8>(g, j0);
    let j0 = gemm_strips::<FMA, R, 4>(g, j0);
    gemm_strips::<FMA, R, 1>(g, j0);
}

/// `dst[j][i] = scale · src[i·rs + j]` for `i < ni`, `j < nj`, and `dst[j][i] = 0` for
/// `ni <= i < N`: copies `ni` rows of `nj` channels into a transposed tile.
///
/// Uses explicit 8 × 8 AVX transposes if `avx`, because the
/// auto-vectoriser turns the plain loop into slow scatters under AVX-512.
#[inline(always)]
fn transpose_into<const N: usize>(
    avx: bool,
    dst: &mut [[f32; N]; DT],
    src: &[f32],
    rs: usize,
    (ni, nj): (usize, usize),
    scale: f32,
) {
    assert!(ni <= N && nj <= DT);
    if ni < N {
        for row in &mut dst[..nj] {
            row[ni..].fill(0.0);
        }
    }
    if ni == 0 || nj == 0 {
        return;
    }
    assert!((ni - 1) * rs + nj <= src.len());
    let (mut i8, mut j8) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if avx {
        (i8, j8) = (ni / 8 * 8, nj / 8 * 8);
        for i0 in (0..i8).step_by(8) {
            for j0 in (0..j8).step_by(8) {
                // SAFETY: `avx` variants run only where AVX2 was detected. Rows
                // i0..i0 + 8 <= ni of channels j0..j0 + 8 <= nj are in bounds of `src`
                // (asserted above), and of `dst` (nj <= DT rows of N >= ni columns).
                unsafe {
                    transpose8x8_avx(
                        src.as_ptr().add(i0 * rs + j0),
                        rs,
                        dst.as_mut_ptr().cast::<f32>().add(j0 * N + i0),
                        N,
                        scale,
                    );
                }
            }
        }
    }
    // What the 8 × 8 blocks left: channels j8.. of rows ..i8, all channels of rows i8...
    for i in 0..ni {
        let from = if i < i8 { j8 } else { 0 };
        for (j, &v) in src[i * rs..i * rs + nj].iter().enumerate().skip(from) {
            dst[j][i] = v * scale;
        }
    }
}

/// Transposes the 8 × 8 block at `src` (rows `rs` apart) into `dst` (rows `ds` apart),
/// multiplying by `scale`.
///
/// # Safety
/// AVX must be available; the 8 rows of 8 floats at `src` and at `dst` must be in
/// bounds.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose8x8_avx(src: *const f32, rs: usize, dst: *mut f32, ds: usize, scale: f32) {
    use std::arch::x86_64::*;
    let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * rs)));
    // Interleave pairs of rows: t[2p] = (r[2p][0], r[2p+1][0], r[2p][1], r[2p+1][1] | the
    // same for channels 4, 5), t[2p + 1] likewise for channels 2, 3 | 6, 7.
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // Then pairs of pairs: u[4h + k] holds channel k (low lane) and k + 4 (high lane)
    // of rows 4h..4h + 4.
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (h, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + k / 2], t[4 * h + k / 2 + 2]);
        if k % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xEE>(a, b)
        }
    });
    let s = _mm256_set1_ps(scale);
    for k in 0..4 {
        let lo = _mm256_permute2f128_ps::<0x20>(u[k], u[4 + k]);
        let hi = _mm256_permute2f128_ps::<0x31>(u[k], u[4 + k]);
        _mm256_storeu_ps(dst.add(k * ds), _mm256_mul_ps(lo, s));
        _mm256_storeu_ps(dst.add((k + 4) * ds), _mm256_mul_ps(hi, s));
    }
}

/// One forward task: query rows `i0..i0 + lse.len()` of head `bh`.
struct FwdTask<'a> {
    g: Geom,
    qkv: &'a [f32],
    out: SharedMut,
    lse: &'a mut [f32],
    bh: usize,
    i0: usize,
    mask: Dropout,
}

#[inline(always)]
fn forward_block<K: Variant, const DROP: bool>(task: FwdTask) {
    let FwdTask {
        g,
        qkv,
        out,
        lse,
        bh,
        i0,
        mask,
    } = task;
    let (t, c, hs, fma) = (g.t, g.c, g.hs, K::FMA);
    let row3 = 3 * c;
    let nr = lse.len();
    let qbase = g.qkv_base(bh);
    let obase = g.out_base(bh) + i0 * c;
    let mask_base = (bh * t) as u64 * t as u64;
    let qkv_rows = Src::rows(qkv.as_ptr(), row3);
    assert!(nr > 0 && i0 + nr <= t && qbase + (t - 1) * row3 + 2 * c + hs <= qkv.len());

    let resident = hs <= DT;
    // Transposed, pre-scaled queries: qt[d][r] = scale · q[i0 + r][d0 + d]. Columns
    // r >= nr are zero, so every score of the padding rows is finite.
    let mut qt = [[0.0f32; BQ]; DT];
    if resident {
        let src = &qkv[qbase + i0 * row3..];
        transpose_into(K::AVX, &mut qt, src, row3, (nr, hs), g.scale);
    }
    // Unnormalised output rows: this stack tile when the head fits in it, else `out`.
    let mut o = [[0.0f32; DT]; BQ];
    // Scores, transposed: st[c][r] for key j0 + c and query i0 + r.
    let mut st = [[0.0f32; BQ]; BK];
    let mut m = [f32::NEG_INFINITY; BQ];
    let mut l = [0.0f32; BQ];

    // Keys beyond the last query of the block are masked for all its rows.
    let kend = i0 + nr;
    for j0 in (0..kend).step_by(BK) {
        let nc = BK.min(kend - j0);
        for d0 in (0..hs).step_by(DT) {
            let dn = DT.min(hs - d0);
            if !resident {
                let src = &qkv[qbase + i0 * row3 + d0..];
                transpose_into(K::AVX, &mut qt, src, row3, (nr, dn), g.scale);
            }
            // SAFETY: key rows j0..j0 + nc <= T, channels d0..d0 + dn <= HS of this
            // head lie in `qkv`; `qt` has DT >= dn rows of BQ; `st` has BK >= nc rows.
            unsafe {
                K::gemm(Gemm {
                    m: nc,
                    n: BQ,
                    kn: dn,
                    a: qkv_rows.at(0, qbase + j0 * row3 + c + d0),
                    b: Src::rows(qt.as_ptr().cast(), BQ),
                    c: Dst {
                        ptr: st.as_mut_ptr().cast(),
                        rs: BQ,
                    },
                    add: d0 > 0,
                });
            }
        }
        if j0 + nc > i0 + 1 {
            // Diagonal tile: key j0 + c is masked for query i0 + r when j0 + c > i0 + r.
            for (cc, row) in st[..nc].iter_mut().enumerate() {
                for (r, v) in row.iter_mut().enumerate() {
                    if j0 + cc > i0 + r {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }
        // Online softmax. Every row sees key 0 in its first tile, so `m` is finite
        // from then on and `alpha` is never NaN.
        let mut m_new = m;
        for row in &st[..nc] {
            for (mn, &v) in m_new.iter_mut().zip(row) {
                *mn = fmax(*mn, v);
            }
        }
        let mut alpha = [0.0f32; BQ];
        for ((a, &mo), &mn) in alpha.iter_mut().zip(&m).zip(&m_new) {
            *a = exp_fast(fma, mo - mn);
        }
        for row in &mut st[..nc] {
            for (v, &mn) in row.iter_mut().zip(&m_new) {
                *v = exp_fast(fma, *v - mn);
            }
        }
        for (lr, &a) in l.iter_mut().zip(&alpha) {
            *lr *= a;
        }
        for row in &st[..nc] {
            for (lr, &p) in l.iter_mut().zip(row) {
                *lr += p;
            }
        }
        m = m_new;
        // The first tile overwrites the output rows; later ones rescale them and add.
        if j0 > 0 {
            for (r, &a) in alpha[..nr].iter().enumerate() {
                if a != 1.0 {
                    let row = if resident {
                        &mut o[r][..hs]
                    } else {
                        // SAFETY: this task's own rows and head channels of `out`.
                        unsafe { out.run(obase + r * c, hs) }
                    };
                    for v in row {
                        *v *= a;
                    }
                }
            }
        }
        if DROP {
            for (cc, row) in st[..nc].iter_mut().enumerate() {
                for (r, v) in row[..nr].iter_mut().enumerate() {
                    let index = mask_base + ((i0 + r) * t + j0 + cc) as u64;
                    *v *= mask_factor::<DROP>(mask, index);
                }
            }
        }
        // o[r] (+)= Σ_c p[r][c] · v[j0 + c].
        let o_dst = if resident {
            Dst {
                ptr: o.as_mut_ptr().cast(),
                rs: DT,
            }
        } else {
            Dst {
                ptr: out.get().wrapping_add(obase),
                rs: c,
            }
        };
        // SAFETY: `st` holds BK >= nc rows of BQ >= nr; value rows j0..j0 + nc <= T of
        // this head lie in `qkv`; `o` has BQ rows of DT >= HS, and the `out` rows are
        // this task's own.
        unsafe {
            K::gemm(Gemm {
                m: nr,
                n: hs,
                kn: nc,
                a: Src::cols(st.as_ptr().cast(), BQ),
                b: qkv_rows.at(0, qbase + j0 * row3 + 2 * c),
                c: o_dst,
                add: j0 > 0,
            });
        }
    }
    for r in 0..nr {
        let inv = 1.0 / l[r];
        // SAFETY: this task's own rows and head channels of `out`.
        let dst = unsafe { out.run(obase + r * c, hs) };
        if resident {
            for (d, &v) in dst.iter_mut().zip(&o[r]) {
                *d = v * inv;
            }
        } else {
            for d in dst {
                *d *= inv;
            }
        }
        lse[r] = m[r] + l[r].ln();
    }
}

/// One backward task: all of head `bh`.
struct BwdTask<'a> {
    g: Geom,
    dqkv: SharedMut,
    dout: &'a [f32],
    qkv: &'a [f32],
    out: &'a [f32],
    lse: &'a [f32],
    bh: usize,
    mask: Dropout,
}

#[inline(always)]
fn backward_head<K: Variant, const DROP: bool>(task: BwdTask) {
    let BwdTask {
        g,
        dqkv,
        dout,
        qkv,
        out,
        lse,
        bh,
        mask,
    } = task;
    let (t, c, hs, scale, fma) = (g.t, g.c, g.hs, g.scale, K::FMA);
    let row3 = 3 * c;
    let qbase = g.qkv_base(bh);
    let obase = g.out_base(bh);
    let mask_base = (bh * t) as u64 * t as u64;
    let qkv_rows = Src::rows(qkv.as_ptr(), row3);
    let dout_rows = Src::rows(dout.as_ptr(), c);
    let dqkv_rows = Dst {
        ptr: dqkv.get(),
        rs: row3,
    };
    assert!(lse.len() == t && qbase + (t - 1) * row3 + 2 * c + hs <= qkv.len());
    assert!(obase + (t - 1) * c + hs <= dout.len().min(out.len()));

    let resident = hs <= DT;
    // Transposed key and value tiles: kt[d][c] = k[j0 + c][d0 + d], likewise vt.
    let mut kt = [[0.0f32; BK]; DT];
    let mut vt = [[0.0f32; BK]; DT];
    // dK_j and dV_j: these stack tiles when the head fits in them, else `dqkv` itself.
    let mut dk = [[0.0f32; DT]; BK];
    let mut dv = [[0.0f32; DT]; BK];
    // p[r][c]: probabilities (times the dropout factor once dS is formed);
    // ds[r][c]: first dP̃ = dO·v, then scale · dS.
    let mut p = [[0.0f32; BK]; BQ];
    let mut ds = [[0.0f32; BK]; BQ];
    let mut dd = [0.0f32; BQ];

    for j0 in (0..t).step_by(BK) {
        let nc = BK.min(t - j0);
        if resident {
            let src = &qkv[qbase + j0 * row3 + c..];
            transpose_into(K::AVX, &mut kt, src, row3, (nc, hs), 1.0);
            transpose_into(K::AVX, &mut vt, &src[c..], row3, (nc, hs), 1.0);
        }
        // Query blocks start on the diagonal: i0 = j0 is the only partial tile, and the
        // first to touch dK_j and dV_j (which it overwrites). Likewise j0 = 0 is the
        // first key block to touch each dQ_i.
        for i0 in (j0..t).step_by(BQ) {
            let nr = BQ.min(t - i0);
            for d0 in (0..hs).step_by(DT) {
                let dn = DT.min(hs - d0);
                if !resident {
                    let src = &qkv[qbase + j0 * row3 + c + d0..];
                    transpose_into(K::AVX, &mut kt, src, row3, (nc, dn), 1.0);
                    transpose_into(K::AVX, &mut vt, &src[c..], row3, (nc, dn), 1.0);
                }
                // SAFETY: query rows i0..i0 + nr <= T, channels d0..d0 + dn <= HS of
                // this head lie in `qkv` and `dout` (asserted above); kt/vt have
                // DT >= dn rows of BK columns; p/ds have BQ >= nr rows of BK.
                unsafe {
                    K::gemm(Gemm {
                        m: nr,
                        n: BK,
                        kn: dn,
                        a: qkv_rows.at(0, qbase + i0 * row3 + d0),
                        b: Src::rows(kt.as_ptr().cast(), BK),
                        c: Dst {
                            ptr: p.as_mut_ptr().cast(),
                            rs: BK,
                        },
                        add: d0 > 0,
                    });
                    K::gemm(Gemm {
                        m: nr,
                        n: BK,
                        kn: dn,
                        a: dout_rows.at(0, obase + i0 * c + d0),
                        b: Src::rows(vt.as_ptr().cast(), BK),
                        c: Dst {
                            ptr: ds.as_mut_ptr().cast(),
                            rs: BK,
                        },
                        add: d0 > 0,
                    });
                }
            }
            // D_r = dO_r · O_r (cheap next to the tile: recomputed rather than stored).
            for (r, d) in dd[..nr].iter_mut().enumerate() {
                let o = obase + (i0 + r) * c;
                *d = row_dot(fma, &dout[o..o + hs], &out[o..o + hs]);
            }
            for r in 0..nr {
                let lse_r = lse[i0 + r];
                // Keys below `lim` are visible to this row: all of a tile below the
                // diagonal, and up to the query itself in the diagonal tile.
                let lim = if i0 == j0 { r + 1 } else { BK };
                let (pr, dsr) = (&mut p[r], &mut ds[r]);
                for v in pr.iter_mut() {
                    *v = exp_fast(fma, fmadd(fma, *v, scale, -lse_r));
                }
                pr[lim..].fill(0.0);
                if DROP {
                    for cc in 0..lim {
                        let index = mask_base + ((i0 + r) * t + j0 + cc) as u64;
                        let f = mask_factor::<DROP>(mask, index);
                        dsr[cc] = pr[cc] * (f * dsr[cc] - dd[r]) * scale;
                        pr[cc] *= f;
                    }
                    dsr[lim..].fill(0.0);
                } else {
                    for (dv, &pv) in dsr.iter_mut().zip(pr.iter()) {
                        *dv = pv * (*dv - dd[r]) * scale;
                    }
                }
            }
            let (dk_dst, dv_dst) = if resident {
                let dk = Dst {
                    ptr: dk.as_mut_ptr().cast(),
                    rs: DT,
                };
                let dv = Dst {
                    ptr: dv.as_mut_ptr().cast(),
                    rs: DT,
                };
                (dk, dv)
            } else {
                let dk = dqkv_rows.at(0, qbase + j0 * row3 + c);
                (dk, dk.at(0, c))
            };
            let dout_i = dout_rows.at(0, obase + i0 * c);
            let q_i = qkv_rows.at(0, qbase + i0 * row3);
            let k_j = qkv_rows.at(0, qbase + j0 * row3 + c);
            let dq_i = dqkv_rows.at(0, qbase + i0 * row3);
            // SAFETY: p/ds hold BQ >= nr rows of BK >= nc; the q/k rows read lie in
            // `qkv` and the dout rows in `dout` (asserted above); dk/dv have BK rows of
            // DT >= HS; the dq/dk/dv rows written are this task's own (`SharedMut`).
            unsafe {
                // dV_j (+)= (P∘M)ᵀ · dO_i
                K::gemm(Gemm {
                    m: nc,
                    n: hs,
                    kn: nr,
                    a: Src::cols(p.as_ptr().cast(), BK),
                    b: dout_i,
                    c: dv_dst,
                    add: i0 > j0,
                });
                // dK_j (+)= scale · dSᵀ · Q_i
                K::gemm(Gemm {
                    m: nc,
                    n: hs,
                    kn: nr,
                    a: Src::cols(ds.as_ptr().cast(), BK),
                    b: q_i,
                    c: dk_dst,
                    add: i0 > j0,
                });
                // dQ_i (+)= scale · dS · K_j
                K::gemm(Gemm {
                    m: nr,
                    n: hs,
                    kn: nc,
                    a: Src::rows(ds.as_ptr().cast(), BK),
                    b: k_j,
                    c: dq_i,
                    add: j0 > 0,
                });
            }
        }
        if resident {
            for (cc, (dkr, dvr)) in dk[..nc].iter().zip(&dv[..nc]).enumerate() {
                let row = qbase + (j0 + cc) * row3;
                // SAFETY: this task's own rows and head channels of `dqkv`.
                unsafe { dqkv.run(row + c, hs) }.copy_from_slice(&dkr[..hs]);
                // SAFETY: as above.
                unsafe { dqkv.run(row + 2 * c, hs) }.copy_from_slice(&dvr[..hs]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{assert_close, dot, numeric_grad, rand_vec, to_f64};
    use super::*;

    /// Every instruction-set variant this CPU can run.
    fn isas() -> Vec<Isa> {
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

    /// Naive f64 attention with the full `T × T` softmax: `(out, lse)`.
    fn reference(
        qkv: &[f64],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        mask: Option<Dropout>,
    ) -> (Vec<f64>, Vec<f64>) {
        let hs = c / nh;
        let scale = 1.0 / (hs as f64).sqrt();
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut x = vec![0.0; t];
        for bi in 0..b {
            for h in 0..nh {
                for ti in 0..t {
                    let q = &qkv[(bi * t + ti) * 3 * c + h * hs..][..hs];
                    for (s, xs) in x[..=ti].iter_mut().enumerate() {
                        let k = &qkv[(bi * t + s) * 3 * c + c + h * hs..][..hs];
                        *xs = q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale;
                    }
                    let mx = x[..=ti].iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = x[..=ti].iter().map(|&v| (v - mx).exp()).sum();
                    let l = mx + sum.ln();
                    lse[(bi * nh + h) * t + ti] = l;
                    let o = &mut out[(bi * t + ti) * c + h * hs..][..hs];
                    for (s, &xs) in x[..=ti].iter().enumerate() {
                        let index = (((bi * nh + h) * t + ti) * t + s) as u64;
                        let f = mask.map_or(1.0, |m| m.factor(index) as f64);
                        let pf = (xs - l).exp() * f;
                        let v = &qkv[(bi * t + s) * 3 * c + 2 * c + h * hs..][..hs];
                        for (od, &vd) in o.iter_mut().zip(v) {
                            *od += pf * vd;
                        }
                    }
                }
            }
        }
        (out, lse)
    }

    fn inputs(b: usize, t: usize, c: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        // Scaled up so that attention is far from uniform.
        let qkv: Vec<f32> = rand_vec(b * t * 3 * c, seed)
            .iter()
            .map(|v| 2.0 * v)
            .collect();
        (qkv, rand_vec(b * t * c, seed + 1))
    }

    /// Checks forward against the reference and backward against central differences
    /// of `L = Σ out · w`, on every coordinate, or on `subset` of them if given.
    fn check(
        (b, t, c, nh): (usize, usize, usize, usize),
        mask: Option<Dropout>,
        seed: u64,
        subset: Option<usize>,
    ) {
        let (qkv, w) = inputs(b, t, c, seed);
        let qkv64 = to_f64(&qkv);
        let (want_out, want_lse) = reference(&qkv64, b, t, c, nh, mask);
        let loss = |x: &[f64]| dot(&reference(x, b, t, c, nh, mask).0, &w);
        let eps = 1e-5;
        let (indices, want_grad): (Vec<usize>, Vec<f64>) = match subset {
            None => ((0..qkv.len()).collect(), numeric_grad(loss, &qkv64, eps)),
            Some(n) => {
                let stride = (qkv.len() / n).max(1) | 1;
                let idx: Vec<usize> = (0..qkv.len()).step_by(stride).collect();
                let mut x = qkv64.clone();
                let grad = idx
                    .iter()
                    .map(|&i| {
                        let orig = x[i];
                        x[i] = orig + eps;
                        let plus = loss(&x);
                        x[i] = orig - eps;
                        let minus = loss(&x);
                        x[i] = orig;
                        (plus - minus) / (2.0 * eps)
                    })
                    .collect();
                (idx, grad)
            }
        };
        for isa in isas() {
            let what = format!("B={b} T={t} C={c} NH={nh} mask={mask:?} {isa:?}");
            let g = Geom::new(t, c, nh);
            let mut out = vec![f32::NAN; b * t * c];
            let mut lse = vec![f32::NAN; b * nh * t];
            forward_impl(isa, &mut out, &mut lse, &qkv, g, mask);
            assert_close(&format!("{what}: out"), &out, &want_out, 1e-5, 1e-6);
            assert_close(&format!("{what}: lse"), &lse, &want_lse, 1e-5, 1e-6);
            let mut dqkv = vec![f32::NAN; qkv.len()];
            backward_impl(isa, &mut dqkv, &w, &qkv, &out, &lse, g, mask);
            let got: Vec<f32> = indices.iter().map(|&i| dqkv[i]).collect();
            assert_close(&format!("{what}: dqkv"), &got, &want_grad, 1e-4, 1e-5);
        }
    }

    const DROP: Option<Dropout> = Some(Dropout { p: 0.25, seed: 99 });

    #[test]
    fn small_two_heads() {
        check((2, 7, 16, 2), None, 1, None);
        check((2, 7, 16, 2), DROP, 2, None);
    }

    #[test]
    fn single_token() {
        check((1, 1, 16, 2), None, 3, None);
        check((1, 1, 16, 2), DROP, 4, None);
    }

    #[test]
    fn several_blocks_ragged_tail() {
        // T = 70 is more than two blocks and not a multiple of the block size; HS = 8.
        check((1, 70, 16, 2), None, 5, None);
        check((1, 70, 16, 2), DROP, 6, None);
    }

    #[test]
    fn one_head() {
        // HS = 24: a 16-wide strip plus an 8-wide one.
        check((2, 33, 24, 1), None, 7, None);
        check((2, 33, 24, 1), DROP, 8, None);
    }

    #[test]
    fn head_size_16() {
        check((2, 9, 48, 3), None, 9, None);
        check((2, 9, 48, 3), DROP, 10, None);
    }

    #[test]
    fn head_size_64() {
        check((2, 65, 128, 2), None, 11, Some(500));
        check((2, 65, 128, 2), DROP, 12, Some(500));
    }

    #[test]
    fn head_size_80() {
        check((1, 40, 160, 2), None, 13, Some(400));
        check((1, 40, 160, 2), DROP, 14, Some(400));
    }

    #[test]
    fn head_larger_than_tile() {
        // HS = 136 > DT: channels go through the transposed tiles in two chunks.
        const { assert!(136 > DT) };
        check((1, 35, 136, 1), None, 15, Some(400));
        check((1, 35, 136, 1), DROP, 16, Some(400));
    }

    #[test]
    fn dropout_changes_output() {
        let (b, t, c, nh) = (1, 20, 16, 2);
        let (qkv, _) = inputs(b, t, c, 17);
        let run = |mask| {
            let mut out = vec![0.0; b * t * c];
            let mut lse = vec![0.0; b * nh * t];
            attention_forward(
                &mut out,
                &mut lse,
                &qkv,
                crate::kernels::Dims { b, t, c, nh },
                mask,
            );
            (out, lse)
        };
        let (plain, plain_lse) = run(None);
        let (dropped, dropped_lse) = run(DROP);
        assert_ne!(plain, dropped);
        assert_eq!(plain_lse, dropped_lse, "lse must not depend on dropout");
        assert_eq!(plain, run(Some(Dropout { p: 0.0, seed: 5 })).0);
    }

    #[test]
    fn deterministic_across_thread_counts() {
        let (b, t, c, nh) = (2, 100, 64, 4);
        let (qkv, dout) = inputs(b, t, c, 18);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut out = vec![0.0; b * t * c];
                let mut lse = vec![0.0; b * nh * t];
                attention_forward(
                    &mut out,
                    &mut lse,
                    &qkv,
                    crate::kernels::Dims { b, t, c, nh },
                    DROP,
                );
                let mut dqkv = vec![0.0; qkv.len()];
                attention_backward(
                    &mut dqkv,
                    &dout,
                    &qkv,
                    &out,
                    &lse,
                    crate::kernels::Dims { b, t, c, nh },
                    DROP,
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (bits(&out), bits(&lse), bits(&dqkv))
            })
        };
        let one = run(1);
        assert!(one.2.iter().any(|&x| x != 0));
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }
}
