//! Data-parallel training under a real MPI launcher (`mpirun`): the same run on 1, 2
//! and 3 ranks, with and without ZeRO-1, resumed across world sizes; errors, killed
//! and stopped ranks end the job. Built only with `--features mpi`; needs `mpirun`
//! on PATH (or `NANOGPT_MPIRUN`). Open MPI and MPICH are both driven.

#![cfg(feature = "mpi")]

use nanogpt::checkpoint::Checkpoint;
use nanogpt::model::ParamLayout;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

mod common;
use common::{metric, read_json, succeeds, temp_dir, text, BIN, TINY_SHAKESPEARE};

/// [`TINY_SHAKESPEARE`] as the jobs here train it: one thread per rank, four
/// evaluation batches every 5 iterations, a short schedule, a checkpoint at every
/// evaluation, and a collective timeout.
const JOB: [&str; 6] = [
    "eval_iters=4",
    "eval_interval=5",
    "lr_decay_iters=10",
    "threads=1",
    "always_save_checkpoint=true",
    "collective_timeout_s=60",
];

/// `train` with the settings of every job, then `extra` (later keys win).
fn train_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [&["train"], &TINY_SHAKESPEARE[..], &JOB, extra].concat()
}

/// One MPI job at a time: the machine may have two cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// The directory every job runs in (the dataset is prepared there once).
fn workdir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = temp_dir("mpi");
        let prepare = ["prepare", "shakespeare", "--out", "data/shakespeare_char"];
        succeeds(common::command(dir.path(), prepare).args(["--tokenizer", "char"]));
        dir
    })
    .path()
}

fn mpirun() -> String {
    std::env::var("NANOGPT_MPIRUN").unwrap_or_else(|_| "mpirun".into())
}

fn is_open_mpi() -> bool {
    static OPEN: OnceLock<bool> = OnceLock::new();
    *OPEN.get_or_init(|| {
        let out = Command::new(mpirun()).arg("--version").output();
        let out = out.unwrap_or_else(|e| panic!("cannot run `{}`: {e}; install an MPI", mpirun()));
        text(&out.stdout).contains("Open MPI")
    })
}

