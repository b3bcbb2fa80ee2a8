//! The backward pass: one task per (batch element, key/value head), recomputing the
//! probabilities of each tile from the forward pass's log-sum-exp. A task walks the
//! query heads that share its keys and values, so their key and value gradients sum
//! in its own tiles (in a fixed order: no other task writes them).

use rayon::prelude::*;

use super::isa::{self, Isa, Variant};
use super::tiles::{row_dot, transpose_into, Dst, Gemm, Src};
use super::{check_heads, effective, key_base, mask_factor, out_base, qkv_base, score_scale};
use super::{SharedMut, BK, BQ, DT, NO_MASK};
use crate::kernels::bf16;
use crate::kernels::dropout::Dropout;
use crate::kernels::fastmath::{exp_fast, fmadd};
use crate::kernels::Dims;

/// [`attention_backward`](super::attention_backward) with the given variant (the
/// tests run each one this CPU has), and with `bf16` on `vdpbf16ps` (see
/// [`bf16_backward_products`](super::bf16_backward_products)).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_impl(
    isa: Isa,
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    d: Dims,
    dropout: Option<Dropout>,
    round: bool,
    bf16: bool,
) {
    check_heads(d);
    let (n3, n) = (d.bt() * d.qkv_width(), d.bt() * d.q_width());
    assert_eq!(dqkv.len(), n3, "dqkv must be (B, T, (NH + 2·KV)·HS)");
    assert_eq!(qkv.len(), n3, "qkv must be (B, T, (NH + 2·KV)·HS)");
    assert_eq!(dout.len(), n, "dout must be (B, T, NH·HS)");
    assert_eq!(out.len(), n, "out must be (B, T, NH·HS)");
    assert_eq!(lse.len(), d.b * d.nh * d.t, "lse must be (B, NH, T)");
    if lse.is_empty() {
        return;
    }
    let mask = effective(dropout);
    // The task of batch element b and key/value head g writes only the channels of g's
    // key and value, and of its query heads' queries, of its own rows of `dqkv`: the
    // tasks' pieces are disjoint. Its query heads' rows of `lse` are consecutive.
    let dqkv = SharedMut::new(dqkv);
    lse.par_chunks(d.group() * d.t)
        .enumerate()
        .for_each(|(bg, lse_g)| {
            let task = BwdTask {
                d,
                dqkv,
                dout,
                qkv,
                out,
                lse: lse_g,
                bg,
                mask: mask.unwrap_or(NO_MASK),
                round,
            };
            match (mask, bf16) {
                (Some(_), false) => isa.backward::<true>(task),
                (None, false) => isa.backward::<false>(task),
                (Some(_), true) => backward_bf16::<true>(task),
                (None, true) => backward_bf16::<false>(task),
            }
        });
}

/// One backward task: all of key/value head `bg = b·KV + g` and its query heads.
pub(super) struct BwdTask<'a> {
    d: Dims,
    dqkv: SharedMut<'a>,
    dout: &'a [f32],
    qkv: &'a [f32],
    out: &'a [f32],
    /// The `lse` rows of the query heads, `NH / KV` rows of `T`.
    lse: &'a [f32],
    bg: usize,
    mask: Dropout,
    /// Round the heads' dq, dk and dv to bf16 as each block of rows is final.
    round: bool,
}

