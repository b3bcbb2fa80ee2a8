//! SIGINT, SIGTERM and SIGUSR1 during training: the first asks the training loop to
//! stop after the optimizer step in progress (it then writes a checkpoint and exits
//! with 130, 143 or 138, the shell's codes for the three signals); a second one
//! exits at once, with the same code. Stopping abruptly is safe: checkpoints are
//! replaced by an atomic rename, so the last complete one is always there to resume
//! from.
//!
//! SIGUSR1 is for MPI jobs: Open MPI's `mpirun` answers SIGTERM/SIGINT by killing
//! the ranks a second later, but forwards SIGUSR1 to every rank untouched (Hydra
//! forwards all three), so `kill -USR1 <mpirun>` stops a whole job with its
//! checkpoint; `nanogpt launch` turns Ctrl-C into exactly that.

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

/// A signal asking the run to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    Interrupt,
    Terminate,
    /// SIGUSR1: what MPI launchers forward to every rank (see the module docs).
    User1,
}

impl StopSignal {
    /// The conventional exit status: 128 + the signal number.
    pub fn exit_code(self) -> i32 {
        128 + self.number()
    }

    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Interrupt => "SIGINT",
            StopSignal::Terminate => "SIGTERM",
            StopSignal::User1 => "SIGUSR1",
        }
    }

    fn number(self) -> i32 {
        match self {
            StopSignal::Interrupt => SIGINT,
            StopSignal::Terminate => SIGTERM,
            StopSignal::User1 => SIGUSR1,
        }
    }

    fn from_number(n: usize) -> Option<StopSignal> {
        [
            StopSignal::Interrupt,
            StopSignal::Terminate,
            StopSignal::User1,
        ]
        .into_iter()
        .find(|s| s.number() as usize == n)
    }
}

/// Set by the first signal; a signal that finds it set exits at once.
static STOP: AtomicBool = AtomicBool::new(false);
/// The number of the latest signal.
static WHICH: AtomicUsize = AtomicUsize::new(0);
static INSTALL: Once = Once::new();

/// Installs the handlers (once per process; later calls do nothing).
pub fn install() -> Result<()> {
    let mut result = Ok(());
    INSTALL.call_once(|| result = register());
    result.context("cannot install the SIGINT/SIGTERM/SIGUSR1 handlers")
}

fn register() -> std::io::Result<()> {
    use signal_hook::flag;
    for sig in [SIGINT, SIGTERM, SIGUSR1] {
        // Order matters: the exit runs first and only fires once STOP is already set.
        flag::register_conditional_shutdown(sig, 128 + sig, &STOP)?;
        flag::register_usize(sig, &WHICH, sig as usize)?;
        flag::register(sig, &STOP)?;
    }
    Ok(())
}

/// The signal that asked this process to stop, if one did.
pub fn requested() -> Option<StopSignal> {
    if !STOP.load(Ordering::SeqCst) {
        return None;
    }
    StopSignal::from_number(WHICH.load(Ordering::SeqCst))
}

/// Packs this process's request for a sum across ranks: (interrupts, terminations);
/// SIGUSR1 counts as a termination (a rank that did not receive it stops as if by
/// SIGTERM; the launchers forward it to every rank anyway).
pub fn as_counts(signal: Option<StopSignal>) -> [f64; 2] {
    match signal {
        None => [0.0, 0.0],
        Some(StopSignal::Interrupt) => [1.0, 0.0],
        Some(StopSignal::Terminate | StopSignal::User1) => [0.0, 1.0],
    }
}

/// The job's decision from the summed counts: stop if any rank was asked to; a
/// rank reports its own signal, others the job's (SIGTERM first, as a scheduler's).
pub fn from_counts(local: Option<StopSignal>, counts: [f64; 2]) -> Option<StopSignal> {
    local.or(match counts {
        [_, t] if t > 0.0 => Some(StopSignal::Terminate),
        [i, _] if i > 0.0 => Some(StopSignal::Interrupt),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_the_shells() {
        assert_eq!(StopSignal::Interrupt.exit_code(), 130);
        assert_eq!(StopSignal::Terminate.exit_code(), 143);
        assert_eq!(StopSignal::User1.exit_code(), 138);
        assert_eq!(StopSignal::from_number(10), Some(StopSignal::User1));
    }

    #[test]
    fn any_rank_stops_the_job() {
        let sum = |a: [f64; 2], b: [f64; 2]| [a[0] + b[0], a[1] + b[1]];
        let none = as_counts(None);
        let int = as_counts(Some(StopSignal::Interrupt));
        let term = as_counts(Some(StopSignal::Terminate));
        assert_eq!(from_counts(None, sum(none, none)), None);
        assert_eq!(
            from_counts(None, sum(none, int)),
            Some(StopSignal::Interrupt)
        );
        assert_eq!(
            from_counts(None, sum(int, term)),
            Some(StopSignal::Terminate)
        );
        assert_eq!(
            from_counts(Some(StopSignal::Interrupt), sum(int, term)),
            Some(StopSignal::Interrupt)
        );
        let usr1 = as_counts(Some(StopSignal::User1));
        assert_eq!(
            from_counts(None, sum(none, usr1)),
            Some(StopSignal::Terminate)
        );
        assert_eq!(
            from_counts(Some(StopSignal::User1), sum(usr1, usr1)),
            Some(StopSignal::User1)
        );
    }
}
