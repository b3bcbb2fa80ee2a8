//! The data-parallel side of a training step: gradients reduced once per optimizer
//! step, overlapped with backward; the global loss; the pieces of the update that
//! a sharded optimizer (ZeRO stages 1-3) needs (see [`super::clip_and_step`]);
//! ZeRO-3's gathers and releases of the weights around each layer ([`Sharded`]); the
//! start-up broadcast and the checks that every rank holds the same weights.

use super::{Collective, GatherPart, GradPlan, Pending, Reduce, Reported};
use crate::model::{add_encoder_rows, Dtype, EncoderGrad, Gpt, ParamLayout, PassHooks};
use crate::optim::{AdamW, AdamWConfig};
use crate::resident::release;
use crate::shutdown::{self, StopSignal};
use anyhow::{bail, Result};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::VecDeque;
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
    /// Mean time per step in the other collectives (loss, norm, checksum), ms.
    pub other_comm_ms: f64,
    /// Mean time per step in all-gathers of the weights, ms. ZeRO-1/2: the gather
    /// of the updated parameters, whole when blocking (`NANOGPT_AG_OVERLAP=0`), or
    /// with the gathers left in flight (default) starting them and the waits for
    /// what had not arrived when needed (the next forward, or an evaluation,
    /// checkpoint or checksum before it). ZeRO-3: the waits for each bucket's
    /// weights before its pass.
    pub exposed_gather_ms: f64,
    /// ZeRO-1/2: the parameters' all-gathers were left in flight after the update.
    pub gathers_in_flight: bool,
    /// The gradient reduction alone, nothing to hide it behind (measured at start), ms.
    pub reduce_alone_ms: f64,
    /// Share of the gradient reduction hidden behind backward: 1 − exposed / alone.
    pub hidden_fraction: f64,
    /// Mean per step of how much longer the slowest rank computed than this one
    /// (rank 0), ms, over the last steps measured (up to `SKEW_STEPS`). This
    /// rank waits that long at the gradient reduction, which cannot end before the
    /// slowest rank's last gradient, whatever the communication costs: load
    /// imbalance (ranks sharing cores, a straggler), counted in `exposed_reduce_ms`.
    pub skew_ms: f64,
    /// The hidden share with the skew taken out of the wait:
    /// 1 − max(0, exposed − skew) / alone.
    pub hidden_fraction_net_of_skew: f64,
    /// Gradient bytes each rank contributes per step (4 per value, 2 with
    /// `grad_reduce_dtype = "bfloat16"`).
    pub grad_bytes: usize,
    /// Tokens per second per rank (global tokens / step time / world size).
    pub tokens_per_sec_per_rank: f64,
    /// Backward reported the embeddings' bucket first (its reduction started before
    /// the blocks' backward) and the encoder's gradient was all-gathered after.
    pub embeddings_first: bool,
    /// Bytes of weights made whole per step by all-gathers (each rank receives the
    /// other ranks' pieces of them): stages 1-2 the arena once, after the update;
    /// stage 3 every bucket each time a training pass gathers it (evaluations not
    /// counted).
    pub gathered_bytes: u64,
    /// Bytes of gradients reduced per step (whole buckets, as each rank sends them):
    /// stages 0-2 the arena once per step, stage 3 each bucket once per micro-step
    /// but the embeddings' once per step (summed over the micro-steps first).
    pub reduced_bytes: u64,
    /// Rank 0's minor page faults per step (memory given back and touched again:
    /// stage 3's released buckets).
    pub minor_faults: f64,
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
    /// ZeRO-1/2: in the parameters' all-gather, or waiting for it.
    gather: Duration,
    /// The compute time (wall time less the waits) of each measured step, ms, the
    /// last [`SKEW_STEPS`], and the waits counted up to the step before.
    computes: VecDeque<f64>,
    waits_before: Duration,
    reduce_alone: Duration,
    /// The last iteration at which every rank was seen to hold the same weights.
    verified_iter: Option<u64>,
    /// The reduction of the gradients (stages 0-2): f32 or bf16 on the wire.
    kind: Reduce,
    /// Stages 0-2: backward reports the embeddings' bucket first and the encoder's
    /// gradient is added after ([`DataParallel::backward_reduce`]).
    embeddings_first: bool,
    /// ZeRO-1/2: the update leaves the parameters' all-gathers in flight
    /// ([`DataParallel::keep_gathers_in_flight`]).
    in_flight: bool,
    /// Those gathers, one per bucket with its index, in the order started: the order
    /// the next forward reads the buckets in.
    arriving: VecDeque<(usize, Box<dyn Pending>)>,
    /// Since the first step: floats of weights gathered and of gradients reduced,
    /// and this process's minor page faults (at the first step and at the last).
    gathered: u64,
    reduced: u64,
    faults: (u64, u64),
    /// ZeRO-3: the buckets a pass left whole for the next ([`Sharded::keep`]),
    /// released by the update.
    whole: Vec<usize>,
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
        let kind = Reduce::of_stage(zero_stage, Dtype::Float32);
        DataParallel {
            send: vec![0.0; plan.send_len_for(kind, super::ring_reduce())],
            recv: vec![0.0; plan.recv_len],
            plan,
            steps: 0,
            warm: false,
            step_time: Duration::ZERO,
            exposed: Duration::ZERO,
            other: Duration::ZERO,
            gather: Duration::ZERO,
            computes: VecDeque::new(),
            waits_before: Duration::ZERO,
            reduce_alone: Duration::ZERO,
            verified_iter: None,
            // ZeRO-3 reduces each bucket by itself on every micro-step (`Sharded`).
            embeddings_first: zero_stage < 3 && embeddings_first(model, comm.world_size()),
            kind,
            in_flight: false,
            arriving: VecDeque::new(),
            gathered: 0,
            reduced: 0,
            faults: (0, 0),
            whole: Vec::new(),
        }
    }

    /// ZeRO-1/2 without LoRA, unless `NANOGPT_AG_OVERLAP=0`: from here on each
    /// update leaves the all-gathers of the updated parameters in flight, one per
    /// bucket, started in the order the next forward reads them (the embeddings,
    /// `ln_f`, then block by block); [`DataParallel::forward`] waits for each bucket
    /// just before its first use, and [`DataParallel::params_whole`] for all of them
    /// (call it before anything else reads or writes the parameters). Returns
    /// whether it is on.
    ///
    /// # Safety
    /// A gather in flight borrows the collective and writes into the parameters
    /// given to the update ([`super::clip_and_step`]) beyond that call: until
    /// [`DataParallel::params_whole`] (or the drop of this value) has returned, that
    /// collective must stay alive, the parameters allocated, and nothing but
    /// [`DataParallel::forward`] may read or write them.
    pub unsafe fn keep_gathers_in_flight(&mut self, model: &Gpt) -> bool {
        let stage = self.plan.zero_stage;
        self.in_flight = matches!(stage, 1 | 2) && model.frozen().is_none() && ag_overlap();
        self.in_flight
    }

    /// Whether the parameters' all-gathers are in flight (some parameters still
    /// arriving).
    pub fn params_arriving(&self) -> bool {
        !self.arriving.is_empty()
    }

    /// The parameters whole on this rank: every all-gather left in flight by the
    /// update waited for (a no-op when none is), and the bf16 copy refreshed if the
    /// forward was to round it as the buckets arrived. Every reader of the
    /// parameters but [`DataParallel::forward`] calls it first.
    pub fn params_whole(&mut self, model: &mut Gpt) {
        if self.arriving.is_empty() {
            return;
        }
        let start = Instant::now();
        for (_, gather) in self.arriving.drain(..) {
            gather.wait();
        }
        self.gather += start.elapsed();
        if model.bf16_refresh_owed() {
            model.sync_bf16_weights();
        }
    }

    /// `grad_reduce_dtype`: bf16 on the wire (stages 0 and 1; the config refuses it
    /// above) or f32.
    pub fn reduce_in(&mut self, dtype: Dtype) {
        self.kind = Reduce::of_stage(self.plan.zero_stage, dtype);
        let len = self.plan.send_len_for(self.kind, super::ring_reduce());
        if self.send.len() != len {
            self.send = vec![0.0; len];
        }
    }

    /// Floats of the send and receive buffers (what the memory plan counts).
    pub fn buffer_lens(&self) -> (usize, usize) {
        (self.send.len(), self.recv.len())
    }

    fn kind(&self) -> Reduce {
        self.kind
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
        // ZeRO-3: the passes lend the model each bucket's weights (and bf16 copy).
        model.set_weights_lent(self.shards_weights());
        let mut opt = if self.plan.zero_stage == 0 {
            let mut opt =
                root_opt.unwrap_or_else(|| AdamW::new(&model.layout.decay_ranges(), config));
            if moments {
                comm.broadcast(&mut opt.m, 0);
                comm.broadcast(&mut opt.v, 0);
            }
            opt
        } else {
            let plan = &self.plan;
            let mut opt = AdamW::for_shard(
                &model.layout.decay_ranges(),
                config,
                &plan.shard(),
                plan.shard_len,
            );
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
            true => {
                let pass = match model.is_training() {
                    true => Pass::Forward,
                    false => Pass::Evaluation,
                };
                let mut hooks = self.sharded(comm, pass);
                model.forward_hooked(inputs, targets, b, t, &mut hooks)
            }
            false if self.arriving.is_empty() => model.forward(inputs, targets, b, t),
            false => {
                // The update's gathers in flight: each bucket waited for at its need.
                let mut hooks = Arrivals {
                    plan: &self.plan,
                    arriving: &mut self.arriving,
                    waited: &mut self.gather,
                };
                let loss = model.forward_hooked(inputs, targets, b, t, &mut hooks);
                // A full forward needs every bucket: nothing is left (else, waited).
                debug_assert!(self.arriving.is_empty(), "a bucket never needed");
                self.params_whole(model);
                loss
            }
        }
    }

    /// ZeRO-3's hooks on a pass of the model.
    fn sharded<'a>(&'a mut self, comm: &'a dyn Collective, pass: Pass) -> Sharded<'a> {
        Sharded {
            comm,
            keep: keep_whole(&self.plan, pass, prefetch_enabled()),
            whole: &mut self.whole,
            plan: &self.plan,
            pass,
            prefetch: prefetch_enabled(),
            scratch: &mut self.send,
            sums: &mut self.recv,
            gathers: &mut self.gather,
            reductions: &mut self.exposed,
            gathered: &mut self.gathered,
            reduced: &mut self.reduced,
            arriving: None,
            reducing: None,
            hold: None,
        }
    }

    /// A micro-step's backward and the gradient reduction; `last`: this rank's last
    /// micro-step of the step. Stages 0-2: before the last, a plain backward (the
    /// gradients accumulate in `model.grads`); in the last, each bucket's reduction
    /// started as soon as backward has finished it; stage 0: `model.grads` then
    /// holds the sum over ranks, stages 1 and 2: this rank's shard of it is held
    /// here. Stage 3 (every micro-step): each bucket's weights gathered again, its
    /// gradients reduced to their owners as soon as final and added to this rank's
    /// sums, then released; but the embeddings', which accumulate in `model.grads`
    /// and are reduced in the last micro-step only. Their bucket is whole through
    /// every backward anyway (the classifier adds to it first, the encoder last), so
    /// holding it costs no more memory than the plan counts, and saves all but one
    /// of its reductions per step (31 % of 124M's bytes). LoRA freezes them.
    pub fn backward_reduce(&mut self, comm: &dyn Collective, model: &mut Gpt, last: bool) {
        if self.shards_weights() {
            let hold = !last && model.frozen().is_none();
            let hold = hold.then(|| embeddings_bucket(&self.plan));
            let mut hooks = self.sharded(comm, Pass::Backward);
            hooks.hold = hold;
            model.backward_hooked(&mut hooks);
            hooks.finish(&mut model.grads);
            return;
        }
        if !last {
            return model.backward();
        }
        // The gathers' send pieces are in `recv`, which the reduction overwrites.
        self.params_whole(model);
        let kind = self.kind();
        self.reduced += self.plan.arena_len as u64;
        let (early, mut held) = (self.embeddings_first, EncoderGrad::default());
        let times = comm.reduce_during_backward(
            kind,
            &self.plan.buckets,
            &mut self.send,
            &mut self.recv,
            &mut |hook| held = model.backward_reporting(early, hook),
        );
        self.exposed += times.exposed;
        if early {
            self.add_encoder_grads(comm, &model.layout, &held);
        }
        if matches!(kind, Reduce::AllReduce | Reduce::AllReduceBf16) {
            // Every bucket of `recv` was overwritten: it is the summed gradient.
            std::mem::swap(&mut model.grads, &mut self.recv);
        }
    }

    /// After an embeddings-first backward: every rank's held-back encoder gradient
    /// (all-gathered: B·T·C floats and B·T tokens per rank, small beside the
    /// embeddings' (V + block_size)·C) added, in rank order, to the part of the
    /// reduced embeddings this rank holds: all of it at stage 0, its piece at stages
    /// 1 and 2. Every rank adds the same rows in the same order: the replicas stay
    /// bit-identical. Counted as exposed reduction time.
    fn add_encoder_grads(
        &mut self,
        comm: &dyn Collective,
        layout: &ParamLayout,
        held: &EncoderGrad,
    ) {
        let start = Instant::now();
        let n = held.tokens.len();
        let mut mine = held.dout.clone();
        // Token ids below 2^24 are exact as f32.
        mine.extend(held.tokens.iter().map(|&tok| tok as f32));
        let per = mine.len();
        let mut all = vec![0.0; per * comm.world_size()];
        comm.all_gather(&mine, &mut all);
        let plan = &self.plan;
        let b = embeddings_bucket(plan);
        let (window, dst) = match plan.zero_stage {
            0 => {
                let arena = plan.buckets[b].arena.clone();
                (arena.clone(), &mut self.recv[arena])
            }
            _ => {
                let own = plan.piece(b, plan.rank);
                let at = plan.slot(b);
                (own.clone(), &mut self.recv[at..at + own.len()])
            }
        };
        for part in all.chunks_exact(per) {
            let (dout, tokens) = part.split_at(per - n);
            let tokens: Vec<u32> = tokens.iter().map(|&tok| tok as u32).collect();
            add_encoder_rows(layout, (dout, &tokens, held.t), window.clone(), dst);
        }
        self.exposed += start.elapsed();
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
                        hook(Reported::Final(b.arena.clone(), &model.grads));
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
            // Each rank keeps its own pieces until a pass gathers them; the buckets
            // left whole hold the weights before this update.
            self.release_whole(params);
            return;
        }
        let start = Instant::now();
        match self.in_flight {
            true => self.start_param_gathers(comm, params),
            false => self.all_gather_params(comm, params),
        }
        self.gather += start.elapsed();
        self.gathered += self.plan.arena_len as u64;
    }

    /// Stages 1 and 2, gathers in flight ([`DataParallel::keep_gathers_in_flight`]):
    /// starts every rank's updated pieces into every rank's parameters, one bucket
    /// at a time in the order the next forward reads them, and returns at once.
    /// `recv` (the shard's gradients, used) carries this rank's pieces until then.
    fn start_param_gathers(&mut self, comm: &dyn Collective, params: &mut [f32]) {
        let plan = &self.plan;
        plan.pack_shard(plan.rank, params, &mut self.recv);
        let order = forward_order(plan.buckets.len());
        let parts: Vec<GatherPart> = (order.iter())
            .map(|&b| GatherPart {
                from: plan.slot(b)..plan.slot(b) + plan.buckets[b].counts[plan.rank],
                into: plan.buckets[b].arena.clone(),
                counts: &plan.buckets[b].counts,
            })
            .collect();
        // SAFETY: until each gather is waited for (`Arrivals::need` of its bucket or
        // `params_whole`, which `backward_reduce`, the only writer of `recv` before
        // the next update, calls first) nothing writes `recv` and nothing reads or
        // writes the bucket of `params`: the caller's promise
        // (`keep_gathers_in_flight`), and the forward reads a bucket only after its
        // need. `recv` lives in `self`, which waits for every gather before it drops.
        let started = match crate::fault::late_gathers() {
            false => unsafe { comm.start_all_gathers(&self.recv, params, &parts) },
            true => Late::gathers(comm, &self.recv, params, &parts),
        };
        for (b, gather) in order.into_iter().zip(started) {
            // SAFETY: only the lifetime changes, to keep the gather in `self`: the
            // caller of `keep_gathers_in_flight` keeps `comm` alive until every
            // gather has been waited for (`params_whole` or the drop of `self`).
            let gather: Box<dyn Pending> = unsafe { std::mem::transmute(gather) };
            self.arriving.push_back((b, gather));
        }
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
    pub fn release_params(&mut self, params: &mut [f32]) {
        if !self.shards_weights() {
            return;
        }
        for (b, bucket) in self.plan.buckets.iter().enumerate() {
            release_others(params, &bucket.arena, self.plan.piece(b, self.plan.rank));
        }
        self.whole.clear();
    }

    /// Stage 3: releases the buckets the last pass left whole ([`keep_whole`]) but
    /// this rank's pieces.
    fn release_whole(&mut self, params: &mut [f32]) {
        for b in self.whole.drain(..) {
            let bucket = &self.plan.buckets[b];
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
            self.gather = Duration::ZERO;
            (self.gathered, self.reduced) = (0, 0);
            self.faults = (minor_faults(), minor_faults());
            return;
        }
        self.steps += 1;
        self.step_time += elapsed;
        self.faults.1 = minor_faults();
        // The step's waits (a wait before an evaluation between steps lands in the
        // next step's: its compute is then underestimated, never negative).
        let waits = self.exposed + self.other + self.gather;
        let compute = elapsed.saturating_sub(waits.saturating_sub(self.waits_before));
        self.waits_before = waits;
        if self.computes.len() == SKEW_STEPS {
            self.computes.pop_front();
        }
        self.computes.push_back(compute.as_secs_f64() * 1e3);
    }

    /// [`CommReport::skew_ms`]: every rank's step computes summed into one table
    /// (each fills its own row). Collective.
    fn skew_ms(&self, comm: &dyn Collective) -> f64 {
        let (n, world) = (self.computes.len(), comm.world_size());
        if n == 0 {
            return 0.0; // no step measured, on any rank (they step together)
        }
        let mut all = vec![0.0; n * world];
        let own = comm.rank() * n..(comm.rank() + 1) * n;
        all[own]
            .iter_mut()
            .zip(&self.computes)
            .for_each(|(a, &c)| *a = c);
        comm.all_reduce_sum_f64(&mut all);
        mean_skew(&all, n, comm.rank())
    }

    /// The figures so far, for a step of `tokens` global tokens. Collective: every
    /// rank calls it.
    pub fn report(&self, comm: &dyn Collective, tokens: usize) -> CommReport {
        let n = self.steps.max(1) as f64;
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / n;
        let (step, exposed, other) = (ms(self.step_time), ms(self.exposed), ms(self.other));
        let gather = ms(self.gather);
        let alone = self.reduce_alone.as_secs_f64() * 1e3;
        let hidden_share = |exposed: f64| match alone > 0.0 {
            true => (1.0 - exposed / alone).clamp(0.0, 1.0),
            false => 0.0,
        };
        let skew = self.skew_ms(comm);
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
            compute_ms: step - exposed - other - gather,
            exposed_reduce_ms: exposed,
            other_comm_ms: other,
            exposed_gather_ms: gather,
            gathers_in_flight: self.in_flight,
            reduce_alone_ms: alone,
            hidden_fraction: hidden_share(exposed),
            skew_ms: skew,
            hidden_fraction_net_of_skew: hidden_share((exposed - skew).max(0.0)),
            grad_bytes: self.plan.arena_len * self.kind.wire_bytes(),
            tokens_per_sec_per_rank: per_rank,
            embeddings_first: self.embeddings_first,
            gathered_bytes: self.gathered * 4 / self.steps.max(1),
            reduced_bytes: self.reduced * 4 / self.steps.max(1),
            minor_faults: (self.faults.1 - self.faults.0) as f64 / n,
        }
    }
}

