//! Evaluation during training: nanoGPT's `estimate_loss` over both splits, and
//! what follows it (the metrics row, the loss plot, the best-val checkpoint).

use super::report::say;
use super::Trainer;
use crate::checkpoint;
use crate::data::{self, Draw};
use crate::fault;
use crate::metrics::{plot_loss, Row};
use crate::progress::Progress;
use anyhow::Result;

/// What one evaluation measured: the mean loss of each split, NaN when no window of
/// the split holds a trained target (instruction data whose masks train nothing
/// there), and with masks, how many of the split's windows held none and were skipped.
#[derive(Clone, Copy, Debug)]
pub struct EvalLosses {
    pub train: f32,
    pub val: f32,
    /// Windows without a trained target, then windows evaluated, of (train, val).
    pub empty: [u64; 2],
    pub windows: [u64; 2],
}

/// An evaluation and the iteration it was of (the state before that iteration's
/// step).
#[derive(Clone, Copy, Debug)]
pub struct Evaluation {
    pub iter: u64,
    pub losses: EvalLosses,
}

impl EvalLosses {
    /// `train loss 1.2345, val loss 1.3456`, a split that had nothing to score as
    /// `n/a`, with the skipped windows counted.
    pub fn describe(&self) -> String {
        let mut line = String::new();
        for (i, (name, loss)) in [("train", self.train), ("val", self.val)]
            .into_iter()
            .enumerate()
        {
            if i > 0 {
                line.push_str(", ");
            }
            match loss.is_nan() {
                true => line.push_str(&format!("{name} loss n/a")),
                false => line.push_str(&format!("{name} loss {loss:.4}")),
            }
        }
        let skipped: Vec<String> = ["train", "val"]
            .iter()
            .zip(self.empty.iter().zip(self.windows))
            .filter(|(_, (&empty, _))| empty > 0)
            .map(|(name, (empty, windows))| {
                format!("{empty} of {windows} {name} windows hold no trained token: skipped")
            })
            .collect();
        if !skipped.is_empty() {
            line.push_str(&format!(" ({})", skipped.join("; ")));
        }
        line
    }
}

impl Trainer {
    /// nanoGPT's `estimate_loss`: the mean loss of `eval_iters` batches of each split,
    /// without dropout. The batches are the same at every evaluation; with several
    /// ranks, each evaluates every W-th of them and the sums are added up. With loss
    /// masks (instruction data), the mean is over the trained targets of all batches;
    /// windows without one are skipped and counted, and a split with none at all has
    /// no loss (NaN), which is never the best.
    pub fn evaluate(&mut self) -> Result<EvalLosses> {
        let (b, t) = (self.cfg.batch_size, self.cfg.block_size);
        let (rank, world) = (self.rank() as u64, self.world_size());
        self.params_whole();
        self.model.set_training(false);
        // Per split: loss sums, then (with masks) the trained targets they are over,
        // the windows without one, and the windows evaluated.
        let mut totals = [0.0f64; 8];
        let draws = [Draw::EvalTrain, Draw::EvalVal];
        for (split, draw) in draws.into_iter().enumerate() {
            let (file, mask) = match draw {
                Draw::EvalVal => (&self.val, &self.masks.val),
                _ => (&self.train, &self.masks.train),
            };
            // ZeRO-3: a forward is collective (it gathers the weights), so every rank
            // runs as many; the batches past `eval_iters` are not counted.
            let n = match &self.dp {
                Some(dp) if dp.shards_weights() => self.cfg.eval_iters.div_ceil(world as u64),
                _ => 0,
            };
            let rounds = self.cfg.eval_iters.max(n * world as u64);
            for k in (rank..rounds).step_by(world) {
                let counted = k < self.cfg.eval_iters;
                let offsets = &mut self.offsets;
                data::loader::batch_offsets_into(self.cfg.seed, draw, k, file.len(), t, offsets)?;
                let (inputs, targets) = (&mut self.inputs, &mut self.targets);
                file.read_batch(offsets, t, &mut self.window, inputs, targets)?;
                let kept = match mask {
                    Some(mask) => Some(mask.apply(offsets, t, &mut self.targets)?),
                    None => None,
                };
                let batch = (&self.inputs[..], &self.targets[..]);
                let mean = match &mut self.dp {
                    Some(dp) => dp.forward(&*self.comm, &mut self.model, batch, b, t),
                    None => self.model.forward(batch.0, batch.1, b, t),
                } as f64;
                match kept {
                    _ if !counted => {}
                    // Weighted by the batch's trained targets: a mean over all of them.
                    Some(kept) => {
                        totals[split] += mean * kept as f64;
                        totals[2 + split] += kept as f64;
                        let rows = self.targets[..b * t].chunks_exact(t);
                        let empty = rows.filter(|r| r.iter().all(|&x| x < 0)).count();
                        totals[4 + split] += empty as f64;
                        totals[6 + split] += b as f64;
                    }
                    None => totals[split] += mean,
                }
                fault::during_eval(self.iter_num);
            }
        }
        self.comm.all_reduce_sum_f64(&mut totals);
        self.model.set_training(true);
        if let Some(dp) = &mut self.dp {
            dp.check_replicas(&*self.comm, &self.model.params, self.iter_num)?;
        }
        let counts = |i: usize| [totals[i] as u64, totals[i + 1] as u64];
        if self.masks.train.is_some() {
            let mean = |sum: f64, count: f64| match count > 0.0 {
                true => (sum / count) as f32,
                false => f32::NAN,
            };
            return Ok(EvalLosses {
                train: mean(totals[0], totals[2]),
                val: mean(totals[1], totals[3]),
                empty: counts(4),
                windows: counts(6),
            });
        }
        let n = self.cfg.eval_iters.max(1) as f64;
        Ok(EvalLosses {
            train: (totals[0] / n) as f32,
            val: (totals[1] / n) as f32,
            empty: [0; 2],
            windows: counts(6),
        })
    }

    /// Evaluates the model as it is at iteration `iter` (not yet trained), says so,
    /// and logs, plots and checkpoints as [`Trainer::after_eval`] does.
    pub(super) fn evaluate_and_log(
        &mut self,
        iter: u64,
        progress: &mut Option<Progress>,
    ) -> Result<Evaluation> {
        let losses = self.evaluate()?;
        say(progress, &format!("step {iter}: {}", losses.describe()));
        self.after_eval(iter, losses.train, losses.val, progress)?;
        Ok(Evaluation { iter, losses })
    }

    pub(super) fn after_eval(
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
        // An evaluation-only run changes no checkpoint (its state is the checkpoint's).
        let wanted = improved || self.cfg.always_save_checkpoint;
        if iter > 0 && wanted && !self.cfg.eval_only {
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
}
