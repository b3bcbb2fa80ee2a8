//! AdamW over the flat parameter buffer, global-norm gradient clipping, and
//! nanoGPT's learning-rate schedule.

use crate::kernels::bf16;
use crate::kernels::fastmath::{simd_fn, Simd};
use crate::kernels::SharedMut;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// AdamW hyper-parameters (the learning rate is given per step).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    /// nanoGPT's defaults (PyTorch's eps).
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// The parameter arena as AdamW sees it: its length and, in arena order, each
/// tensor's range and whether weight decay applies to it (nanoGPT decays the tensors
/// of rank ≥ 2 only: `ParamLayout::decay_ranges`). Elements in no range (alignment
/// gaps) are never touched.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecayRanges {
    pub len: usize,
    pub tensors: Vec<(Range<usize>, bool)>,
}

/// Floats per parallel task of the update.
const PIECE: usize = 1 << 16;

/// A stretch of the arena updated with one weight-decay setting; its moments (and
/// gradients, in `step_shard`) start at `slot` of the state buffers.
#[derive(Clone, Debug)]
struct Piece {
    range: Range<usize>,
    slot: usize,
    decay: bool,
}

/// AdamW with decoupled weight decay on the tensors of rank ≥ 2 only; first and
/// second moments in buffers with the parameters' layout.
pub struct AdamW {
    pub config: AdamWConfig,
    /// First moment, same layout as the parameters.
    pub m: Vec<f32>,
    /// Second moment.
    pub v: Vec<f32>,
    /// Updates taken so far (for bias correction).
    pub step: u64,
    pieces: Vec<Piece>,
    /// Built by [`AdamW::new`]: every slot is its arena offset.
    whole: bool,
}

impl AdamW {
    /// AdamW over the whole arena `arena`.
    pub fn new(arena: &DecayRanges, config: AdamWConfig) -> AdamW {
        let mut opt = AdamW::for_shard(arena, config, &[(0..arena.len, 0)], arena.len);
        opt.whole = true;
        opt
    }

    /// AdamW over part of the arena, for ZeRO-1: `shard` lists arena ranges and the
    /// offset (slot) of each in the state buffers, which hold `state_len` floats. `m`
    /// and `v` then cover only the shard; update it with [`AdamW::step_shard`].
    /// Parameters outside every tensor (alignment gaps) are never touched.
    pub fn for_shard(
        arena: &DecayRanges,
        config: AdamWConfig,
        shard: &[(Range<usize>, usize)],
        state_len: usize,
    ) -> AdamW {
        let mut pieces = Vec::new();
        for (part, slot) in shard {
            assert!(slot + part.len() <= state_len, "shard slot out of range");
            for (t, decay) in &arena.tensors {
                let range = t.start.max(part.start)..t.end.min(part.end);
                for start in range.clone().step_by(PIECE) {
                    pieces.push(Piece {
                        range: start..(start + PIECE).min(range.end),
                        slot: slot + start - part.start,
                        decay: *decay,
                    });
                }
            }
        }
        AdamW {
            config,
            m: vec![0.0; state_len],
            v: vec![0.0; state_len],
            step: 0,
            pieces,
            whole: false,
        }
    }

