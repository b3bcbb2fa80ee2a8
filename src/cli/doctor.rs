//! `nanogpt doctor [CONFIG.toml] [key=value ...] [--json]`.

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// The run's TOML config and `key=value` overrides, as given to `train`.
    #[arg(value_name = "CONFIG.toml | key=value")]
    pub args: Vec<String>,
    /// Print one JSON object {"ok", "ranks", "placement", "warnings", "all_reduce"}.
    #[arg(long)]
    pub json: bool,
}

/// Checks the job; returns 0 when every rank can train as rank 0 does, else 1.
pub fn run(args: DoctorArgs) -> Result<i32> {
    let comm = crate::dist::init()?;
    let (config_path, overrides) = super::train::split_args(&args.args);
    let cfg = crate::dist::preflight::shared_config(&*comm, config_path, overrides)?;
    comm.set_timeout(std::time::Duration::from_secs_f64(cfg.collective_timeout_s));
    crate::dist::heartbeat::set_timeout(std::time::Duration::from_secs_f64(
        cfg.heartbeat_timeout_s,
    ));
    let threads = crate::threads::init_pool(cfg.threads, comm.local_size())?;
    let report = crate::doctor::run(&*comm, &cfg, threads)?;
    if comm.rank() == 0 {
        match args.json {
            true => crate::outln!("{}", serde_json::to_string(&report)?),
            false => crate::outln!("{}", crate::doctor::table(&report).trim_end()),
        }
    }
    Ok(if report.ok { 0 } else { 1 })
}