/// `mpirun -n N nanogpt train TINY... extra...` (N = 0: no launcher at all).
fn command(ranks: usize, extra: &[&str]) -> Command {
    let mut cmd = if ranks == 0 {
        Command::new(BIN)
    } else {
        let mut cmd = Command::new(mpirun());
        cmd.args(["-n", &ranks.to_string()]);
        if is_open_mpi() {
            // Two cores, up to three ranks; root in CI containers.
            cmd.args(["--oversubscribe", "--bind-to", "none"]);
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
        cmd.arg(BIN);
        cmd
    };
    cmd.args(train_args(extra));
    cmd.current_dir(workdir());
    cmd
}

/// Runs with a time limit (the job is terminated past it, and the test fails).
fn run_for(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().expect("start the job");
    wait_for(child, limit)
}

fn wait_for(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            terminate(&child);
            let out = child.wait_with_output().unwrap();
            panic!(
                "the job ran past {limit:?}:\n{}\n{}",
                text(&out.stdout),
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn terminate(child: &Child) {
    for signal in ["-TERM", "-KILL"] {
        let _ = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        std::thread::sleep(Duration::from_secs(2));
    }
}

fn train(ranks: usize, out: &str, extra: &[&str]) -> String {
    let mut args = vec![format!("out_dir={out}")];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_for(command(ranks, &args), Duration::from_secs(300));
    let stderr = text(&out.stderr);
    assert!(
        out.status.success(),
        "{ranks} ranks {extra:?} failed:\n{stderr}"
    );
    text(&out.stdout)
}

/// (iteration, loss) pairs.
type Curve = Vec<(u64, f64)>;

/// The rows of `metrics.jsonl`: (iter, loss) of steps and (iter, val_loss) of evals.
fn losses(out: &str) -> (Curve, Curve) {
    let dir = workdir().join(out);
    (metric(&dir, "loss"), metric(&dir, "val_loss"))
}

fn params(out: &str) -> (ParamLayout, Vec<f32>, u64) {
    let ckpt = Checkpoint::open(&workdir().join(out)).unwrap();
    let layout = ParamLayout::new(&ckpt.state.model);
    let mut p = vec![0.0; layout.len];
    ckpt.load_params(&layout, &mut p).unwrap();
    (layout, p, ckpt.state.iter_num)
}

fn assert_same_run(a: &str, b: &str) {
    let ((sa, ea), (sb, eb)) = (losses(a), losses(b));
    assert_eq!(sa.len(), sb.len(), "{a} vs {b}: step rows");
    assert_eq!(ea.len(), eb.len(), "{a} vs {b}: eval rows");
    for ((ia, la), (ib, lb)) in sa.iter().chain(&ea).zip(sb.iter().chain(&eb)) {
        assert_eq!(ia, ib);
        let rel = (la - lb).abs() / la.abs().max(1e-6);
        assert!(
            rel <= 1e-5,
            "{a} vs {b} at iteration {ia}: loss {la} vs {lb}"
        );
    }
    let ((layout, pa, ita), (_, pb, itb)) = (params(a), params(b));
    assert_eq!(ita, itb, "checkpoint iterations");
    let mut worst = 0.0f32;
    for t in &layout.tensors {
        for (x, y) in pa[t.range()].iter().zip(&pb[t.range()]) {
            worst = worst.max((x - y).abs());
        }
    }
    // Summation order differs (per rank, then across ranks): float noise only.
    eprintln!("{a} vs {b}: largest parameter difference {worst:e}");
    assert!(
        worst <= 1e-5,
        "{a} vs {b}: parameters differ by up to {worst}"
    );
}

/// The reference: one process, no launcher.
fn reference(extra: &[&str]) -> String {
    let name = format!("ref-{}", extra.join("-").replace(['=', '_'], ""));
    if !workdir().join(&name).join("ckpt.safetensors").exists() {
        train(0, &name, extra);
    }
    name
}

#[test]
fn two_ranks_follow_the_one_process_run() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let one = reference(&["gradient_accumulation_steps=4", "max_iters=10"]);
    for stage in ["zero_stage=0", "zero_stage=1"] {
        let out = format!("two-{stage}");
        let stdout = train(
            2,
            &out,
            &["gradient_accumulation_steps=4", "max_iters=10", stage],
        );
        assert!(stdout.contains("data parallel: 2 ranks"), "{stdout}");
        assert_same_run(&one, &out);
        let report = read_json(&workdir().join(&out).join("comm.json"));
        assert_eq!(report["world_size"], 2);
        assert_eq!(report["steps"], 10, "11 steps, the first left out");
        assert!(
            report["reduce_alone_ms"].as_f64().unwrap() > 0.0,
            "{report}"
        );
    }
}

#[test]
fn checkpoints_resume_on_another_number_of_ranks() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let acc = "gradient_accumulation_steps=6";
    let full = reference(&[acc, "max_iters=10"]);
    // Saved by 3 ranks with sharded AdamW state at iteration 5 ...
    for (resume_ranks, stage) in [(1, "zero_stage=0"), (2, "zero_stage=1")] {
        let out = format!("resume-{resume_ranks}");
        // (Iterations 0..=4: the final state resumes at 5.)
        train(3, &out, &[acc, "max_iters=4", "zero_stage=1"]);
        assert_eq!(params(&out).2, 5);
        let state = read_json(&workdir().join(&out).join("ckpt.json"));
        assert_eq!(state["world_size"], 3);
        // ... continues on 1 or 2 ranks exactly as the uninterrupted run.
        train(
            resume_ranks,
            &out,
            &[acc, "max_iters=10", "init_from=resume", stage],
        );
        assert_same_run(&full, &out);
    }
}

#[test]
fn an_uneven_split_of_micro_steps_is_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = run_for(
        command(2, &["gradient_accumulation_steps=3", "out_dir=uneven"]),
        Duration::from_secs(120),
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank 0 of 2") || stderr.contains("rank 1 of 2"),
        "{stderr}"
    );
    assert!(
        stderr.contains("must be a multiple of the number of ranks (2); use 2 or 4"),
        "{stderr}"
    );
}

#[test]
fn an_error_on_one_rank_ends_every_rank() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // MPMD launch: rank 1 is given a dataset that does not exist.
    let common = ["out_dir=one-bad", "gradient_accumulation_steps=2"];
    let mut cmd = command(1, &common);
    cmd.args([":", "-n", "1", BIN])
        .args(train_args(&common))
        .arg("dataset=no-such-data");
    let start = Instant::now();
    let out = run_for(cmd, Duration::from_secs(120));
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("error: rank 1 of 2"), "{stderr}");
    assert!(stderr.contains("no-such-data"), "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(60), "ended promptly");
}