/// Steps whose compute times [`CommReport::skew_ms`] compares (the last ones).
pub const SKEW_STEPS: usize = 4096;

/// The mean over steps of the slowest rank's compute less `rank`'s: `all` holds
/// each rank's `n` step computes, rank after rank.
fn mean_skew(all: &[f64], n: usize, rank: usize) -> f64 {
    if n == 0 {
        return 0.0;
    }
    let world = all.len() / n;
    let behind = (0..n).map(|s| {
        let slowest = (0..world).map(|r| all[r * n + s]).fold(f64::MIN, f64::max);
        slowest - all[rank * n + s]
    });
    behind.sum::<f64>() / n as f64
}

/// This process's minor page faults so far (0 where not known).
fn minor_faults() -> u64 {
    #[cfg(unix)]
    {
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage writes one `rusage` into the memory it is given, which is
        // ours and of that size; it is read only if the call succeeded.
        let ok = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0;
        if ok {
            // SAFETY: initialised by the successful call above.
            return unsafe { usage.assume_init() }.ru_minflt as u64;
        }
    }
    0
}

/// The plan's bucket of the embeddings (`wte`, `wpe`: the start of the arena).
/// Without LoRA only: the adapters' buckets hold no embeddings.
fn embeddings_bucket(plan: &GradPlan) -> usize {
    let b = plan.buckets.iter().position(|b| b.arena.start == 0);
    b.expect("the embeddings' bucket starts the arena")
}