    /// One update of every parameter with learning rate `lr`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        self.step_scaled(params, grads, lr, 1.0)
    }

    /// [`AdamW::step`] on the gradients times `grad_factor` (the clipping factor of
    /// [`clip_factor`]), applied as they are read instead of in a pass of their own.
    pub fn step_scaled(&mut self, params: &mut [f32], grads: &[f32], lr: f32, grad_factor: f32) {
        let _t = crate::profile::scope(crate::profile::Section::AdamW);
        assert!(params.len() == self.m.len() && grads.len() == self.m.len());
        self.update(params, grads, lr, grad_factor);
    }

    /// One update of the shard this optimizer was built for ([`AdamW::for_shard`]):
    /// `params` is the whole arena, `grads` is laid out like `m` and `v` and is
    /// multiplied by `grad_factor` as it is read.
    pub fn step_shard(&mut self, params: &mut [f32], grads: &[f32], lr: f32, grad_factor: f32) {
        let _t = crate::profile::scope(crate::profile::Section::AdamW);
        assert_eq!(grads.len(), self.m.len(), "shard gradients");
        let end = self.pieces.iter().map(|p| p.range.end).max().unwrap_or(0);
        assert!(end <= params.len(), "the arena is shorter than the shard");
        self.update(params, grads, lr, grad_factor);
    }

    /// [`AdamW::step_scaled`] fused with what follows it: in the same pass over the
    /// arena, `grads` is zeroed once read (for the next step's accumulation) and, when
    /// `bf16_copy` is given (bf16 autocast's weight copy, laid out like `params`), it
    /// receives the updated parameters rounded to bf16. Bit for bit `step_scaled`,
    /// zeroing the gradients and `bf16::round_into(copy, params)`, for an optimizer
    /// over the whole arena ([`AdamW::new`]); elements outside every tensor (alignment
    /// gaps) are left alone in all four buffers.
    pub fn step_fused(
        &mut self,
        params: &mut [f32],
        grads: &mut [f32],
        bf16_copy: Option<&mut [f32]>,
        lr: f32,
        grad_factor: f32,
    ) {
        let _t = crate::profile::scope(crate::profile::Section::AdamW);
        assert!(params.len() == self.m.len() && grads.len() == self.m.len());
        assert!(
            self.whole,
            "step_fused needs an optimizer over the whole arena"
        );
        let copy = bf16_copy.map(|c| {
            assert_eq!(
                c.len(),
                params.len(),
                "the bf16 copy is laid out like params"
            );
            SharedMut::new(c)
        });
        let grads = SharedMut::new(grads);
        let h = self.hyper(lr, grad_factor);
        let (params, m, v) = (
            SharedMut::new(params),
            SharedMut::new(&mut self.m),
            SharedMut::new(&mut self.v),
        );
        let simd = Simd::detect();
        self.pieces.par_iter().for_each(|piece| {
            let r = piece.range.clone();
            // SAFETY: as in `update`; slots equal arena offsets (`whole`), so the
            // piece's gradients and copy are its own too.
            let (p, m, v, g) = unsafe {
                (
                    params.slice(r.start, r.len()),
                    m.slice(r.start, r.len()),
                    v.slice(r.start, r.len()),
                    grads.slice(r.start, r.len()),
                )
            };
            let h = h.for_piece(piece.decay);
            match copy {
                // SAFETY: as above.
                Some(copy) => {
                    let c = unsafe { copy.slice(r.start, r.len()) };
                    update_copy_lanes(simd, p, m, v, g, c, h);
                }
                None => update_zero_lanes(simd, p, m, v, g, h),
            }
        });
    }

    /// The constants of the next update (advancing the step count).
    fn hyper(&mut self, lr: f32, grad_factor: f32) -> Hyper {
        self.step += 1;
        let c = self.config;
        let t = self.step as i32;
        // PyTorch's formulation: p ← p·(1 − lr·wd) − (lr / bc1) · m / (√v / √bc2 + eps).
        let bc1 = 1.0 - (c.beta1 as f64).powi(t);
        let bc2_sqrt = (1.0 - (c.beta2 as f64).powi(t)).sqrt();
        Hyper {
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            decay: 1.0 - lr * c.weight_decay,
            step_size: (lr as f64 / bc1) as f32,
            inv_bc2_sqrt: (1.0 / bc2_sqrt) as f32,
            grad_factor,
        }
    }

    fn update(&mut self, params: &mut [f32], grads: &[f32], lr: f32, grad_factor: f32) {
        let h = self.hyper(lr, grad_factor);
        let params = SharedMut::new(params);
        let (m, v) = (SharedMut::new(&mut self.m), SharedMut::new(&mut self.v));
        let simd = Simd::detect();
        self.pieces.par_iter().for_each(|piece| {
            let r = piece.range.clone();
            let s = piece.slot..piece.slot + r.len();
            // SAFETY: pieces are disjoint sub-ranges of the tensors, which the layout
            // guarantees do not overlap; their slots are disjoint too (`for_shard`).
            // Each task touches only its own piece of params, m and v.
            let (p, m, v) = unsafe {
                (
                    params.slice(r.start, r.len()),
                    m.slice(s.start, s.len()),
                    v.slice(s.start, s.len()),
                )
            };
            update_lanes(simd, p, m, v, &grads[s], h.for_piece(piece.decay));
        });
    }
}