impl BwdTask<'_> {
    /// Where the task's heads lie, with the bounds of what they read checked.
    #[inline(always)]
    fn heads(&self) -> TaskHeads {
        let lens = (
            self.qkv.len(),
            self.out.len().min(self.dout.len()),
            self.lse.len(),
        );
        TaskHeads::new(self.d, self.bg, lens)
    }

    /// The softmax's backward on the tile of query rows `i0..i0 + nr` and key block
    /// `j0` of the task's query head `hi` (`bh = b·NH + h`): with D_r = dO_r · O_r
    /// (cheap next to the tile: recomputed rather than stored), [`softmax_backward_tile`]
    /// turns the scores `p` into the probabilities times the dropout factor and
    /// `ds`, holding dP̃, into `scale · dS`. `fma`: on FMA.
    #[inline(always)]
    fn softmax_backward<const DROP: bool>(
        &self,
        tile: (&mut [[f32; BK]; BQ], &mut [[f32; BK]; BQ]),
        (hi, bh): (usize, usize),
        (i0, j0, nr): (usize, usize, usize),
        fma: bool,
    ) {
        let (d, t) = (self.d, self.d.t);
        let (c, hs, obase) = (d.q_width(), d.hs, out_base(d, bh));
        let mut dd = [0.0f32; BQ];
        for (r, dr) in dd[..nr].iter_mut().enumerate() {
            let o = obase + (i0 + r) * c;
            *dr = row_dot(fma, &self.dout[o..o + hs], &self.out[o..o + hs]);
        }
        let lse = &self.lse[hi * t + i0..hi * t + i0 + nr];
        let mask_base = (bh * t) as u64 * t as u64;
        let scale = (score_scale(d), fma);
        softmax_backward_tile::<DROP>(tile, lse, &dd, (i0, j0), scale, self.mask, mask_base, t);
    }
}

/// Where one task's heads lie: its key/value head and its query heads.
#[derive(Clone, Copy)]
struct TaskHeads {
    /// The first query head, `b·NH + g·NH / KV`.
    bh0: usize,
    /// Query heads: `NH / KV`.
    group: usize,
    /// Index in `qkv` of the key/value head's key at token `(b, 0)`.
    kbase: usize,
    /// From a key to its value: `KV·HS`.
    vofs: usize,
}

impl TaskHeads {
    /// The heads of task `bg`, with the bounds of what they read checked.
    fn new(d: Dims, bg: usize, lens: (usize, usize, usize)) -> TaskHeads {
        let (qkv_len, out_len, lse_len) = lens;
        let (b, g, group, row) = (bg / d.kv, bg % d.kv, d.group(), d.qkv_width());
        let heads = TaskHeads {
            bh0: b * d.nh + g * group,
            group,
            kbase: key_base(d, bg),
            vofs: d.kv * d.hs,
        };
        let (t, hs) = (d.t, d.hs);
        assert!(lse_len == group * t && heads.kbase + (t - 1) * row + heads.vofs + hs <= qkv_len);
        for bh in heads.bh0..heads.bh0 + group {
            assert!(qkv_base(d, bh) + (t - 1) * row + hs <= qkv_len);
            assert!(out_base(d, bh) + (t - 1) * d.q_width() + hs <= out_len);
        }
        heads
    }
}

