//! Fault injection, for tests only: `NANOGPT_FAULT=KIND:ITER[:ARG]` makes a training
//! run fail on purpose at one chosen point, so that the tests in
//! `tests/reliability.rs` can check that a crash there loses nothing. Users never
//! set it; unset, every hook below is a no-op (one relaxed load).
//!
//! | `NANOGPT_FAULT`              | at iteration ITER                                   |
//! |------------------------------|-----------------------------------------------------|
//! | `kill-during-step:ITER`      | SIGKILL after backward, before the AdamW update      |
//! | `kill-during-eval:ITER`      | SIGKILL after the first batch of the evaluation      |
//! | `kill-during-checkpoint:ITER`| SIGKILL with half of the checkpoint's temp file written |
//! | `pause-during-step:ITER:MS`  | sleep MS ms after backward (time to send a signal)   |
//! | `nan-grad:ITER:COUNT`        | a NaN gradient in iterations ITER..ITER+COUNT        |
//! | `nan-param:ITER`             | a NaN parameter after the update of iteration ITER   |
//! | `pause-during-export:MS`     | `export`: sleep MS ms with the weights written, before the folder is moved into place |
//! | `kill-during-gather:N:RANK`  | ZeRO-3: SIGKILL rank RANK as it starts its N-th gather of a layer's weights (the other ranks wait in that gather) |
//! | `stop-during-gather:N:RANK`  | the same with SIGSTOP (a hung rank: only the watchdog can tell) |
//! | `late-gathers`               | ZeRO-1/2, every update: the weights' all-gathers left in flight start only when waited for (a network slower than any computation), so a reader that does not wait sees the other ranks' pieces from before the update |
//! | `eio-write:N`                | the N-th output file finished by [`crate::fsutil`] fails to write with EIO (an I/O error of the disk) |
//! | `eio-rename:N`               | the N-th rename by [`crate::fsutil`] that moves an output into place fails with EIO |
//! | `kill-at-write:N`            | SIGKILL with the N-th output file half written |
//! | `kill-at-rename:N`           | SIGKILL just before the N-th rename that moves an output into place |
//!
//! The last four count the output files and renames of any command (`export`,
//! `prepare`, checkpoints), from 1, so that a test can stop a multi-file output at
//! every step of its way (`scripts/fault_outputs.sh` tries them at random).
//!
//! For checkpoints, ITER is the iteration the checkpoint resumes at. With several
//! ranks every rank applies the fault, except `nan-grad`, which poisons this rank's
//! loss instead (the gradients are reduced inside backward), and the `-during-gather`
//! faults, which only rank RANK applies.

use anyhow::{bail, Context, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// One injected fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    KillDuringStep(u64),
    KillDuringEval(u64),
    KillDuringCheckpoint(u64),
    PauseDuringStep {
        iter: u64,
        ms: u64,
    },
    NanGrad {
        from: u64,
        count: u64,
    },
    NanParam(u64),
    PauseDuringExport(u64),
    /// ZeRO-1/2: the all-gathers of the updated weights start when waited for.
    LateGathers,
    /// SIGKILL (or with `stop`, SIGSTOP) in a ZeRO-3 gather.
    SignalDuringGather {
        nth: u64,
        rank: u64,
        stop: bool,
    },
    /// The `nth` output write or rename fails with EIO, or (with `kill`) dies.
    Io {
        op: IoOp,
        nth: u64,
        kill: bool,
    },
}

/// The file operations of [`crate::fsutil`] that [`Fault::Io`] fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    /// An output file's contents, written and about to be synced.
    Write,
    /// A rename that moves an output (a file or a folder) into place.
    Rename,
}

static FAULT: OnceLock<Option<Fault>> = OnceLock::new();

/// Reads `NANOGPT_FAULT` once; a malformed value is an error (a typo in a test
/// should not silently test nothing).
pub fn init() -> Result<()> {
    let parsed = match crate::tuning::env::get().fault.as_deref() {
        Some(spec) if !spec.is_empty() => Some(parse(spec).with_context(|| {
            let name = crate::tuning::env::FAULT;
            format!("{name}={spec} (a test-only setting): unset it for normal runs")
        })?),
        _ => None,
    };
    let _ = FAULT.set(parsed);
    Ok(())
}

