//! Checkpoints of a run in progress: the best-val one, the interval ones (pruned
//! to `keep_last`), written by rank 0 with the AdamW moments gathered from every rank.

use super::Trainer;
use crate::checkpoint::{self, CheckpointState};
use anyhow::Result;
use std::path::{Path, PathBuf};

impl Trainer {
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
        let gathered = match &mut self.dp {
            Some(dp) => dp.gather_moments(&*self.comm, &self.opt),
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
        };
        let moments = match &gathered {
            Some((m, v)) => Some((m.as_slice(), v.as_slice())),
            None => Some((self.opt.m.as_slice(), self.opt.v.as_slice())),
        };
        let (layout, params) = (&self.model.layout, &self.model.params);
        checkpoint::save_to(path, &state, layout, params, moments)
    }
}