/// Whether backward reports the embeddings first and their encoder gradient is
/// all-gathered after (see [`DataParallel::backward_reduce`]): without LoRA (which
/// freezes the embeddings) and when the gather carries no more than the bucket,
/// `world_size` · B · T ≤ rows of `wte` and `wpe`. `NANOGPT_EMBEDDINGS_FIRST=0|1`
/// overrides (to measure, and for the tests).
fn embeddings_first(model: &Gpt, world_size: usize) -> bool {
    if model.frozen().is_some() {
        return false;
    }
    crate::tuning::get().embeddings_first.unwrap_or_else(|| {
        let rows = (model.layout.wte.len() + model.layout.wpe.len()) / model.config().n_embd;
        world_size * model.max_tokens() <= rows
    })
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        // Gathers in flight write into the parameters: never left to MPI.
        for (_, gather) in self.arriving.drain(..) {
            gather.wait();
        }
    }
}

/// `NANOGPT_AG_OVERLAP=0`: ZeRO-1/2 all-gather the updated parameters with one
/// blocking collective (to measure what leaving them in flight saves).
fn ag_overlap() -> bool {
    crate::tuning::get().ag_overlap
}

/// The buckets (of `n`: `ln_f`, the blocks from the last, the embeddings) in the
/// order a forward needs them: the embeddings, `ln_f`, the blocks from the first.
fn forward_order(n: usize) -> Vec<usize> {
    let rest = (1..n.saturating_sub(1)).rev();
    [n - 1, 0].into_iter().take(n).chain(rest).collect()
}

