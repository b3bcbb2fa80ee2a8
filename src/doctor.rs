//! `nanogpt doctor`: the pre-flight check of a job, alone or under the same
//! launcher as the training run. Every rank reports its host, binary, CPU path,
//! memory and the fingerprint of the data it would read; rank 0 adds whether it
//! can write `out_dir`; the ranks measure an all-reduce of the gradient's size.
//! Rank 0 prints one table (or JSON) and every rank exits non-zero when anything
//! differs from rank 0 or cannot work.

use crate::config::TrainConfig;
use crate::dist::preflight::{self, Fingerprint};
use crate::dist::{Collective, GradPlan, Reduce, Reported};
use crate::kernels::bf16::Backend;
use crate::model::ParamLayout;
use crate::plan;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};

/// One rank's row.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankRow {
    pub rank: usize,
    pub host: String,
    pub binary: String,
    /// The matmul paths: f32 (AVX-512 or AVX2) and bf16 (oneDNN, AMX-BF16,
    /// AVX512-BF16, or the f32 GEMM).
    pub cpu: String,
    pub threads: usize,
    pub cores: usize,
    pub mem_available_gib: f64,
    /// This rank's planned peak memory for the run (`nanogpt plan`), MB; None when
    /// it cannot be planned (the problem says why).
    pub planned_mb: Option<f64>,
    /// The dataset folder as this rank resolves it, and its fingerprint.
    pub data_dir: String,
    pub data_fingerprint: String,
    /// Rank 0 only: whether `out_dir` can be written (None elsewhere).
    pub out_dir_writable: Option<bool>,
    /// The interface (and its address) whose route reaches the other ranks' hosts,
    /// e.g. `eth0 10.0.0.1`; `local` when every rank is on this host.
    #[serde(default)]
    pub interface: String,
    /// The interface settings MPI was given (`btl_tcp_if_include=eth0`, ...), empty
    /// when it chooses by itself.
    #[serde(default)]
    pub mpi_interface: Vec<String>,
    /// The networks MPI may choose between on this host (running, non-loopback).
    #[serde(default)]
    pub networks: Vec<crate::launch::probe::Network>,
    /// What is wrong on this rank (empty: nothing).
    pub problems: Vec<String>,
}

/// The measured all-reduce of the gradient's size.
#[derive(Clone, Debug, Default, Serialize)]
pub struct AllReduce {
    pub bytes: usize,
    pub ms: f64,
    /// Bytes of the buffer per second of all-reduce, GB/s.
    pub gb_per_s: f64,
    /// An all-reduce of one number, µs (the median of 20).
    pub latency_us: f64,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub ok: bool,
    pub ranks: Vec<RankRow>,
    pub placement: String,
    pub warnings: Vec<String>,
    pub all_reduce: AllReduce,
    /// What the check of the ZeRO 1-3 gradient reductions compared
    /// (`dist::check_reductions`); a difference is a problem of the rank.
    pub reduce_check: String,
}

