//! The forward pass: one task per (batch element, head, query block).

use rayon::prelude::*;
use std::cell::Cell;

use super::isa::{self, Isa, Variant};
use super::score_scale;
use super::tiles::{transpose_into, Dst, Gemm, Src};
use super::{check_heads, effective, key_base, kv_head, mask_factor, out_base, qkv_base};
use super::{SharedMut, BK, BQ, DT, NO_MASK};
use crate::kernels::dropout::Dropout;
use crate::kernels::fastmath::exp_fast;
use crate::kernels::Dims;

/// [`attention_forward`](super::attention_forward) with the given variant (the tests
/// run each one this CPU has), and with `bf16` on `vdpbf16ps` (see
/// [`bf16_forward_products`](super::bf16_forward_products)).
pub(super) fn forward_impl(
    isa: Isa,
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    d: Dims,
    dropout: Option<Dropout>,
    bf16: bool,
) {
    check_heads(d);
    let w = d.qkv_width();
    assert_eq!(qkv.len(), d.bt() * w, "qkv must be (B, T, (NH + 2·KV)·HS)");
    assert_eq!(out.len(), d.bt() * d.q_width(), "out must be (B, T, NH·HS)");
    assert_eq!(lse.len(), d.b * d.nh * d.t, "lse must be (B, NH, T)");
    if lse.is_empty() {
        return;
    }
    let mask = effective(dropout);
    // With `bf16`, every key/value head's keys and values are packed once, before the
    // tasks that read them; the buffer is the calling thread's, kept for the next call.
    let mut kv_owned = if bf16 { KV_PACKS.take() } else { Vec::new() };
    let per_head = kv_pack_len(d).iter().sum::<usize>();
    if bf16 {
        pack_keys_values(&mut kv_owned, qkv, d);
    }
    let kv = &kv_owned[..];
    // The task of batch element b, head h and one query block writes only channels
    // h·HS..(h+1)·HS of its own rows of `out`: the tasks' pieces are disjoint.
    let out = SharedMut::new(out);
    for_each_query_block(lse, d.t, |bh, i0, lse_blk| {
        let bg = kv_head(d, bh);
        let base = key_base(d, bg);
        let task = FwdTask {
            d,
            qkv,
            out,
            lse: lse_blk,
            bh,
            i0,
            mask: mask.unwrap_or(NO_MASK),
            kv: kv.get(bg * per_head..(bg + 1) * per_head).unwrap_or(&[]),
            keys: KeyRows {
                keys: &qkv[base..],
                values: &qkv[base + d.kv * d.hs..],
                rs: w,
                pos0: 0,
            },
        };
        match (mask, bf16) {
            (Some(_), false) => isa.forward::<true>(task),
            (None, false) => isa.forward::<false>(task),
            (Some(_), true) => forward_bf16::<true>(task),
            (None, true) => forward_bf16::<false>(task),
        }
    });
    if bf16 {
        KV_PACKS.set(std::mem::take(&mut kv_owned));
    }
}

/// Runs `task(bh, i0, lse_block)` for every head `bh` (of `lse.len() / t`, each `t`
/// rows of `lse`) and block of [`BQ`] query rows from `i0`, in parallel: the forward
/// pass's split into tasks, which each own their rows of `lse`.
pub(super) fn for_each_query_block(
    lse: &mut [f32],
    t: usize,
    task: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse_bh)| {
        lse_bh
            .par_chunks_mut(BQ)
            .enumerate()
            .for_each(|(qb, lse_blk)| task(bh, qb * BQ, lse_blk));
    });
}