/// `NANOGPT_FAULT=late-gathers` (tests): an all-gather of the updated weights
/// started only when waited for, blocking then (every rank waits for the gathers in
/// the same order): a reader that does not wait first sees the other ranks' pieces
/// from before the update, however fast the network.
struct Late<'a> {
    comm: &'a dyn Collective,
    mine: (*const f32, usize),
    all: (*mut f32, usize),
    counts: Vec<usize>,
}

impl<'a> Late<'a> {
    /// One per part of [`Collective::start_all_gathers`]: `send[from]` into `recv[into]`.
    fn gathers(
        comm: &'a dyn Collective,
        send: &[f32],
        recv: &mut [f32],
        parts: &[GatherPart],
    ) -> Vec<Box<dyn Pending + 'a>> {
        let late = |p: &GatherPart| -> Box<dyn Pending + 'a> {
            let (mine, all) = (&send[p.from.clone()], &mut recv[p.into.clone()]);
            Box::new(Late {
                comm,
                mine: (mine.as_ptr(), mine.len()),
                all: (all.as_mut_ptr(), all.len()),
                counts: p.counts.to_vec(),
            })
        };
        parts.iter().map(late).collect()
    }
}

impl Pending for Late<'_> {
    fn wait(self: Box<Self>) {
        // SAFETY: as for a gather in flight ([`Collective::start_all_gathers`]), both
        // ranges stay allocated, `mine` unchanged and `all` untouched until this wait.
        let (mine, all) = unsafe {
            let mine = std::slice::from_raw_parts(self.mine.0, self.mine.1);
            (mine, std::slice::from_raw_parts_mut(self.all.0, self.all.1))
        };
        self.comm.all_gather_pieces(mine, all, &self.counts);
    }
}

/// The hooks of a forward while the update's gathers are in flight
/// ([`DataParallel::forward`]): `need` of a bucket waits for its gather.
struct Arrivals<'a> {
    plan: &'a GradPlan,
    arriving: &'a mut VecDeque<(usize, Box<dyn Pending>)>,
    waited: &'a mut Duration,
}

impl PassHooks for Arrivals<'_> {
    fn need(&mut self, range: Range<usize>, _params: &mut [f32]) {
        let b = self.plan.buckets.iter().position(|b| b.arena == range);
        let b = b.expect("the model reports the plan's buckets");
        if let Some(at) = self.arriving.iter().position(|&(k, _)| k == b) {
            let start = Instant::now();
            let (_, gather) = self.arriving.remove(at).expect("found");
            gather.wait();
            *self.waited += start.elapsed();
        }
    }
}

