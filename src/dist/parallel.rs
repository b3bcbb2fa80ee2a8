//! The data-parallel side of a training step: gradients reduced once per optimizer
//! step, overlapped with backward; the global loss; the pieces of the update that
//! a sharded optimizer (ZeRO stages 1-3) needs (see [`super::clip_and_step`]);
//! ZeRO-3's gathers and releases of the weights around each layer ([`Sharded`]); the
//! start-up broadcast and the checks that every rank holds the same weights.

use super::resident::release;
use super::{Collective, GradPlan, Reduce};
use crate::model::{Gpt, PassHooks};
use crate::optim::{AdamW, AdamWConfig};
use crate::shutdown::{self, StopSignal};
use anyhow::{bail, Result};
use rayon::prelude::*;
use serde::Serialize;
use std::ops::Range;
use std::time::{Duration, Instant};

/// Communication figures of a run, written to `out_dir/comm.json` by rank 0.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CommReport {
    pub world_size: usize,
    pub zero_stage: u8,
    pub backend: String,
    /// Optimizer steps measured (the run's first step, a warm-up, is left out).
    pub steps: u64,
    /// Mean wall time of a step, ms.
    pub step_ms: f64,
    /// Mean time of a step not spent waiting for other ranks, ms.
    pub compute_ms: f64,
    /// Mean wait per step for the gradient reduction after backward (not hidden), ms.
    pub exposed_reduce_ms: f64,
    /// Mean time per step in the other collectives (loss, norm, all-gather), ms.
    pub other_comm_ms: f64,
    /// The gradient reduction alone, nothing to hide it behind (measured at start), ms.
    pub reduce_alone_ms: f64,
    /// Share of the gradient reduction hidden behind backward: 1 − exposed / alone.
    pub hidden_fraction: f64,
    /// Gradient bytes each rank contributes per step.
    pub grad_bytes: usize,
    /// Tokens per second per rank (global tokens / step time / world size).
    pub tokens_per_sec_per_rank: f64,
}

/// Buffers and timings of data-parallel training on one rank.
pub struct DataParallel {
    pub plan: GradPlan,
    send: Vec<f32>,
    recv: Vec<f32>,
    steps: u64,
    /// The first step has been seen (and left out of the figures).
    warm: bool,
    step_time: Duration,
    exposed: Duration,
    other: Duration,
    reduce_alone: Duration,
    /// The last iteration at which every rank was seen to hold the same weights.
    verified_iter: Option<u64>,
}

impl DataParallel {
    /// Plans the buckets of `model` for `comm`'s ranks and allocates the buffers
    /// (stage 0: two arena-sized buffers; stage 1: about 1 + 1/W of one; stage 2:
    /// 1/W of one, the shard's reduced gradients; stage 3: those and one piece of
    /// scratch).
    pub fn new(comm: &dyn Collective, model: &Gpt, zero_stage: u8) -> DataParallel {
        let plan = GradPlan::new(
            &model.grad_buckets(),
            model.layout.len,
            comm.world_size(),
            comm.rank(),
            zero_stage,
        );
        DataParallel {
            send: vec![0.0; plan.send_len],
            recv: vec![0.0; plan.recv_len],
            plan,
            steps: 0,
            warm: false,
            step_time: Duration::ZERO,
            exposed: Duration::ZERO,
            other: Duration::ZERO,
            reduce_alone: Duration::ZERO,
            verified_iter: None,
        }
    }

    /// Floats of the send and receive buffers (what the memory plan counts).
    pub fn buffer_lens(&self) -> (usize, usize) {
        (self.send.len(), self.recv.len())
    }

    fn kind(&self) -> Reduce {
        match self.plan.zero_stage {
            0 => Reduce::AllReduce,
            1 => Reduce::ReduceScatter,
            _ => Reduce::ReducePieces,
        }
    }