/// The constants of one AdamW update of one piece.
#[derive(Clone, Copy)]
struct Hyper {
    beta1: f32,
    beta2: f32,
    eps: f32,
    /// `1 − lr·wd` for the decayed tensors; 1 in [`Hyper::for_piece`] for the rest.
    decay: f32,
    step_size: f32,
    inv_bc2_sqrt: f32,
    grad_factor: f32,
}

impl Hyper {
    fn for_piece(self, decay: bool) -> Hyper {
        Hyper {
            decay: if decay { self.decay } else { 1.0 },
            ..self
        }
    }

    /// One element's update: `p`, `m`, `v` from gradient `g` (before the factor).
    #[inline(always)]
    fn apply(self, p: &mut f32, m: &mut f32, v: &mut f32, g: f32) {
        let g = g * self.grad_factor;
        *m = self.beta1 * *m + (1.0 - self.beta1) * g;
        *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
        let denom = v.sqrt() * self.inv_bc2_sqrt + self.eps;
        *p = *p * self.decay - self.step_size * *m / denom;
    }
}

simd_fn! {
    fn update_lanes(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], h: Hyper) {
        for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(g) {
            h.apply(p, m, v, g);
        }
    }
}

simd_fn! {
    /// [`update_lanes`], zeroing each gradient once read.
    fn update_zero_lanes(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &mut [f32], h: Hyper) {
        for (((p, m), v), g) in p.iter_mut().zip(m).zip(v).zip(g) {
            h.apply(p, m, v, *g);
            *g = 0.0;
        }
    }
}

simd_fn! {
    /// [`update_zero_lanes`], writing the updated parameter rounded to bf16 to `copy`.
    fn update_copy_lanes(
        p: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &mut [f32],
        copy: &mut [f32],
        h: Hyper,
    ) {
        for ((((p, m), v), g), c) in p.iter_mut().zip(m).zip(v).zip(g).zip(copy) {
            h.apply(p, m, v, *g);
            *g = 0.0;
            *c = bf16::round(*p);
        }
    }
}

/// Sum of squares of all gradients, in f64, with a fixed reduction order (so the
/// result is bit-identical for any thread count). Across ranks, add these up before
/// taking the root.
pub fn grad_sq_sum(grads: &[f32]) -> f64 {
    const PARTS: usize = 256;
    let mut partial = [0.0f64; PARTS];
    let chunk = grads.len().div_ceil(PARTS).max(1);
    grads
        .par_chunks(chunk)
        .zip(partial.par_iter_mut())
        .for_each(|(g, s)| *s = sq_sum(g));
    partial.iter().sum()
}

simd_fn! {
    /// Σ x² in f64 over independent lanes, so that the loop vectorises.
    fn sq_sum_lanes(g: &[f32]) -> f64 {
        const LANES: usize = 8;
        let mut lanes = [0.0f64; LANES];
        let mut chunks = g.chunks_exact(LANES);
        for chunk in &mut chunks {
            for (s, &x) in lanes.iter_mut().zip(chunk) {
                *s += x as f64 * x as f64;
            }
        }
        let rest: f64 = chunks
            .remainder()
            .iter()
            .map(|&x| x as f64 * x as f64)
            .sum();
        lanes.iter().sum::<f64>() + rest
    }
}

/// [`sq_sum_lanes`] on the widest instruction set this CPU has (the same bits).
fn sq_sum(g: &[f32]) -> f64 {
    sq_sum_lanes(Simd::detect(), g)
}

/// Multiplies every gradient by `factor`.
pub fn scale_grads(grads: &mut [f32], factor: f32) {
    grads
        .par_chunks_mut(PIECE)
        .for_each(|g| g.iter_mut().for_each(|x| *x *= factor));
}

