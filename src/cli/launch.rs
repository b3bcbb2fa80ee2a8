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

/// Prints the line; unless `--dry-run`, runs `doctor` with it, then the job.
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
    use std::os::unix::process::CommandExt;
    let err = std::process::Command::new(&train[0])
        .args(&train[1..])
        .exec();
    Err(err).with_context(|| format!("cannot run {mpirun}"))
}