    /// Rank 0's weights (and, when `moments`, its AdamW state at `adam_step`) on
    /// every rank. `root_opt` is rank 0's full optimizer (None elsewhere). Returns
    /// this rank's optimizer: full at stage 0, its shard at stage 1.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        comm: &dyn Collective,
        model: &mut Gpt,
        root_opt: Option<AdamW>,
        config: AdamWConfig,
        adam_step: u64,
        moments: bool,
        iter: u64,
    ) -> Result<AdamW> {
        match self.shards_weights() {
            true => self.scatter_params(comm, &mut model.params),
            false => comm.broadcast(&mut model.params, 0),
        }
        let mut opt = if self.plan.zero_stage == 0 {
            let mut opt = root_opt.unwrap_or_else(|| AdamW::new(&model.layout, config));
            if moments {
                comm.broadcast(&mut opt.m, 0);
                comm.broadcast(&mut opt.v, 0);
            }
            opt
        } else {
            let plan = &self.plan;
            let mut opt = AdamW::for_shard(&model.layout, config, &plan.shard(), plan.shard_len);
            if moments && plan.zero_stage >= 2 {
                let root = root_opt.as_ref();
                scatter_shard(comm, plan, root.map(|o| &o.m[..]), &mut opt.m);
                scatter_shard(comm, plan, root.map(|o| &o.v[..]), &mut opt.v);
            } else if moments {
                let s = plan.shard_len;
                for which in 0..2 {
                    if let Some(full) = &root_opt {
                        let src = if which == 0 { &full.m } else { &full.v };
                        for q in 0..plan.world_size {
                            plan.pack_shard(q, src, &mut self.send[q * s..(q + 1) * s]);
                        }
                    }
                    let dst = if which == 0 { &mut opt.m } else { &mut opt.v };
                    comm.scatter(&self.send, dst, 0);
                }
                self.send.fill(0.0);
            }
            opt
        };
        opt.step = adam_step;
        self.check_replicas(comm, &model.params, iter)?;
        Ok(opt)
    }

    /// ZeRO-3: each rank holds only its pieces of the parameters between passes;
    /// a pass gathers each bucket's as it needs them. Every micro-step's backward
    /// then reduces its gradients ([`DataParallel::backward_reduce`]).
    pub fn shards_weights(&self) -> bool {
        self.plan.zero_stage >= 3
    }

    /// Clears the gradients before a step's first micro-step: the model's, or at
    /// stage 3 this rank's sums of its pieces (the model's are released, zero).
    pub fn zero_grad(&mut self, model: &mut Gpt) {
        match self.shards_weights() {
            true => self.recv.fill(0.0),
            false => model.zero_grad(),
        }
    }

    /// `model.forward`, at stage 3 with each bucket's weights gathered before it
    /// is read and released after (the embeddings and `ln_f` in training mode at
    /// the end of backward). Collective at stage 3.
    pub fn forward(
        &mut self,
        comm: &dyn Collective,
        model: &mut Gpt,
        batch: (&[u32], &[i32]),
        b: usize,
        t: usize,
    ) -> f32 {
        let (inputs, targets) = batch;
        match self.shards_weights() {
            true => model.forward_hooked(inputs, targets, b, t, &mut self.sharded(comm)),
            false => model.forward(inputs, targets, b, t),
        }
    }

    /// ZeRO-3's hooks on a pass of the model.
    fn sharded<'a>(&'a mut self, comm: &'a dyn Collective) -> Sharded<'a> {
        Sharded {
            comm,
            plan: &self.plan,
            scratch: &mut self.send,
            sums: &mut self.recv,
            gathers: &mut self.other,
            reductions: &mut self.exposed,
        }
    }

    /// A micro-step's backward with the gradient reduction. Stages 0-2 (the last
    /// local micro-step only): each bucket's reduction started as soon as backward
    /// has finished it; stage 0: `model.grads` then holds the sum over ranks, stages
    /// 1 and 2: this rank's shard of it is held here. Stage 3 (every micro-step):
    /// each bucket's weights gathered again, its gradients reduced to their owners as
    /// soon as final and added to this rank's sums, then released.
    pub fn backward_reduce(&mut self, comm: &dyn Collective, model: &mut Gpt) {
        if self.shards_weights() {
            model.backward_hooked(&mut self.sharded(comm));
            return;
        }
        let kind = self.kind();
        let times = comm.reduce_during_backward(
            kind,
            &self.plan.buckets,
            &mut self.send,
            &mut self.recv,
            &mut |hook| model.backward_with(|range, grads| hook(range, grads)),
        );
        self.exposed += times.exposed;
        if kind == Reduce::AllReduce {
            // Every bucket of `recv` was overwritten: it is the summed gradient.
            std::mem::swap(&mut model.grads, &mut self.recv);
        }
    }

    /// Measures the gradient reduction with nothing to hide it behind (the
    /// reference for [`CommReport::hidden_fraction`]); the gradients are not
    /// touched. Collective: every rank calls it.
    pub fn calibrate(&mut self, comm: &dyn Collective, model: &Gpt) {
        let kind = self.kind();
        let mut best = Duration::MAX;
        for _ in 0..2 {
            let start = Instant::now();
            let buckets = self.plan.buckets.clone();
            comm.reduce_during_backward(
                kind,
                &self.plan.buckets,
                &mut self.send,
                &mut self.recv,
                &mut |hook| {
                    for b in &buckets {
                        hook(b.arena.clone(), &model.grads);
                    }
                },
            );
            best = best.min(start.elapsed());
        }
        self.reduce_alone = best;
    }

    /// The mean loss over every rank's micro-steps (each already divided by the
    /// global number of micro-steps), and whether any rank was asked to stop by a
    /// signal: one all-reduce of three numbers, so every rank stops at the same step.
    pub fn global_loss_and_stop(
        &mut self,
        comm: &dyn Collective,
        local: f32,
        stop: Option<StopSignal>,
    ) -> (f32, Option<StopSignal>) {
        let start = Instant::now();
        let [interrupts, terminations] = shutdown::as_counts(stop);
        let mut v = [local as f64, interrupts, terminations];
        comm.all_reduce_sum_f64(&mut v);
        self.other += start.elapsed();
        (v[0] as f32, shutdown::from_counts(stop, [v[1], v[2]]))
    }

    /// Stage 1: this rank's shard of the summed gradients (what its optimizer
    /// steps on), after [`DataParallel::backward_reduce`].
    pub(super) fn shard_grads(&self) -> &[f32] {
        &self.recv
    }

    /// Stage 1: the sum over the ranks of each one's `value` (a sum of squares of
    /// its shard's gradients), every rank receiving it.
    pub(super) fn sum_over_ranks(&mut self, comm: &dyn Collective, value: f64) -> f64 {
        let start = Instant::now();
        let mut sum = [value];
        comm.all_reduce_sum_f64(&mut sum);
        self.other += start.elapsed();
        sum[0]
    }

    /// Stage 1: the AdamW step of this rank's shard (gradients times `grad_factor`),
    /// then every rank's updated pieces into every rank's parameters.
    pub(super) fn step_shard(
        &mut self,
        comm: &dyn Collective,
        opt: &mut AdamW,
        params: &mut [f32],
        lr: f32,
        grad_factor: f32,
    ) {
        opt.step_shard(params, &self.recv, lr, grad_factor);
        if self.shards_weights() {
            return; // each rank keeps its own pieces until a pass gathers them
        }
        let start = Instant::now();
        self.all_gather_params(comm, params);
        self.other += start.elapsed();
    }

    /// Stages 1 and 2: every rank's updated pieces into every rank's parameters.
    fn all_gather_params(&mut self, comm: &dyn Collective, params: &mut [f32]) {
        let (plan, s) = (&self.plan, self.plan.shard_len);
        if plan.zero_stage >= 2 {
            // `recv` (the shard's gradients, used) carries this rank's pieces; each
            // bucket is gathered straight into the parameters.
            plan.pack_shard(plan.rank, params, &mut self.recv);
            for (b, bucket) in plan.buckets.iter().enumerate() {
                let mine = &self.recv[plan.slot(b)..][..bucket.counts[plan.rank]];
                comm.all_gather_pieces(mine, &mut params[bucket.arena.clone()], &bucket.counts);
            }
            return;
        }
        // Both buffers are free until the next step's reduction, which overwrites
        // (and zero-pads) every bucket of them: `recv` (the shard's gradients, used)
        // carries this rank's pieces, `send` receives everyone's.
        plan.pack_shard(plan.rank, params, &mut self.recv);
        comm.all_gather(&self.recv, &mut self.send);
        for q in 0..plan.world_size {
            plan.unpack_shard(q, &self.send[q * s..(q + 1) * s], params);
        }
    }

    /// Stage 3 at start-up: this rank's pieces of rank 0's parameters; the rest of
    /// `params` is released.
    fn scatter_params(&mut self, comm: &dyn Collective, params: &mut [f32]) {
        let (plan, root) = (&self.plan, self.plan.rank == 0);
        for (b, bucket) in plan.buckets.iter().enumerate() {
            let own = plan.piece(b, plan.rank);
            let mine = &mut self.send[..own.len()];
            let all = if root {
                &params[bucket.arena.clone()]
            } else {
                &[][..]
            };
            comm.scatter_pieces(all, mine, &bucket.counts, 0);
            params[own].copy_from_slice(mine);
        }
        self.release_params(params);
    }

    /// Stage 3, for the quick start's closing sample: the whole parameters on rank 0.
    /// Collective; a no-op below stage 3. (Checkpoints gather one tensor at a time:
    /// [`DataParallel::gather_range`].)
    pub fn gather_params(&mut self, comm: &dyn Collective, params: &mut [f32]) {
        if !self.shards_weights() {
            return;
        }
        let start = Instant::now();
        let (plan, root) = (&self.plan, self.plan.rank == 0);
        for (b, bucket) in plan.buckets.iter().enumerate() {
            let own = plan.piece(b, plan.rank);
            let mine = &mut self.send[..own.len()];
            mine.copy_from_slice(&params[own]);
            let all = match root {
                true => &mut params[bucket.arena.clone()],
                false => &mut [][..],
            };
            comm.gather_pieces(mine, all, &bucket.counts, 0);
        }
        self.other += start.elapsed();
    }

    /// Stage 3: releases every part of `params` but this rank's pieces. A no-op below
    /// stage 3.
    pub fn release_params(&self, params: &mut [f32]) {
        if !self.shards_weights() {
            return;
        }
        for (b, bucket) in self.plan.buckets.iter().enumerate() {
            release_others(params, &bucket.arena, self.plan.piece(b, self.plan.rank));
        }
    }

    /// For a checkpoint, one tensor at a time: rank 0's `out` (`range.len()` floats;
    /// empty elsewhere) = arena range `range` of an array of which every rank holds
    /// its pieces: the parameters at stage 3 (`local` = the arena, `in_arena`), an
    /// AdamW moment at stages 1-3 (`local` = this rank's shard). Collective: every
    /// rank calls it with the same `range`.
    pub fn gather_range(
        &self,
        comm: &dyn Collective,
        local: &[f32],
        in_arena: bool,
        range: Range<usize>,
        out: &mut [f32],
    ) {
        let (plan, root) = (&self.plan, self.plan.rank == 0);
        for (b, bucket) in plan.buckets.iter().enumerate() {
            let part = range.start.max(bucket.arena.start)..range.end.min(bucket.arena.end);
            if part.is_empty() {
                continue;
            }
            let within = |q: usize| {
                let piece = plan.piece(b, q);
                let r = part.start.max(piece.start)..part.end.min(piece.end);
                (piece.start, r.start..r.end.max(r.start))
            };
            let counts: Vec<usize> = (0..plan.world_size).map(|q| within(q).1.len()).collect();
            let (piece_start, own) = within(plan.rank);
            let mine = match in_arena {
                true => &local[own],
                false if own.is_empty() => &[][..],
                false => {
                    let at = plan.slot(b) + own.start - piece_start;
                    &local[at..at + own.len()]
                }
            };
            let all = match root {
                true => &mut out[part.start - range.start..part.end - range.start],
                false => &mut [][..],
            };
            comm.gather_pieces(mine, all, &counts, 0);
        }
    }

    /// Checks that every rank holds bit-identical parameters (a checksum per rank,
    /// compared); the error names the ranks that differ. Stage 3 holds no replicas
    /// (each rank its own pieces): nothing to compare.
    pub fn check_replicas(
        &mut self,
        comm: &dyn Collective,
        params: &[f32],
        iter: u64,
    ) -> Result<()> {
        if self.shards_weights() {
            return Ok(());
        }
        let start = Instant::now();
        let sums = comm.all_gather_u64(params_checksum(params));
        self.other += start.elapsed();
        let differ: Vec<String> = sums
            .iter()
            .enumerate()
            .filter(|(_, &s)| s != sums[0])
            .map(|(r, s)| format!("rank {r} has {s:016x}"))
            .collect();
        if !differ.is_empty() {
            bail!(
                "{}",
                replicas_differ_message(iter, self.verified_iter, sums[0], &differ)
            );
        }
        self.verified_iter = Some(iter);
        Ok(())
    }

    /// Adds one step's wall time (the step itself measures it). The first step
    /// (buffers touched for the first time, connections opened) is left out.
    pub fn record_step(&mut self, elapsed: Duration) {
        if !self.warm {
            self.warm = true;
            (self.exposed, self.other) = (Duration::ZERO, Duration::ZERO);
            return;
        }
        self.steps += 1;
        self.step_time += elapsed;
    }

    /// The figures so far, for a step of `tokens` global tokens.
    pub fn report(&self, comm: &dyn Collective, tokens: usize) -> CommReport {
        let n = self.steps.max(1) as f64;
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / n;
        let (step, exposed, other) = (ms(self.step_time), ms(self.exposed), ms(self.other));
        let alone = self.reduce_alone.as_secs_f64() * 1e3;
        let hidden = if alone > 0.0 {
            (1.0 - exposed / alone).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let per_rank = if step > 0.0 {
            tokens as f64 / (step / 1e3) / comm.world_size() as f64
        } else {
            0.0
        };
        CommReport {
            world_size: comm.world_size(),
            zero_stage: self.plan.zero_stage,
            backend: comm.describe(),
            steps: self.steps,
            step_ms: step,
            compute_ms: step - exposed - other,
            exposed_reduce_ms: exposed,
            other_comm_ms: other,
            reduce_alone_ms: alone,
            hidden_fraction: hidden,
            grad_bytes: self.plan.arena_len * 4,
            tokens_per_sec_per_rank: per_rank,
        }
    }
}