/// Which way a pass walks the blocks: the order ZeRO-3 prefetches them in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// The embeddings, `ln_f`, then the blocks from the first; a backward follows.
    Forward,
    /// The same, no backward following.
    Evaluation,
    /// The blocks from the last.
    Backward,
}

/// The buckets a ZeRO-3 pass leaves whole for the next instead of releasing them,
/// because the next pass needs them first and the weights do not change before:
/// a training forward the last two blocks (the first its backward needs; the
/// second is the bucket it would prefetch; without prefetch the last only), a
/// backward the first block, `ln_f` and the embeddings (the first a next
/// micro-step's forward needs; else released by the update). Either way no more
/// blocks are whole at once than without: two with prefetch, one without.
/// `NANOGPT_ZERO3_KEEP=0` releases every bucket at once (to measure).
fn keep_whole(plan: &GradPlan, pass: Pass, prefetch: bool) -> Vec<usize> {
    let on = crate::tuning::get().zero3_keep;
    let n = plan.buckets.len();
    match pass {
        _ if !on => vec![],
        Pass::Evaluation => vec![],
        // Buckets: `ln_f`, the blocks from the last, the embeddings.
        Pass::Forward => (1..n - 1).take(1 + usize::from(prefetch)).collect(),
        Pass::Backward => vec![n - 2, n - 1, 0],
    }
}

/// Whether ZeRO-3 gathers the next bucket while the model computes with this one
/// and reduces a bucket's gradients while backward continues (default), or waits
/// for each collective at once (`NANOGPT_ZERO3_PREFETCH=0`, to measure what the
/// overlap saves).
fn prefetch_enabled() -> bool {
    crate::tuning::get().zero3_prefetch
}

/// ZeRO-3's side of a pass ([`PassHooks`]): a bucket's weights all-gathered from
/// the ranks' pieces before it is read and the other ranks' pieces released after;
/// its gradients, once final, reduced to their owners (this rank's piece added to
/// its sums) and released. Every rank runs the same passes, so the collectives
/// start in the same order everywhere.
///
/// With prefetch, `need` of a bucket waits for its gather (started at the previous
/// `need`) and starts the gather of the bucket the pass needs next, so at most two
/// blocks are whole at once ([`GradPlan::gathered_len`]): one computed, one
/// arriving. A bucket's reduction starts in `grads_done` and is waited for at the
/// next bucket's `grads_done` (then its gradients are released), so at most two
/// blocks' gradients are resident: one computed, one travelling. Call
/// [`Sharded::finish`] after backward for the last reduction.
struct Sharded<'a> {
    comm: &'a dyn Collective,
    /// The buckets this pass leaves whole at `done` ([`keep_whole`]).
    keep: Vec<usize>,
    /// The buckets whole from an earlier pass (used without a gather) or for a
    /// later one.
    whole: &'a mut Vec<usize>,
    plan: &'a GradPlan,
    pass: Pass,
    prefetch: bool,
    /// Two pieces: where the reductions in flight land, before being added to `sums`.
    scratch: &'a mut [f32],
    /// This rank's pieces of the gradients, summed over the step's micro-steps.
    sums: &'a mut [f32],
    /// Time spent waiting for weights and for gradient reductions.
    gathers: &'a mut Duration,
    reductions: &'a mut Duration,
    /// Floats of weights gathered and of gradients reduced.
    gathered: &'a mut u64,
    reduced: &'a mut u64,
    /// The bucket whose weights are arriving, and its all-gather.
    arriving: Option<(usize, Box<dyn Pending + 'a>)>,
    /// The bucket whose gradients are travelling, its scratch slot, its reduction.
    reducing: Option<(usize, usize, Box<dyn Pending + 'a>)>,
    /// A bucket whose gradients this backward leaves in place, unreduced, for the
    /// next micro-step's to add to (the embeddings', before a rank's last
    /// micro-step: [`DataParallel::backward_reduce`]).
    hold: Option<usize>,
}

impl<'a> Sharded<'a> {
    /// The bucket of the plan that `range` is.
    fn bucket(&self, range: &Range<usize>) -> usize {
        let buckets = &self.plan.buckets;
        let found = buckets.iter().position(|b| b.arena == *range);
        found.expect("the model reports the plan's buckets")
    }

    /// The bucket this pass needs after bucket `b` (buckets: `ln_f`, the blocks
    /// from the last, the embeddings), if any still to gather.
    fn next_after(&self, b: usize) -> Option<usize> {
        let n = self.plan.buckets.len();
        match self.pass {
            _ if !self.prefetch => None,
            Pass::Forward | Pass::Evaluation if b == n - 1 => Some(0),
            Pass::Forward | Pass::Evaluation if b == 0 => (n >= 3).then_some(n - 2),
            Pass::Forward | Pass::Evaluation => (b >= 2).then(|| b - 1),
            Pass::Backward => (b + 1 < n - 1).then_some(b + 1),
        }
    }

    /// Starts gathering bucket `b` into `params`.
    fn start_gather(&mut self, b: usize, params: &mut [f32]) -> Box<dyn Pending + 'a> {
        let bucket = &self.plan.buckets[b];
        if self.pass != Pass::Evaluation {
            *self.gathered += bucket.arena.len() as u64;
        }
        // SAFETY: until this gather is waited for (in `need` of bucket `b`, or when
        // `arriving` is dropped with `self`), nothing reads or writes
        // `params[bucket]`: the model reads only the buckets it has been told about
        // in `need` and not yet in `done`, `b` is not one of them (it is needed next),
        // and `done` and `release_params` touch only the bucket they name. The arena
        // outlives the pass, and so this hook.
        unsafe {
            let comm: &'a dyn Collective = self.comm;
            comm.start_all_gather_in_place(&mut params[bucket.arena.clone()], &bucket.counts)
        }
    }

    /// Waits for the reduction in flight, adds this rank's piece of it to the sums
    /// and releases its gradients.
    fn finish_reduction(&mut self, grads: &mut [f32]) {
        let Some((b, slot, request)) = self.reducing.take() else {
            return;
        };
        request.wait();
        let (plan, half) = (self.plan, self.scratch.len() / 2);
        let n = plan.buckets[b].counts[plan.rank];
        let piece = &self.scratch[slot * half..][..n];
        for (sum, g) in self.sums[plan.slot(b)..][..n].iter_mut().zip(piece) {
            *sum += g;
        }
        release(grads, plan.buckets[b].arena.clone());
    }

    /// After backward: the last reduction completed and added to the sums.
    fn finish(&mut self, grads: &mut [f32]) {
        let start = Instant::now();
        self.finish_reduction(grads);
        *self.reductions += start.elapsed();
    }
}

