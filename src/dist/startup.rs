//! The start-up timer: MPI itself waits forever, printing nothing, when a rank
//! never starts or the hosts cannot reach each other. The timer ends this process
//! after `NANOGPT_START_TIMEOUT_S` (120 s) with a message saying which ranks never
//! started and which are stuck in MPI's start-up, as the check-in hub knows them
//! ([`super::checkin`]), and the likely causes. The first rank the hub heard from
//! ends the job sooner: at once when a rank refused to start, after
//! [`NEVER_STARTED`] when some rank never checked in.

use super::checkin::{Board, Checkin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a rank may take to start before the job is ended (when a hub can tell).
pub const NEVER_STARTED: Duration = Duration::from_secs(30);

/// Runs until [`Timer::done`]; see the module's doc.
pub struct Timer {
    done: Arc<AtomicBool>,
}

impl Timer {
    /// Starts the timer of this rank (`rank` as the launcher said, if it did);
    /// `abort` ends the job with the status it is given.
    pub fn start(checkin: Arc<Checkin>, rank: Option<usize>, abort: fn(i32) -> !) -> Timer {
        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        let limit = crate::tuning::env::get().start_timeout();
        let early = NEVER_STARTED.min(limit);
        let _ = std::thread::Builder::new()
            .name("mpi-start-timer".into())
            .spawn(move || {
                let start = Instant::now();
                let mut looked = Instant::now();
                while start.elapsed() < limit {
                    std::thread::sleep(Duration::from_millis(100));
                    if flag.load(Ordering::SeqCst) {
                        return;
                    }
                    if looked.elapsed() < Duration::from_secs(1) {
                        continue;
                    }
                    looked = Instant::now();
                    let Some(board) = checkin.board() else {
                        continue;
                    };
                    let verdict = early_verdict(&board, rank, start.elapsed(), early);
                    if let Some(message) = verdict.filter(|_| !flag.load(Ordering::SeqCst)) {
                        crate::errln!("error: {}", message);
                        abort(4);
                    }
                }
                if flag.load(Ordering::SeqCst) {
                    return;
                }
                let board = checkin.board();
                crate::errln!("error: {}", hang_message(limit, board.as_ref()));
                abort(4);
            });
        Timer { done }
    }

    pub fn done(self) {
        self.done.store(true, Ordering::SeqCst);
    }
}

/// What the rank that acts for the job (the lowest one the hub heard from) says
/// before the time limit: a rank refused to start, or some rank never started
/// within `early`. None: wait on.
fn early_verdict(
    board: &Board,
    me: Option<usize>,
    elapsed: Duration,
    early: Duration,
) -> Option<String> {
    let first_heard = (0..board.ranks.len()).find(|r| !board.never_started().contains(r));
    if me.is_none() || first_heard != me {
        return None;
    }
    if board.failed().is_some() {
        return Some(format!(
            "{}: MPI start-up cannot complete: {}; ending the job",
            whoami(),
            board.summary()
        ));
    }
    if elapsed >= early && !board.never_started().is_empty() {
        return Some(hang_message(elapsed, Some(board)));
    }
    None
}

/// `rank R, host H` (the rank as the launcher said).
fn whoami() -> String {
    let rank = super::launcher::started()
        .and_then(|s| s.rank)
        .map_or(String::new(), |r| format!("rank {r}, "));
    format!("{rank}host {}", super::this_host())
}

/// What a rank says when MPI start-up did not complete in `limit`: who never
/// started and who waits (from the hub's `board`, where there is one), then the
/// likely causes.
pub fn hang_message(limit: Duration, board: Option<&Board>) -> String {
    let head = format!(
        "{}: MPI start-up (MPI_Init and the first collectives) did not complete in {:.0} s \
         (NANOGPT_START_TIMEOUT_S)",
        whoami(),
        limit.as_secs_f64()
    );
    let networks = super::route::candidates();
    let several = match networks.len() {
        0 | 1 => String::new(),
        _ => format!(
            " This host has several networks ({}): tell MPI the one that joins the hosts \
             (`nanogpt launch --iface NAME`).",
            super::route::describe(&networks)
        ),
    };
    let causes = "Likely causes: MPI picked a network interface that does not join the hosts \
         (docker0 or virbr0 have the same address on every host): name the right one with \
         `--mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0` (Open MPI) or `-iface \
         eth0 -genv UCX_NET_DEVICES eth0` (MPICH, Intel MPI), or `nanogpt launch --iface eth0`; a \
         firewall between the hosts (MPI needs TCP connections between every pair); a host \
         name that resolves to an address the others cannot reach. See docs/multinode.md";
    match board {
        Some(b) if !b.never_started().is_empty() => format!(
            "{head}: {}. Every rank must start before MPI can: fix the ranks that never \
             started (their launcher's output names the host and the error).",
            b.summary()
        ),
        Some(b) => format!(
            "{head}: every rank started and waits in MPI start-up ({}), so the ranks cannot \
             reach each other over the network.{several} {causes}",
            b.waiting()
        ),
        None => format!("{head}: the ranks cannot reach each other.{several} {causes}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::checkin::Seen;

    #[test]
    fn the_first_rank_heard_from_ends_a_start_up_missing_a_rank() {
        let mut board = Board::new(3, vec![None, None, Some("h3".into())]);
        let started = |h: &str| Seen::Started {
            host: h.into(),
            build: "b".into(),
        };
        board.ranks[0] = started("h1");
        board.ranks[1] = started("h2");
        let (s5, s40, early) = (
            Duration::from_secs(5),
            Duration::from_secs(40),
            Duration::from_secs(30),
        );
        assert_eq!(early_verdict(&board, Some(0), s5, early), None, "too soon");
        assert_eq!(
            early_verdict(&board, Some(1), s40, early),
            None,
            "rank 0 acts"
        );
        let msg = early_verdict(&board, Some(0), s40, early).expect("rank 0 ends the job");
        assert!(
            msg.contains("did not complete in 40 s (NANOGPT_START_TIMEOUT_S): never started"),
            "{msg}"
        );
        assert!(msg.contains("rank 2 (host h3)"), "{msg}");
        assert!(
            !msg.contains("Likely causes"),
            "not the network's fault: {msg}"
        );
        // A refusal ends it at once.
        board.ranks[2] = Seen::Failed {
            host: "h3".into(),
            why: "built against MPICH, started by Open MPI's mpirun".into(),
        };
        let msg = early_verdict(&board, Some(0), s5, early).expect("at once");
        assert!(
            msg.contains("MPI start-up cannot complete: refused to start: rank 2 (host h3): built"),
            "{msg}"
        );
        // Everyone started but MPI does not come up: the network.
        board.ranks[2] = started("h3");
        assert_eq!(early_verdict(&board, Some(0), s40, early), None);
        let msg = hang_message(Duration::from_secs(120), Some(&board));
        assert!(
            msg.contains("every rank started and waits in MPI start-up (rank 0 (host h1), rank 1"),
            "{msg}"
        );
        assert!(msg.contains("Likely causes"), "{msg}");
    }
}