/// The factor PyTorch's `clip_grad_norm_` applies for a global `norm`: `max_norm /
/// (norm + 1e-6)` when that is below 1, else 1 (and 1 when `max_norm` ≤ 0: no clipping).
pub fn clip_factor(norm: f32, max_norm: f32) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        coef
    } else {
        1.0
    }
}

/// Clips the gradients to global L2 norm `max_norm` like PyTorch's
/// `clip_grad_norm_`; returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> f32 {
    let norm = grad_norm(grads);
    clip_to_norm(grads, norm, max_norm);
    norm
}

/// The global L2 norm of the gradients (one process).
pub fn grad_norm(grads: &[f32]) -> f32 {
    let _t = crate::profile::scope(crate::profile::Section::GradNorm);
    grad_sq_sum(grads).sqrt() as f32
}

/// Scales gradients of global norm `norm` down to `max_norm` (if above it).
pub fn clip_to_norm(grads: &mut [f32], norm: f32, max_norm: f32) {
    let factor = clip_factor(norm, max_norm);
    if factor < 1.0 {
        scale_grads(grads, factor);
    }
}

/// nanoGPT's learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub learning_rate: f32,
    pub min_lr: f32,
    pub warmup_iters: u64,
    pub lr_decay_iters: u64,
    /// Off: the rate is `learning_rate` throughout.
    pub decay_lr: bool,
}