impl Drop for Sharded<'_> {
    fn drop(&mut self) {
        // A gather still in flight is waited for by dropping it; a reduction must
        // have been finished (its sum is part of the step).
        debug_assert!(self.reducing.is_none(), "Sharded::finish after backward");
    }
}

impl<'a> PassHooks for Sharded<'a> {
    fn need(&mut self, range: Range<usize>, params: &mut [f32]) {
        crate::fault::during_gather(self.plan.rank);
        let start = Instant::now();
        let b = self.bucket(&range);
        let kept = self.whole.iter().position(|&k| k == b);
        let arrived = match self.arriving.take() {
            Some((a, gather)) => {
                gather.wait();
                a == b
            }
            None => false,
        };
        match kept {
            Some(i) => _ = self.whole.swap_remove(i),
            None if !arrived => self.start_gather(b, params).wait(),
            None => {}
        }
        let next = self.next_after(b).filter(|n| !self.whole.contains(n));
        if let Some(next) = next {
            self.arriving = Some((next, self.start_gather(next, params)));
        }
        *self.gathers += start.elapsed();
    }

    fn done(&mut self, range: Range<usize>, params: &mut [f32]) {
        let b = self.bucket(&range);
        if self.keep.contains(&b) {
            self.whole.push(b);
            return;
        }
        release_others(params, &range, self.plan.piece(b, self.plan.rank));
    }

    fn grads_done(&mut self, range: Range<usize>, grads: &mut [f32]) {
        let start = Instant::now();
        let (plan, b) = (self.plan, self.bucket(&range));
        if self.hold == Some(b) {
            return;
        }
        // The previous bucket's reduction frees its slot of the scratch.
        let slot = self.reducing.as_ref().map_or(0, |&(_, s, _)| 1 - s);
        let half = self.scratch.len() / 2;
        let counts = &plan.buckets[b].counts;
        *self.reduced += range.len() as u64;
        let piece = &mut self.scratch[slot * half..][..counts[plan.rank]];
        // SAFETY: backward no longer writes `grads[range]` in this pass, and only
        // `finish_reduction` (after the wait) releases it; `piece` is a slot of the
        // scratch that nothing touches until that wait; both outlive the pass.
        let request = unsafe {
            let comm: &'a dyn Collective = self.comm;
            comm.start_reduce_scatter_pieces(&grads[range], piece, counts)
        };
        let previous = self.reducing.replace((b, slot, request));
        if let Some(previous) = previous {
            let newest = self.reducing.replace(previous);
            self.finish_reduction(grads);
            self.reducing = newest;
        }
        if !self.prefetch {
            self.finish_reduction(grads);
        }
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
    use crate::kernels::bf16::Backend;

    #[test]
    fn the_skew_is_how_far_the_slowest_rank_computed_beyond_this_one_per_step() {
        // Three ranks, two steps: rank 1 is slowest in the first, rank 2 in the
        // second; the mean of per-step gaps, not the gap of the means.
        let all = [
            100.0, 100.0, // rank 0
            130.0, 90.0, // rank 1
            110.0, 150.0, // rank 2
        ];
        assert_eq!(mean_skew(&all, 2, 0), (30.0 + 50.0) / 2.0);
        assert_eq!(mean_skew(&all, 2, 1), (0.0 + 60.0) / 2.0);
        assert_eq!(mean_skew(&all, 2, 2), (20.0 + 0.0) / 2.0);
        assert_eq!(mean_skew(&[], 0, 0), 0.0);
    }

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

    use crate::model::{Dtype, ModelConfig, NoHooks};
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;

    /// What the deferred collective and the hooks saw, in order (bucket numbers).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Event {
        Need(usize),
        Done(usize),
        /// `done`, the bucket left whole for the next pass.
        Kept(usize),
        GatherStart(usize),
        GatherWait(usize),
        ReduceStart,
        ReduceWait,
    }
    type Log = Rc<RefCell<Vec<Event>>>;

    /// Rank 0 of two whose twin, rank 1, holds the same gradients and the other
    /// pieces of `full`. Its collectives complete only when waited for: a gather
    /// writes the bucket then, a reduction reads the gradients then, so a pass that
    /// read weights before waiting, or released gradients before their reduction
    /// completed, computes something else.
    struct Twin {
        full: Vec<f32>,
        plan: GradPlan,
        /// Address of the model's parameter arena (to tell which bucket a buffer is).
        base: Cell<usize>,
        log: Log,
    }

