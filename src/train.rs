//! The training loop: nanoGPT's train.py, step for step.
//!
//! ```text
//! for iter in start..=max_iters:
//!     every eval_interval: estimate train/val loss, checkpoint if val improved
//!     for each micro-step: forward + backward on its rows of the global batch
//!     clip to grad_clip, AdamW step at lr(iter) (skipped if the loss or norm is
//!         not finite), log
//!     every ckpt_interval, or on SIGINT/SIGTERM: checkpoint (then stop, for a signal)
//! ```
//! The global batch of an iteration is a pure function of `(seed, iter)`, and the
//! dropout masks of `(seed, iter, micro-step)`, so a resumed run repeats exactly what
//! an uninterrupted one would have done.
//!
//! Data parallel ([`crate::dist`]): with W ranks, rank r runs micro-steps
//! `r·A/W .. (r+1)·A/W` of the same global batch (A = `gradient_accumulation_steps`,
//! the global count), the gradients are summed across ranks once per step (started
//! layer by layer during the last micro-step's backward), and the loss, gradient
//! norm and evaluation are global, so any number of ranks follows the same
//! trajectory as one process. Only rank 0 writes files and progress.

use crate::checkpoint::{self, Checkpoint, CheckpointState};
use crate::config::{InitFrom, TrainConfig};
use crate::data::{self, batch_offsets, fill_batch, Draw, Meta, Split, TokenFile};
use crate::dist::{Collective, CommReport, DataParallel, Single};
use crate::fault;
use crate::kernels::dropout::mix64;
use crate::metrics::{plot_loss, MetricsLog, Row};
use crate::model::{Gpt, ModelConfig};
use crate::optim::{clip_factor, grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::progress::Progress;
use crate::shutdown::{self, StopSignal};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// With several ranks, check that all hold the same weights this often (and at
/// every evaluation).
const REPLICA_CHECK_EVERY: u64 = 100;

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct TrainOutcome {
    pub out_dir: PathBuf,
    /// The last iteration trained (or evaluated, with `eval_only`).
    pub iter_num: u64,
    pub best_val_loss: f32,
    /// The last evaluation's losses, if any ran.
    pub last_eval: Option<(f32, f32)>,
    pub final_train_loss: Option<f32>,
    /// Set when a signal stopped the run: the signal and the checkpoint written.
    pub stopped: Option<(StopSignal, PathBuf)>,
}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    /// Mean loss over all ranks' micro-steps.
    pub loss: f32,
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// False when the loss or the norm was not finite and the update was skipped.
    pub applied: bool,
    /// A signal asked some rank to stop (the same answer on every rank).
    pub stop: Option<StopSignal>,
}

/// A run in progress: the model, its optimizer, the data and the bookkeeping.
pub struct Trainer {
    pub cfg: TrainConfig,
    pub model: Gpt,
    /// The optimizer; with `zero_stage = 1` on several ranks, this rank's shard.
    pub opt: AdamW,
    pub meta: Meta,
    train: TokenFile,
    val: TokenFile,
    schedule: LrSchedule,
    pub iter_num: u64,
    pub best_val_loss: f32,
    /// Rank 0's metrics log (other ranks write nothing).
    metrics: Option<MetricsLog>,
    /// The ranks of the job ([`Single`] without MPI).
    comm: Box<dyn Collective>,
    /// Gradient reduction and sharded state, with more than one rank.
    dp: Option<DataParallel>,
    /// One micro-batch: B·T inputs and targets, B offsets.
    inputs: Vec<u32>,
    targets: Vec<i32>,
    offsets: Vec<usize>,
    peak_gflops: f64,
    /// Steps skipped in a row for a non-finite loss or gradient norm.
    nonfinite_in_row: u64,
}

impl Trainer {
    /// Resolves the data, builds or loads the model and opens the output directory.
    pub fn new(cfg: TrainConfig) -> Result<Trainer> {
        Trainer::with_collective(cfg, Box::new(Single))
    }

