//! The small dense products both passes are built from: a register-tiled matrix
//! kernel over strided views, the transposes that fill its stack tiles, and a row dot
//! product.

use super::DT;
use crate::kernels::fastmath::fmadd;

/// A read-only strided matrix: element `(i, j)` is at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(super) struct Src {
    ptr: *const f32,
    rs: usize,
    cs: usize,
}

/// A writable matrix with contiguous rows: element `(i, j)` is at `ptr + i·rs + j`.
#[derive(Clone, Copy)]
pub(super) struct Dst {
    pub(super) ptr: *mut f32,
    pub(super) rs: usize,
}

impl Src {
    pub(super) fn rows(ptr: *const f32, rs: usize) -> Self {
        Src { ptr, rs, cs: 1 }
    }

    /// The transpose of a tile with rows `rs` apart: element `(i, j)` is at `j·rs + i`.
    pub(super) fn cols(ptr: *const f32, rs: usize) -> Self {
        Src { ptr, rs: 1, cs: rs }
    }

    pub(super) fn at(self, i: usize, j: usize) -> Self {
        Src {
            ptr: self.ptr.wrapping_add(i * self.rs + j * self.cs),
            ..self
        }
    }
}

impl Dst {
    pub(super) fn at(self, i: usize, j: usize) -> Self {
        Dst {
            ptr: self.ptr.wrapping_add(i * self.rs + j),
            ..self
        }
    }
}

/// One matrix product `C (+)= A·B` of an `m × kn` by a `kn × n` matrix.
#[derive(Clone, Copy)]
pub(super) struct Gemm {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) kn: usize,
    pub(super) a: Src,
    pub(super) b: Src,
    pub(super) c: Dst,
    /// `C += A·B` if set, else `C = A·B`.
    pub(super) add: bool,
}

/// Dot product over 16 interleaved partial sums (vectorisable, fixed order).
#[inline(always)]
pub(super) fn row_dot(fma: bool, a: &[f32], b: &[f32]) -> f32 {
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
pub(super) unsafe fn gemm_acc<const FMA: bool, const R: usize, const W: usize>(g: Gemm) {
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
pub(super) fn transpose_into<const N: usize>(
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