impl LrSchedule {
    /// Linear warm-up over `warmup_iters` (reaching `learning_rate` at iteration
    /// `warmup_iters`), cosine decay to `min_lr` at `lr_decay_iters`, `min_lr` after.
    pub fn lr_at(&self, it: u64) -> f32 {
        if !self.decay_lr {
            return self.learning_rate;
        }
        let (lr, min_lr) = (self.learning_rate as f64, self.min_lr as f64);
        if it < self.warmup_iters {
            return (lr * (it + 1) as f64 / (self.warmup_iters + 1) as f64) as f32;
        }
        if it > self.lr_decay_iters {
            return self.min_lr;
        }
        let span = (self.lr_decay_iters - self.warmup_iters).max(1) as f64;
        let ratio = (it - self.warmup_iters) as f64 / span;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        (min_lr + coeff * (lr - min_lr)) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An arena of `blocks` pairs of tensors: a matrix (decayed) of 4·(3 + b) floats,
    /// then a vector of 4 and a gap of 3, as a model ranges's alignment leaves them.
    fn arena(blocks: usize) -> DecayRanges {
        let (mut tensors, mut at) = (Vec::new(), 0);
        for b in 0..blocks {
            let m = 4 * (3 + b);
            tensors.push((at..at + m, true));
            tensors.push((at + m..at + m + 4, false));
            at += m + 4 + 3;
        }
        DecayRanges { len: at, tensors }
    }

    fn schedule() -> LrSchedule {
        LrSchedule {
            learning_rate: 1e-3,
            min_lr: 1e-4,
            warmup_iters: 10,
            lr_decay_iters: 110,
            decay_lr: true,
        }
    }

    #[test]
    fn schedule_warms_up_decays_and_floors() {
        let s = schedule();
        assert!((s.lr_at(0) - 1e-3 / 11.0).abs() < 1e-9);
        assert!((s.lr_at(9) - 1e-3 * 10.0 / 11.0).abs() < 1e-9);
        assert!(
            (s.lr_at(10) - 1e-3).abs() < 1e-9,
            "peak right after warm-up"
        );
        assert!((s.lr_at(60) - 5.5e-4).abs() < 1e-9, "half-way is the mean");
        assert!((s.lr_at(110) - 1e-4).abs() < 1e-9);
        assert_eq!(s.lr_at(111), 1e-4);
        assert_eq!(s.lr_at(1_000_000), 1e-4);
        for it in 10..110 {
            assert!(s.lr_at(it + 1) <= s.lr_at(it), "monotone decay at {it}");
        }
        let flat = LrSchedule {
            decay_lr: false,
            ..s
        };
        assert!([0, 5, 50, 500].iter().all(|&it| flat.lr_at(it) == 1e-3));
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let mut g = vec![3.0f32, 4.0, 0.0, 0.0];
        let norm = clip_grad_norm(&mut g, 1.0);
        assert_eq!(norm, 5.0);
        let after = grad_sq_sum(&g).sqrt();
        assert!((after - 1.0).abs() < 1e-5, "{after}");
        let mut small = vec![0.3f32, 0.4];
        assert!((clip_grad_norm(&mut small, 1.0) - 0.5).abs() < 1e-7);
        assert_eq!(small, vec![0.3, 0.4], "below the max: untouched");
    }

    /// Clipping inside the update gives the same bits as clipping the gradients first.
    #[test]
    fn scaled_step_equals_clipping_then_stepping() {
        let ranges = arena(6);
        let n = ranges.len;
        let init: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
        let (mut clipped, mut fused) = (init.clone(), init);
        let mut first = AdamW::new(&ranges, AdamWConfig::default());
        let mut second = AdamW::new(&ranges, AdamWConfig::default());
        for s in 0..3 {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * 7 + s) % 11) as f32 * 0.3 - 1.5)
                .collect();
            let mut g_clipped = g.clone();
            let norm = clip_grad_norm(&mut g_clipped, 1.0);
            assert!(norm > 1.0, "the test must clip");
            first.step(&mut clipped, &g_clipped, 1e-2);
            second.step_scaled(&mut fused, &g, 1e-2, clip_factor(norm, 1.0));
        }
        assert_eq!(clipped, fused);
        assert_eq!((first.m, first.v), (second.m, second.v));
        assert_eq!(
            clip_factor(1e9, 0.0),
            1.0,
            "grad_clip = 0 turns clipping off"
        );
    }

    #[test]
    fn fused_step_is_the_step_then_the_copy_then_zeroing() {
        let ranges = arena(12);
        let n = ranges.len;
        let init: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.1013 - 0.6).collect();
        for with_copy in [false, true] {
            let (mut plain, mut fused) = (init.clone(), init.clone());
            let mut first = AdamW::new(&ranges, AdamWConfig::default());
            let mut second = AdamW::new(&ranges, AdamWConfig::default());
            let mut copy = vec![f32::NAN; n];
            for s in 0..3 {
                let g: Vec<f32> = (0..n)
                    .map(|i| ((i * 7 + s) % 11) as f32 * 0.3 - 1.5)
                    .collect();
                first.step_scaled(&mut plain, &g, 1e-2, 0.7);
                let mut g_fused = g.clone();
                let c = with_copy.then_some(&mut copy[..]);
                second.step_fused(&mut fused, &mut g_fused, c, 1e-2, 0.7);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&plain), bits(&fused), "step {s}");
                assert_eq!((&first.m, &first.v), (&second.m, &second.v));
                // Zeroed where the step read them; the gaps between tensors untouched.
                let read: Vec<bool> = (0..n)
                    .map(|i| ranges.tensors.iter().any(|(t, _)| t.contains(&i)))
                    .collect();
                for i in 0..n {
                    let want = if read[i] { 0.0 } else { g[i] };
                    assert_eq!(g_fused[i], want, "gradient {i}");
                }
                if with_copy {
                    let mut want = vec![0.0; n];
                    crate::kernels::bf16::round_into(&mut want, &fused);
                    for i in (0..n).filter(|&i| read[i]) {
                        assert_eq!(copy[i].to_bits(), want[i].to_bits(), "copy {i}");
                        assert_ne!(copy[i], fused[i], "copy {i} is rounded");
                    }
                }
            }
        }
    }

    #[test]
    fn sq_sum_matches_f64_sum() {
        let g: Vec<f32> = (0..1037).map(|i| (i % 17) as f32 * 0.37 - 3.0).collect();
        let want: f64 = g.iter().map(|&x| x as f64 * x as f64).sum();
        assert!((sq_sum(&g) - want).abs() <= 1e-12 * want);
    }

    #[test]
    fn grad_norm_is_independent_of_thread_count() {
        let g: Vec<f32> = (0..1_000_003u64)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        let norms: Vec<f64> = [1, 2, 3]
            .iter()
            .map(|&n| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .unwrap();
                pool.install(|| grad_sq_sum(&g))
            })
            .collect();
        assert!(norms.windows(2).all(|w| w[0] == w[1]), "{norms:?}");
    }

    #[test]
    fn sharded_steps_equal_the_full_step() {
        let ranges = arena(12);
        let n = ranges.len;
        let init: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
        let grads: Vec<Vec<f32>> = (0..3)
            .map(|s| {
                (0..n)
                    .map(|i| ((i * 7 + s) % 11) as f32 * 0.01 - 0.05)
                    .collect()
            })
            .collect();
        let mut full = AdamW::new(&ranges, AdamWConfig::default());
        let mut want = init.clone();
        for g in &grads {
            full.step(&mut want, g, 1e-2);
        }
        // Three uneven shards, each with two ranges stored out of arena order.
        let cuts = [0, n / 5, n / 3, n / 2, 2 * n / 3, 4 * n / 5, n];
        let mut got = init.clone();
        for s in 0..3 {
            let (a, b) = (
                cuts[2 * s]..cuts[2 * s + 1],
                cuts[2 * s + 1]..cuts[2 * s + 2],
            );
            let shard = [(b.clone(), 1), (a.clone(), 1 + b.len())];
            let len = 1 + a.len() + b.len();
            let mut opt = AdamW::for_shard(&ranges, AdamWConfig::default(), &shard, len);
            let mut p = init.clone();
            for g in &grads {
                let mut sg = vec![0.0; len];
                sg[1..1 + b.len()].copy_from_slice(&g[b.clone()]);
                sg[1 + b.len()..].copy_from_slice(&g[a.clone()]);
                opt.step_shard(&mut p, &sg, 1e-2, 1.0);
            }
            assert_eq!(opt.m[1..1 + b.len()], full.m[b.clone()]);
            assert_eq!(opt.v[1 + b.len()..], full.v[a.clone()]);
            got[a.clone()].copy_from_slice(&p[a]);
            got[b.clone()].copy_from_slice(&p[b]);
        }
        assert_eq!(got, want);
    }

    #[test]
    fn adamw_matches_a_hand_computed_step_and_decays_only_what_it_is_told() {
        let ranges = arena(6);
        let c = AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.5,
        };
        let mut opt = AdamW::new(&ranges, c);
        let mut params = vec![1.0f32; ranges.len];
        let grads = vec![0.1f32; ranges.len];
        let lr = 0.01;
        opt.step(&mut params, &grads, lr);
        // Step 1: m̂ = g, v̂ = g², so the Adam part moves by lr·g/(|g| + eps) ≈ lr.
        let adam = lr * 0.1 / (0.1 + 1e-8);
        let (weight, bias) = (ranges.tensors[2].0.clone(), ranges.tensors[3].0.clone());
        let want_bias = 1.0 - adam;
        let want_weight = 1.0 * (1.0 - lr * 0.5) - adam;
        assert!(params[bias].iter().all(|&p| (p - want_bias).abs() < 1e-6));
        assert!(params[weight.clone()]
            .iter()
            .all(|&p| (p - want_weight).abs() < 1e-6));
        // Step 2 with a different gradient, against the formula in f64.
        let grads2 = vec![-0.3f32; ranges.len];
        let before = params[weight.start] as f64;
        opt.step(&mut params, &grads2, lr);
        let m = 0.9 * (0.1 * 0.1) + 0.1 * -0.3;
        let v = 0.99 * (0.01 * 0.01) + 0.01 * 0.09;
        let (mhat, vhat) = (m / (1.0 - 0.81), v / (1.0 - 0.99f64.powi(2)));
        let want = before * (1.0 - 0.01 * 0.5) - 0.01 * mhat / (vhat.sqrt() + 1e-8);
        assert!((params[weight.start] as f64 - want).abs() < 1e-6);
    }
}
