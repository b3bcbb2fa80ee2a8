//! What a run tells as it goes: rank 0's progress lines and metrics rows, the
//! warnings and the error for steps skipped as non-finite, the communication report.

use super::{StepOutcome, Trainer};
use crate::metrics::Row;
use crate::progress::Progress;
use anyhow::{bail, Result};

impl Trainer {
    /// After a step: a warning for a skipped one, and an error once
    /// `max_nonfinite_steps` were skipped in a row.
    pub(super) fn count_nonfinite(
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

    pub(super) fn log_step(
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
        let flops = self.model.flops_per_token(self.cfg.block_size) * tokens_per_sec;
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
            // The peak is that of the precision that runs, measured with the kernel
            // its matmuls use, so the step cannot beat it on an idle machine: above
            // 100 % means that measurement (or this step) met other load. Say so.
            let busy = if mfu > 1.0 {
                " (above the GEMM peak measured at start: other work on the machine skewed one of the two)"
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
    pub(super) fn write_comm_report(&self) -> Result<()> {
        let Some(report) = self.comm_report().filter(|_| self.rank() == 0) else {
            return Ok(());
        };
        let path = self.cfg.out_dir.join("comm.json");
        let text = serde_json::to_string_pretty(&report)?;
        crate::fsutil::write_bytes_atomic(&path, text)?;
        crate::outln!(
            "{} ranks: {:.1} ms/step, of which computing {:.1}, waiting for the gradient \
             reduction {:.1} ({:.0}% of its {:.1} ms hidden behind backward; {:.1} ms of \
             the wait is the slowest rank computing longer, {:.0}% hidden without it), \
             for the weights' all-gather {:.1}, other collectives {:.1}; {:.0} tokens/s \
             per rank",
            report.world_size,
            report.step_ms,
            report.compute_ms,
            report.exposed_reduce_ms,
            report.hidden_fraction * 100.0,
            report.reduce_alone_ms,
            report.skew_ms.min(report.exposed_reduce_ms),
            report.hidden_fraction_net_of_skew * 100.0,
            report.exposed_gather_ms,
            report.other_comm_ms,
            report.tokens_per_sec_per_rank
        );
        Ok(())
    }
}

/// A line above rank 0's progress bar; nothing on other ranks.
pub(super) fn say(progress: &mut Option<Progress>, line: &str) {
    if let Some(p) = progress {
        p.println(line);
    }
}
