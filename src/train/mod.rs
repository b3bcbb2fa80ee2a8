//! The training loop: nanoGPT's train.py, step for step.
//!
//! ```text
//! for iter in start..=max_iters:
//!     every eval_interval: estimate train/val loss, checkpoint if val improved
//!     every eval_tasks_interval: score the eval_tasks (multiple-choice accuracy)
//!     for each micro-step: forward + backward on its rows of the global batch
//!     clip to grad_clip, AdamW step at lr(iter) (skipped if the loss or norm is
//!         not finite), log
//!     every ckpt_interval, or on SIGINT/SIGTERM: checkpoint (then stop, for a signal)
//! at the end: evaluate the final state (losses, tasks) unless iteration max_iters
//!     was evaluated, and checkpoint it unless this run already did
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

mod evaluate;
mod report;
mod save;
mod start;
mod tasks;

pub use evaluate::EvalLosses;
use evaluate::Evaluation;
use report::say;
use start::{Masks, Start};
use tasks::Tasks;

use crate::config::{InitFrom, TrainConfig};
use crate::data::{batch_offsets, Draw, Meta, TokenFile, Tokenizer};
use crate::dist::{self, Collective, CommReport, DataParallel, Single, StepSettings};
use crate::fault;
use crate::kernels::bf16::Backend;
use crate::kernels::dropout::mix64;
use crate::metrics::MetricsLog;
use crate::model::{lora, Gpt};
use crate::optim::{AdamW, LrSchedule};
use crate::progress::Progress;
use crate::shutdown::{self, StopSignal};
use anyhow::Result;
use std::borrow::Cow;
use std::path::PathBuf;
use std::time::Instant;

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
    /// The losses of the last evaluation, if any ran: of the final state, or of
    /// iteration `max_iters` (see `Trainer::finish`).
    pub last_eval: Option<EvalLosses>,
    pub final_train_loss: Option<f32>,
    /// The accuracies of the last scoring of `eval_tasks` (of the final state, or of
    /// iteration `max_iters`); empty without tasks.
    pub last_tasks: Vec<crate::tasks::TaskReport>,
    /// Set when a signal stopped the run: the signal and the checkpoint written.
    pub stopped: Option<(StopSignal, PathBuf)>,
    /// A resumed run that had already reached `max_iters`: nothing was trained or
    /// written.
    pub already_complete: bool,
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
    /// The kernel of the bf16 products (`bf16_kernel`), chosen at start-up.
    pub backend: Backend,
    pub model: Gpt,
    /// The optimizer; with `zero_stage` ≥ 1 on several ranks, this rank's shard.
    pub opt: AdamW,
    pub meta: Meta,
    /// The dataset's tokenizer (`meta`'s).
    tokenizer: Tokenizer,
    /// What checkpoints record of the data.
    dataset_record: crate::checkpoint::DatasetRecord,
    train: TokenFile,
    val: TokenFile,
    /// Instruction data: only the targets these masks mark are trained and scored.
    masks: Masks,
    /// The multiple-choice tasks scored during training (`eval_tasks`).
    tasks: Tasks,
    schedule: LrSchedule,
    pub iter_num: u64,
    pub best_val_loss: f32,
    /// Rank 0's metrics log (other ranks write nothing).
    metrics: Option<MetricsLog>,
    /// The ranks of the job ([`Single`] without MPI).
    comm: Box<dyn Collective>,
    /// Gradient reduction and sharded state, with more than one rank.
    dp: Option<DataParallel>,
    /// Rank 0's lock on `out_dir`: a second run writing it is refused while this one
    /// lasts (released when the trainer is dropped or the process ends).
    _out_dir_lock: Option<crate::fsutil::DirLock>,
    /// Finished earlier runs' final-state checkpoints, deleted at the first save.
    replace_at_first_save: Vec<PathBuf>,
    /// One micro-batch: B·T inputs and targets, B offsets.
    inputs: Vec<u32>,
    targets: Vec<i32>,
    offsets: Vec<usize>,
    /// The B windows of T+1 tokens read for a micro-batch.
    window: Vec<u32>,
    /// Rank 0: the GEMM peak MFU is against (GFLOP/s of one rank), and how many times
    /// it was probed again ([`report`]).
    peak_gflops: f64,
    peak_reprobes: u32,
    /// Steps skipped in a row for a non-finite loss or gradient norm.
    nonfinite_in_row: u64,
    /// The iteration this run's newest checkpoint resumes at (the same on every rank).
    saved_at: Option<u64>,
    /// The last optimizer step left `model.grads` zeroed (the fused AdamW pass), so the
    /// next step's micro-steps need not zero them again.
    grads_zeroed: bool,
}

