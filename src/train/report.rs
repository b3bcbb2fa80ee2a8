//! What a run tells as it goes: rank 0's progress lines and metrics rows, the
//! warnings and the error for steps skipped as non-finite, the communication report.

use super::{StepOutcome, Trainer};
use crate::config::InitFrom;
use crate::metrics::Row;
use crate::progress::Progress;
use anyhow::{bail, Result};

/// Times a run probes the GEMM peak again after a step beat it ([`Trainer::mfu`]).
const PEAK_REPROBES: u32 = 2;

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
            // What this run resumed from or saved, known alike on every rank.
            let resumable = self.saved_at.is_some() || self.cfg.init() == InitFrom::Resume;
            let then = match resumable {
                true => "continue with init_from=resume (the checkpoints hold only finite values)",
                false => "start the run again (it saved no checkpoint yet)",
            };
            bail!(
                "{n} optimizer steps in a row (iterations {}..={iter}) had a non-finite loss or \
                 gradient norm ({what}), so training stopped (max_nonfinite_steps = {max}): \
                 lower learning_rate, set grad_clip or check the data, then {then}",
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
        let (Some(_), Some(progress)) = (&self.metrics, progress) else {
            return Ok(());
        };
        // Tokens of the whole job (all ranks) per second.
        let tokens = self.cfg.tokens_per_iter() as f64;
        let tokens_per_sec = tokens / secs;
        let flops = self.model.flops_per_token(self.cfg.block_size) * tokens_per_sec;
        let ms = secs * 1e3;
        progress.step(iter, loss);
        if self.cfg.log_interval > 0 && iter.is_multiple_of(self.cfg.log_interval) {
            let mfu = self.mfu(flops);
            let metrics = self.metrics.as_mut().expect("rank 0 logs");
            metrics.append(Row::Step {
                iter,
                loss,
                lr,
                ms,
                tokens_per_sec,
                mfu: Some(mfu),
                grad_norm: Some(grad_norm),
            })?;
            // Still above 100 % after probing again ([`Trainer::mfu`]): say so.
            let busy = if mfu > 1.0 {
                " (above the GEMM peak measured: other work on the machine skewed the probes)"
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

    /// `flops` per second of the whole job against the GEMM peak of the precision that
    /// runs. The peak is that of the kernel the step's matmuls use, so a step above it
    /// means the probe met other load on the machine: it is probed again (a few
    /// tenths of a second, at most [`PEAK_REPROBES`] times a run) and the better kept.
    fn mfu(&mut self, flops: f64) -> f64 {
        let ranks = self.comm.world_size() as f64;
        let (dtype, backend) = (self.cfg.dtype, &self.backend);
        let probe = || crate::bench::gemm_peak_gflops_quick(dtype, backend);
        let (peak, probed) = peak_for(self.peak_gflops, flops / ranks, self.peak_reprobes, probe);
        self.peak_gflops = peak;
        self.peak_reprobes += u32::from(probed);
        flops / (peak * 1e9 * ranks)
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

/// The peak (GFLOP/s) to divide a rank's `flops` per second by: `peak`, or where the
/// step beat it and fewer than [`PEAK_REPROBES`] probes were made again (`reprobes`),
/// the better of it and a new `probe`; and whether `probe` ran.
fn peak_for(peak: f64, flops: f64, reprobes: u32, probe: impl FnOnce() -> f64) -> (f64, bool) {
    match flops > peak * 1e9 && reprobes < PEAK_REPROBES {
        true => (peak.max(probe()), true),
        false => (peak, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_above_the_peak_probes_it_again_a_bounded_number_of_times() {
        let never = || -> f64 { panic!("probed below the peak") };
        assert_eq!(peak_for(100.0, 90e9, 0, never), (100.0, false));
        assert_eq!(peak_for(100.0, 150e9, 0, || 180.0), (180.0, true));
        // A probe that meets load again keeps the better figure.
        assert_eq!(peak_for(100.0, 150e9, 1, || 80.0), (100.0, true));
        assert_eq!(peak_for(100.0, 150e9, PEAK_REPROBES, never), (100.0, false));
    }
}
