//! Checkpoints of a run in progress: the best-val one, the interval ones (pruned
//! to `keep_last`), written by rank 0 tensor by tensor, with what ZeRO shards
//! gathered from every rank one tensor at a time.

use super::evaluate::Evaluation;
use super::report::say;
use super::Trainer;
use crate::checkpoint::{self, Array, CheckpointState, Entry, TensorSource};
use crate::dist::{save_buffer_len, Collective, DataParallel};
use crate::model::ParamLayout;
use crate::optim::AdamW;
use crate::progress::Progress;
use anyhow::Result;
use std::path::{Path, PathBuf};

impl Trainer {
    /// After the last iteration (`max_iters`): the final state is evaluated, unless
    /// iteration `max_iters` was (nanoGPT's last evaluation, one step before the end)
    /// or evaluation is off (`eval_interval = 0`), so that the closing summary never
    /// reports older losses; the tasks likewise (unless `max_iters` scored them); and it is checkpointed unless this run just did. With
    /// `always_save_checkpoint` it goes to `ckpt.safetensors` (the newest state, as at
    /// every evaluation); without, `ckpt.safetensors` stays the best-val checkpoint and
    /// the final state goes to the interval checkpoint `ckpt-NNNNNN.safetensors`,
    /// which `init_from=resume` takes as the newest.
    pub(super) fn finish(
        &mut self,
        last_eval: &mut Option<Evaluation>,
        last_tasks: &mut Option<(u64, Vec<crate::tasks::TaskReport>)>,
        progress: &mut Option<Progress>,
    ) -> Result<()> {
        let (end, max_iters) = (self.iter_num, self.cfg.max_iters);
        let stale = last_eval.is_none_or(|e| e.iter < max_iters);
        if self.cfg.eval_interval > 0 && stale {
            *last_eval = Some(self.evaluate_and_log(end, progress)?);
        }
        let stale = last_tasks
            .as_ref()
            .is_none_or(|(iter, _)| *iter < max_iters);
        if !self.tasks.is_empty() && stale {
            *last_tasks = Some((end, self.score_tasks(end, progress)?));
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
    /// With a model's own tokenizer, its files beside the checkpoints (written when
    /// `out_dir` does not hold them yet), so that `sample`, `chat`, `eval` and `export`
    /// find the tokenizer the checkpoint names by hash.
    fn save_tokenizer(&self) -> Result<()> {
        if let Some(hf) = self.tokenizer.hf() {
            if !hf.files().is_in(&self.cfg.out_dir) {
                hf.files().write_into(&self.cfg.out_dir)?;
            }
        }
        Ok(())
    }

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
    /// `path`. With several ranks every rank calls it and rank 0 writes, one tensor
    /// at a time: what ZeRO shards (the AdamW moments at stages 1-3, the weights at
    /// stage 3) is gathered tensor by tensor into one buffer of the largest tensor's
    /// size ([`save_buffer_len`]) while rank 0 streams the file, so the checkpoint does
    /// not depend on the world size and saving costs no whole-model gather. A failed
    /// write leaves the previous file intact and is an error.
    pub fn save_checkpoint_to(&mut self, path: &Path, iter: u64) -> Result<()> {
        self.params_whole();
        self.saved_at = Some(iter);
        let (rank, world) = (self.rank(), self.world_size());
        let layout = &self.model.layout;
        let stage = self.dp.as_ref().map_or(0, |dp| dp.plan.zero_stage);
        let mut source = Gathered {
            comm: &*self.comm,
            dp: self.dp.as_ref(),
            layout,
            params: &self.model.params,
            opt: &self.opt,
            buf: vec![0.0; save_buffer_len(layout, stage, world, rank)],
            root: rank == 0,
        };
        if rank != 0 {
            for entry in checkpoint::file_order(layout, true) {
                source.fetch(entry);
            }
            return Ok(());
        }
        let state = CheckpointState {
            model: self.model.config().clone(),
            train_config: serde_json::to_value(&self.cfg)?,
            iter_num: iter,
            best_val_loss: self.best_val_loss,
            adam_step: self.opt.step,
            tokenizer: serde_json::to_value(&self.meta)?,
            world_size: world,
            lora: self.model.frozen().map(|f| f.state.clone()),
            dataset: Some(self.dataset_record.clone()),
            bf16_kernel: (self.cfg.dtype == crate::model::Dtype::Bfloat16)
                .then(|| self.backend.kernel().name().to_string()),
            ab_switches: crate::tuning::get().changed(),
        };
        // A lost rank reported while this is written names it too.
        let _saving = crate::dist::heartbeat::saving(path, iter);
        checkpoint::save_streamed(path, &state, layout, true, &mut source)?;
        self.save_tokenizer()?;
        crate::dist::heartbeat::checkpoint_written(path, iter);
        for old in std::mem::take(&mut self.replace_at_first_save) {
            if old != path {
                // Best effort: a leftover is refused by the next fresh start, not lost.
                let _ = std::fs::remove_file(old.with_extension("json"));
                let _ = std::fs::remove_file(&old);
            }
        }
        Ok(())
    }

    /// After [`Trainer::run`], when rank 0 `wants` them (the quick start's closing
    /// sample; the other ranks follow rank 0's choice): the whole final weights in
    /// rank 0's `model.params`. Collective at ZeRO-3, where each rank holds only its
    /// pieces: rank 0 then holds the whole weights again, `len − shard` floats more
    /// (only the quick start samples). The run is over and its checkpoint written, so
    /// every rank first frees its AdamW moments (`2 · shard`): up to 3 ranks that and
    /// the released layers make room for the weights within the run's plan
    /// (`plan::closing_gather_fits`). A no-op otherwise.
    pub fn gather_final_weights(&mut self, wants: bool) {
        let Some(dp) = self.dp.as_mut().filter(|dp| dp.shards_weights()) else {
            return;
        };
        let mut choice = vec![wants as u8];
        self.comm.broadcast_bytes(&mut choice, 0);
        if choice == [1] {
            self.opt.m = Vec::new();
            self.opt.v = Vec::new();
            dp.gather_params(&*self.comm, &mut self.model.params);
        }
    }
}

/// A checkpoint's tensors as this rank sees them: rank 0's own where it holds them
/// whole, else gathered from every rank's pieces into `buf` (rank 0) or sent from
/// this rank's (the others).
struct Gathered<'a> {
    comm: &'a dyn Collective,
    dp: Option<&'a DataParallel>,
    layout: &'a ParamLayout,
    params: &'a [f32],
    opt: &'a AdamW,
    /// Rank 0: one tensor, the largest's size when anything is gathered.
    buf: Vec<f32>,
    root: bool,
}

impl TensorSource for Gathered<'_> {
    fn fetch(&mut self, entry: Entry) -> Option<&[f32]> {
        let range = self.layout.tensors[entry.tensor].range();
        let local = match entry.array {
            Array::Params => self.params,
            Array::M => &self.opt.m[..],
            Array::V => &self.opt.v[..],
        };
        let sharded = self.dp.filter(|dp| match entry.array {
            Array::Params => dp.shards_weights(),
            Array::M | Array::V => dp.plan.zero_stage >= 1,
        });
        let Some(dp) = sharded else {
            return self.root.then(|| &local[range]);
        };
        let n = if self.root { range.len() } else { 0 };
        let in_arena = entry.array == Array::Params;
        dp.gather_range(self.comm, local, in_arena, range, &mut self.buf[..n]);
        self.root.then(|| &self.buf[..n])
    }
}
