//! The forward pass: one task per (batch element, head, query block).

use rayon::prelude::*;

use super::isa::{Isa, Variant};
use super::tiles::{transpose_into, Dst, Gemm, Src};
use super::{check_heads, effective, mask_factor, out_base, qkv_base, score_scale};
use super::{SharedMut, BK, BQ, DT, NO_MASK};
use crate::kernels::dropout::Dropout;
use crate::kernels::fastmath::exp_fast;
use crate::kernels::Dims;

/// [`attention_forward`](super::attention_forward) with the given variant (the tests
/// run each one this CPU has).
pub(super) fn forward_impl(
    isa: Isa,
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    d: Dims,
    dropout: Option<Dropout>,
) {
    check_heads(d);
    assert_eq!(qkv.len(), d.bt() * 3 * d.c, "qkv must be (B, T, 3C)");
    assert_eq!(out.len(), d.bt() * d.c, "out must be (B, T, C)");
    assert_eq!(lse.len(), d.b * d.nh * d.t, "lse must be (B, NH, T)");
    if lse.is_empty() {
        return;
    }
    let mask = effective(dropout);
    // The task of batch element b, head h and one query block writes only channels
    // h·HS..(h+1)·HS of its own rows of `out`: the tasks' pieces are disjoint.
    let out = SharedMut::new(out);
    lse.par_chunks_mut(d.t)
        .enumerate()
        .for_each(|(bh, lse_bh)| {
            lse_bh
                .par_chunks_mut(BQ)
                .enumerate()
                .for_each(|(qb, lse_blk)| {
                    let task = FwdTask {
                        d,
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

#[inline(always)]
fn fmax(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// One forward task: query rows `i0..i0 + lse.len()` of head `bh`.
pub(super) struct FwdTask<'a> {
    d: Dims,
    qkv: &'a [f32],
    out: SharedMut<'a>,
    lse: &'a mut [f32],
    bh: usize,
    i0: usize,
    mask: Dropout,
}

#[inline(always)]
pub(super) fn forward_block<K: Variant, const DROP: bool>(task: FwdTask) {
    let FwdTask {
        d,
        qkv,
        out,
        lse,
        bh,
        i0,
        mask,
    } = task;
    let (t, c, hs, scale, fma) = (d.t, d.c, d.hs(), score_scale(d), K::FMA);
    let row3 = 3 * c;
    let nr = lse.len();
    let qbase = qkv_base(d, bh);
    let obase = out_base(d, bh) + i0 * c;
    let mask_base = (bh * t) as u64 * t as u64;
    let qkv_rows = Src::rows(qkv.as_ptr(), row3);
    assert!(nr > 0 && i0 + nr <= t && qbase + (t - 1) * row3 + 2 * c + hs <= qkv.len());

    let resident = hs <= DT;
    // Transposed, pre-scaled queries: qt[d][r] = scale · q[i0 + r][d0 + d]. Columns
    // r >= nr are zero, so every score of the padding rows is finite.
    let mut qt = [[0.0f32; BQ]; DT];
    if resident {
        let src = &qkv[qbase + i0 * row3..];
        transpose_into(K::AVX, &mut qt, src, row3, (nr, hs), scale);
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
                transpose_into(K::AVX, &mut qt, src, row3, (nr, dn), scale);
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
                        unsafe { out.slice(obase + r * c, hs) }
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
                ptr: out.ptr().wrapping_add(obase),
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
        let dst = unsafe { out.slice(obase + r * c, hs) };
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