/// ZeRO-3's side of a pass ([`PassHooks`]): a bucket's weights all-gathered from
/// the ranks' pieces before it is read and the other ranks' pieces released after;
/// its gradients, once final, reduced to their owners (this rank's piece added to
/// its sums) and released. Blocking collectives, in the same order on every rank
/// (every rank runs the same passes).
struct Sharded<'a> {
    comm: &'a dyn Collective,
    plan: &'a GradPlan,
    /// Scratch for one piece: this rank's piece of a bucket, sent or received.
    scratch: &'a mut [f32],
    /// This rank's pieces of the gradients, summed over the step's micro-steps.
    sums: &'a mut [f32],
    /// Time spent gathering weights and reducing gradients.
    gathers: &'a mut Duration,
    reductions: &'a mut Duration,
}

impl Sharded<'_> {
    /// The bucket of the plan that `range` is.
    fn bucket(&self, range: &Range<usize>) -> usize {
        let buckets = &self.plan.buckets;
        let found = buckets.iter().position(|b| b.arena == *range);
        found.expect("the model reports the plan's buckets")
    }
}

impl PassHooks for Sharded<'_> {
    fn need(&mut self, range: Range<usize>, params: &mut [f32]) {
        crate::fault::during_gather(self.plan.rank);
        let start = Instant::now();
        let (plan, b) = (self.plan, self.bucket(&range));
        let own = plan.piece(b, plan.rank);
        let mine = &mut self.scratch[..own.len()];
        mine.copy_from_slice(&params[own]);
        (self.comm).all_gather_pieces(mine, &mut params[range], &plan.buckets[b].counts);
        *self.gathers += start.elapsed();
    }

    fn done(&mut self, range: Range<usize>, params: &mut [f32]) {
        let own = self.plan.piece(self.bucket(&range), self.plan.rank);
        release_others(params, &range, own);
    }

    fn grads_done(&mut self, range: Range<usize>, grads: &mut [f32]) {
        let start = Instant::now();
        let (plan, b) = (self.plan, self.bucket(&range));
        let counts = &plan.buckets[b].counts;
        let at = plan.slot(b)..plan.slot(b) + counts[plan.rank];
        let piece = &mut self.scratch[..at.len()];
        (self.comm).reduce_scatter_pieces(&grads[range.clone()], piece, counts);
        for (sum, g) in self.sums[at].iter_mut().zip(piece.iter()) {
            *sum += g;
        }
        release(grads, range);
        *self.reductions += start.elapsed();
    }
}

