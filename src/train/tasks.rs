//! Multiple-choice accuracy during training (`eval_tasks`): every
//! `eval_tasks_interval` iterations (by default with each loss evaluation), at the
//! end, and in an evaluation-only run, each task is scored as `nanogpt eval --task`
//! scores it: the same scorer, sized for the same questions, each rank scoring every
//! W-th question and the counts summed. So the accuracies logged at an iteration are
//! those of `eval --task` (with `--limit` = `eval_tasks_limit`) on the checkpoint of
//! that iteration, on any number of ranks.
//!
//! Rank 0 reads the task files and sends them to every rank (or the error, which every
//! rank then returns, so that none waits for the others); every rank encodes them with
//! the dataset's tokenizer.

use super::report::say;
use super::Trainer;
use crate::config::TrainConfig;
use crate::data::Tokenizer;
use crate::dist::Collective;
use crate::metrics::{plot_loss, Row};
use crate::model::ModelConfig;
use crate::progress::Progress;
use crate::tasks::{self, Encoded, Scorer, Tally, TaskReport};
use anyhow::{anyhow, Context, Result};
use std::path::Path;

/// The tasks of a run, encoded once.
#[derive(Default)]
pub(super) struct Tasks {
    tasks: Vec<Task>,
    /// Score every this many iterations (0: never).
    interval: u64,
}

struct Task {
    /// The name the results are reported under (`hellaswag`, `choice/NAME`).
    name: String,
    questions: Vec<Encoded>,
}

impl Tasks {
    /// Reads and encodes `cfg.eval_tasks` (their first `eval_tasks_limit` questions)
    /// for a model of `config`.
    pub(super) fn load(
        cfg: &TrainConfig,
        comm: &dyn Collective,
        tokenizer: &Tokenizer,
        config: &ModelConfig,
    ) -> Result<Tasks> {
        let limit = (cfg.eval_tasks_limit > 0).then_some(cfg.eval_tasks_limit as usize);
        let mut tasks = Vec::new();
        for spec in cfg.tasks()? {
            let bytes = read_on_root(&spec.path, comm)?;
            let questions = tasks::load_task(&spec, &bytes, limit, tokenizer, config)
                .context("`eval_tasks`")?;
            tasks.push(Task {
                name: spec.name(),
                questions,
            });
        }
        Ok(Tasks {
            tasks,
            interval: cfg.tasks_interval(),
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Whether the tasks are scored before iteration `iter`.
    pub(super) fn due(&self, iter: u64) -> bool {
        !self.is_empty() && self.interval > 0 && iter.is_multiple_of(self.interval)
    }
}

/// Rank 0's bytes of the file at `path`, on every rank; rank 0's error on every rank.
fn read_on_root(path: &Path, comm: &dyn Collective) -> Result<Vec<u8>> {
    let read = (comm.rank() == 0).then(|| {
        crate::fsutil::check_regular_file(path, "the task file").and_then(|()| {
            std::fs::read(path)
                .with_context(|| format!("cannot read the task file {}", path.display()))
        })
    });
    let outcome = crate::dist::root_outcome(comm, read);
    let mut bytes = outcome
        .map_err(|e| anyhow!("`eval_tasks`: {e}"))?
        .unwrap_or_default();
    comm.broadcast_bytes(&mut bytes, 0);
    Ok(bytes)
}

impl Trainer {
    /// Scores every task on the model as it is at iteration `iter` (not yet trained),
    /// says so, logs a row per task and replots.
    pub(super) fn score_tasks(
        &mut self,
        iter: u64,
        progress: &mut Option<Progress>,
    ) -> Result<Vec<TaskReport>> {
        self.params_whole();
        let (rank, world) = (self.rank(), self.world_size());
        // With LoRA, the base with the adapters merged in: the model `eval` loads.
        let params = self.merged_params_everywhere()?;
        let (config, layout) = (self.model.config(), self.model.base_layout());
        let mut reports = Vec::with_capacity(self.tasks.tasks.len());
        for task in &self.tasks.tasks {
            let mut scorer = Scorer::new(config, &task.questions);
            let ours = task.questions.iter().skip(rank).step_by(world);
            let tally = tasks::score::tally(&mut scorer, &params, layout, ours, |_| {});
            let mut sums = tally.to_array();
            self.comm.all_reduce_sum_f64(&mut sums);
            reports.push(TaskReport::new(task.name.clone(), &Tally::from_array(sums)));
        }
        drop(params);
        for report in &reports {
            say(progress, &format!("step {iter}: {}", report.summary()));
        }
        if let Some(metrics) = &mut self.metrics {
            for r in &reports {
                metrics.append(Row::Task {
                    iter,
                    task: r.task.clone(),
                    examples: r.examples as u64,
                    acc: r.acc.value,
                    acc_norm: r.acc_norm.value,
                    acc_bytes: r.acc_bytes.value,
                    acc_token: r.acc_token.value,
                })?;
            }
            if let Err(e) = plot_loss(metrics.rows(), &self.cfg.out_dir.join("loss.png")) {
                say(progress, &format!("warning: loss.png not updated: {e:#}"));
            }
        }
        Ok(reports)
    }
}