    /// [`Trainer::new`] as one rank of `comm`: rank 0 builds or loads the model and
    /// every rank starts from its weights.
    pub fn with_collective(cfg: TrainConfig, comm: Box<dyn Collective>) -> Result<Trainer> {
        cfg.check_world_size(comm.world_size())?;
        comm.set_timeout(Duration::from_secs_f64(cfg.collective_timeout_s));
        let root = comm.rank() == 0;
        // Rank 0 prepares a built-in dataset first, so ranks sharing its directory
        // find it ready (ranks on other hosts prepare their own copy).
        if !root {
            comm.barrier_patient();
        }
        let (meta, train, val) = open_data(&cfg)?;
        if root {
            prepare_out_dir(&cfg)?;
            comm.barrier_patient();
        }
        let (mut model, opt, iter_num, best_val_loss, dp) = if comm.world_size() == 1 {
            let (model, opt, iter_num, best) = build_model(&cfg, &meta)?;
            (model, opt, iter_num, best, None)
        } else {
            let (model, opt, iter_num, best, dp) = start_distributed(&cfg, &meta, &*comm)?;
            (model, opt, iter_num, best, Some(dp))
        };
        // Master weights and optimizer state stay f32; with bfloat16 the model makes
        // its bf16 weight copy here and after every optimizer step.
        model.set_dtype(cfg.dtype);
        let resume_from = (cfg.init() == InitFrom::Resume).then_some(iter_num);
        let metrics = match root {
            true => Some(MetricsLog::open(&cfg.out_dir, resume_from)?),
            false => None,
        };
        let schedule = LrSchedule {
            learning_rate: cfg.learning_rate as f32,
            min_lr: cfg.min_lr as f32,
            warmup_iters: cfg.warmup_iters,
            lr_decay_iters: cfg.lr_decay_iters,
            decay_lr: cfg.decay_lr,
        };
        let bt = cfg.batch_size * cfg.block_size;
        let peak_gflops = match root {
            true => crate::bench::gemm_peak_gflops_quick(),
            false => 0.0,
        };
        Ok(Trainer {
            inputs: vec![0; bt],
            targets: vec![0; bt],
            offsets: vec![0; cfg.batch_size],
            peak_gflops,
            nonfinite_in_row: 0,
            cfg,
            model,
            opt,
            meta,
            train,
            val,
            schedule,
            iter_num,
            best_val_loss,
            metrics,
            comm,
            dp,
        })
    }

    /// This process's rank (0 without MPI).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the job.
    /// Every rank waits here until rank 0 arrives (a no-op on one process): call it
    /// after rank 0's final output (the quick start's sample can take a while), so no
    /// rank enters `MPI_Finalize` and its grace period while rank 0 still works.
    pub fn wait_for_root(&self) {
        self.comm.barrier_patient();
    }