fn get() -> Option<Fault> {
    FAULT.get().copied().flatten()
}

/// Parses `KIND:ITER[:ARG]`.
pub fn parse(spec: &str) -> Result<Fault> {
    let parts: Vec<&str> = spec.split(':').collect();
    let num = |i: usize| -> Result<u64> {
        let s = parts.get(i).context("missing a number")?;
        s.parse().with_context(|| format!("`{s}` is not a number"))
    };
    let fault = match (parts[0], parts.len()) {
        ("kill-during-step", 2) => Fault::KillDuringStep(num(1)?),
        ("kill-during-eval", 2) => Fault::KillDuringEval(num(1)?),
        ("kill-during-checkpoint", 2) => Fault::KillDuringCheckpoint(num(1)?),
        ("pause-during-step", 3) => Fault::PauseDuringStep {
            iter: num(1)?,
            ms: num(2)?,
        },
        ("nan-grad", 3) => Fault::NanGrad {
            from: num(1)?,
            count: num(2)?,
        },
        ("nan-param", 2) => Fault::NanParam(num(1)?),
        ("pause-during-export", 2) => Fault::PauseDuringExport(num(1)?),
        ("late-gathers", 1) => Fault::LateGathers,
        (kind @ ("kill-during-gather" | "stop-during-gather"), 3) => Fault::SignalDuringGather {
            nth: num(1)?,
            rank: num(2)?,
            stop: kind.starts_with("stop"),
        },
        (kind @ ("eio-write" | "eio-rename" | "kill-at-write" | "kill-at-rename"), 2) => {
            Fault::Io {
                op: match kind.ends_with("write") {
                    true => IoOp::Write,
                    false => IoOp::Rename,
                },
                nth: num(1)?,
                kill: kind.starts_with("kill"),
            }
        }
        _ => bail!(
            "expected kill-during-step:ITER, kill-during-eval:ITER, kill-during-checkpoint:ITER, \
             pause-during-step:ITER:MS, nan-grad:ITER:COUNT, nan-param:ITER, \
             pause-during-export:MS, kill-during-gather:N:RANK, stop-during-gather:N:RANK, \
             late-gathers, eio-write:N, eio-rename:N, kill-at-write:N or kill-at-rename:N"
        ),
    };
    Ok(fault)
}

/// Ends this process as `kill -9` would: no destructors, no flushing.
fn kill_self(what: &str) -> ! {
    eprintln!("fault injection: SIGKILL {what}");
    let _ = signal_hook::low_level::raise(signal_hook::consts::SIGKILL);
    // SIGKILL cannot be caught; this is never reached.
    std::process::abort()
}

/// In a training step, between backward and the update.
pub fn during_step(iter: u64) {
    match get() {
        Some(Fault::KillDuringStep(i)) if i == iter => kill_self(&format!("in step {iter}")),
        Some(Fault::PauseDuringStep { iter: i, ms }) if i == iter => {
            eprintln!("fault injection: pausing {ms} ms in step {iter}");
            std::thread::sleep(Duration::from_millis(ms));
        }
        _ => {}
    }
}

/// In the evaluation at `iter`, after its first batch.
pub fn during_eval(iter: u64) {
    if get() == Some(Fault::KillDuringEval(iter)) {
        kill_self(&format!("in the evaluation at iteration {iter}"));
    }
}

/// After the checkpoint that resumes at `iter` has been written to `tmp` (not yet
/// renamed into place): cuts `tmp` to half its length, then dies.
pub fn during_checkpoint(iter: u64, tmp: &std::path::Path) {
    if get() != Some(Fault::KillDuringCheckpoint(iter)) {
        return;
    }
    if let Ok(f) = std::fs::OpenOptions::new().write(true).open(tmp) {
        let half = f.metadata().map_or(0, |m| m.len() / 2);
        let _ = f.set_len(half).and_then(|()| f.sync_all());
    }
    kill_self(&format!("writing the checkpoint of iteration {iter}"));
}