/// Runs the checks (a collective: every rank calls it); every rank returns the
/// report (complete on rank 0, which prints it).
pub fn run(comm: &dyn Collective, cfg: &TrainConfig, threads: usize) -> Result<Report> {
    let root = comm.rank() == 0;
    // Rank 0 prepares a built-in dataset first, as `train` does.
    if !root {
        comm.barrier_patient();
    }
    let data_dir = crate::data::find_or_prepare_dataset(&cfg.dataset);
    if root {
        comm.barrier_patient();
    }
    let mut problems = Vec::new();
    let (dir_text, print) = match &data_dir {
        Ok(dir) => (dir.display().to_string(), Fingerprint::of(dir)?),
        Err(e) => {
            problems.push(format!("{e:#}"));
            (
                cfg.dataset.clone(),
                Fingerprint::of(Path::new(&cfg.dataset))?,
            )
        }
    };
    // Rank 0's fingerprint, compared here.
    let mut bytes = match root {
        true => serde_json::to_vec(&print)?,
        false => Vec::new(),
    };
    comm.broadcast_bytes(&mut bytes, 0);
    let root_print: Fingerprint = serde_json::from_slice(&bytes)?;
    if let Ok(dir) = &data_dir {
        problems.extend(print.differences(&root_print, dir));
    }
    let backend = Backend::detect(cfg.bf16_kernel_request());
    let planned_mb = match plan_memory(comm, cfg, &backend) {
        Ok((mb, refused)) => {
            problems.extend(refused);
            Some(mb)
        }
        Err(e) => {
            // A missing dataset is already the problem; the plan needs its vocabulary.
            if data_dir.is_ok() {
                problems.push(format!("cannot plan the run's memory: {e:#}"));
            }
            None
        }
    };
    let reduce_check = crate::dist::check_reductions(comm).unwrap_or_else(|e| {
        problems.push(e.clone());
        e
    });
    let out_dir_writable = root.then(|| match out_dir_writable(&cfg.out_dir) {
        Ok(()) => true,
        Err(e) => {
            problems.push(e);
            false
        }
    });
    let row = RankRow {
        rank: comm.rank(),
        host: match comm.world_size() {
            1 => crate::dist::this_host(),
            _ => comm.host(),
        },
        binary: print.binary.clone(),
        cpu: cpu_path(&backend),
        threads,
        cores: crate::threads::host_cores().unwrap_or(0),
        mem_available_gib: mem_available_gib(),
        planned_mb,
        data_dir: dir_text,
        data_fingerprint: format!("{:016x}", print.digest()),
        out_dir_writable,
        interface: crate::dist::route::interface_to(&comm.hosts(), &comm.host()),
        mpi_interface: crate::dist::route::mpi_interface_settings(),
        networks: crate::launch::probe::this_host().networks,
        problems,
    };
    let rows: Vec<RankRow> = preflight::all_gather_text(comm, &serde_json::to_string(&row)?)
        .iter()
        .map(|t| serde_json::from_str(t))
        .collect::<Result<_, _>>()?;
    // The gradient's size: the config's architecture on the dataset's vocabulary.
    let vocab = data_dir
        .as_ref()
        .ok()
        .and_then(|d| crate::data::Meta::load(d).ok())
        .map_or(50257, |m| m.vocab_size);
    let all_reduce = measure_all_reduce(comm, cfg, vocab);
    let hosts: Vec<String> = rows.iter().map(|r| r.host.clone()).collect();
    let threads: Vec<u64> = rows.iter().map(|r| r.threads as u64).collect();
    let cores: Vec<u64> = rows.iter().map(|r| r.cores as u64).collect();
    let (placement, mut warnings) = preflight::placement(&hosts, &threads, &cores);
    warnings.extend(network_warnings(&rows));
    let ok = rows.iter().all(|r| r.problems.is_empty());
    Ok(Report {
        ok,
        ranks: rows,
        placement,
        warnings,
        all_reduce,
        reduce_check,
    })
}

/// This rank's planned peak (MB), and `train`'s refusal when this host's ranks
/// together would need more memory than it has.
fn plan_memory(
    comm: &dyn Collective,
    cfg: &TrainConfig,
    backend: &Backend,
) -> Result<(f64, Option<String>)> {
    let (w, local) = (comm.world_size(), comm.local_size());
    let (input, _, refused) = plan::check_run(cfg, w, local, backend)?;
    Ok((plan::rank_plan(&input, comm.rank()).peak_rss_mb, refused))
}

/// When MPI was told no interface: hosts with several networks, and an address
/// that several hosts share (docker0's), which can make a start-up hang.
fn network_warnings(ranks: &[RankRow]) -> Vec<String> {
    if ranks.iter().any(|r| !r.mpi_interface.is_empty()) {
        return Vec::new();
    }
    let mut hosts: Vec<(String, crate::launch::probe::HostInfo)> = Vec::new();
    for r in ranks {
        if !hosts.iter().any(|(h, _)| *h == r.host) {
            let info = crate::launch::probe::HostInfo {
                host: r.host.clone(),
                binary: r.binary.clone(),
                build: String::new(),
                mpi: None,
                networks: r.networks.clone(),
            };
            hosts.push((r.host.clone(), info));
        }
    }
    let (shared, several) = crate::launch::probe::networks(&hosts, None);
    shared
        .into_iter()
        .chain(several)
        .map(|w| format!("{w} (this start-up worked, but another may not)"))
        .collect()
}

/// What the launcher told MPI about the network: one line for all ranks when they
/// were told the same, else one per rank; nothing when no rank was told anything.
fn interface_settings_line(ranks: &[RankRow]) -> String {
    let told = |r: &RankRow| match r.mpi_interface.is_empty() {
        true => "nothing (MPI chooses)".to_string(),
        false => r.mpi_interface.join(", "),
    };
    if ranks.iter().all(|r| r.mpi_interface.is_empty()) {
        return String::new();
    }
    if ranks
        .iter()
        .all(|r| r.mpi_interface == ranks[0].mpi_interface)
    {
        return format!("network: every rank was told {}\n", told(&ranks[0]));
    }
    ranks
        .iter()
        .map(|r| format!("network: rank {} was told {}\n", r.rank, told(r)))
        .collect()
}

/// Creates `out_dir` if needed and writes (then removes) a probe file in it.
fn out_dir_writable(dir: &Path) -> Result<(), String> {
    let fail = |e: std::io::Error| format!("out_dir {} is not writable: {e}", dir.display());
    std::fs::create_dir_all(dir).map_err(fail)?;
    let probe = dir.join(".nanogpt-doctor-probe");
    std::fs::write(&probe, b"probe").map_err(fail)?;
    std::fs::remove_file(&probe).map_err(fail)
}