    /// The GEMM peak (GFLOP/s, this rank's threads) that MFU is reported against;
    /// measured on rank 0 when the trainer starts.
    pub fn peak_gflops(&self) -> f64 {
        self.peak_gflops
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Communication figures so far (with more than one rank).
    pub fn comm_report(&self) -> Option<CommReport> {
        let dp = self.dp.as_ref()?;
        Some(dp.report(&*self.comm, self.cfg.tokens_per_iter()))
    }

    /// Runs to `max_iters` (nanoGPT trains iterations `start..=max_iters`, evaluating
    /// at every multiple of `eval_interval`, the last one included).
    pub fn run(&mut self) -> Result<TrainOutcome> {
        let root = self.rank() == 0;
        let mut progress = root.then(|| Progress::new(self.iter_num, self.cfg.max_iters + 1));
        let mut last_eval = None;
        let mut final_train_loss = None;
        let mut stopped = None;
        loop {
            let iter = self.iter_num;
            if self.cfg.eval_interval > 0 && iter.is_multiple_of(self.cfg.eval_interval) {
                let (train_loss, val_loss) = self.evaluate()?;
                last_eval = Some((train_loss, val_loss));
                say(
                    &mut progress,
                    &format!("step {iter}: train loss {train_loss:.4}, val loss {val_loss:.4}"),
                );
                self.after_eval(iter, train_loss, val_loss, &mut progress)?;
            }
            if self.cfg.eval_only {
                break;
            }
            let start = Instant::now();
            let step = self.train_step(iter)?;
            let elapsed = start.elapsed();
            if let Some(dp) = &mut self.dp {
                dp.record_step(elapsed);
            }
            final_train_loss = Some(step.loss);
            let secs = elapsed.as_secs_f64();
            self.log_step(
                iter,
                step.loss,
                step.lr,
                step.grad_norm,
                secs,
                &mut progress,
            )?;
            self.count_nonfinite(iter, &step, &mut progress)?;
            self.iter_num += 1;
            if let Some(signal) = step.stop {
                stopped = Some((signal, self.save_latest(self.iter_num)?));
                break;
            }
            let every = self.cfg.ckpt_interval;
            if every > 0 && self.iter_num.is_multiple_of(every) {
                let path = self.save_latest(self.iter_num)?;
                say(
                    &mut progress,
                    &format!("saving checkpoint to {}", path.display()),
                );
            }
            if self.iter_num > self.cfg.max_iters {
                break;
            }
        }
        if let Some(p) = &mut progress {
            p.finish();
        }
        self.write_comm_report()?;
        Ok(TrainOutcome {
            out_dir: self.cfg.out_dir.clone(),
            iter_num: self.iter_num,
            best_val_loss: self.best_val_loss,
            last_eval,
            final_train_loss,
            stopped,
        })
    }

    /// After a step: a warning for a skipped one, and an error once
    /// `max_nonfinite_steps` were skipped in a row.
    fn count_nonfinite(
        &mut self,
        iter: u64,
        step: &StepOutcome,
        progress: &mut Option<Progress>,
    ) -> Result<()> {
        if step.applied {
            self.nonfinite_in_row = 0;
            return Ok(());
        }
        self.nonfinite_in_row += 1;
        let (n, max) = (self.nonfinite_in_row, self.cfg.max_nonfinite_steps);
        let what = format!("loss {}, gradient norm {}", step.loss, step.grad_norm);
        if n >= max {
            bail!(
                "{n} optimizer steps in a row (iterations {}..={iter}) had a non-finite loss or \
                 gradient norm ({what}), so training stopped (max_nonfinite_steps = {max}); the \
                 checkpoints hold only finite values: lower learning_rate, set grad_clip or check \
                 the data, then continue with init_from=resume",
                iter + 1 - n
            );
        }
        say(
            progress,
            &format!(
                "warning: iteration {iter}: {what} is not finite; update skipped ({n} in a row, \
                 the run stops at max_nonfinite_steps = {max})"
            ),
        );
        Ok(())
    }

    /// One optimizer step at iteration `iter`: this rank's micro-steps' forward and
    /// backward, the gradient reduction across ranks, clipping, AdamW (skipped when
    /// the loss or gradient norm is not finite). The stop request of a signal is
    /// sampled here, and with several ranks agreed on with the loss's all-reduce.
    pub fn train_step(&mut self, iter: u64) -> Result<StepOutcome> {
        let accum = self.cfg.gradient_accumulation_steps;
        let (b, t) = (self.cfg.batch_size, self.cfg.block_size);
        let global = batch_offsets(
            self.cfg.seed,
            Draw::Train,
            iter,
            b * accum,
            self.train.len(),
            t,
        )?;
        // This rank's share of the global batch's micro-steps.
        let per_rank = accum / self.world_size();
        let mine = self.rank() * per_rank..(self.rank() + 1) * per_rank;
        self.model.set_training(true);
        self.model.set_grad_scale(1.0 / accum as f32);
        self.model.zero_grad();
        let mut loss = 0.0f32;
        for (k, rows) in global.chunks_exact(b).enumerate() {
            if !mine.contains(&k) {
                continue;
            }
            fill_batch(
                self.train.tokens(),
                rows,
                t,
                &mut self.inputs,
                &mut self.targets,
            )?;
            self.model
                .set_dropout_seed(dropout_seed(self.cfg.seed, iter, k));
            loss += self.model.forward(&self.inputs, &self.targets, b, t) / accum as f32;
            match &mut self.dp {
                // The last micro-step: reduce each layer as backward finishes it.
                Some(dp) if k + 1 == mine.end => dp.backward_reduce(&*self.comm, &mut self.model),
                _ => self.model.backward(),
            }
        }
        fault::during_step(iter);
        if fault::nan_grad(iter) {
            match self.dp {
                None => self.model.grads[self.model.layout.tensors[0].range().start] = f32::NAN,
                Some(_) => loss = f32::NAN,
            }
        }
        let lr = self.schedule.lr_at(iter);
        let grad_clip = self.cfg.grad_clip as f32;
        let (grad_norm, applied, stop) = match &mut self.dp {
            None => {
                let norm = grad_norm(&self.model.grads);
                let applied = loss.is_finite() && norm.is_finite();
                if applied {
                    let factor = clip_factor(norm, grad_clip);
                    let (params, grads) = (&mut self.model.params, &self.model.grads);
                    self.opt.step_scaled(params, grads, lr, factor);
                }
                (norm, applied, shutdown::requested())
            }
            Some(dp) => {
                let (global_loss, stop) =
                    dp.global_loss_and_stop(&*self.comm, loss, shutdown::requested());
                loss = global_loss;
                let (comm, model) = (&*self.comm, &mut self.model);
                let opt = &mut self.opt;
                let (norm, applied) =
                    dp.clip_and_step(comm, model, opt, grad_clip, lr, loss.is_finite());
                if (iter + 1).is_multiple_of(REPLICA_CHECK_EVERY) {
                    dp.check_replicas(comm, &model.params, iter + 1)?;
                }
                (norm, applied, stop)
            }
        };
        if fault::nan_param(iter) {
            self.model.params[self.model.layout.tensors[0].range().start] = f32::NAN;
        }
        self.model.sync_bf16_weights();
        Ok(StepOutcome {
            loss,
            lr,
            grad_norm,
            applied,
            stop,
        })
    }

    /// nanoGPT's `estimate_loss`: the mean loss of `eval_iters` batches of each split,
    /// without dropout. The batches are the same at every evaluation; with several
    /// ranks, each evaluates every W-th of them and the sums are added up.
    pub fn evaluate(&mut self) -> Result<(f32, f32)> {
        let (b, t) = (self.cfg.batch_size, self.cfg.block_size);
        let (rank, world) = (self.rank() as u64, self.world_size());
        self.model.set_training(false);
        let mut totals = [0.0f64; 2];
        for (total, draw) in totals.iter_mut().zip([Draw::EvalTrain, Draw::EvalVal]) {
            let file = if draw == Draw::EvalVal {
                &self.val
            } else {
                &self.train
            };
            for k in (rank..self.cfg.eval_iters).step_by(world) {
                let offsets = &mut self.offsets;
                data::loader::batch_offsets_into(self.cfg.seed, draw, k, file.len(), t, offsets)?;
                fill_batch(
                    file.tokens(),
                    offsets,
                    t,
                    &mut self.inputs,
                    &mut self.targets,
                )?;
                *total += self.model.forward(&self.inputs, &self.targets, b, t) as f64;
                fault::during_eval(self.iter_num);
            }
        }
        self.comm.all_reduce_sum_f64(&mut totals);
        self.model.set_training(true);
        if let Some(dp) = &mut self.dp {
            dp.check_replicas(&*self.comm, &self.model.params, self.iter_num)?;
        }
        let n = self.cfg.eval_iters.max(1) as f64;
        Ok(((totals[0] / n) as f32, (totals[1] / n) as f32))
    }

    fn after_eval(
        &mut self,
        iter: u64,
        train_loss: f32,
        val_loss: f32,
        progress: &mut Option<Progress>,
    ) -> Result<()> {
        if let Some(metrics) = &mut self.metrics {
            metrics.append(Row::Eval {
                iter,
                train_loss,
                val_loss,
            })?;
            if let Err(e) = plot_loss(metrics.rows(), &self.cfg.out_dir.join("loss.png")) {
                say(progress, &format!("warning: loss.png not updated: {e:#}"));
            }
        }
        // The losses are global, so every rank takes the same branch here.
        let improved = val_loss < self.best_val_loss;
        if improved {
            self.best_val_loss = val_loss;
        }
        if iter > 0 && (improved || self.cfg.always_save_checkpoint) {
            self.save_checkpoint(iter)?;
            say(
                progress,
                &format!(
                    "saving checkpoint to {}",
                    checkpoint::checkpoint_path(&self.cfg.out_dir).display()
                ),
            );
        }
        Ok(())
    }

    /// Writes `out_dir/ckpt.safetensors`, the state from which iteration `iter`
    /// (not yet trained) resumes. See [`Trainer::save_checkpoint_to`].
    pub fn save_checkpoint(&mut self, iter: u64) -> Result<()> {
        let path = checkpoint::checkpoint_path(&self.cfg.out_dir);
        self.save_checkpoint_to(&path, iter)
    }

    /// Writes the interval checkpoint `ckpt-NNNNNN.safetensors` for iteration
    /// `iter`, then deletes interval checkpoints beyond the newest `keep_last`.
    pub fn save_latest(&mut self, iter: u64) -> Result<PathBuf> {
        let path = checkpoint::interval_path(&self.cfg.out_dir, iter);
        self.save_checkpoint_to(&path, iter)?;
        if self.rank() == 0 {
            // The new checkpoint is in place: failing to delete old ones is not fatal.
            if let Err(e) =
                checkpoint::prune_interval_checkpoints(&self.cfg.out_dir, self.cfg.keep_last)
            {
                eprintln!("warning: {e:#}");
            }
        }
        Ok(path)
    }

    /// Writes the state from which iteration `iter` (not yet trained) resumes to
    /// `path`. With several ranks every rank calls it (sharded AdamW moments are
    /// gathered to rank 0) and rank 0 writes: the checkpoint does not depend on the
    /// world size. A failed write leaves the previous file intact and is an error.
    pub fn save_checkpoint_to(&mut self, path: &std::path::Path, iter: u64) -> Result<()> {
        let gathered = match &mut self.dp {
            Some(dp) => dp.gather_moments(&*self.comm, &self.opt),
            None => None,
        };
        if self.rank() != 0 {
            return Ok(());
        }
        let state = CheckpointState {
            model: self.model.config.clone(),
            train_config: serde_json::to_value(&self.cfg)?,
            iter_num: iter,
            best_val_loss: self.best_val_loss,
            adam_step: self.opt.step,
            tokenizer: serde_json::to_value(&self.meta)?,
            world_size: self.world_size(),
        };
        let moments = match &gathered {
            Some((m, v)) => Some((m.as_slice(), v.as_slice())),
            None => Some((self.opt.m.as_slice(), self.opt.v.as_slice())),
        };
        let (layout, params) = (&self.model.layout, &self.model.params);
        checkpoint::save_to(path, &state, layout, params, moments)
    }

    fn log_step(
        &mut self,
        iter: u64,
        loss: f32,
        lr: f32,
        grad_norm: f32,
        secs: f64,
        progress: &mut Option<Progress>,
    ) -> Result<()> {
        let (Some(metrics), Some(progress)) = (&mut self.metrics, progress) else {
            return Ok(());
        };
        // Tokens of the whole job (all ranks) per second.
        let tokens = self.cfg.tokens_per_iter() as f64;
        let tokens_per_sec = tokens / secs;
        let flops = self.model.config.flops_per_token(self.cfg.block_size) * tokens_per_sec;
        let mfu = flops / (self.peak_gflops * 1e9 * self.comm.world_size() as f64);
        let ms = secs * 1e3;
        progress.step(iter, loss);
        if self.cfg.log_interval > 0 && iter.is_multiple_of(self.cfg.log_interval) {
            metrics.append(Row::Step {
                iter,
                loss,
                lr,
                ms,
                tokens_per_sec,
                mfu: Some(mfu),
                grad_norm: Some(grad_norm),
            })?;
            // Above 100 % only when the peak measured at start was depressed by
            // other work on the machine: say so rather than print it bare.
            let busy = if mfu > 1.0 {
                " (the peak measured at start was low: machine busy)"
            } else {
                ""
            };
            progress.log(&format!(
                "iter {iter}: loss {loss:.4}, lr {lr:.2e}, time {ms:.1}ms, {tokens_per_sec:.0} tok/s, mfu {:.1}%{busy}",
                mfu * 100.0
            ));
        }
        Ok(())
    }

    /// Rank 0: `out_dir/comm.json` and a summary line (with more than one rank).
    fn write_comm_report(&self) -> Result<()> {
        let Some(report) = self.comm_report().filter(|_| self.rank() == 0) else {
            return Ok(());
        };
        let path = self.cfg.out_dir.join("comm.json");
        let text = serde_json::to_string_pretty(&report)?;
        crate::fsutil::write_bytes_atomic(&path, text)?;
        println!(
            "{} ranks: {:.1} ms/step, of which computing {:.1}, waiting for the gradient \
             reduction {:.1} ({:.0}% of its {:.1} ms hidden behind backward), other \
             collectives {:.1}; {:.0} tokens/s per rank",
            report.world_size,
            report.step_ms,
            report.compute_ms,
            report.exposed_reduce_ms,
            report.hidden_fraction * 100.0,
            report.reduce_alone_ms,
            report.other_comm_ms,
            report.tokens_per_sec_per_rank
        );
        Ok(())
    }
}

/// A line above rank 0's progress bar; nothing on other ranks.
fn say(progress: &mut Option<Progress>, line: &str) {
    if let Some(p) = progress {
        p.println(line);
    }
}

/// The dataset of `cfg` and its two splits, checked against the config.
fn open_data(cfg: &TrainConfig) -> Result<(Meta, TokenFile, TokenFile)> {
    let data_dir = data::find_or_prepare_dataset(&cfg.dataset)?;
    let meta = Meta::load(&data_dir)?;
    let train = TokenFile::open_split(&data_dir, Split::Train, &meta)?;
    let val = TokenFile::open_split(&data_dir, Split::Val, &meta)?;
    for file in [&train, &val] {
        file.check_block_size(cfg.block_size)?;
        file.check_vocab(meta.vocab_size)?;
    }
    Ok((meta, train, val))
}

/// What rank 0 tells the others before sending the weights.
#[derive(Serialize, Deserialize)]
struct StartHeader {
    model: ModelConfig,
    adam: AdamWConfig,
    iter_num: u64,
    /// None: no evaluation yet (infinite).
    best_val_loss: Option<f32>,
    adam_step: u64,
}

/// Several ranks: rank 0 builds or loads the model (any `init_from`); every rank
/// then holds its weights (and AdamW state), checked by checksum.
fn start_distributed(
    cfg: &TrainConfig,
    meta: &Meta,
    comm: &dyn Collective,
) -> Result<(Gpt, AdamW, u64, f32, DataParallel)> {
    let built = match comm.rank() {
        0 => Some(build_model(cfg, meta)?),
        _ => None,
    };
    let mut bytes = Vec::new();
    if let Some((model, opt, iter_num, best)) = &built {
        bytes = serde_json::to_vec(&StartHeader {
            model: model.config.clone(),
            adam: opt.config,
            iter_num: *iter_num,
            best_val_loss: best.is_finite().then_some(*best),
            adam_step: opt.step,
        })?;
    }
    comm.broadcast_bytes(&mut bytes, 0);
    let header: StartHeader =
        serde_json::from_slice(&bytes).context("internal error: bad start header from rank 0")?;
    let (mut model, root_opt) = match built {
        Some((model, opt, ..)) => (model, Some(opt)),
        None => (
            Gpt::new(header.model.clone(), cfg.batch_size, cfg.block_size)?,
            None,
        ),
    };
    let mut dp = DataParallel::new(comm, &model, cfg.zero_stage);
    let moments = header.adam_step > 0;
    let opt = dp.start(
        comm,
        &mut model,
        root_opt,
        header.adam,
        header.adam_step,
        moments,
        header.iter_num,
    )?;
    dp.calibrate(comm, &model);
    let best = header.best_val_loss.unwrap_or(f32::INFINITY);
    Ok((model, opt, header.iter_num, best, dp))
}

/// Seed of the dropout masks of micro-step `k` of iteration `iter`.
fn dropout_seed(seed: u64, iter: u64, k: usize) -> u64 {
    mix64(mix64(seed ^ 0x6472_6f70) ^ mix64(iter) ^ mix64(k as u64 + 1).rotate_left(17))
}

fn prepare_out_dir(cfg: &TrainConfig) -> Result<()> {
    let dir = &cfg.out_dir;
    if dir.exists() && !dir.is_dir() {
        bail!(
            "out_dir {} is a file, not a directory; choose another out_dir",
            dir.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| {
        format!(
            "cannot create out_dir {}; check permissions or choose another out_dir",
            dir.display()
        )
    })?;
    if cfg.init() != InitFrom::Resume {
        check_fresh_start(dir)?;
    }
    Ok(())
}

/// A run that does not resume, in an `out_dir` with an earlier run's checkpoints.
/// Its best-val checkpoint is replaced at the first save, as in nanoGPT (a warning
/// says so); its interval checkpoints would outrank the new run's when resuming, so
/// they are refused rather than silently deleted.
fn check_fresh_start(dir: &Path) -> Result<()> {
    let old = checkpoint::interval_checkpoints(dir)?;
    if let Some((iter, path)) = old.last() {
        bail!(
            "out_dir {} holds {} interval checkpoint(s) of an earlier run (the newest, {}, \
             resumes at iteration {iter}); continue that run with init_from=resume, or \
             choose another out_dir, or delete them to start over",
            dir.display(),
            old.len(),
            path.display()
        );
    }
    let best = checkpoint::checkpoint_path(dir);
    if best.exists() {
        eprintln!(
            "warning: {} belongs to an earlier run and will be replaced at this run's first \
             checkpoint; stop now and use init_from=resume or another out_dir to keep it",
            best.display()
        );
    }
    Ok(())
}

/// The model and optimizer the run starts from, with its first iteration and best
/// val loss so far.
fn build_model(cfg: &TrainConfig, meta: &Meta) -> Result<(Gpt, AdamW, u64, f32)> {
    let adam_cfg = AdamWConfig {
        beta1: cfg.beta1 as f32,
        beta2: cfg.beta2 as f32,
        eps: 1e-8,
        weight_decay: cfg.weight_decay as f32,
    };
    let (b, t) = (cfg.batch_size, cfg.block_size);
    match cfg.init() {
        InitFrom::Scratch => {
            let model_cfg = ModelConfig {
                vocab_size: meta.vocab_size,
                block_size: cfg.block_size,
                n_layer: cfg.n_layer,
                n_head: cfg.n_head,
                n_embd: cfg.n_embd,
                bias: cfg.bias,
                dropout: cfg.dropout,
            };
            let mut model = Gpt::new(model_cfg, b, t)?;
            model.init_gpt2(cfg.seed);
            let opt = AdamW::new(&model.layout, adam_cfg);
            Ok((model, opt, 0, f32::INFINITY))
        }
        InitFrom::Resume => {
            let latest = Checkpoint::open_latest(&cfg.out_dir)?;
            for note in &latest.notes {
                eprintln!("note: {note}");
            }
            let ckpt = latest.checkpoint;
            let state = &ckpt.state;
            println!(
                "resuming from {} at iteration {}",
                ckpt.path().display(),
                state.iter_num
            );
            check_resume_compatible(cfg, meta, state)?;
            let model_cfg = ModelConfig {
                dropout: cfg.dropout,
                ..state.model.clone()
            };
            let mut model = Gpt::new(model_cfg, b, t)?;
            ckpt.load_params(&model.layout, &mut model.params)?;
            let mut opt = AdamW::new(&model.layout, adam_cfg);
            if ckpt.load_moments(&model.layout, &mut opt.m, &mut opt.v)? {
                opt.step = state.adam_step;
            }
            Ok((model, opt, state.iter_num, state.best_val_loss))
        }
        InitFrom::Pretrained(name) => {
            let model = load_pretrained(cfg, meta, &name)?;
            let opt = AdamW::new(&model.layout, adam_cfg);
            Ok((model, opt, 0, f32::INFINITY))
        }
    }
}

/// The architecture comes from the checkpoint (the config is told where it differs);
/// the data and the window length must fit it.
fn check_resume_compatible(cfg: &TrainConfig, meta: &Meta, state: &CheckpointState) -> Result<()> {
    let m = &state.model;
    let out = cfg.out_dir.display();
    if meta.vocab_size != m.vocab_size {
        bail!(
            "cannot resume from {out}: the checkpoint's vocabulary has {} tokens but the dataset's \
             meta.json says {}; resume on the dataset the run was trained on",
            m.vocab_size,
            meta.vocab_size
        );
    }
    if cfg.block_size > m.block_size {
        bail!(
            "cannot resume from {out}: block_size {} is longer than the checkpoint's {}; use block_size <= {}",
            cfg.block_size,
            m.block_size,
            m.block_size
        );
    }
    // As in nanoGPT, the checkpoint's architecture wins over the config's.
    let ignored = [
        ("n_layer", cfg.n_layer, m.n_layer),
        ("n_head", cfg.n_head, m.n_head),
        ("n_embd", cfg.n_embd, m.n_embd),
        ("bias", cfg.bias as usize, m.bias as usize),
    ];
    for (key, config, checkpoint) in ignored {
        if config != checkpoint {
            eprintln!("note: resuming with the checkpoint's {key} = {checkpoint} (the config's {config} is ignored)");
        }
    }
    Ok(())
}

/// The pretrained model `name` (see [`crate::hf`]) for fine-tuning: its architecture
/// wins over the config's (which is told when it differs), `block_size` crops the
/// position table, `dropout` applies. The dataset must be GPT-2 tokens.
fn load_pretrained(cfg: &TrainConfig, meta: &Meta, name: &str) -> Result<Gpt> {
    let pretrained = crate::hf::Pretrained::open(name)
        .with_context(|| format!("init_from={name}: cannot load the pretrained model"))?;
    let model_cfg = pretrained.model_config(Some(cfg.block_size), cfg.dropout)?;
    if meta.tokenizer != data::TokenizerKind::Gpt2 || meta.vocab_size > model_cfg.vocab_size {
        bail!(
            "init_from={name} is a GPT-2 with {} tokens, but dataset {} holds {} tokens (vocabulary {}); \
             fine-tuning needs text prepared with GPT-2's tokenizer: `nanogpt prepare SOURCE --out DIR \
             --tokenizer gpt2`, then dataset=DIR",
            model_cfg.vocab_size,
            cfg.dataset,
            meta.tokenizer,
            meta.vocab_size
        );
    }
    let ignored: Vec<String> = [
        ("n_layer", cfg.n_layer, model_cfg.n_layer),
        ("n_head", cfg.n_head, model_cfg.n_head),
        ("n_embd", cfg.n_embd, model_cfg.n_embd),
        ("bias", cfg.bias as usize, 1),
    ]
    .iter()
    .filter(|(_, mine, theirs)| mine != theirs)
    .map(|(key, mine, theirs)| match *key {
        "bias" => format!("bias = {} (it has biases)", *mine != 0),
        _ => format!("{key} = {mine} (it has {theirs})"),
    })
    .collect();
    if !ignored.is_empty() {
        eprintln!(
            "note: the architecture comes from {}: ignoring {} from the config",
            pretrained.location.display(),
            ignored.join(", ")
        );
    }
    let (b, t) = (cfg.batch_size, cfg.block_size);
    let mut model = Gpt::new(model_cfg, b, t)?;
    pretrained.load_params(&model.layout, &model.config, &mut model.params)?;
    Ok(model)
}