/// In `export`, with the weights written to the temporary folder.
pub fn during_export() {
    if let Some(Fault::PauseDuringExport(ms)) = get() {
        eprintln!("fault injection: pausing {ms} ms in the export");
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// ZeRO-3, as rank `rank` starts gathering a layer's weights from the other ranks.
pub fn during_gather(rank: usize) {
    static GATHERS: AtomicU64 = AtomicU64::new(0);
    let Some(Fault::SignalDuringGather { nth, rank: r, stop }) = get() else {
        return;
    };
    if r != rank as u64 || GATHERS.fetch_add(1, Ordering::Relaxed) + 1 != nth {
        return;
    }
    let what = format!("rank {rank} in ZeRO-3 weight gather {nth}");
    if !stop {
        kill_self(&what);
    }
    eprintln!("fault injection: SIGSTOP {what}");
    let _ = signal_hook::low_level::raise(signal_hook::consts::SIGSTOP);
}

/// Before [`crate::fsutil`] syncs an output file it wrote (`op` [`IoOp::Write`], `path`
/// the file) or renames an output into place ([`IoOp::Rename`], `path` the source):
/// the injected EIO, or SIGKILL (a file to be written is cut to half its length first).
pub fn io(op: IoOp, path: &std::path::Path) -> std::io::Result<()> {
    static COUNTS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];
    let Some(Fault::Io { op: o, nth, kill }) = get() else {
        return Ok(());
    };
    if o != op || COUNTS[op as usize].fetch_add(1, Ordering::Relaxed) + 1 != nth {
        return Ok(());
    }
    let what = match op {
        IoOp::Write => "write",
        IoOp::Rename => "rename",
    };
    if !kill {
        eprintln!("fault injection: EIO at {what} {nth} ({})", path.display());
        return Err(std::io::Error::from_raw_os_error(5));
    }
    if op == IoOp::Write {
        if let Ok(f) = std::fs::OpenOptions::new().write(true).open(path) {
            let half = f.metadata().map_or(0, |m| m.len() / 2);
            let _ = f.set_len(half).and_then(|()| f.sync_all());
        }
    }
    kill_self(&format!("at {what} {nth} ({})", path.display()))
}

/// Whether ZeRO-1/2's all-gathers of the updated weights start only when waited for.
pub fn late_gathers() -> bool {
    get() == Some(Fault::LateGathers)
}

/// Whether iteration `iter` gets a NaN gradient.
pub fn nan_grad(iter: u64) -> bool {
    matches!(get(), Some(Fault::NanGrad { from, count }) if (from..from + count).contains(&iter))
}

/// Whether iteration `iter`'s update is followed by a NaN parameter.
pub fn nan_param(iter: u64) -> bool {
    get() == Some(Fault::NanParam(iter))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_and_refuses_typos() {
        assert_eq!(
            parse("kill-during-step:7").unwrap(),
            Fault::KillDuringStep(7)
        );
        assert_eq!(
            parse("pause-during-step:3:1500").unwrap(),
            Fault::PauseDuringStep { iter: 3, ms: 1500 }
        );
        assert_eq!(
            parse("nan-grad:2:4").unwrap(),
            Fault::NanGrad { from: 2, count: 4 }
        );
        assert_eq!(
            parse("kill-during-gather:40:1").unwrap(),
            Fault::SignalDuringGather {
                nth: 40,
                rank: 1,
                stop: false
            }
        );
        assert_eq!(
            parse("stop-during-gather:3:2").unwrap(),
            Fault::SignalDuringGather {
                nth: 3,
                rank: 2,
                stop: true
            }
        );
        assert_eq!(parse("late-gathers").unwrap(), Fault::LateGathers);
        assert_eq!(
            parse("kill-at-rename:3").unwrap(),
            Fault::Io {
                op: IoOp::Rename,
                nth: 3,
                kill: true
            }
        );
        assert_eq!(
            parse("eio-write:1").unwrap(),
            Fault::Io {
                op: IoOp::Write,
                nth: 1,
                kill: false
            }
        );
        let typos = [
            "late-gathers:1",
            "kill-during-gather:40",
            "kill-during-stp:7",
            "kill-during-step",
            "eio-rename",
            "kill-at-write:1:2",
        ];
        for bad in typos.into_iter().chain(["nan-grad:x:1", ""]) {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
