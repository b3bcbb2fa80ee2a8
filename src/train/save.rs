//! Checkpoints of a run in progress: the best-val one, the interval ones (pruned
//! to `keep_last`), written by rank 0 with the AdamW moments gathered from every rank.

use super::report::say;
use super::Trainer;
use crate::checkpoint::{self, CheckpointState};
use crate::progress::Progress;
use anyhow::Result;
use std::path::{Path, PathBuf};

impl Trainer {
    /// After the last iteration (`max_iters`): the final state is evaluated, unless
    /// iteration `max_iters` was (nanoGPT's last evaluation, one step before the end)
    /// or evaluation is off (`eval_interval = 0`), so that the closing summary never
    /// reports older losses; and it is checkpointed unless this run just did. With
    /// `always_save_checkpoint` it goes to `ckpt.safetensors` (the newest state, as at
    /// every evaluation); without, `ckpt.safetensors` stays the best-val checkpoint and
    /// the final state goes to the interval checkpoint `ckpt-NNNNNN.safetensors`,
    /// which `init_from=resume` takes as the newest.
    pub(super) fn finish(
        &mut self,
        last_eval: &mut Option<(u64, f32, f32)>,
        progress: &mut Option<Progress>,
    ) -> Result<()> {
        let (end, max_iters) = (self.iter_num, self.cfg.max_iters);
        let stale = last_eval.is_none_or(|(iter, _, _)| iter < max_iters);
        if self.cfg.eval_interval > 0 && stale {
            *last_eval = Some(self.evaluate_and_log(end, progress)?);
        }
        if self.saved_at == Some(end) {
            return Ok(());
        }
        let path = match self.cfg.always_save_checkpoint {
            true => {
                self.save_checkpoint(end)?;
                checkpoint::checkpoint_path(&self.cfg.out_dir)
            }
            false => self.save_latest(end)?,
        };
        let line = format!("saving the final state to {}", path.display());
        say(progress, &line);
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
                crate::errln!("warning: {e:#}");
            }
        }
        Ok(path)
    }

    /// Writes the state from which iteration `iter` (not yet trained) resumes to
    /// `path`. With several ranks every rank calls it (sharded AdamW moments are
    /// gathered to rank 0) and rank 0 writes: the checkpoint does not depend on the
    /// world size. A failed write leaves the previous file intact and is an error.
    pub fn save_checkpoint_to(&mut self, path: &Path, iter: u64) -> Result<()> {
        self.saved_at = Some(iter);
        let gathered = match &mut self.dp {
            Some(dp) => {
                dp.gather_params(&*self.comm, &mut self.model.params);
                dp.gather_moments(&*self.comm, &self.opt)
            }
            None => None,
        };
        if self.rank() != 0 {
            return Ok(());
        }
        let state = CheckpointState {
            model: self.model.config().clone(),
            train_config: serde_json::to_value(&self.cfg)?,
            iter_num: iter,
            best_val_loss: self.best_val_loss,
            adam_step: self.opt.step,
            tokenizer: serde_json::to_value(&self.meta)?,
            world_size: self.world_size(),
            lora: self.model.frozen().map(|f| f.state.clone()),
            dataset: Some(self.dataset_record.clone()),
        };
        let moments = match &gathered {
            Some((m, v)) => Some((m.as_slice(), v.as_slice())),
            None => Some((self.opt.m.as_slice(), self.opt.v.as_slice())),
        };
        let (layout, params) = (&self.model.layout, &self.model.params);
        let saved = checkpoint::save_to(path, &state, layout, params, moments);
        if let Some(dp) = &self.dp {
            dp.release_params(&mut self.model.params);
        }
        saved?;
        for old in std::mem::take(&mut self.replace_at_first_save) {
            if old != path {
                // Best effort: a leftover is refused by the next fresh start, not lost.
                let _ = std::fs::remove_file(old.with_extension("json"));
                let _ = std::fs::remove_file(&old);
            }
        }
        Ok(())
    }
}
