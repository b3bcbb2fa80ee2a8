//! The training loop: nanoGPT's train.py, step for step.
//!
//! ```text
//! for iter in start..=max_iters:
//!     every eval_interval: estimate train/val loss, checkpoint if val improved
//!     for each micro-step: forward + backward on its rows of the global batch
//!     clip to grad_clip, AdamW step at lr(iter), log
//! ```
//! The global batch of an iteration is a pure function of `(seed, iter)`, and the
//! dropout masks of `(seed, iter, micro-step)`, so a resumed run repeats exactly what
//! an uninterrupted one would have done.

use crate::checkpoint::{self, Checkpoint, CheckpointState};
use crate::config::{Dtype, InitFrom, TrainConfig};
use crate::data::{self, batch_offsets, fill_batch, Draw, Meta, Split, TokenFile};
use crate::kernels::dropout::mix64;
use crate::metrics::{plot_loss, MetricsLog, Row};
use crate::model::{Gpt, ModelConfig};
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::progress::Progress;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::Instant;

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
}

/// A run in progress: the model, its optimizer, the data and the bookkeeping.
pub struct Trainer {
    pub cfg: TrainConfig,
    pub model: Gpt,
    pub opt: AdamW,
    pub meta: Meta,
    train: TokenFile,
    val: TokenFile,
    schedule: LrSchedule,
    pub iter_num: u64,
    pub best_val_loss: f32,
    metrics: MetricsLog,
    /// One micro-batch: B·T inputs and targets, B offsets.
    inputs: Vec<u32>,
    targets: Vec<i32>,
    offsets: Vec<usize>,
    peak_gflops: f64,
}

impl Trainer {
    /// Resolves the data, builds or loads the model and opens the output directory.
    pub fn new(cfg: TrainConfig) -> Result<Trainer> {
        if cfg.dtype == Dtype::Bfloat16 {
            bail!("dtype = \"bfloat16\" is not available yet; use dtype=float32");
        }
        let data_dir = data::resolve_dataset(&cfg.dataset)?;
        let meta = Meta::load(&data_dir)?;
        let train = TokenFile::open_split(&data_dir, Split::Train, &meta)?;
        let val = TokenFile::open_split(&data_dir, Split::Val, &meta)?;
        for file in [&train, &val] {
            file.check_block_size(cfg.block_size)?;
            file.check_vocab(meta.vocab_size)?;
        }
        prepare_out_dir(&cfg)?;
        let (model, opt, iter_num, best_val_loss) = build_model(&cfg, &meta)?;
        let resume_from = (cfg.init() == InitFrom::Resume).then_some(iter_num);
        let metrics = MetricsLog::open(&cfg.out_dir, resume_from)?;
        let schedule = LrSchedule {
            learning_rate: cfg.learning_rate as f32,
            min_lr: cfg.min_lr as f32,
            warmup_iters: cfg.warmup_iters,
            lr_decay_iters: cfg.lr_decay_iters,
            decay_lr: cfg.decay_lr,
        };
        let bt = cfg.batch_size * cfg.block_size;
        Ok(Trainer {
            inputs: vec![0; bt],
            targets: vec![0; bt],
            offsets: vec![0; cfg.batch_size],
            peak_gflops: crate::bench::gemm_peak_gflops_quick(),
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
        })
    }

    /// Runs to `max_iters` (nanoGPT trains iterations `start..=max_iters`, evaluating
    /// at every multiple of `eval_interval`, the last one included).
    pub fn run(&mut self) -> Result<TrainOutcome> {
        let mut progress = Progress::new(self.iter_num, self.cfg.max_iters + 1);
        let mut last_eval = None;
        let mut final_train_loss = None;
        loop {
            let iter = self.iter_num;
            if self.cfg.eval_interval > 0 && iter.is_multiple_of(self.cfg.eval_interval) {
                let (train_loss, val_loss) = self.evaluate()?;
                last_eval = Some((train_loss, val_loss));
                progress.println(&format!(
                    "step {iter}: train loss {train_loss:.4}, val loss {val_loss:.4}"
                ));
                self.after_eval(iter, train_loss, val_loss, &mut progress)?;
            }
            if self.cfg.eval_only {
                break;
            }
            let start = Instant::now();
            let (loss, lr, grad_norm) = self.train_step(iter)?;
            let secs = start.elapsed().as_secs_f64();
            final_train_loss = Some(loss);
            self.log_step(iter, loss, lr, grad_norm, secs, &mut progress)?;
            self.iter_num += 1;
            if self.iter_num > self.cfg.max_iters {
                break;
            }
        }
        progress.finish();
        Ok(TrainOutcome {
            out_dir: self.cfg.out_dir.clone(),
            iter_num: self.iter_num,
            best_val_loss: self.best_val_loss,
            last_eval,
            final_train_loss,
        })
    }

    /// One optimizer step at iteration `iter`: every micro-step's forward and
    /// backward, clipping, AdamW. Returns (mean loss, lr, pre-clip gradient norm).
    pub fn train_step(&mut self, iter: u64) -> Result<(f32, f32, f32)> {
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
        self.model.set_training(true);
        self.model.set_grad_scale(1.0 / accum as f32);
        self.model.zero_grad();
        let mut loss = 0.0f32;
        for (k, rows) in global.chunks_exact(b).enumerate() {
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
            self.model.backward();
        }
        let grad_norm = if self.cfg.grad_clip > 0.0 {
            clip_grad_norm(&mut self.model.grads, self.cfg.grad_clip as f32)
        } else {
            crate::optim::grad_sq_sum(&self.model.grads).sqrt() as f32
        };
        let lr = self.schedule.lr_at(iter);
        self.opt.step(&mut self.model.params, &self.model.grads, lr);
        Ok((loss, lr, grad_norm))
    }