/// Releases `buf[bucket]` but this rank's piece `own` (inside the bucket).
fn release_others(buf: &mut [f32], bucket: &Range<usize>, own: Range<usize>) {
    release(buf, bucket.start..own.start);
    release(buf, own.end..bucket.end);
}

/// Stages 2 and 3: `shard` (this rank's pieces) = its pieces of `root`'s `full`
/// arena (`Some` on rank 0 only), one bucket at a time.
fn scatter_shard(comm: &dyn Collective, plan: &GradPlan, full: Option<&[f32]>, shard: &mut [f32]) {
    for (b, bucket) in plan.buckets.iter().enumerate() {
        let mine = &mut shard[plan.slot(b)..][..bucket.counts[plan.rank]];
        let all = full.map_or(&[][..], |f| &f[bucket.arena.clone()]);
        comm.scatter_pieces(all, mine, &bucket.counts, 0);
    }
}

/// The error when the ranks' weights differ at `iter` (`verified`: the last
/// iteration they were equal): what can cause it, and which checkpoints to trust.
fn replicas_differ_message(
    iter: u64,
    verified: Option<u64>,
    root: u64,
    differ: &[String],
) -> String {
    let trust = match verified {
        Some(v) => format!(
            "they were equal at iteration {v}: a checkpoint written after iteration {v} may \
             hold diverged weights, so resume only from one written at or before it"
        ),
        None => "no checkpoint of this run is known to be good".to_string(),
    };
    [
        format!(
            "the ranks' weights differ at iteration {iter} (checksum on rank 0 {root:016x}, {})",
            differ.join(", ")
        ),
        trust,
        "the ranks computed differently: check that every host has the same binary, data and \
         settings (`nanogpt doctor` under the same launcher compares them); if they do, a host \
         may be faulty (memory or CPU)"
            .to_string(),
    ]
    .join("; ")
}