/// The pid of rank `rank` among the processes running `BIN` with `out_dir`.
fn rank_pid(out_dir: &str, rank: usize) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        let arg = format!("out_dir={out_dir}\0");
        if !cmdline.starts_with(BIN) || !cmdline.contains(&arg) {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let environ = String::from_utf8_lossy(&environ);
        let is_rank = environ.split('\0').any(|kv| {
            ["OMPI_COMM_WORLD_RANK=", "PMI_RANK="]
                .iter()
                .any(|k| kv == format!("{k}{rank}"))
        });
        if is_rank {
            return Some(pid);
        }
    }
    None
}

/// Starts a long 2-rank run, waits for its first checkpoint, sends `signal` to rank
/// 1, and returns the job's output and how long it took to end after the signal.
fn fault(out: &str, signal: &str, timeout_s: &str) -> (Output, Duration) {
    let mut cmd = command(
        2,
        &[
            &format!("out_dir={out}"),
            "gradient_accumulation_steps=2",
            "max_iters=100000",
            "lr_decay_iters=100000",
            "eval_interval=20",
            timeout_s,
        ],
    );
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let ckpt = workdir().join(out).join("ckpt.safetensors");
    let start = Instant::now();
    while !ckpt.exists() {
        assert!(child.try_wait().unwrap().is_none(), "the job ended early");
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = rank_pid(out, 1).expect("rank 1's process");
    Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    let killed = Instant::now();
    let out = wait_for(child, Duration::from_secs(90));
    // A stopped process would outlive the job if the launcher left it behind.
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .stderr(Stdio::null())
        .status();
    (out, killed.elapsed())
}

#[test]
fn a_killed_rank_ends_the_job_and_the_run_resumes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (out, took) = fault("killed", "-KILL", "collective_timeout_s=20");
    assert!(!out.status.success(), "the job must fail");
    assert!(took < Duration::from_secs(30), "ended after {took:?}");
    // The last checkpoint is intact and the run continues from it.
    let saved = params("killed").2;
    assert!(saved >= 20 && saved.is_multiple_of(20), "{saved}");
    let until = format!("max_iters={}", saved + 3);
    train(
        2,
        "killed",
        &["gradient_accumulation_steps=2", &until, "init_from=resume"],
    );
    let (steps, _) = losses("killed");
    assert_eq!(steps.last().unwrap().0, saved + 3);
}

#[test]
fn a_stopped_rank_trips_the_watchdog() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (out, took) = fault("stopped", "-STOP", "collective_timeout_s=3");
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "the job must fail:\n{stderr}");
    assert!(stderr.contains("rank 0 of 2"), "{stderr}");
    assert!(stderr.contains("made no progress for 3 s"), "{stderr}");
    assert!(took < Duration::from_secs(30), "ended after {took:?}");
}

#[test]
fn sigterm_to_one_rank_stops_every_rank_at_the_same_step() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Only rank 1 is signalled; rank 0 learns of it with the step's loss all-reduce,
    // writes the checkpoint and says so. Disagreeing ranks would hang (watchdog).
    let (out, took) = fault("sigterm", "-TERM", "collective_timeout_s=20");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(took < Duration::from_secs(30), "ended after {took:?}");
    assert_eq!(out.status.code(), Some(143), "{stdout}\n{stderr}");
    assert!(!stderr.contains("made no progress"), "{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("stopped by SIGTERM after iteration "))
        .unwrap_or_else(|| panic!("no stop line:\n{stdout}\n{stderr}"));
    let last: u64 = line["stopped by SIGTERM after iteration ".len()..]
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let ckpt = format!("sigterm/ckpt-{:06}.safetensors", last + 1);
    assert!(line.contains(&ckpt), "{line}");
    let saved = Checkpoint::open_file(&workdir().join(&ckpt)).unwrap();
    assert_eq!(saved.state.iter_num, last + 1);
    // It resumes from there.
    let until = format!("max_iters={}", last + 3);
    let stdout = train(
        2,
        "sigterm",
        &["gradient_accumulation_steps=2", &until, "init_from=resume"],
    );
    assert!(
        stdout.contains(&format!("resuming from {ckpt} at iteration {}", last + 1)),
        "{stdout}"
    );
}
