//! `nanogpt launch --hosts FILE -n N [--iface IF] [--dry-run] -- train CONFIG.toml ...`.

use crate::launch::{self, Job};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// The hosts, one name per line (the same file mpirun takes).
    #[arg(long)]
    pub hosts: PathBuf,
    /// Ranks: one per host, at most the number of hosts listed.
    #[arg(short = 'n', long = "ranks")]
    pub ranks: usize,
    /// The network interface that joins the hosts (e.g. eth0): needed when the
    /// hosts also have a bridge such as docker0.
    #[arg(long)]
    pub iface: Option<String>,
    /// Print the command line and stop.
    #[arg(long)]
    pub dry_run: bool,
    /// The launcher to use (default: $NANOGPT_MPIRUN, else mpirun).
    #[arg(long)]
    pub mpirun: Option<String>,
    /// `train CONFIG.toml key=value ...`, after `--`.
    #[arg(
        last = true,
        required = true,
        value_name = "train CONFIG.toml key=value"
    )]
    pub command: Vec<String>,
}

/// Prints the line; unless `--dry-run`, runs `doctor` with it, then the job (see
/// [`supervise`] for what Ctrl-C does).
pub fn run(args: LaunchArgs) -> Result<i32> {
    let mpirun = args
        .mpirun
        .clone()
        .or_else(|| std::env::var("NANOGPT_MPIRUN").ok())
        .unwrap_or_else(|| "mpirun".into());
    if args.command.first().map(String::as_str) != Some("train") {
        bail!("launch runs `train`: write `nanogpt launch --hosts FILE -n N -- train CONFIG.toml`");
    }
    let flavour = launch::detect(&mpirun)?;
    let hosts = launch::read_hosts(&args.hosts, flavour)?;
    if args.ranks == 0 || args.ranks > hosts.len() {
        bail!(
            "-n {}: {} lists {} host(s), and launch starts one rank per host; use -n 1..={}",
            args.ranks,
            args.hosts.display(),
            hosts.len(),
            hosts.len()
        );
    }
    let binary = std::env::current_exe().context("cannot find this binary's path")?;
    let binary = binary.display().to_string();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let as_root = unsafe { libc::geteuid() } == 0;
    let job = |command: &[String]| {
        Job {
            flavour,
            mpirun: &mpirun,
            hosts: &args.hosts,
            ranks: args.ranks,
            iface: args.iface.as_deref(),
            binary: &binary,
            command,
            env: launch::forwarded_env(),
            as_root,
        }
        .argv()
    };
    let train = job(&args.command);
    crate::outln!("{}", launch::shell_line(&train));
    if args.dry_run {
        return Ok(0);
    }
    let mut doctor_cmd = args.command.clone();
    doctor_cmd[0] = "doctor".into();
    let doctor = job(&doctor_cmd);
    let status = std::process::Command::new(&doctor[0])
        .args(&doctor[1..])
        .status()
        .with_context(|| format!("cannot run {mpirun}"))?;
    if !status.success() {
        bail!("`nanogpt doctor` found problems (above); fix them, then launch again");
    }
    supervise(&train)
}

/// Runs the job's launcher and waits for it, turning the first SIGINT/SIGTERM (Ctrl-C)
/// into SIGUSR1 to the launcher, which both Open MPI and Hydra forward to every rank:
/// the job stops after the step in progress with a checkpoint. (Open MPI's `mpirun`
/// answers SIGINT/SIGTERM itself by killing the ranks a second later.) A second
/// signal is passed on as SIGTERM, the launcher's own abort. The launcher runs in
/// its own process group, so the terminal's Ctrl-C reaches only this process, and
/// without stdin (a background group reading the terminal would be stopped).
/// Returns the launcher's exit status, or after a signal was passed on 128 + the
/// first signal (130 for SIGINT, 143 for SIGTERM: "stopped, resume me"), as the
/// ranks exit, whatever the launcher says (Hydra exits 0, Open MPI 138), unless the
/// launcher reports another failure.
fn supervise(argv: &[String]) -> Result<i32> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let flags = [SIGINT, SIGTERM].map(|sig| (sig, Arc::new(AtomicBool::new(false))));
    for (sig, flag) in &flags {
        signal_hook::flag::register(*sig, Arc::clone(flag))
            .context("cannot install the SIGINT/SIGTERM handlers")?;
    }
    let mut child = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("cannot run {}", argv[0]))?;
    let mut first_signal = None;
    loop {
        if let Some(status) = child.try_wait()? {
            let code = status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
            return Ok(exit_status(code, first_signal));
        }
        for (sig, flag) in &flags {
            if !flag.swap(false, Ordering::SeqCst) {
                continue;
            }
            let (to, name, what) = match first_signal {
                None => (
                    SIGUSR1,
                    "SIGUSR1",
                    "every rank stops after the step in progress and rank 0 writes a \
                     checkpoint (Ctrl-C again to abort at once)",
                ),
                Some(_) => (SIGTERM, "SIGTERM", "aborting the job"),
            };
            first_signal.get_or_insert(*sig);
            crate::errln!(
                "launch: passing the signal on to {} as {name}: {what}",
                argv[0]
            );
            // SAFETY: kill has no memory-safety preconditions; the pid is our own
            // child's, which has not been reaped yet (try_wait above saw it running).
            unsafe { libc::kill(child.id() as libc::pid_t, to) };
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `launch`'s exit status from the launcher's `code`, given the first signal passed
/// on (if any): 128 + that signal when the job stopped as asked (the launcher's 0,
/// or a rank's stop status 130, 143, 138), else the launcher's code.
fn exit_status(code: i32, first_signal: Option<i32>) -> i32 {
    match first_signal {
        Some(sig) if matches!(code, 0 | 130 | 138 | 143) => 128 + sig,
        _ => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_passed_on_exits_with_the_users_signal_and_failures_stay() {
        // Hydra reports 0 after forwarding; Open MPI the ranks' 138.
        assert_eq!(exit_status(0, Some(libc::SIGINT)), 130);
        assert_eq!(exit_status(138, Some(libc::SIGINT)), 130);
        assert_eq!(exit_status(0, Some(libc::SIGTERM)), 143);
        // A rank's error during the stop is still a failure.
        assert_eq!(exit_status(1, Some(libc::SIGINT)), 1);
        // No signal: the launcher's status.
        assert_eq!(exit_status(0, None), 0);
        assert_eq!(exit_status(255, None), 255);
    }
}