/// A 64-bit checksum of the parameters' bytes, the same for any thread count.
pub fn params_checksum(params: &[f32]) -> u64 {
    const CHUNK: usize = 1 << 16;
    let parts: Vec<u64> = params
        .par_chunks(CHUNK)
        .map(|c| {
            c.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
                (h ^ x.to_bits() as u64).wrapping_mul(0x0000_0100_0000_01b3)
            })
        })
        .collect();
    parts.iter().fold(params.len() as u64, |h, &p| {
        crate::kernels::dropout::mix64(h ^ p).wrapping_add(0x9e37_79b9_7f4a_7c15)
    })
}

/// Floats of the buffer into which `rank` receives a checkpoint's tensors, one at a
/// time ([`DataParallel::gather_range`]): the largest tensor of `layout` on rank 0
/// when ZeRO shards what a checkpoint holds (stages 1-3: the moments, 3: the weights
/// too) over several ranks; none otherwise. The memory plan counts it.
pub fn save_buffer_len(
    layout: &crate::model::ParamLayout,
    zero_stage: u8,
    world_size: usize,
    rank: usize,
) -> usize {
    match rank == 0 && world_size > 1 && zero_stage >= 1 {
        true => layout.tensors.iter().map(|t| t.numel()).max().unwrap_or(0),
        false => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_divergence_message_is_one_clean_line_that_trusts_only_verified_checkpoints() {
        let differ = ["rank 2 has 00000000000000ab".to_string()];
        let msg = replicas_differ_message(40, Some(20), 0x12, &differ);
        assert!(!msg.contains("  ") && !msg.contains('\n'), "{msg}");
        assert!(msg.contains("differ at iteration 40"), "{msg}");
        assert!(msg.contains("rank 2 has 00000000000000ab"), "{msg}");
        assert!(
            msg.contains("after iteration 20 may hold diverged"),
            "{msg}"
        );
        assert!(!msg.contains("last checkpoint"), "{msg}");
        // The likely causes come before a hardware fault.
        assert!(
            msg.find("binary").unwrap() < msg.find("memory").unwrap(),
            "{msg}"
        );
        let msg = replicas_differ_message(0, None, 0x12, &differ);
        assert!(
            msg.contains("no checkpoint of this run is known to be good"),
            "{msg}"
        );
    }

    #[test]
    fn checksum_sees_one_changed_bit_and_ignores_threads() {
        let a: Vec<f32> = (0..300_000).map(|i| i as f32 * 1e-3).collect();
        let mut b = a.clone();
        b[123_456] = f32::from_bits(b[123_456].to_bits() ^ 1);
        assert_ne!(params_checksum(&a), params_checksum(&b));
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| params_checksum(&a));
        assert_eq!(one, params_checksum(&a));
    }
}