thread_local! {
    /// The keys and values of bf16 attention packed for `vdpbf16ps`, grown to the
    /// largest call on this thread and reused, so a training step allocates nothing
    /// once warm.
    static KV_PACKS: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

/// The lengths, in pairs, of one key/value head's packed keys (T rows of ⌈HS / 2⌉
/// pairs along the channels: the A operand of S = Q·Kᵀ, computed as K·Qᵀ) and packed
/// values (⌈T / 2⌉ pair rows over keys of 16·⌈HS / 16⌉ columns: the B operand of P̃·V).
fn kv_pack_len(d: Dims) -> [usize; 2] {
    let hs = d.hs;
    [d.t * hs.div_ceil(2), d.t.div_ceil(2) * hs.div_ceil(16) * 16]
}

/// Packs every key/value head's keys and values into `kv`, heads (`b·KV + g`) one
/// after another ([`kv_pack_len`]), in parallel over heads. Panics without
/// AVX512-BF16.
fn pack_keys_values(kv: &mut Vec<u32>, qkv: &[f32], d: Dims) {
    assert!(isa::bf16_usable(), "bf16 attention needs AVX512-BF16");
    let [kl, vl] = kv_pack_len(d);
    kv.resize(d.b * d.kv * (kl + vl), 0);
    kv.par_chunks_mut(kl + vl)
        .enumerate()
        .for_each(|(bg, dst)| {
            let (k, v) = dst.split_at_mut(kl);
            let (vo, hs, row, base) = (d.kv * d.hs, d.hs, d.qkv_width(), key_base(d, bg));
            assert!(base + (d.t - 1) * row + vo + hs <= qkv.len());
            // SAFETY: AVX512-BF16 and AVX-512 F (asserted); the head's T key and value
            // rows lie in `qkv` (asserted), `k` holds T rows of ⌈HS / 2⌉ pairs and `v`
            // ⌈T / 2⌉ pair rows of 16·⌈HS / 16⌉ >= HS.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                use super::pairs::{pack_across, pack_along};
                let hw = hs.div_ceil(16) * 16;
                pack_along(
                    k.as_mut_ptr(),
                    (hs.div_ceil(2), 1),
                    &qkv[base],
                    row,
                    (d.t, hs),
                );
                pack_across(v.as_mut_ptr(), hw, &qkv[base + vo], row, (d.t, hs));
            }
            let _ = (k, v);
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
    pub(super) d: Dims,
    pub(super) qkv: &'a [f32],
    pub(super) out: SharedMut<'a>,
    pub(super) lse: &'a mut [f32],
    pub(super) bh: usize,
    pub(super) i0: usize,
    pub(super) mask: Dropout,
    /// The key/value head's keys and values packed for `vdpbf16ps`
    /// ([`pack_keys_values`]), or empty.
    pub(super) kv: &'a [u32],
    /// The key/value head's keys and values in f32, which the f32 pass reads.
    pub(super) keys: KeyRows<'a>,
}

impl FwdTask<'_> {
    /// Where the block's rows start: the index in `qkv` of its first query row
    /// (channel 0 of the head; the head's rows checked to lie in `qkv`) and in `out`
    /// of its first output row; and the online softmax of its rows (`fma`: `exp` on
    /// FMA).
    #[inline(always)]
    fn start(&self, fma: bool) -> (usize, usize, OnlineSoftmax) {
        let (d, bh, i0, nr) = (self.d, self.bh, self.i0, self.lse.len());
        let (t, row3, qbase) = (d.t, d.qkv_width(), qkv_base(d, bh));
        assert!(nr > 0 && i0 + nr <= t && qbase + (t - 1) * row3 + d.hs <= self.qkv.len());
        let mask_base = (bh * t) as u64 * t as u64;
        let obase = out_base(d, bh) + i0 * d.q_width();
        let soft = OnlineSoftmax::new(fma, self.mask, mask_base, t);
        (qbase + i0 * row3, obase, soft)
    }

    /// The block's end: each output row (at `out[obase + r·C]`) divided by the row's
    /// sum, from the unnormalised rows in `o` where given, else in place; and each
    /// row's log-sum-exp stored.
    #[inline(always)]
    fn finish(self, soft: &OnlineSoftmax, o: Option<&[[f32; DT]; BQ]>, obase: usize) {
        let (c, hs) = (self.d.q_width(), self.d.hs);
        for (r, lse) in self.lse.iter_mut().enumerate() {
            let inv = 1.0 / soft.l[r];
            // SAFETY: this task's own rows and head channels of `out`.
            let dst = unsafe { self.out.slice(obase + r * c, hs) };
            match o {
                Some(o) => dst.iter_mut().zip(&o[r]).for_each(|(d, &v)| *d = v * inv),
                None => dst.iter_mut().for_each(|d| *d *= inv),
            }
            *lse = soft.m[r] + soft.l[r].ln();
        }
    }
}

/// One head's keys and values as the f32 forward pass reads them: the key of
/// absolute position `s` at `keys[s·rs..s·rs + HS]`, its value likewise in `values`.
/// Training reads them from `qkv` itself (`rs = (NH + 2·KV)·HS`, `pos0 = 0`); generation from a
/// cache of earlier positions ([`cached_attention`](super::cached_attention)).
#[derive(Clone, Copy)]
pub(super) struct KeyRows<'a> {
    pub(super) keys: &'a [f32],
    pub(super) values: &'a [f32],
    pub(super) rs: usize,
    /// The absolute position of query row 0 of `qkv`: query row `i` attends to the
    /// keys at positions `0..=pos0 + i`.
    pub(super) pos0: usize,
}