/// The matmul paths this CPU takes: f32, and bf16 (the kernel a bfloat16 run of the
/// config uses, `backend`'s).
fn cpu_path(backend: &Backend) -> String {
    use crate::kernels::bf16::Kernel;
    #[cfg(target_arch = "x86_64")]
    let f32_path = match std::is_x86_feature_detected!("avx512f") {
        true => "AVX-512 f32",
        false => "AVX2 f32",
    };
    #[cfg(not(target_arch = "x86_64"))]
    let f32_path = "portable f32";
    let bf16_path = match backend.kernel() {
        Kernel::OneDnn => "bf16 on oneDNN",
        Kernel::Amx => "bf16 on AMX-BF16",
        Kernel::Avx512Bf16 => "bf16 on AVX512-BF16",
        Kernel::F32 => "bf16 via f32 GEMM",
    };
    format!("{f32_path}, {bf16_path}")
}

/// `MemAvailable` of /proc/meminfo, GiB (0 when unknown).
fn mem_available_gib() -> f64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / (1024.0 * 1024.0))
}

/// The config's gradient (every parameter, f32) all-reduced: the best of three,
/// and the latency of a one-number all-reduce (median of 20).
fn measure_all_reduce(comm: &dyn Collective, cfg: &TrainConfig, vocab: usize) -> AllReduce {
    let model = cfg.model_config(vocab);
    let n = ParamLayout::new(&model).len;
    // One bucket: the whole gradient.
    let whole = [std::ops::Range { start: 0, end: n }];
    let plan = GradPlan::new(&whole, n, comm.world_size(), comm.rank(), 0);
    let grads = vec![1.0f32; n];
    let (mut send, mut recv) = (vec![0.0; plan.send_len], vec![0.0; plan.recv_len]);
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        comm.reduce_during_backward(
            Reduce::AllReduce,
            &plan.buckets,
            &mut send,
            &mut recv,
            &mut |hook| hook(Reported::Final(0..n, &grads)),
        );
        best = best.min(start.elapsed());
    }
    let mut lat = Vec::with_capacity(20);
    for _ in 0..20 {
        let mut v = [1.0f64];
        let start = Instant::now();
        comm.all_reduce_sum_f64(&mut v);
        lat.push(start.elapsed());
    }
    lat.sort();
    let secs = best.as_secs_f64();
    AllReduce {
        bytes: n * 4,
        ms: secs * 1e3,
        gb_per_s: if secs > 0.0 {
            n as f64 * 4.0 / secs / 1e9
        } else {
            0.0
        },
        latency_us: lat[lat.len() / 2].as_secs_f64() * 1e6,
    }
}

/// The report as a table, one row per rank.
pub fn table(report: &Report) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<5} {:<14} {:<58} {:<32} {:>7} {:>9} {:>9} {:<17} {:<8} {}\n",
        "rank",
        "host",
        "binary",
        "cpu",
        "threads",
        "mem GiB",
        "plan MB",
        "data",
        "out_dir",
        "network"
    ));
    for r in &report.ranks {
        let out_dir = match r.out_dir_writable {
            Some(true) => "writable",
            Some(false) => "NO",
            None => "-",
        };
        out.push_str(&format!(
            "{:<5} {:<14} {:<58} {:<32} {:>7} {:>9.1} {:>9} {:<17} {:<8} {}\n",
            r.rank,
            r.host,
            r.binary,
            r.cpu,
            format!("{}/{}", r.threads, r.cores),
            r.mem_available_gib,
            r.planned_mb
                .map_or("-".to_string(), |mb| format!("{mb:.0}")),
            r.data_fingerprint,
            out_dir,
            r.interface
        ));
    }
    out.push_str(&interface_settings_line(&report.ranks));
    out.push_str(&report.placement);
    out.push('\n');
    let a = &report.all_reduce;
    out.push_str(&format!(
        "all-reduce of the gradient ({:.1} MB): {:.1} ms, {:.2} GB/s; latency {:.0} µs\n",
        a.bytes as f64 / 1e6,
        a.ms,
        a.gb_per_s,
        a.latency_us
    ));
    out.push_str(&format!(
        "gradient reductions: {}
",
        report.reduce_check
    ));
    for w in &report.warnings {
        out.push_str(&format!("warning: {w}\n"));
    }
    for r in &report.ranks {
        for p in &r.problems {
            out.push_str(&format!(
                "problem: rank {} (host {}): {p}\n",
                r.rank, r.host
            ));
        }
    }
    out.push_str(match report.ok {
        true => "ok: every rank has the same binary and data as rank 0\n",
        false => "NOT OK: fix the problems above before training\n",
    });
    out
}