impl Trainer {
    /// The trained model as one arena laid out by its base's layout, for sampling
    /// on this rank: [`Gpt::merged_params`] (with LoRA the base with the adapters
    /// merged in). Where the run gave the base's f32 linears back (LoRA in bf16:
    /// [`Gpt::release_frozen_linears`]), the base is loaded again from its source
    /// (which rank 0 always has) and checked against its fingerprint.
    pub fn merged_params(&self) -> Result<Cow<'_, [f32]>> {
        if !self.model.frozen().is_some_and(|f| f.released()) {
            return Ok(self.model.merged_params());
        }
        let base = self.base_again()?;
        Ok(Cow::Owned(self.merge_into(base)))
    }

    /// [`Trainer::merged_params`] on every rank (collective): a base given back is
    /// loaded again by rank 0 only and sent to the others, which may not have its
    /// files (they received it from rank 0 at start); rank 0's error on every rank.
    pub(super) fn merged_params_everywhere(&self) -> Result<Cow<'_, [f32]>> {
        if !self.model.frozen().is_some_and(|f| f.released()) {
            return Ok(self.model.merged_params());
        }
        let comm = &*self.comm;
        let loaded = (comm.rank() == 0).then(|| self.base_again());
        let mut base = dist::root_outcome(comm, loaded)?
            .unwrap_or_else(|| vec![0.0; self.model.base_layout().len]);
        comm.broadcast(&mut base, 0);
        Ok(Cow::Owned(self.merge_into(base)))
    }

    /// The frozen base of this LoRA run, loaded again from its source and checked
    /// against its fingerprint.
    fn base_again(&self) -> Result<Vec<f32>> {
        let state = &self.model.frozen().expect("a LoRA run").state;
        let base = crate::model_source::load_lora_base(state, self.model.config())?;
        crate::model_source::check_lora_base(state, &base, "this run")?;
        Ok(base)
    }

    /// `base` with this LoRA run's adapters merged in.
    fn merge_into(&self, mut base: Vec<f32>) -> Vec<f32> {
        let f = self.model.frozen().expect("a LoRA run");
        let config = &f.state.config;
        lora::merge_into(
            &mut base,
            &f.layout,
            &f.adapters,
            &self.model.params,
            config,
        );
        base
    }

    /// Resolves the data, builds or loads the model and opens the output directory.
    pub fn new(cfg: TrainConfig) -> Result<Trainer> {
        Trainer::with_collective(cfg, Box::new(Single))
    }

    /// [`Trainer::new`] as one rank of `comm`: rank 0 builds or loads the model and
    /// every rank starts from its weights.
    pub fn with_collective(cfg: TrainConfig, comm: Box<dyn Collective>) -> Result<Trainer> {
        let backend = Backend::detect(cfg.bf16_kernel_request());
        let Start {
            data,
            state,
            mut dp,
            out_dir_lock,
            replace_at_first_save,
        } = Start::new(&cfg, &*comm, &backend)?;
        if let Some(dp) = dp.as_mut() {
            // SAFETY: the trainer owns `comm` and the model as long as `dp`; it calls
            // `params_whole` before anything but `dp.forward` reads or writes
            // `model.params` (evaluation, checkpoints, the replica check, the fault
            // injection, the end of `run` and of `train_step`) and in its drop,
            // before its fields (`comm`, the model) are dropped.
            unsafe { dp.keep_gathers_in_flight(&state.model) };
        }
        let tasks = Tasks::load(&cfg, &*comm, &data.tokenizer, state.model.config())?;
        let root = comm.rank() == 0;
        // A resumed run drops the rows logged past its checkpoint (it runs them again);
        // an evaluation-only run changes nothing logged: every row stays, and its
        // evaluation is appended.
        let keep_rows_before = match cfg.eval_only {
            false => state.iter_num,
            true => u64::MAX,
        };
        let resume_from = (cfg.init() == InitFrom::Resume).then_some(keep_rows_before);
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
            true => crate::bench::gemm_peak_gflops_quick(cfg.dtype, &backend),
            false => 0.0,
        };
        Ok(Trainer {
            inputs: vec![0; bt],
            targets: vec![0; bt],
            offsets: vec![0; cfg.batch_size],
            window: vec![0; cfg.batch_size * (cfg.block_size + 1)],
            peak_gflops,
            peak_reprobes: 0,
            nonfinite_in_row: 0,
            saved_at: None,
            grads_zeroed: false,
            cfg,
            backend,
            model: state.model,
            opt: state.opt,
            meta: data.meta,
            tokenizer: data.tokenizer,
            dataset_record: data.record,
            train: data.train,
            val: data.val,
            masks: data.masks,
            tasks,
            schedule,
            iter_num: state.iter_num,
            best_val_loss: state.best_val_loss,
            metrics,
            comm,
            dp,
            _out_dir_lock: out_dir_lock,
            replace_at_first_save,
        })
    }

    /// The dataset's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// This process's rank (0 without MPI).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Every rank waits here until rank 0 arrives (a no-op on one process): call it
    /// after rank 0's final output (the quick start's sample can take a while), so no
    /// rank enters `MPI_Finalize` and its grace period while rank 0 still works.
    pub fn wait_for_root(&self) {
        self.comm.barrier_patient();
    }

    /// The GEMM peak (GFLOP/s, this rank's threads) of the run's precision that MFU is
    /// reported against; measured on rank 0 when the trainer starts.
    pub fn peak_gflops(&self) -> f64 {
        self.peak_gflops
    }

    /// Ranks in the job.
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
        if self.iter_num > self.cfg.max_iters && !self.cfg.eval_only {
            // A finished run resumed again (a scheduler's requeue loop): nothing to do.
            return Ok(TrainOutcome {
                out_dir: self.cfg.out_dir.clone(),
                iter_num: self.iter_num,
                best_val_loss: self.best_val_loss,
                last_eval: None,
                final_train_loss: None,
                last_tasks: Vec::new(),
                stopped: None,
                already_complete: true,
            });
        }
        let root = self.rank() == 0;
        let mut progress = root.then(|| Progress::new(self.iter_num, self.cfg.max_iters + 1));
        // The iteration and losses of the last evaluation.
        let mut last_eval: Option<Evaluation> = None;
        // The iteration and accuracies of the last scoring of the tasks.
        let mut last_tasks: Option<(u64, Vec<crate::tasks::TaskReport>)> = None;
        let mut final_train_loss = None;
        let mut stopped = None;
        loop {
            let iter = self.iter_num;
            let due = self.cfg.eval_interval > 0 && iter.is_multiple_of(self.cfg.eval_interval);
            if due || self.cfg.eval_only {
                last_eval = Some(self.evaluate_and_log(iter, &mut progress)?);
            }
            if self.tasks.due(iter) || (self.cfg.eval_only && !self.tasks.is_empty()) {
                last_tasks = Some((iter, self.score_tasks(iter, &mut progress)?));
            }
            if self.cfg.eval_only {
                break;
            }
            let start = Instant::now();
            let step = self.step(iter)?;
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
                self.finish(&mut last_eval, &mut last_tasks, &mut progress)?;
                break;
            }
        }
        if let Some(p) = &mut progress {
            p.finish();
        }
        self.params_whole();
        self.write_comm_report()?;
        Ok(TrainOutcome {
            out_dir: self.cfg.out_dir.clone(),
            iter_num: self.iter_num,
            best_val_loss: self.best_val_loss,
            last_eval: last_eval.map(|e| e.losses),
            final_train_loss,
            last_tasks: last_tasks.map(|(_, reports)| reports).unwrap_or_default(),
            stopped,
            already_complete: false,
        })
    }

    /// One optimizer step at iteration `iter`: this rank's micro-steps' forward and
    /// backward, the gradient reduction across ranks, clipping, AdamW (skipped when
    /// the loss or gradient norm is not finite). The stop request of a signal is
    /// sampled here, and with several ranks agreed on with the loss's all-reduce.
    pub fn train_step(&mut self, iter: u64) -> Result<StepOutcome> {
        let step = self.step(iter);
        self.params_whole();
        step
    }

    /// The parameters whole on this rank (ZeRO-1/2: the update's all-gathers, left
    /// in flight for the next forward, waited for; see
    /// `DataParallel::keep_gathers_in_flight`). Every reader or writer of
    /// `model.params` between steps calls it first.
    pub fn params_whole(&mut self) {
        if let Some(dp) = &mut self.dp {
            dp.params_whole(&mut self.model);
        }
    }

    /// [`Trainer::train_step`], leaving ZeRO-1/2's all-gathers of the updated
    /// parameters in flight for the next forward.
    fn step(&mut self, iter: u64) -> Result<StepOutcome> {
        let mut loss = self.micro_steps(iter)?;
        fault::during_step(iter);
        if fault::nan_grad(iter) {
            match self.dp {
                None => self.model.grads[self.model.layout.tensors[0].range().start] = f32::NAN,
                Some(_) => loss = f32::NAN,
            }
        }
        let requested = shutdown::requested();
        let (loss, stop) = match &mut self.dp {
            Some(dp) => dp.global_loss_and_stop(&*self.comm, loss, requested),
            None => (loss, requested),
        };
        let settings = StepSettings {
            lr: self.schedule.lr_at(iter),
            grad_clip: self.cfg.grad_clip as f32,
        };
        let (dp, comm) = (self.dp.as_mut(), &*self.comm);
        let (model, opt) = (&mut self.model, &mut self.opt);
        let update = dist::clip_and_step(dp, comm, model, opt, settings, loss.is_finite());
        if let Some(dp) = &mut self.dp {
            if (iter + 1).is_multiple_of(REPLICA_CHECK_EVERY) {
                dp.params_whole(&mut self.model);
                dp.check_replicas(&*self.comm, &self.model.params, iter + 1)?;
            }
        }
        let nan_param = fault::nan_param(iter);
        if nan_param {
            self.params_whole();
            self.model.params[self.model.layout.tensors[0].range().start] = f32::NAN;
        }
        // A skipped or sharded step left the bf16 copy and the gradients as they were.
        if nan_param || !update.fused {
            match self.dp.as_ref().is_some_and(DataParallel::params_arriving) {
                // Rounded bucket by bucket as the next forward receives them.
                true => self.model.refresh_bf16_at_next_forward(),
                false => self.model.sync_bf16_weights(),
            }
        }
        self.grads_zeroed = update.fused;
        Ok(StepOutcome {
            loss,
            lr: settings.lr,
            grad_norm: update.grad_norm,
            applied: update.applied,
            stop,
        })
    }

    /// This rank's micro-steps of iteration `iter`: forward and backward, the
    /// gradients accumulated (and with several ranks, reduced during the last
    /// backward). Returns this rank's part of the mean loss.
    fn micro_steps(&mut self, iter: u64) -> Result<f32> {
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
        match &mut self.dp {
            _ if std::mem::take(&mut self.grads_zeroed) => {}
            Some(dp) => dp.zero_grad(&mut self.model),
            None => self.model.zero_grad(),
        }
        // With a mask: the mean over the trained targets of the whole global batch,
        // whatever its split into micro-steps and ranks (every rank counts them all).
        let trained = match &self.masks.train {
            Some(mask) => Some(mask.count_trained(&global, t)?.max(1) as f64),
            None => None,
        };
        let mut loss = 0.0;
        for (k, rows) in global.chunks_exact(b).enumerate() {
            if !mine.contains(&k) {
                continue;
            }
            let (inputs, targets) = (&mut self.inputs, &mut self.targets);
            (self.train).read_batch(rows, t, &mut self.window, inputs, targets)?;
            // This micro-step's weight in the step's mean: 1/accum, or with a mask its
            // share of the trained targets (the classifier divides by its own count).
            let mut share = None;
            if let (Some(mask), Some(trained)) = (&self.masks.train, trained) {
                let kept = mask.apply(rows, t, &mut self.targets)?;
                let weight = (kept as f64 / trained) as f32;
                self.model.set_grad_scale(weight);
                share = Some(weight);
            }
            self.model
                .set_dropout_seed(dropout_seed(self.cfg.seed, iter, k));
            let batch = (&self.inputs[..], &self.targets[..]);
            let micro = match &mut self.dp {
                Some(dp) => dp.forward(&*self.comm, &mut self.model, batch, b, t),
                None => self.model.forward(batch.0, batch.1, b, t),
            };
            loss += match share {
                Some(weight) => micro * weight,
                None => micro / accum as f32,
            };
            match &mut self.dp {
                Some(dp) => dp.backward_reduce(&*self.comm, &mut self.model, k + 1 == mine.end),
                None => self.model.backward(),
            }
        }
        Ok(loss)
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        // Gathers in flight borrow `comm` and write `model.params`: completed before
        // either is dropped (after an error, too).
        self.params_whole();
    }
}

/// Seed of the dropout masks of micro-step `k` of iteration `iter`.
fn dropout_seed(seed: u64, iter: u64, k: usize) -> u64 {
    mix64(mix64(seed ^ 0x6472_6f70) ^ mix64(iter) ^ mix64(k as u64 + 1).rotate_left(17))
}