#[inline(always)]
pub(super) fn forward_block<K: Variant, const DROP: bool>(task: FwdTask) {
    let (d, qkv, out, kr) = (task.d, task.qkv, task.out, task.keys);
    // Rows of `qkv` are `row3` apart, rows of `out` `c` (GPT-2: 3C and C).
    let (c, hs, scale, fma) = (d.q_width(), d.hs, score_scale(d), K::FMA);
    let (row3, nr, i0) = (d.qkv_width(), task.lse.len(), task.i0);
    let (q_at, obase, mut soft) = task.start(fma);
    // The absolute position of query row i0 (the rows of this block attend to keys
    // 0..=q0 + r), and the keys of the block's last row.
    let q0 = kr.pos0 + i0;
    let kend = q0 + nr;
    let fits = |rows: &[f32]| (kend - 1) * kr.rs + hs <= rows.len();
    assert!(
        fits(kr.keys) && fits(kr.values),
        "keys and values up to the last query"
    );
    let (key_rows, value_rows) = (
        Src::rows(kr.keys.as_ptr(), kr.rs),
        Src::rows(kr.values.as_ptr(), kr.rs),
    );

    let resident = hs <= DT;
    // Transposed, pre-scaled queries: qt[d][r] = scale · q[i0 + r][d0 + d]. Columns
    // r >= nr are zero, so every score of the padding rows is finite.
    let mut qt = [[0.0f32; BQ]; DT];
    if resident {
        let src = &qkv[q_at..];
        transpose_into(K::AVX, &mut qt, src, row3, (nr, hs), scale);
    }
    // Unnormalised output rows: this stack tile when the head fits in it, else `out`.
    let mut o = [[0.0f32; DT]; BQ];
    // Scores, transposed: st[c][r] for key j0 + c and query i0 + r.
    let mut st = [[0.0f32; BQ]; BK];

    // Keys beyond the last query of the block are masked for all its rows.
    for j0 in (0..kend).step_by(BK) {
        let nc = BK.min(kend - j0);
        for d0 in (0..hs).step_by(DT) {
            let dn = DT.min(hs - d0);
            if !resident {
                let src = &qkv[q_at + d0..];
                transpose_into(K::AVX, &mut qt, src, row3, (nr, dn), scale);
            }
            // SAFETY: key rows j0..j0 + nc <= kend, channels d0..d0 + dn <= HS of this
            // head lie in `kr.keys` (asserted); `qt` has DT >= dn rows of BQ; `st` has
            // BK >= nc rows.
            unsafe {
                K::gemm(Gemm {
                    m: nc,
                    n: BQ,
                    kn: dn,
                    a: key_rows.at(j0, d0),
                    b: Src::rows(qt.as_ptr().cast(), BQ),
                    c: Dst {
                        ptr: st.as_mut_ptr().cast(),
                        rs: BQ,
                    },
                    add: d0 > 0,
                });
            }
        }
        let alpha = soft.tile::<DROP>(&mut st, (nc, nr), (q0, j0));
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
        // SAFETY: `st` holds BK >= nc rows of BQ >= nr; value rows j0..j0 + nc <= kend
        // of this head lie in `kr.values` (asserted); `o` has BQ rows of DT >= HS, and
        // the `out` rows are this task's own.
        unsafe {
            K::gemm(Gemm {
                m: nr,
                n: hs,
                kn: nc,
                a: Src::cols(st.as_ptr().cast(), BQ),
                b: value_rows.at(j0, 0),
                c: o_dst,
                add: j0 > 0,
            });
        }
    }
    task.finish(&soft, resident.then_some(&o), obase);
}