    /// nanoGPT's `estimate_loss`: the mean loss of `eval_iters` batches of each split,
    /// without dropout. The batches are the same at every evaluation.
    pub fn evaluate(&mut self) -> Result<(f32, f32)> {
        let (b, t) = (self.cfg.batch_size, self.cfg.block_size);
        self.model.set_training(false);
        let mut means = [0.0f32; 2];
        for (mean, draw) in means.iter_mut().zip([Draw::EvalTrain, Draw::EvalVal]) {
            let file = if draw == Draw::EvalVal {
                &self.val
            } else {
                &self.train
            };
            let mut total = 0.0f64;
            for k in 0..self.cfg.eval_iters {
                let offsets = &mut self.offsets;
                data::loader::batch_offsets_into(self.cfg.seed, draw, k, file.len(), t, offsets)?;
                fill_batch(
                    file.tokens(),
                    offsets,
                    t,
                    &mut self.inputs,
                    &mut self.targets,
                )?;
                total += self.model.forward(&self.inputs, &self.targets, b, t) as f64;
            }
            *mean = (total / self.cfg.eval_iters.max(1) as f64) as f32;
        }
        self.model.set_training(true);
        Ok((means[0], means[1]))
    }

    fn after_eval(
        &mut self,
        iter: u64,
        train_loss: f32,
        val_loss: f32,
        progress: &mut Progress,
    ) -> Result<()> {
        self.metrics.append(Row::Eval {
            iter,
            train_loss,
            val_loss,
        })?;
        if let Err(e) = plot_loss(self.metrics.rows(), &self.cfg.out_dir.join("loss.png")) {
            progress.println(&format!("warning: loss.png not updated: {e:#}"));
        }
        let improved = val_loss < self.best_val_loss;
        if improved {
            self.best_val_loss = val_loss;
        }
        if iter > 0 && (improved || self.cfg.always_save_checkpoint) {
            self.save_checkpoint(iter)?;
            progress.println(&format!(
                "saving checkpoint to {}",
                checkpoint::checkpoint_path(&self.cfg.out_dir).display()
            ));
        }
        Ok(())
    }

    /// Writes the state from which iteration `iter` (not yet trained) resumes.
    pub fn save_checkpoint(&self, iter: u64) -> Result<()> {
        let state = CheckpointState {
            model: self.model.config.clone(),
            train_config: serde_json::to_value(&self.cfg)?,
            iter_num: iter,
            best_val_loss: self.best_val_loss,
            adam_step: self.opt.step,
            tokenizer: serde_json::to_value(&self.meta)?,
            world_size: 1,
        };
        let moments = Some((self.opt.m.as_slice(), self.opt.v.as_slice()));
        checkpoint::save(
            &self.cfg.out_dir,
            &state,
            &self.model.layout,
            &self.model.params,
            moments,
        )
    }

    fn log_step(
        &mut self,
        iter: u64,
        loss: f32,
        lr: f32,
        grad_norm: f32,
        secs: f64,
        progress: &mut Progress,
    ) -> Result<()> {
        let tokens = self.cfg.tokens_per_iter() as f64;
        let tokens_per_sec = tokens / secs;
        let flops = self.model.config.flops_per_token(self.cfg.block_size) * tokens_per_sec;
        let mfu = flops / (self.peak_gflops * 1e9);
        let ms = secs * 1e3;
        progress.step(iter, loss);
        if self.cfg.log_interval > 0 && iter.is_multiple_of(self.cfg.log_interval) {
            self.metrics.append(Row::Step {
                iter,
                loss,
                lr,
                ms,
                tokens_per_sec,
                mfu: Some(mfu),
                grad_norm: Some(grad_norm),
            })?;
            progress.log(&format!(
                "iter {iter}: loss {loss:.4}, lr {lr:.2e}, time {ms:.1}ms, {tokens_per_sec:.0} tok/s, mfu {:.1}%",
                mfu * 100.0
            ));
        }
        Ok(())
    }
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
    })
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
            let ckpt = Checkpoint::open(&cfg.out_dir)?;
            let state = &ckpt.state;
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
        InitFrom::Pretrained(name) => bail!(
            "init_from={name}: loading pretrained weights is not available yet; use init_from=scratch or resume"
        ),
    }
}

/// The architecture comes from the checkpoint; the config may not contradict it.
fn check_resume_compatible(cfg: &TrainConfig, meta: &Meta, state: &CheckpointState) -> Result<()> {
    let m = &state.model;
    let pairs = [
        ("n_layer", cfg.n_layer, m.n_layer),
        ("n_head", cfg.n_head, m.n_head),
        ("n_embd", cfg.n_embd, m.n_embd),
        (
            "vocab_size (from the dataset's meta.json)",
            meta.vocab_size,
            m.vocab_size,
        ),
    ];
    for (key, want, have) in pairs {
        if want != have {
            bail!(
                "cannot resume from {}: the checkpoint has {key} = {have} but the config says {want}; \
                 use the run's original settings",
                cfg.out_dir.display()
            );
        }
    }
    if cfg.block_size > m.block_size || cfg.bias != m.bias {
        bail!(
            "cannot resume from {}: the checkpoint has block_size {} and bias {}, the config block_size {} and bias {}",
            cfg.out_dir.display(),
            m.block_size,
            m.bias,
            cfg.block_size,
            cfg.bias
        );
    }
    Ok(())
}
