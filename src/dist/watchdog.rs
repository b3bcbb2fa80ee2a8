//! A thread that ends the job when a collective makes no progress.
//!
//! MPI notices a dead process, but not a stopped one, a hung host or a cut link: the
//! other ranks would wait in their next collective forever. Each blocking collective
//! arms the watchdog for its duration; if one stays armed longer than
//! `collective_timeout_s`, the watchdog reports which operation and rank waited,
//! then runs its action (for MPI: `MPI_Abort`, which ends every rank).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Action = Box<dyn Fn(String) + Send + Sync>;

struct State {
    origin: Instant,
    /// The timeout in milliseconds; 0 = off.
    timeout_ms: AtomicU64,
    /// When the current wait began (ms since `origin`, plus one); 0 = not waiting.
    armed_at: AtomicU64,
    /// Multiple of the timeout the current wait may last.
    patience: AtomicU64,
    what: Mutex<&'static str>,
    who: String,
    action: Action,
}

/// Arms the watchdog while a collective runs; see [`Watchdog::arm`].
pub struct Watchdog {
    state: Arc<State>,
    started: std::sync::Once,
}

/// Disarms on drop.
pub struct Armed<'a>(&'a Watchdog);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.state.armed_at.store(0, Ordering::SeqCst);
    }
}

impl Watchdog {
    /// A watchdog for `who` (e.g. "rank 1 of 3 (host h2)") that calls `action`
    /// with its message when a wait times out. Off until [`Watchdog::set_timeout`].
    pub fn new(who: String, action: impl Fn(String) + Send + Sync + 'static) -> Watchdog {
        Watchdog {
            state: Arc::new(State {
                origin: Instant::now(),
                timeout_ms: AtomicU64::new(0),
                armed_at: AtomicU64::new(0),
                patience: AtomicU64::new(1),
                what: Mutex::new(""),
                who,
                action: Box::new(action),
            }),
            started: std::sync::Once::new(),
        }
    }

    /// Sets the timeout (zero turns the watchdog off) and starts its thread.
    pub fn set_timeout(&self, timeout: Duration) {
        let ms = timeout.as_millis().min(u64::MAX as u128) as u64;
        self.state.timeout_ms.store(ms, Ordering::SeqCst);
        if ms > 0 {
            self.started.call_once(|| {
                let state = Arc::clone(&self.state);
                std::thread::Builder::new()
                    .name("collective-watchdog".into())
                    .spawn(move || watch(&state))
                    .expect("cannot start the collective watchdog thread");
            });
        }
    }