/// The online softmax of one block of query rows: each row's running max `m` and
/// sum `l` over the key tiles seen so far, and what masks and drops out a tile.
pub(super) struct OnlineSoftmax {
    pub(super) m: [f32; BQ],
    pub(super) l: [f32; BQ],
    fma: bool,
    mask: Dropout,
    /// The dropout index of query 0 and key 0 of this head: `(bh·T)·T`.
    mask_base: u64,
    t: usize,
}

impl OnlineSoftmax {
    /// No tile seen yet, for a head of `t` tokens whose dropout indices start at
    /// `mask_base`; `fma`: `exp` on FMA.
    #[inline(always)]
    pub(super) fn new(fma: bool, mask: Dropout, mask_base: u64, t: usize) -> OnlineSoftmax {
        OnlineSoftmax {
            m: [f32::NEG_INFINITY; BQ],
            l: [0.0; BQ],
            fma,
            mask,
            mask_base,
            t,
        }
    }

    /// One key tile: masks the diagonal tile's future keys, updates `m` and `l`, turns
    /// the scores `st[c][r]` (key `j0 + c`, query at position `i0 + r`; `nc` keys, `nr`
    /// queries) into unnormalised probabilities times the dropout factor, and returns
    /// the factors `alpha` the rows' earlier output must be rescaled by.
    #[inline(always)]
    pub(super) fn tile<const DROP: bool>(
        &mut self,
        st: &mut [[f32; BQ]; BK],
        (nc, nr): (usize, usize),
        (i0, j0): (usize, usize),
    ) -> [f32; BQ] {
        let OnlineSoftmax {
            m,
            l,
            fma,
            mask,
            mask_base,
            t,
        } = self;
        let (fma, mask, mask_base, t) = (*fma, *mask, *mask_base, *t);
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
        let mut m_new = *m;
        for row in &st[..nc] {
            for (mn, &v) in m_new.iter_mut().zip(row) {
                *mn = fmax(*mn, v);
            }
        }
        let mut alpha = [0.0f32; BQ];
        for ((a, &mo), &mn) in alpha.iter_mut().zip(m.iter()).zip(&m_new) {
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
        *m = m_new;
        if DROP {
            for (cc, row) in st[..nc].iter_mut().enumerate() {
                for (r, v) in row[..nr].iter_mut().enumerate() {
                    let index = mask_base + ((i0 + r) * t + j0 + cc) as u64;
                    *v *= mask_factor::<DROP>(mask, index);
                }
            }
        }
        alpha
    }
}

/// [`forward_block`] with its two products on `vdpbf16ps` (bf16 autocast on a CPU with
/// AVX512-BF16, heads of at most [`DT`] channels): S = Q·Kᵀ from the bf16 values of
/// q and k, scaled in f32; O += P̃·V with the unnormalised probabilities times the
/// dropout factor, P̃, rounded to bf16. The softmax is the f32 one of [`OnlineSoftmax::tile`].
///
/// # Safety
/// The CPU has AVX-512 F, AVX512-BF16, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn forward_block_bf16<const DROP: bool>(task: FwdTask) {
    use super::pairs::{pack_across, pack_along, pair_gemm, pairs, PairGemm};
    let (d, qkv, kv) = (task.d, task.qkv, task.kv);
    assert_eq!(
        task.keys.pos0, 0,
        "the bf16 pass reads the keys of `qkv` itself"
    );
    let (t, hs, row3, scale) = (d.t, d.hs, d.qkv_width(), score_scale(d));
    let (nr, i0) = (task.lse.len(), task.i0);
    let (q_at, obase, mut soft) = task.start(true);
    assert!(hs <= DT);
    let (hp, hw) = (pairs(hs), hs.div_ceil(16) * 16);
    let [kl, vl] = kv_pack_len(d);
    assert_eq!(
        kv.len(),
        kl + vl,
        "the key/value head's packed keys and values"
    );
    let (kpk, vpk) = kv.split_at(kl);
    assert!(kpk.len() == t * hp && vpk.len() == t.div_ceil(2) * hw);