#[inline(always)]
pub(super) fn backward_head<K: Variant, const DROP: bool>(task: BwdTask) {
    let (d, dqkv, dout, qkv) = (task.d, task.dqkv, task.dout, task.qkv);
    // Rows of `qkv` are `row3` apart, rows of `out` `c` (GPT-2: 3C and C).
    let (t, c, hs, fma) = (d.t, d.q_width(), d.hs, K::FMA);
    let row3 = d.qkv_width();
    let heads = task.heads();
    let (kbase, vofs) = (heads.kbase, heads.vofs);
    let qkv_rows = Src::rows(qkv.as_ptr(), row3);
    let dout_rows = Src::rows(dout.as_ptr(), c);
    let dqkv_rows = Dst {
        ptr: dqkv.ptr(),
        rs: row3,
    };

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

    for j0 in (0..t).step_by(BK) {
        let nc = BK.min(t - j0);
        let kj = kbase + j0 * row3;
        if resident {
            transpose_into(K::AVX, &mut kt, &qkv[kj..], row3, (nc, hs), 1.0);
            transpose_into(K::AVX, &mut vt, &qkv[kj + vofs..], row3, (nc, hs), 1.0);
        }
        for (hi, bh) in (heads.bh0..heads.bh0 + heads.group).enumerate() {
            let (qbase, obase) = (qkv_base(d, bh), out_base(d, bh));
            // Query blocks start on the diagonal: i0 = j0 is the only partial tile, and
            // for the first query head the first to touch dK_j and dV_j (which it
            // overwrites). Likewise j0 = 0 is the first key block to touch each dQ_i.
            for i0 in (j0..t).step_by(BQ) {
                let nr = BQ.min(t - i0);
                let first = hi == 0 && i0 == j0;
                for d0 in (0..hs).step_by(DT) {
                    let dn = DT.min(hs - d0);
                    if !resident {
                        let (k, v) = (&qkv[kj + d0..], &qkv[kj + vofs + d0..]);
                        transpose_into(K::AVX, &mut kt, k, row3, (nc, dn), 1.0);
                        transpose_into(K::AVX, &mut vt, v, row3, (nc, dn), 1.0);
                    }
                    // SAFETY: query rows i0..i0 + nr <= T, channels d0..d0 + dn <= HS of
                    // this head lie in `qkv` and `dout` (asserted by TaskHeads::new);
                    // kt/vt have DT >= dn rows of BK columns; p/ds have BQ >= nr rows of
                    // BK.
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
                task.softmax_backward::<DROP>((&mut p, &mut ds), (hi, bh), (i0, j0, nr), fma);
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
                    let dk = dqkv_rows.at(0, kj);
                    (dk, dk.at(0, vofs))
                };
                let dout_i = dout_rows.at(0, obase + i0 * c);
                let q_i = qkv_rows.at(0, qbase + i0 * row3);
                let k_j = qkv_rows.at(0, kj);
                let dq_i = dqkv_rows.at(0, qbase + i0 * row3);
                // SAFETY: p/ds hold BQ >= nr rows of BK >= nc; the q/k rows read lie in
                // `qkv` and the dout rows in `dout` (asserted by TaskHeads::new); dk/dv
                // have BK rows of DT >= HS; the dq/dk/dv rows written are this task's
                // own (`SharedMut`).
                unsafe {
                    // dV_j (+)= (P∘M)ᵀ · dO_i
                    K::gemm(Gemm {
                        m: nc,
                        n: hs,
                        kn: nr,
                        a: Src::cols(p.as_ptr().cast(), BK),
                        b: dout_i,
                        c: dv_dst,
                        add: !first,
                    });
                    // dK_j (+)= scale · dSᵀ · Q_i
                    K::gemm(Gemm {
                        m: nc,
                        n: hs,
                        kn: nr,
                        a: Src::cols(ds.as_ptr().cast(), BK),
                        b: q_i,
                        c: dk_dst,
                        add: !first,
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
        }
        let tiles = (&dk, &dv);
        finish_key_block(
            dqkv,
            resident.then_some(tiles),
            (d, heads),
            (j0, nc),
            task.round,
        );
    }
}

/// dK or dV of one key block: BK rows of up to DT head channels.
type KeyTile = [[f32; DT]; BK];

/// Ends key block `j0` (`nc` rows) of the task's `heads`: stores its dK and dV from
/// the stack `tiles` if given, and with `round` rounds the block's rows of dk and dv,
/// and of every query head's dq, to bf16.
#[inline(always)]
fn finish_key_block(
    dqkv: SharedMut,
    tiles: Option<(&KeyTile, &KeyTile)>,
    (d, heads): (Dims, TaskHeads),
    (j0, nc): (usize, usize),
    round: bool,
) {
    let (hs, row3, kbase, vofs) = (d.hs, d.qkv_width(), heads.kbase, heads.vofs);
    if let Some((dk, dv)) = tiles {
        for (cc, (dkr, dvr)) in dk[..nc].iter().zip(&dv[..nc]).enumerate() {
            let row = kbase + (j0 + cc) * row3;
            // SAFETY: this task's own rows and head channels of `dqkv`.
            unsafe { dqkv.slice(row, hs) }.copy_from_slice(&dkr[..hs]);
            // SAFETY: as above.
            unsafe { dqkv.slice(row + vofs, hs) }.copy_from_slice(&dvr[..hs]);
        }
    }
    if round {
        // Rows j0..j0 + nc are final: later key blocks touch only later query rows
        // (dq), and their dk and dv were completed above. Round them in cache.
        let queries = (heads.bh0..heads.bh0 + heads.group).map(|bh| qkv_base(d, bh));
        for base in queries.chain([kbase, kbase + vofs]) {
            for cc in 0..nc {
                // SAFETY: this task's own rows and head channels of `dqkv`.
                let seg = unsafe { dqkv.slice(base + (j0 + cc) * row3, hs) };
                seg.iter_mut().for_each(|v| *v = bf16::round(*v));
            }
        }
    }
}

/// The softmax's backward on one (query block, key block) tile, rows `r < nr =
/// lse.len()`: turns the scores `p[r][c]` (unscaled, query `i0 + r`, key `j0 + c`)
/// into the probabilities times the dropout factor, and `ds[r][c]`, holding
/// dP̃ = dO·v, into `scale · dS`; zero for masked keys.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn softmax_backward_tile<const DROP: bool>(
    (p, ds): (&mut [[f32; BK]; BQ], &mut [[f32; BK]; BQ]),
    lse: &[f32],
    dd: &[f32; BQ],
    (i0, j0): (usize, usize),
    (scale, fma): (f32, bool),
    mask: Dropout,
    mask_base: u64,
    t: usize,
) {
    for (r, &lse_r) in lse.iter().enumerate() {
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
}

/// [`backward_head`] with its five products on `vdpbf16ps` (bf16 autocast on a CPU
/// with AVX512-BF16, heads of at most [`DT`] channels): S = Q·Kᵀ and dP̃ = dO·Vᵀ from
/// bf16 q, k, v and dO (dO rounded by the packing), then, with the probabilities times
/// the dropout factor and `scale · dS` rounded to bf16, dV += (P∘M)ᵀ·dO,
/// dK += dSᵀ·Q, dQ += dS·K. D = dO·O and the softmax's backward stay f32.
///
/// # Safety
/// The CPU has AVX-512 F, AVX512-BF16, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn backward_head_bf16<const DROP: bool>(task: BwdTask) {
    use super::pairs::{pack_across, pack_along, pair_gemm, pairs, PairGemm};
    let (d, dqkv, dout, qkv) = (task.d, task.dqkv, task.dout, task.qkv);
    let (t, c, hs, row3) = (d.t, d.q_width(), d.hs, d.qkv_width());
    let heads = task.heads();
    let (kbase, vofs, group) = (heads.kbase, heads.vofs, heads.group);
    assert!(hs <= DT);
    let (hp, hw) = (pairs(hs), hs.div_ceil(16) * 16);
    let kv_at = |row: usize, ofs: usize| qkv[kbase + row * row3 + ofs..].as_ptr();

    // Per key block: Kᵀ and Vᵀ as pair rows over channels (B of S and dP̃), K as pair
    // rows over keys (B of dQ).
    let mut ktp = [[0u32; BK]; DT / 2];
    let mut vtp = [[0u32; BK]; DT / 2];
    let mut kb = [[0u32; DT]; BK / 2];
    // Each query head's Q and dO rows as pairs along channels (A of S and dP̃) and as
    // pair rows over queries (B of dK and dV), packed once (the worker's buffer); per
    // tile, P∘M and dS as pairs along queries (A of dV, dK) and dS along keys (A of dQ).
    let mut packs = QO_PACKS.take();
    let (al, bl) = (t * hp, t.div_ceil(2) * hw);
    let per_head = 2 * (al + bl);
    packs.resize(group * per_head, 0);
    for (hi, head) in packs.chunks_exact_mut(per_head).enumerate() {
        let bh = heads.bh0 + hi;
        let (q, o) = (
            qkv[qkv_base(d, bh)..].as_ptr(),
            dout[out_base(d, bh)..].as_ptr(),
        );
        let (qa, rest) = head.split_at_mut(al);
        let (doa, rest) = rest.split_at_mut(al);
        let (qb, dob) = rest.split_at_mut(bl);
        // SAFETY: the head's T query rows lie in `qkv` and its T dout rows in `dout`
        // (asserted by TaskHeads::new); qa/doa hold T rows of ⌈HS / 2⌉ pairs, qb/dob
        // ⌈T / 2⌉ pair rows of hw >= HS.
        unsafe {
            pack_along(qa.as_mut_ptr(), (hp, 1), q, row3, (t, hs));
            pack_along(doa.as_mut_ptr(), (hp, 1), o, c, (t, hs));
            pack_across(qb.as_mut_ptr(), hw, q, row3, (t, hs));
            pack_across(dob.as_mut_ptr(), hw, o, c, (t, hs));
        }
    }
    let mut pt = [[0u32; BK]; BQ / 2];
    let mut dst = [[0u32; BK]; BQ / 2];
    let mut dsa = [[0u32; BK / 2]; BQ];
    let mut dk = [[0.0f32; DT]; BK];
    let mut dv = [[0.0f32; DT]; BK];
    let mut p = [[0.0f32; BK]; BQ];
    let mut ds = [[0.0f32; BK]; BQ];
    let gemm =
        |m, n, kp, (a, ars, aps): (*const u32, usize, usize), (b, ldb), (c, ldc), add| PairGemm {
            m,
            n,
            kp,
            a,
            ars,
            aps,
            b,
            ldb,
            c,
            ldc,
            add,
        };

    for j0 in (0..t).step_by(BK) {
        let nc = BK.min(t - j0);
        // SAFETY: key and value rows j0..j0 + nc <= T of this head lie in `qkv`
        // (asserted); ktp/vtp hold ⌈HS / 2⌉ <= DT / 2 pair rows of BK >= nc, kb
        // ⌈nc / 2⌉ <= BK / 2 pair rows of DT >= HS.
        unsafe {
            pack_along(
                ktp.as_mut_ptr().cast(),
                (1, BK),
                kv_at(j0, 0),
                row3,
                (nc, hs),
            );
            pack_along(
                vtp.as_mut_ptr().cast(),
                (1, BK),
                kv_at(j0, vofs),
                row3,
                (nc, hs),
            );
            pack_across(kb.as_mut_ptr().cast(), DT, kv_at(j0, 0), row3, (nc, hs));
        }
        for (hi, head) in packs.chunks_exact(per_head).enumerate() {
            let bh = heads.bh0 + hi;
            let qbase = qkv_base(d, bh);
            let (qa, rest) = head.split_at(al);
            let (doa, rest) = rest.split_at(al);
            let (qb, dob) = rest.split_at(bl);
            // As in `backward_head`: query blocks start on the diagonal tile, for the
            // first query head the first to touch dK_j and dV_j; j0 = 0 is the first key
            // block to touch each dQ_i.
            for i0 in (j0..t).step_by(BQ) {
                let nr = BQ.min(t - i0);
                let first = hi == 0 && i0 == j0;
                // SAFETY: rows i0..i0 + nr <= T of the head's packed Q and dO hold
                // ⌈HS / 2⌉ pairs each; ktp/vtp ⌈HS / 2⌉ pair rows of BK columns; p/ds
                // BQ >= nr rows of BK.
                unsafe {
                    let (qa, doa) = (qa[i0 * hp..].as_ptr(), doa[i0 * hp..].as_ptr());
                    let (ktp, vtp) = (ktp.as_ptr().cast(), vtp.as_ptr().cast());
                    let (p, ds) = (p.as_mut_ptr().cast(), ds.as_mut_ptr().cast());
                    pair_gemm(gemm(nr, BK, hp, (qa, hp, 1), (ktp, BK), (p, BK), false));
                    pair_gemm(gemm(nr, BK, hp, (doa, hp, 1), (vtp, BK), (ds, BK), false));
                }
                // D = dO·O and the softmax's backward in f32.
                task.softmax_backward::<DROP>((&mut p, &mut ds), (hi, bh), (i0, j0, nr), true);
                let dq_i = dqkv.ptr().wrapping_add(qbase + i0 * row3);
                // SAFETY: p/ds hold nr rows of BK >= nc; pt/dst ⌈nr / 2⌉ <= BQ / 2 pair
                // rows of BK, dsa nr rows of ⌈nc / 2⌉ <= BK / 2 pairs; the packed Q and
                // dO pair rows i0 / 2.. and kb ⌈·⌉ pair rows of hw / DT >= 16·⌈HS / 16⌉
                // columns; dk/dv BK >= nc rows of DT >= HS; the dq rows written are this
                // task's own.
                unsafe {
                    pack_across(pt.as_mut_ptr().cast(), BK, p.as_ptr().cast(), BK, (nr, nc));
                    pack_across(
                        dst.as_mut_ptr().cast(),
                        BK,
                        ds.as_ptr().cast(),
                        BK,
                        (nr, nc),
                    );
                    pack_along(
                        dsa.as_mut_ptr().cast(),
                        (BK / 2, 1),
                        ds.as_ptr().cast(),
                        BK,
                        (nr, nc),
                    );
                    // Pair rows i0 / 2.. (i0 is even); a ragged T's last is padded with
                    // zero.
                    let (qb, dob) = (qb[i0 / 2 * hw..].as_ptr(), dob[i0 / 2 * hw..].as_ptr());
                    let kb = kb.as_ptr().cast();
                    let (pt, dst) = (pt.as_ptr().cast(), dst.as_ptr().cast());
                    let dsa = dsa.as_ptr().cast();
                    let (dk, dv) = (dk.as_mut_ptr().cast(), dv.as_mut_ptr().cast());
                    let (kr, kq) = (pairs(nr), pairs(nc));
                    // dV_j (+)= (P∘M)ᵀ · dO_i, dK_j (+)= scale · dSᵀ · Q_i
                    pair_gemm(gemm(nc, hs, kr, (pt, 1, BK), (dob, hw), (dv, DT), !first));
                    pair_gemm(gemm(nc, hs, kr, (dst, 1, BK), (qb, hw), (dk, DT), !first));
                    // dQ_i (+)= scale · dS · K_j
                    pair_gemm(gemm(
                        nr,
                        hs,
                        kq,
                        (dsa, BK / 2, 1),
                        (kb, DT),
                        (dq_i, row3),
                        j0 > 0,
                    ));
                }
            }
        }
        finish_key_block(dqkv, Some((&dk, &dv)), (d, heads), (j0, nc), task.round);
    }
    QO_PACKS.set(packs);
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// A worker's packed Q and dO of the query heads it is on ([`backward_head_bf16`]),
    /// grown to the largest call and reused, so a training step allocates nothing once
    /// warm.
    static QO_PACKS: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

impl Isa {
    /// One backward task ([`backward_head`]) compiled for this variant.
    pub(super) fn backward<const DROP: bool>(self, task: BwdTask) {
        match self {
            Isa::Base => backward_head::<isa::Base, DROP>(task),
            // SAFETY: `Isa::detect` found these features on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::backward_avx2::<DROP>(task) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::backward_avx512::<DROP>(task) },
        }
    }
}

/// One backward task of bf16 attention on `vdpbf16ps`. Panics without AVX512-BF16.
fn backward_bf16<const DROP: bool>(task: BwdTask) {
    assert!(isa::bf16_usable(), "bf16 attention needs AVX512-BF16");
    // SAFETY: AVX-512 F, AVX2, FMA and AVX512-BF16 were checked just above.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        x86::backward_bf16::<DROP>(task)
    }
}

/// The backward task compiled with AVX2 + FMA, with AVX-512, and with AVX512-BF16.
/// Every `#[inline(always)]` helper it calls is compiled into it with these features.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::isa::{Avx2, Avx512};
    use super::{backward_head, backward_head_bf16, BwdTask};

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
    pub(super) unsafe fn backward_bf16<const DROP: bool>(task: BwdTask) {
        // SAFETY: the features are enabled here (caller).
        unsafe { backward_head_bf16::<DROP>(task) }
    }
}
