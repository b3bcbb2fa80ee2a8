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
    /// The launcher to use (default: $NANOGPT_MPIRUN, else the one of the MPI this
    /// binary links: mpirun.openmpi, or mpiexec.hydra / mpirun.mpich).
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

/// Prints the line; unless `--dry-run`, checks every host over SSH, runs `doctor`
/// with the line, then the job (see [`supervise`] for what Ctrl-C does).
pub fn run(args: LaunchArgs) -> Result<i32> {
    if args.command.first().map(String::as_str) != Some("train") {
        bail!("launch runs `train`: write `nanogpt launch --hosts FILE -n N -- train CONFIG.toml`");
    }
    let explicit = args
        .mpirun
        .clone()
        .or_else(|| crate::tuning::env::get().mpirun.clone());
    let version = launch::probe::mpi_version();
    let library = version
        .as_deref()
        .map(|v| (crate::dist::launcher::Library::of(v), v));
    let (mpirun, flavour) = launch::pick(explicit.as_deref(), library)?;
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
    let iface = args.iface.as_deref();
    if flavour == launch::Flavour::Hydra && iface.is_some_and(|i| i.contains('/')) {
        bail!(
            "--iface {}: MPICH and Intel MPI take an interface name (e.g. eth0), not a subnet",
            iface.unwrap_or("")
        );
    }
    let binary = std::env::current_exe().context("cannot find this binary's path")?;
    let binary = binary.display().to_string();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let as_root = unsafe { libc::geteuid() } == 0;
    let job = |command: &[String], env: Vec<String>| {
        Job {
            flavour,
            mpirun: &mpirun,
            hosts: &args.hosts,
            ranks: args.ranks,
            iface,
            binary: &binary,
            command,
            env,
            as_root,
        }
        .argv()
    };
    crate::outln!(
        "{}",
        launch::shell_line(&job(&args.command, launch::forwarded_env()))
    );
    if args.dry_run {
        return Ok(0);
    }
    if version.is_none() {
        bail!(
            "this nanogpt is built without MPI support, so its ranks would each train alone: \
             build it with `cargo build --release --features mpi` (docs/multinode.md)"
        );
    }
    let hosts = &hosts[..args.ranks];
    launch::probe::check_hosts(flavour, hosts, &binary, iface)?;
    let mut doctor_cmd = args.command.clone();
    doctor_cmd[0] = "doctor".into();
    let doctor = with_hub(hosts, iface, |env| job(&doctor_cmd, env));
    let mut doctor = doctor;
    let status = doctor
        .command
        .status()
        .with_context(|| format!("cannot run {mpirun}"))?;
    if !status.success() {
        bail!("`nanogpt doctor` found problems (above); fix them, then launch again");
    }
    let train = with_hub(hosts, iface, |env| job(&args.command, env));
    supervise(train.command)
}

/// A launcher command (from `argv`, given the variables to forward) whose ranks
/// check in with a hub served here ([`crate::dist::checkin`]), kept alive with it.
struct Hubbed {
    command: std::process::Command,
    _hub: Option<crate::dist::checkin::Hub>,
}

fn with_hub(
    hosts: &[String],
    iface: Option<&str>,
    argv: impl Fn(Vec<String>) -> Vec<String>,
) -> Hubbed {
    use crate::dist::checkin::Hub;
    use crate::tuning::env::CHECKIN;
    // This host's address on the named network, offered first.
    let first = iface.and_then(|i| {
        crate::dist::route::candidates()
            .into_iter()
            .find(|a| a.name == i)
            .map(|a| a.ip)
    });
    let hub = Hub::for_launch(hosts.len(), hosts, first);
    let mut env = launch::forwarded_env();
    env.retain(|v| v != CHECKIN);
    if hub.is_some() {
        env.push(CHECKIN.into());
    }
    let argv = argv(env);
    let mut command = std::process::Command::new(&argv[0]);
    command.args(&argv[1..]);
    if let Some(hub) = &hub {
        command.env(CHECKIN, hub.invitation.encode());
    }
    Hubbed { command, _hub: hub }
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
fn supervise(mut command: std::process::Command) -> Result<i32> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let flags = [SIGINT, SIGTERM].map(|sig| (sig, Arc::new(AtomicBool::new(false))));
    for (sig, flag) in &flags {
        signal_hook::flag::register(*sig, Arc::clone(flag))
            .context("cannot install the SIGINT/SIGTERM handlers")?;
    }
    let launcher = command.get_program().to_string_lossy().into_owned();
    let mut child = command
        .stdin(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("cannot run {launcher}"))?;
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
            crate::errln!("launch: passing the signal on to {launcher} as {name}: {what}");
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