    // Qᵀ as pair rows over the head's channels: qp[p][r] = (q[i0 + r][2p], q[..][2p + 1]).
    let mut qp = [[0u32; BQ]; DT / 2];
    // P̃ as pair rows over keys (its queries in columns), refilled per key block.
    let mut pp = [[0u32; BQ]; BK / 2];
    let mut o = [[0.0f32; DT]; BQ];
    let mut st = [[0.0f32; BQ]; BK];
    let q = qkv[q_at..].as_ptr();
    // SAFETY: rows i0..i0 + nr of this head's q lie in `qkv` (asserted); qp has
    // ⌈HS / 2⌉ <= DT / 2 rows of BQ >= nr pairs.
    unsafe { pack_along(qp.as_mut_ptr().cast(), (1, BQ), q, row3, (nr, hs)) };

    let kend = i0 + nr;
    for j0 in (0..kend).step_by(BK) {
        let nc = BK.min(kend - j0);
        // SAFETY: the packed key rows j0..j0 + nc <= T of ⌈HS / 2⌉ pairs lie in `kpk`;
        // st holds nc rows of BQ and qp BQ columns.
        unsafe {
            pair_gemm(PairGemm {
                m: nc,
                n: BQ,
                kp: hp,
                a: kpk[j0 * hp..].as_ptr(),
                ars: hp,
                aps: 1,
                b: qp.as_ptr().cast(),
                ldb: BQ,
                c: st.as_mut_ptr().cast(),
                ldc: BQ,
                add: false,
            });
        }
        for row in &mut st[..nc] {
            for v in row.iter_mut() {
                *v *= scale;
            }
        }
        let alpha = soft.tile::<DROP>(&mut st, (nc, nr), (i0, j0));
        if j0 > 0 {
            for (row, &a) in o[..nr].iter_mut().zip(&alpha) {
                if a != 1.0 {
                    row[..hs].iter_mut().for_each(|v| *v *= a);
                }
            }
        }
        // o[r] (+)= Σ_c p̃[r][c] · v[j0 + c], P̃ rounded to bf16 by the packing.
        // SAFETY: st holds nc rows of BQ >= nr; pp has ⌈nc / 2⌉ <= BK / 2 pair rows of
        // BQ; `vpk` pair rows j0 / 2.. (j0 is even) of hw = 16·⌈HS / 16⌉ columns, the
        // last one of a ragged T padded with zero; o has BQ >= nr rows of DT >= hw.
        unsafe {
            pack_across(pp.as_mut_ptr().cast(), BQ, st.as_ptr().cast(), BQ, (nc, nr));
            pair_gemm(PairGemm {
                m: nr,
                n: hs,
                kp: pairs(nc),
                a: pp.as_ptr().cast(),
                ars: 1,
                aps: BQ,
                b: vpk[j0 / 2 * hw..].as_ptr(),
                ldb: hw,
                c: o.as_mut_ptr().cast(),
                ldc: DT,
                add: j0 > 0,
            });
        }
    }
    task.finish(&soft, Some(&o), obase);
}

impl Isa {
    /// One forward task ([`forward_block`]) compiled for this variant.
    pub(super) fn forward<const DROP: bool>(self, task: FwdTask) {
        match self {
            Isa::Base => forward_block::<isa::Base, DROP>(task),
            // SAFETY: `Isa::detect` found these features on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::forward_avx2::<DROP>(task) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::forward_avx512::<DROP>(task) },
        }
    }
}

/// One forward task of bf16 attention on `vdpbf16ps`. Panics without AVX512-BF16.
fn forward_bf16<const DROP: bool>(task: FwdTask) {
    assert!(isa::bf16_usable(), "bf16 attention needs AVX512-BF16");
    // SAFETY: AVX-512 F, AVX2, FMA and AVX512-BF16 were checked just above.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        x86::forward_bf16::<DROP>(task)
    }
}

/// The forward task compiled with AVX2 + FMA, with AVX-512, and with AVX512-BF16.
/// Every `#[inline(always)]` helper it calls is compiled into it with these features.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::isa::{Avx2, Avx512};
    use super::{forward_block, forward_block_bf16, FwdTask};

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn forward_avx2<const DROP: bool>(task: FwdTask) {
        forward_block::<Avx2, DROP>(task)
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn forward_avx512<const DROP: bool>(task: FwdTask) {
        forward_block::<Avx512, DROP>(task)
    }

    /// # Safety
    /// The CPU must have AVX-512 F, AVX512-BF16, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
    pub(super) unsafe fn forward_bf16<const DROP: bool>(task: FwdTask) {
        // SAFETY: the features are enabled here (caller).
        unsafe { forward_block_bf16::<DROP>(task) }
    }
}