    /// Arms the watchdog for the wait `what` until the guard drops; the wait may last
    /// `patience` timeouts.
    pub fn arm(&self, what: &'static str, patience: u32) -> Armed<'_> {
        *self.state.what.lock().unwrap_or_else(|e| e.into_inner()) = what;
        self.state
            .patience
            .store(patience.max(1) as u64, Ordering::SeqCst);
        let now = self.state.origin.elapsed().as_millis() as u64 + 1;
        self.state.armed_at.store(now, Ordering::SeqCst);
        Armed(self)
    }
}

/// What the watchdog does at one look.
#[derive(Debug, PartialEq)]
enum Look {
    /// Nothing armed, or armed for less than the limit.
    Wait,
    /// This process itself did not run for `gap_ms` (longer than a poll should take):
    /// the wait restarts from now, so that the other ranks are given time.
    Stalled { gap_ms: u64 },
    /// Armed for longer than the limit.
    Fire,
}

/// A look `now` (ms) at a wait armed at `armed_at` (0: none) with `limit` ms of
/// patience, the previous look having been at `prev` after sleeping `poll` ms.
fn look(now: u64, prev: u64, poll: u64, armed_at: u64, limit: u64) -> Look {
    if armed_at == 0 {
        return Look::Wait;
    }
    let gap = now.saturating_sub(prev);
    // A sleep of `poll` ms that took seconds longer: the process was stopped
    // (SIGSTOP, a suspended job or VM), not waiting on the others.
    if gap > poll + 2000 && now.saturating_sub(armed_at) > limit {
        return Look::Stalled { gap_ms: gap };
    }
    match now.saturating_sub(armed_at) > limit {
        true => Look::Fire,
        false => Look::Wait,
    }
}

fn watch(state: &State) {
    let now = || state.origin.elapsed().as_millis() as u64 + 1;
    let mut prev = now();
    loop {
        let timeout = state.timeout_ms.load(Ordering::SeqCst);
        let poll = (timeout / 10).clamp(20, 1000);
        std::thread::sleep(Duration::from_millis(poll));
        let t = now();
        let armed_at = state.armed_at.load(Ordering::SeqCst);
        let limit = timeout.saturating_mul(state.patience.load(Ordering::SeqCst));
        let what = || *state.what.lock().unwrap_or_else(|e| e.into_inner());
        match look(t, prev, poll, armed_at, limit) {
            _ if timeout == 0 => {}
            Look::Wait => {}
            Look::Stalled { gap_ms } => {
                // Restart this wait only if it is still the same one.
                let _ = state.armed_at.compare_exchange(
                    armed_at,
                    t,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
                crate::errln!(
                    "warning: {}: this process was itself stopped for {:.0} s (SIGSTOP, a \
                     suspended job or VM, or heavy swapping) while in {}; waiting another \
                     {:.0} s for the other ranks, which may have given up on it",
                    state.who,
                    gap_ms as f64 / 1e3,
                    what(),
                    limit as f64 / 1e3
                );
            }
            Look::Fire => {
                (state.action)(format!(
                    "{}: {} made no progress for {:.0} s (collective_timeout_s = {:.0})",
                    state.who,
                    what(),
                    limit as f64 / 1e3,
                    timeout as f64 / 1e3
                ));
                // The action normally ends the process; if it returns, report once.
                state.armed_at.store(0, Ordering::SeqCst);
            }
        }
        prev = t;
    }
}

/// Guards a shutdown step that may hang (`MPI_Finalize`): after `grace`, unless the
/// process has ended, prints a warning and calls `leave` with `code`, the status the
/// run meant: 0, or a signal stop's 130, 143 or 138, which must reach the launcher
/// even when the step hangs.
pub fn leave_if_stuck(
    grace: Duration,
    what: &'static str,
    code: i32,
    leave: impl FnOnce(i32) + Send + 'static,
) {
    let _ = std::thread::Builder::new()
        .name("finalize-watchdog".into())
        .spawn(move || {
            std::thread::sleep(grace);
            crate::errln!(
                "warning: {what} has not returned after {} s (a known hang of some MPI \
                 versions); the run is complete, exiting without it (status {code})",
                grace.as_secs()
            );
            leave(code)
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_stuck_shutdown_leaves_with_the_runs_status() {
        let (tx, rx) = mpsc::channel();
        leave_if_stuck(
            Duration::from_millis(10),
            "MPI_Finalize",
            138,
            move |code| {
                let _ = tx.send(code);
            },
        );
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(138));
    }

    #[test]
    fn fires_only_for_a_wait_longer_than_the_timeout() {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let dog = Watchdog::new("rank 1 of 2 (host h)".into(), move |msg| {
            let _ = tx.lock().unwrap().send(msg);
        });
        dog.set_timeout(Duration::from_millis(200));
        {
            let _g = dog.arm("all-reduce", 1);
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(400));
        assert!(rx.try_recv().is_err(), "a short wait does not fire");
        {
            let _g = dog.arm("broadcast", 1);
            let msg = rx.recv_timeout(Duration::from_secs(5)).expect("fires");
            assert!(
                msg.contains("rank 1 of 2") && msg.contains("broadcast made no progress"),
                "{msg}"
            );
        }
        {
            let _g = dog.arm("barrier", 10);
            std::thread::sleep(Duration::from_millis(500));
        }
        assert!(rx.try_recv().is_err(), "patience multiplies the timeout");
    }

    #[test]
    fn a_process_that_was_itself_stopped_waits_again_instead_of_firing() {
        // Polls every 100 ms, a limit of 1 s, armed at 1000.
        assert_eq!(look(1500, 1400, 100, 1000, 1000), Look::Wait);
        assert_eq!(look(2100, 2000, 100, 1000, 1000), Look::Fire);
        assert_eq!(look(2100, 2000, 100, 0, 1000), Look::Wait, "not armed");
        // The process did not run from 1500 to 9000: its own stop, not the others'.
        assert_eq!(
            look(9000, 1500, 100, 1000, 1000),
            Look::Stalled { gap_ms: 7500 }
        );
        // A stop within a wait that has not yet run out changes nothing.
        assert_eq!(look(9000, 1500, 100, 1000, 10_000), Look::Wait);
    }
}