    /// A deferred completion.
    struct Later<'a>(Box<dyn FnOnce() + 'a>);
    impl Pending for Later<'_> {
        fn wait(self: Box<Self>) {
            (self.0)()
        }
    }

    impl Collective for Twin {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            2
        }
        fn local_size(&self) -> usize {
            2
        }
        crate::dist::quiet_collective_methods!();
        fn reduce_scatter_pieces(&self, _: &[f32], _: &mut [f32], _: &[usize]) {
            unreachable!("stage 3 reduces without blocking")
        }
        fn all_gather_pieces(&self, _: &[f32], _: &mut [f32], _: &[usize]) {
            unreachable!("stage 3 gathers without blocking")
        }
        unsafe fn start_all_gather_in_place<'a>(
            &'a self,
            buf: &mut [f32],
            _: &[usize],
        ) -> Box<dyn Pending + 'a> {
            let at = (buf.as_ptr() as usize - self.base.get()) / 4;
            let b = self.plan.buckets.iter().position(|k| k.arena.start == at);
            let b = b.expect("a bucket of the parameters");
            self.log.borrow_mut().push(Event::GatherStart(b));
            let (ptr, len) = (buf.as_mut_ptr() as usize, buf.len());
            Box::new(Later(Box::new(move || {
                // SAFETY: the caller keeps the bucket allocated and untouched until
                // this wait (the contract under test).
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut f32, len) };
                buf.copy_from_slice(&self.full[at..at + len]);
                self.log.borrow_mut().push(Event::GatherWait(b));
            })))
        }
        unsafe fn start_reduce_scatter_pieces<'a>(
            &'a self,
            send: &[f32],
            mine: &mut [f32],
            _: &[usize],
        ) -> Box<dyn Pending + 'a> {
            self.log.borrow_mut().push(Event::ReduceStart);
            let (from, to, n) = (
                send.as_ptr() as usize,
                mine.as_mut_ptr() as usize,
                mine.len(),
            );
            Box::new(Later(Box::new(move || {
                // SAFETY: the caller keeps both buffers allocated, `send` unchanged
                // and `mine` untouched until this wait (the contract under test).
                let (send, mine) = unsafe {
                    let send = std::slice::from_raw_parts(from as *const f32, n);
                    (send, std::slice::from_raw_parts_mut(to as *mut f32, n))
                };
                for (m, s) in mine.iter_mut().zip(send) {
                    *m = 2.0 * s; // rank 0's piece comes first; the twin's equals it
                }
                self.log.borrow_mut().push(Event::ReduceWait);
            })))
        }
        unsafe fn start_all_gathers<'a>(
            &'a self,
            _: &[f32],
            recv: &mut [f32],
            parts: &[GatherPart],
        ) -> Vec<Box<dyn Pending + 'a>> {
            let mut started: Vec<Box<dyn Pending + 'a>> = Vec::new();
            for part in parts {
                let at = part.into.clone();
                let b = self.plan.buckets.iter().position(|k| k.arena == at);
                let b = b.expect("a bucket of the parameters");
                self.log.borrow_mut().push(Event::GatherStart(b));
                let ptr = recv[at.clone()].as_mut_ptr() as usize;
                started.push(Box::new(Later(Box::new(move || {
                    // SAFETY: the caller keeps the bucket allocated and untouched
                    // until this wait (the contract under test).
                    let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut f32, at.len()) };
                    buf.copy_from_slice(&self.full[at.clone()]);
                    self.log.borrow_mut().push(Event::GatherWait(b));
                }))));
            }
            started
        }
    }

    /// [`Sharded`], with its `need` and `done` calls logged.
    struct Logged<'a>(Sharded<'a>, Log);
    impl PassHooks for Logged<'_> {
        fn need(&mut self, range: Range<usize>, params: &mut [f32]) {
            let b = self.0.bucket(&range);
            self.1.borrow_mut().push(Event::Need(b));
            self.0.need(range, params);
        }
        fn done(&mut self, range: Range<usize>, params: &mut [f32]) {
            let b = self.0.bucket(&range);
            self.0.done(range, params);
            let kept = self.0.whole.contains(&b);
            let event = if kept { Event::Kept(b) } else { Event::Done(b) };
            self.1.borrow_mut().push(event);
        }
        fn grads_done(&mut self, range: Range<usize>, grads: &mut [f32]) {
            self.0.grads_done(range, grads);
        }
    }

    /// Blocks (buckets between `ln_f` and the embeddings) whole at once at most,
    /// and reductions in flight at most, over `log`.
    fn most_at_once(log: &[Event], n: usize) -> (usize, usize) {
        let (mut whole, mut most) = (std::collections::BTreeSet::new(), 0);
        let (mut flying, mut most_flying) = (0usize, 0);
        for e in log {
            match *e {
                Event::GatherStart(b) if b > 0 && b < n - 1 => {
                    whole.insert(b);
                }
                Event::Done(b) => {
                    whole.remove(&b);
                }
                Event::ReduceStart => flying += 1,
                Event::ReduceWait => flying -= 1,
                _ => {}
            }
            most = most.max(whole.len());
            most_flying = most_flying.max(flying);
        }
        (most, most_flying)
    }

    /// ZeRO-3 training passes (two micro-steps) on rank 0 of two, its collectives
    /// completing only when waited for: the same losses as the whole model, this
    /// rank's pieces of the summed gradients, every weight waited for before it was
    /// read; with prefetch each gather started one bucket ahead and at most two
    /// blocks whole, and two reductions in flight, at once; with buckets kept whole
    /// between passes, those not gathered again (and released by the update).
    #[test]
    fn zero_3_waits_for_each_prefetched_collective_before_its_buffers_are_used() {
        let cfg = ModelConfig::tiny_for_tests(4, 0.1);
        let (b, t, micro) = (2, 8, 2);
        let x: Vec<u32> = (0..b * t).map(|i| (i * 7 % 50) as u32).collect();
        let y: Vec<i32> = (0..b * t).map(|i| (i * 3 % 50) as i32).collect();
        let runs = [
            (true, false, true),
            (true, true, true),
            (false, false, true),
            (true, false, false),
        ];
        for (prefetch, ckpt, keep) in runs {
            let mut plain = Gpt::new(cfg.clone(), b, t).unwrap();
            plain.init_gpt2(5);
            plain.set_dtype(Dtype::Float32, &Backend::detect(None));
            let mut gpt = Gpt::from_params(cfg.clone(), plain.params.clone(), b, t).unwrap();
            for m in [&mut plain, &mut gpt] {
                m.set_activation_checkpointing(ckpt);
                m.set_dropout_seed(9);
                m.zero_grad();
            }
            let log = Log::default();
            let twin = Twin {
                full: gpt.params.clone(),
                plan: GradPlan::new(&gpt.grad_buckets(), gpt.layout.len, 2, 0, 3),
                base: Cell::new(gpt.params.as_ptr() as usize),
                log: log.clone(),
            };
            let mut dp = DataParallel::new(&twin, &gpt, 3);
            dp.release_params(&mut gpt.params);
            let released = gpt.params.clone();
            dp.zero_grad(&mut gpt);
            let run = format!("prefetch {prefetch} checkpointing {ckpt} keep {keep}");
            // This rank's pieces of the sum over the two (equal) ranks, each
            // micro-step's sum added to the step's.
            let mut want = vec![0.0; dp.plan.shard_len];
            let mut piece = want.clone();
            for _ in 0..micro {
                plain.zero_grad();
                let loss = plain.forward(&x, &y, b, t);
                plain.backward_hooked(&mut NoHooks);
                dp.plan.pack_shard(0, &plain.grads, &mut piece);
                want.iter_mut().zip(&piece).for_each(|(w, g)| *w += 2.0 * g);
                for pass in [Pass::Forward, Pass::Backward] {
                    let mut hooks = Logged(dp.sharded(&twin, pass), log.clone());
                    hooks.0.prefetch = prefetch;
                    hooks.0.keep = match keep {
                        true => keep_whole(hooks.0.plan, pass, prefetch),
                        false => vec![],
                    };
                    if pass == Pass::Forward {
                        let got = gpt.forward_hooked(&x, &y, b, t, &mut hooks);
                        assert_eq!(got, loss, "{run}");
                    } else {
                        gpt.backward_hooked(&mut hooks);
                        hooks.0.finish(&mut gpt.grads);
                    }
                }
            }
            let same = dp.shard_grads() == &want[..];
            assert!(same, "this rank's summed pieces, {run}");
            assert!(gpt.grads.iter().all(|&g| g == 0.0), "gradients released");
            // Left whole after backward: the first block, `ln_f`, the embeddings,
            // given back by the update.
            let n = dp.plan.buckets.len();
            let mut whole = dp.whole.clone();
            whole.sort();
            assert_eq!(whole, if keep { vec![0, n - 2, n - 1] } else { vec![] });
            dp.release_whole(&mut gpt.params);
            assert!(gpt.params == released, "{run}");
            let log = log.borrow();
            let at_once = if prefetch { (2, 2) } else { (1, 1) };
            assert_eq!(most_at_once(&log, n), at_once, "{log:?}");
            // Every need waits for its bucket before the model reads it: arrived
            // (prefetched), gathered then, or kept whole since its last `done`.
            let (mut fetched_then, mut kept) = (0, 0);
            for (i, e) in log.iter().enumerate() {
                if let Event::Need(k) = *e {
                    let arrived = log[i + 1] == Event::GatherWait(k);
                    let fetched =
                        log[i + 1..i + 3] == [Event::GatherStart(k), Event::GatherWait(k)];
                    let last = log[..i].iter().rev().find(|e| match **e {
                        Event::Need(j) | Event::Done(j) | Event::Kept(j) => j == k,
                        _ => false,
                    });
                    let whole = last == Some(&Event::Kept(k));
                    assert!(arrived || fetched || whole, "{log:?}");
                    fetched_then += usize::from(fetched);
                    kept += usize::from(whole);
                }
            }
            let needs = log.iter().filter(|e| matches!(e, Event::Need(_))).count();
            assert_eq!(needs, micro * (2 + 2 * cfg.n_layer));
            // Kept: the last two blocks (one without prefetch) into each backward,
            // the first block, `ln_f` and the embeddings into the second
            // micro-step's forward.
            let into_backward = 1 + usize::from(prefetch);
            assert_eq!(kept, if keep { micro * into_backward + 3 } else { 0 });
            let gathers = log.iter().filter(|e| matches!(e, Event::GatherStart(_)));
            assert_eq!(gathers.count(), needs - kept, "no gather wasted: {log:?}");
            let first = match (prefetch, keep) {
                (true, true) => 1,          // the first forward's embeddings
                (true, false) => 2 * micro, // each pass's first bucket
                (false, _) => needs - kept,
            };
            assert_eq!(fetched_then, first, "{log:?}");
        }
    }

    /// [`Arrivals`], with its `need` calls logged.
    struct LoggedArrivals<'a>(Arrivals<'a>, Log);
    impl PassHooks for LoggedArrivals<'_> {
        fn need(&mut self, range: Range<usize>, params: &mut [f32]) {
            let b = self.0.plan.buckets.iter().position(|b| b.arena == range);
            self.1.borrow_mut().push(Event::Need(b.unwrap()));
            self.0.need(range, params);
        }
    }

    /// ZeRO-1 on rank 0 of two, the update's all-gathers completing only when waited
    /// for: they start in the forward's order (the embeddings, `ln_f`, block 0, 1,
    /// ...), the forward waits for each bucket right at its need and for none before,
    /// and computes the loss of the whole updated model, in f32 and in bf16 (the copy
    /// rounded bucket by bucket as they arrive).
    #[test]
    fn zero_1_forward_waits_for_each_bucket_of_the_update_just_before_reading_it() {
        let cfg = ModelConfig::tiny_for_tests(3, 0.0);
        let (b, t) = (2, 8);
        let x: Vec<u32> = (0..b * t).map(|i| (i * 7 % 50) as u32).collect();
        let y: Vec<i32> = (0..b * t).map(|i| (i * 3 % 50) as i32).collect();
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let mut plain = Gpt::new(cfg.clone(), b, t).unwrap();
            plain.init_gpt2(5);
            plain.set_dtype(dtype, &Backend::detect(None));
            let loss = plain.forward(&x, &y, b, t);
            // Before the gathers this rank holds its own updated pieces only.
            let mut gpt = Gpt::new(cfg.clone(), b, t).unwrap();
            gpt.set_dtype(dtype, &Backend::detect(None));
            let log = Log::default();
            let twin = Twin {
                full: plain.params.clone(),
                plan: GradPlan::new(&gpt.grad_buckets(), gpt.layout.len, 2, 0, 1),
                base: Cell::new(gpt.params.as_ptr() as usize),
                log: log.clone(),
            };
            let mut dp = DataParallel::new(&twin, &gpt, 1);
            for (k, _) in dp.plan.buckets.iter().enumerate() {
                let own = dp.plan.piece(k, 0);
                gpt.params[own.clone()].copy_from_slice(&plain.params[own]);
            }
            dp.start_param_gathers(&twin, &mut gpt.params);
            gpt.refresh_bf16_at_next_forward();
            let mut hooks = LoggedArrivals(
                Arrivals {
                    plan: &dp.plan,
                    arriving: &mut dp.arriving,
                    waited: &mut dp.gather,
                },
                log.clone(),
            );
            let got = gpt.forward_hooked(&x, &y, b, t, &mut hooks);
            assert_eq!(got, loss, "{dtype:?}");
            assert!(dp.arriving.is_empty() && gpt.params == plain.params);
            let log = log.borrow();
            let n = dp.plan.buckets.len();
            let starts: Vec<Event> = forward_order(n)
                .into_iter()
                .map(Event::GatherStart)
                .collect();
            assert_eq!(log[..n], starts[..], "{log:?}");
            assert_eq!(forward_order(n), [n - 1, 0, 3, 2, 1]);
            for (i, e) in log.iter().enumerate().skip(n) {
                match *e {
                    Event::Need(k) => assert_eq!(log[i + 1], Event::GatherWait(k), "{log:?}"),
                    Event::GatherWait(k) => assert_eq!(log[i - 1], Event::Need(k), "{log:?}"),
                    _ => panic!("{log:?}"),
                }
            }
            assert_eq!(log.len(), 3 * n, "{log:?}");
        }
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
