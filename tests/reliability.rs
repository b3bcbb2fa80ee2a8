//! Crash safety of training, driving the binary: runs killed with SIGKILL mid-step,
//! mid-evaluation and mid-checkpoint resume with the losses of a run that was never
//! interrupted; SIGINT/SIGTERM checkpoint and exit 130/143; non-finite steps are
//! skipped and stop the run when they persist; a checkpoint that cannot be written
//! (file-size limit, permissions) stops the run and leaves the previous one intact.
//!
//! The exact points of failure come from the test-only `NANOGPT_FAULT` hook
//! (src/fault.rs).

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, ChildStderr, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{
    command, metric, read_json, refused, succeeds, temp_dir, text, BIN, TINY_SHAKESPEARE,
};

/// The suite's runs: [`TINY_SHAKESPEARE`] into `run/`, with an evaluation every 4
/// iterations and an interval checkpoint every 3.
const SCHEDULE: [&str; 3] = ["eval_interval=4", "ckpt_interval=3", "out_dir=run"];

/// `nanogpt train TINY_SHAKESPEARE... SCHEDULE... extra...` in `dir`, with
/// `NANOGPT_FAULT=fault` if given.
fn train_command(dir: &Path, extra: &[&str], fault: Option<&str>) -> Command {
    let args = [&["train"], &TINY_SHAKESPEARE[..], &SCHEDULE, extra].concat();
    let mut cmd = command(dir, args);
    if let Some(fault) = fault {
        cmd.env("NANOGPT_FAULT", fault);
    }
    cmd
}

fn run(dir: &Path, extra: &[&str], fault: Option<&str>) -> Output {
    common::run(&mut train_command(dir, extra, fault))
}

/// Trains successfully; returns stdout.
fn train(dir: &Path, extra: &[&str]) -> String {
    succeeds(&mut train_command(dir, extra, None)).0
}

/// The step rows of `metrics.jsonl`: (iter, loss bits), for exact comparison.
fn step_losses(out_dir: &Path) -> Vec<(u64, u32)> {
    metric(out_dir, "loss")
        .into_iter()
        .map(|(iter, loss)| (iter, (loss as f32).to_bits()))
        .collect()
}

/// The losses of an uninterrupted run to `max_iters` (in its own directory).
fn reference(max_iters: u64) -> Vec<(u64, u32)> {
    let dir = temp_dir("reference");
    train(dir.path(), &[&format!("max_iters={max_iters}")]);
    let losses = step_losses(&dir.path().join("run"));
    assert_eq!(losses.len() as u64, max_iters + 1);
    losses
}

/// Resumes `dir/run` to `max_iters`; returns stdout and stderr.
fn resume(dir: &Path, max_iters: u64) -> (String, String) {
    let until = format!("max_iters={max_iters}");
    succeeds(&mut train_command(dir, &[&until, "init_from=resume"], None))
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn temp_files(dir: &Path) -> Vec<String> {
    files(dir)
        .into_iter()
        .filter(|n| n.contains(".tmp"))
        .collect()
}

/// Kills a run with `fault`, resumes it and compares every loss with an
/// uninterrupted run's, bit for bit; returns the resumed run's stdout and stderr.
fn kill_and_resume(tag: &str, fault: &str, resumes_from: &str) -> (String, String) {
    let dir = temp_dir(tag);
    let d = dir.path();
    let out = run(d, &["max_iters=12"], Some(fault));
    assert_eq!(
        out.status.signal(),
        Some(9),
        "{fault}: killed by SIGKILL:\n{}",
        text(&out.stderr)
    );
    let (stdout, stderr) = resume(d, 12);
    assert!(
        stdout.contains(&format!("resuming from run/{resumes_from}")),
        "{fault}: {stdout}"
    );
    assert_eq!(
        step_losses(&d.join("run")),
        reference(12),
        "{fault}: the resumed losses differ from the uninterrupted run's"
    );
    (stdout, stderr)
}

#[test]
fn interval_checkpoints_keep_the_newest_and_resume_picks_the_latest() {
    let dir = temp_dir("interval");
    let d = dir.path();
    train(d, &["max_iters=8", "keep_last=2"]);
    let run_dir = d.join("run");
    // Interval checkpoints at 3, 6, 9 (the last one the final state, after iteration
    // 8): the newest two are kept, with their JSON.
    assert_eq!(
        files(&run_dir),
        [
            ".nanogpt.lock",
            "ckpt-000006.json",
            "ckpt-000006.safetensors",
            "ckpt-000009.json",
            "ckpt-000009.safetensors",
            "ckpt.json",
            "ckpt.safetensors",
            "loss.png",
            "metrics.jsonl"
        ]
    );
    let state = read_json(&run_dir.join("ckpt-000009.json"));
    assert_eq!(state["iter_num"], 9);
    assert_eq!(state["adam_step"], 9);
    // ckpt.safetensors is from the evaluation at 8; the interval one at 9 is newer.
    let (stdout, _) = resume(d, 12);
    assert!(
        stdout.contains("resuming from run/ckpt-000009.safetensors at iteration 9"),
        "{stdout}"
    );
    assert_eq!(step_losses(&run_dir), reference(12));
}

#[test]
fn killed_mid_step_resumes_exactly() {
    // Killed in iteration 7, before its update: the checkpoint at 6 is the latest.
    kill_and_resume("step", "kill-during-step:7", "ckpt-000006.safetensors");
}

#[test]
fn killed_mid_evaluation_resumes_exactly() {
    // Killed in the evaluation at 8, before it could save: 6 is the latest.
    kill_and_resume("eval", "kill-during-eval:8", "ckpt-000006.safetensors");
}

#[test]
fn killed_mid_checkpoint_write_resumes_from_the_previous_one() {
    // Killed with half of ckpt-000009's temporary file written: the evaluation's
    // checkpoint at 8 is the newest complete one; the temporary file is ignored.
    let (_, stderr) = kill_and_resume(
        "ckpt",
        "kill-during-checkpoint:9",
        "ckpt.safetensors at iteration 8",
    );
    assert!(
        stderr.contains("note: ignoring run/.ckpt-000009.safetensors.tmp-")
            && stderr.contains("left by an interrupted checkpoint write"),
        "{stderr}"
    );
}

#[test]
fn killed_at_an_arbitrary_moment_resumes_exactly() {
    let dir = temp_dir("anytime");
    let d = dir.path();
    let mut child = train_command(
        d,
        &["max_iters=300", "ckpt_interval=20", "eval_interval=50"],
        None,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let metrics = d.join("run/metrics.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 60 {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(start.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    assert_eq!(child.wait().unwrap().signal(), Some(9));
    let out = run(
        d,
        &["max_iters=300", "eval_interval=50", "init_from=resume"],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let dir2 = temp_dir("anytime-ref");
    train(dir2.path(), &["max_iters=300", "eval_interval=50"]);
    assert_eq!(
        step_losses(&d.join("run")),
        step_losses(&dir2.path().join("run"))
    );
}

/// Spawns `cmd` (a run with a `pause-during-step` fault) and waits until it pauses;
/// returns the child, the rest of its stderr and what it printed there so far.
fn start_paused(cmd: &mut Command) -> (Child, BufReader<ChildStderr>, String) {
    let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("fault injection: pausing") {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "the run ended before pausing:\n{seen}"
        );
        seen.push_str(&line);
    }
    (child, stderr, seen)
}

/// Starts a run that pauses 1.5 s in iteration 5 and sends it `signals` (with
/// `gap` between them) once it pauses; returns its output and how long it took
/// to exit after the last signal.
fn signal_during_pause(d: &Path, signals: &[&str], gap: Duration) -> (Output, Duration) {
    let mut cmd = train_command(
        d,
        &["max_iters=12", "ckpt_interval=0"],
        Some("pause-during-step:5:1500"),
    );
    let (child, mut stderr, seen) = start_paused(cmd.stdout(Stdio::piped()));
    let pid = child.id().to_string();
    for (i, signal) in signals.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(gap);
        }
        let sent = Command::new("kill")
            .args([signal, pid.as_str()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {signal}");
    }
    let sent = Instant::now();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    let mut out = child.wait_with_output().unwrap();
    let took = sent.elapsed();
    out.stderr = (seen + &rest).into_bytes();
    (out, took)
}

#[test]
fn a_second_run_on_the_same_out_dir_is_refused_while_the_first_lasts() {
    let dir = temp_dir("two-writers");
    let d = dir.path();
    let mut cmd = train_command(d, &["max_iters=12"], Some("pause-during-step:5:20000"));
    let (mut first, _stderr, _) = start_paused(cmd.stdout(Stdio::null()));
    let lock_file = d.join("run/.nanogpt.lock");
    let before = (contents(&d.join("run")), std::fs::read(&lock_file).unwrap());
    let holder = format!("in use by a training run (pid {} on host", first.id());
    for extra in [&["max_iters=12"][..], &["max_iters=12", "init_from=resume"]] {
        let started = Instant::now();
        let out = run(d, extra, None);
        let msg = refused(&out);
        assert!(
            msg.contains(&holder) && msg.contains("out_dir"),
            "{extra:?}: {msg}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "refused promptly"
        );
    }
    let after = (contents(&d.join("run")), std::fs::read(&lock_file).unwrap());
    assert!(
        after == before,
        "the first run's files (and its lock) are untouched"
    );
    first.kill().unwrap();
    first.wait().unwrap();
    // The OS released the lock with the process: the run can continue.
    let out = train(d, &["max_iters=6", "init_from=resume"]);
    assert!(out.contains("iter 6"), "{out}");
}

fn signal_checkpoints_and_resumes(tag: &str, signal: &str, name: &str, code: i32) {
    let dir = temp_dir(tag);
    let d = dir.path();
    let (out, _) = signal_during_pause(d, &[signal], Duration::ZERO);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(code), "{stdout}\n{stderr}");
    // The step in progress finishes; its checkpoint resumes at 6. No interval
    // checkpoints are configured, so this one is written for the signal alone.
    let line = format!(
        "stopped by {name} after iteration 5: checkpoint written to run/ckpt-000006.safetensors; \
         continue with init_from=resume"
    );
    assert!(stdout.contains(&line), "{stdout}");
    assert!(!stdout.contains("iter 6:"), "no step after the signal");
    let (stdout, _) = resume(d, 12);
    assert!(
        stdout.contains("resuming from run/ckpt-000006.safetensors at iteration 6"),
        "{stdout}"
    );
    assert_eq!(step_losses(&d.join("run")), reference(12));
}

#[test]
fn sigint_finishes_the_step_checkpoints_and_exits_130() {
    signal_checkpoints_and_resumes("sigint", "-INT", "SIGINT", 130);
}

#[test]
fn sigterm_finishes_the_step_checkpoints_and_exits_143() {
    signal_checkpoints_and_resumes("sigterm", "-TERM", "SIGTERM", 143);
}

#[test]
fn a_second_sigint_exits_at_once() {
    let dir = temp_dir("sigint2");
    let d = dir.path();
    let (out, took) = signal_during_pause(d, &["-INT", "-INT"], Duration::from_millis(200));
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(130), "{stdout}");
    // Still inside the 1.5 s pause: the step was not finished, nothing written.
    assert!(took < Duration::from_millis(1000), "took {took:?}");
    assert!(!stdout.contains("stopped by"), "{stdout}");
    assert!(!d.join("run/ckpt-000006.safetensors").exists());
    // The evaluation's checkpoint at 4 is intact and resumes exactly.
    let (stdout, _) = resume(d, 12);
    assert!(
        stdout.contains("resuming from run/ckpt.safetensors at iteration 4"),
        "{stdout}"
    );
    assert_eq!(step_losses(&d.join("run")), reference(12));
}

#[test]
fn a_non_finite_gradient_skips_the_update_and_the_run_goes_on() {
    let dir = temp_dir("nan-skip");
    let d = dir.path();
    let out = run(d, &["max_iters=12"], Some("nan-grad:5:2"));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for (iter, n) in [(5, 1), (6, 2)] {
        let warning = format!("warning: iteration {iter}: loss ");
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&warning))
            .unwrap_or_else(|| panic!("no warning for {iter}:\n{stdout}"));
        assert!(
            line.contains("gradient norm NaN is not finite; update skipped")
                && line.contains(&format!(
                    "({n} in a row, the run stops at max_nonfinite_steps = 5)"
                )),
            "{line}"
        );
    }
    assert!(!stdout.contains("warning: iteration 7"), "{stdout}");
    // Two updates fewer than iterations; the losses before the fault are the
    // reference's, the ones after differ (the model missed two updates).
    let state = read_json(&d.join("run/ckpt-000012.json"));
    assert_eq!(state["iter_num"], 12);
    assert_eq!(state["adam_step"], 10);
    let (got, want) = (step_losses(&d.join("run")), reference(12));
    assert_eq!(got[..6], want[..6], "identical up to iteration 5's loss");
    assert_ne!(got[7], want[7]);
}

#[test]
fn persistent_non_finite_steps_stop_the_run() {
    let dir = temp_dir("nan-stop");
    let d = dir.path();
    let out = run(
        d,
        &["max_iters=12", "max_nonfinite_steps=3"],
        Some("nan-grad:5:100"),
    );
    let stderr = refused(&out);
    assert!(
        stderr.contains(
            "error: 3 optimizer steps in a row (iterations 5..=7) had a non-finite loss or \
             gradient norm"
        ) && stderr.contains("max_nonfinite_steps = 3")
            && stderr.contains("then continue with init_from=resume"),
        "{stderr}"
    );
    // The checkpoint at 6 (after the skipped step 5) holds the finite weights.
    let state = read_json(&d.join("run/ckpt-000006.json"));
    assert_eq!(state["adam_step"], 5);
    assert!(temp_files(&d.join("run")).is_empty());
}

/// Stopped before its first checkpoint, a run has nothing to resume from: the
/// error says to start it again.
#[test]
fn non_finite_steps_before_any_checkpoint_say_to_start_again() {
    let dir = temp_dir("nan-first");
    let d = dir.path();
    let extra = ["max_iters=12", "max_nonfinite_steps=2"];
    let stderr = refused(&run(d, &extra, Some("nan-grad:1:100")));
    assert!(
        stderr.contains("(iterations 1..=2) had a non-finite loss")
            && stderr.contains("then start the run again (it saved no checkpoint yet)")
            && !stderr.contains("init_from=resume"),
        "{stderr}"
    );
    assert!(snapshot(&d.join("run")).is_empty());
}

#[test]
fn non_finite_parameters_are_never_checkpointed() {
    let dir = temp_dir("nan-param");
    let d = dir.path();
    // A NaN weight after iteration 4's update: iteration 5 is skipped (NaN loss),
    // then the checkpoint at 6 is refused.
    let out = run(d, &["max_iters=12"], Some("nan-param:4"));
    let stderr = refused(&out);
    assert!(
        stderr.contains(
            "refusing to write run/ckpt-000006.safetensors for iteration 6: the parameters of"
        ) && stderr.contains("hold NaN or infinite values (the previous checkpoint is kept)"),
        "{stderr}"
    );
    assert!(text(&out.stdout).contains("warning: iteration 5: loss NaN"));
    let run_dir = d.join("run");
    assert!(!run_dir.join("ckpt-000006.safetensors").exists());
    assert!(run_dir.join("ckpt-000003.safetensors").exists());
    assert!(temp_files(&run_dir).is_empty());
}

/// The name and bytes of every file in `dir` but the lock file (which records the
/// last run that held the folder, and a refused run may have been that run).
fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    files(dir)
        .into_iter()
        .filter(|n| n != ".nanogpt.lock")
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            (n, bytes)
        })
        .collect()
}

/// The checkpoints of `dir` and their bytes.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = contents(dir);
    files.retain(|(n, _)| n.starts_with("ckpt"));
    files
}

#[test]
fn a_full_disk_stops_the_run_and_keeps_the_previous_checkpoint() {
    let dir = temp_dir("full");
    let d = dir.path();
    train(d, &["max_iters=4", "ckpt_interval=2"]);
    let run_dir = d.join("run");
    let before = snapshot(&run_dir);
    assert_eq!(
        before.len(),
        6,
        "ckpt-000004, ckpt-000005 (the final state), ckpt: each with JSON"
    );
    let ckpt_len = std::fs::metadata(run_dir.join("ckpt.safetensors"))
        .unwrap()
        .len();
    let extra = ["max_iters=8", "ckpt_interval=2", "init_from=resume"];
    let out = train_on_a_full_disk(d, ckpt_len, &extra);
    let stderr = refused(&out);
    // The first run's final state resumes at 5; after iteration 5 the interval
    // checkpoint of 6 cannot be written.
    assert!(
        stderr.contains(
            "error: the checkpoint of iteration 6 was not saved (free disk space or fix the \
             permissions of run, then continue with init_from=resume): run/ckpt-000006.safetensors \
             was not written (any previous copy is intact): cannot write \
             run/.ckpt-000006.safetensors.tmp-"
        ) && stderr.trim_end().ends_with("File too large (os error 27)"),
        "{stderr}"
    );
    assert_eq!(snapshot(&run_dir), before, "the checkpoints are untouched");
    assert!(temp_files(&run_dir).is_empty(), "{:?}", files(&run_dir));
    // Without the limit the run continues exactly.
    resume(d, 8);
    assert_eq!(step_losses(&run_dir), reference(8));
}

/// [`train_command`] where files may grow to 60% of a checkpoint of `ckpt_len`
/// bytes (in 512-byte blocks): the metrics and the plot fit, a checkpoint does not.
/// SIGXFSZ is ignored so that the write fails with EFBIG ("File too large"), as on
/// a full disk.
fn train_on_a_full_disk(d: &Path, ckpt_len: u64, extra: &[&str]) -> Output {
    let blocks = ckpt_len * 6 / 10 / 512;
    let script = format!("trap '' XFSZ; ulimit -f {blocks}; exec \"$0\" \"$@\"");
    let cmd = train_command(d, extra, None);
    let args: Vec<String> = std::iter::once(BIN.to_string())
        .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
        .collect();
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .args(args)
        .current_dir(d)
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("NANOGPT_FAULT")
        .output()
        .unwrap()
}

/// A run whose first checkpoint cannot be written has nothing to resume: the error
/// says to start it again, not to resume, and the run's directory holds no
/// checkpoint or partial file.
#[test]
fn a_full_disk_at_the_first_checkpoint_says_to_start_again() {
    let dir = temp_dir("full-first");
    let d = dir.path();
    train(d, &["max_iters=2", "out_dir=sized"]);
    let ckpt_len = std::fs::metadata(d.join("sized/ckpt.safetensors"))
        .unwrap()
        .len();
    let out = train_on_a_full_disk(d, ckpt_len, &["max_iters=4", "ckpt_interval=2"]);
    let stderr = refused(&out);
    assert!(
        stderr.contains(
            "error: the checkpoint of iteration 2 was not saved (free disk space or fix the \
             permissions of run, then start the run again: it has no checkpoint to resume from \
             yet): run/ckpt-000002.safetensors was not written"
        ) && !stderr.contains("init_from=resume"),
        "{stderr}"
    );
    let run_dir = d.join("run");
    assert!(snapshot(&run_dir).is_empty(), "{:?}", files(&run_dir));
    assert!(temp_files(&run_dir).is_empty(), "{:?}", files(&run_dir));
}

/// Whether this process can write into a read-only directory (root can).
fn ignores_permissions(dir: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let probe = dir.join("probe");
    std::fs::create_dir(&probe).unwrap();
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o555)).unwrap();
    let writable = std::fs::write(probe.join("x"), b"x").is_ok();
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o755)).unwrap();
    writable
}

#[test]
fn a_read_only_out_dir_stops_the_run_and_keeps_the_previous_checkpoint() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("readonly");
    let d = dir.path();
    if ignores_permissions(d) {
        eprintln!("skipped: this user (root?) writes into read-only directories anyway");
        return;
    }
    train(d, &["max_iters=4", "ckpt_interval=2"]);
    let run_dir = d.join("run");
    let before = snapshot(&run_dir);
    let mode = |m| std::fs::Permissions::from_mode(m);
    std::fs::set_permissions(&run_dir, mode(0o555)).unwrap();
    // A fresh run into the same out_dir can still rewrite metrics.jsonl (the file
    // itself is writable) but cannot create a checkpoint beside it.
    let out = run(d, &["max_iters=8", "ckpt_interval=2"], None);
    std::fs::set_permissions(&run_dir, mode(0o755)).unwrap();
    let stderr = refused(&out);
    assert!(
        stderr.contains("error: the checkpoint of iteration 2 was not saved")
            && stderr.contains(
                "run/ckpt-000002.safetensors was not written (any previous copy is intact)"
            )
            && stderr
                .trim_end()
                .ends_with("Permission denied (os error 13)"),
        "{stderr}"
    );
    assert_eq!(snapshot(&run_dir), before);
    let (stdout, _) = resume(d, 8);
    assert!(stdout.contains("at iteration 4"), "{stdout}");
}

#[test]
fn a_malformed_fault_setting_is_refused() {
    let dir = temp_dir("fault-typo");
    let out = run(dir.path(), &["max_iters=2"], Some("kill-during-stp:1"));
    let stderr = refused(&out);
    assert!(
        stderr.contains("NANOGPT_FAULT=kill-during-stp:1"),
        "{stderr}"
    );
}

/// A run that only has interval checkpoints (no evaluation, so no best-val
/// `ckpt.safetensors`) can still be evaluated and sampled: the run directory means
/// its newest checkpoint, and an interval checkpoint file can be named directly.
#[test]
fn eval_and_sample_read_interval_checkpoints() {
    let dir = temp_dir("interval-eval");
    train(dir.path(), &["max_iters=5", "eval_interval=0"]);
    let run_dir = dir.path().join("run");
    assert!(!run_dir.join("ckpt.safetensors").exists());
    let eval = |init_from: &str| {
        let data = "data/shakespeare_char/val.bin";
        let args = ["eval", "--init-from", init_from, "--block-size", "16"];
        let mut cmd = command(dir.path(), args);
        let (stdout, _) = succeeds(cmd.args(["--json", "--data", data]));
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        report["loss"].as_f64().unwrap()
    };
    // Interval checkpoints resuming at 3 and 6 (the final state); the directory means
    // the newest.
    let newest = eval("run");
    assert_eq!(newest, eval("run/ckpt-000006.safetensors"));
    let older = eval("run/ckpt-000003.safetensors");
    assert_ne!(
        newest, older,
        "the directory must not mean an older checkpoint"
    );
    let args = ["sample", "--out-dir", "run", "--max-new-tokens", "20"];
    let mut cmd = command(dir.path(), args);
    let (sample, _) = succeeds(cmd.args(["--num-samples", "1", "--seed", "1"]));
    assert!(sample.len() >= 20, "{sample}");
    // Its state has no best val loss yet (infinite, null in JSON): resuming works.
    let stdout = train(
        dir.path(),
        &["max_iters=8", "eval_interval=0", "init_from=resume"],
    );
    assert!(stdout.contains("at iteration 6"), "{stdout}");
}

/// Starting afresh in an out_dir that holds an earlier run's interval checkpoints is
/// refused (they would outrank the new run's when resuming), and nothing changes.
#[test]
fn a_fresh_start_over_interval_checkpoints_is_refused() {
    let dir = temp_dir("fresh-over");
    train(dir.path(), &["max_iters=4"]);
    let run_dir = dir.path().join("run");
    let before = contents(&run_dir);
    let stderr = refused(&run(dir.path(), &["max_iters=4"], None));
    assert!(
        stderr.contains("interval checkpoint(s) of an earlier run")
            && stderr.contains("init_from=resume"),
        "{stderr}"
    );
    assert!(
        before == contents(&run_dir),
        "the earlier run's files changed"
    );
}

/// Runs `args` with stdout into a pipe that is closed after its first line; returns
/// the exit status, stderr and how long the command took after the close.
fn with_stdout_closed_early(
    dir: &Path,
    args: &[&str],
) -> (std::process::ExitStatus, String, Duration) {
    let mut child = command(dir, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    drop(stdout); // as `| head -1` does
    let closed = Instant::now();
    let out = child.wait_with_output().unwrap();
    (out.status, text(&out.stderr), closed.elapsed())
}

#[test]
fn a_closed_stdout_neither_panics_nor_ends_a_training_run() {
    let dir = temp_dir("closed-stdout");
    let d = dir.path();
    let args = [
        &["train"],
        &TINY_SHAKESPEARE[..],
        &SCHEDULE,
        &["max_iters=8"],
    ]
    .concat();
    let (status, stderr, _) = with_stdout_closed_early(d, &args);
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // The run went on to the end: every step is in metrics.jsonl, and its final
    // evaluation's checkpoint is written.
    let iters: Vec<u64> = metric(&d.join("run"), "loss").iter().map(|r| r.0).collect();
    assert_eq!(iters, (0..=8).collect::<Vec<u64>>());
    assert!(d.join("run/ckpt.safetensors").exists());

    // sample stops at once, quietly, with status 0 (generating 5,000 tokens would take
    // far longer than the bound).
    let sample = [
        "sample",
        "--out-dir",
        "run",
        "--max-new-tokens",
        "5000",
        "--num-samples",
        "1",
    ];
    let (status, stderr, took) = with_stdout_closed_early(d, &sample);
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    assert!(took < Duration::from_secs(20), "sample ran on for {took:?}");
}

#[test]
fn an_evaluation_only_resume_keeps_every_logged_row_and_appends_its_evaluation() {
    let dir = temp_dir("eval-only");
    let d = dir.path();
    train(d, &["max_iters=8"]);
    let log = d.join("run/metrics.jsonl");
    let before = std::fs::read_to_string(&log).unwrap();
    let checkpoints = snapshot(&d.join("run"));
    let out = train(d, &["max_iters=8", "init_from=resume", "eval_only=True"]);
    assert!(out.contains("val loss"), "{out}");
    // It wrote no checkpoint (with always_save_checkpoint, it used to rewrite
    // ckpt.safetensors and ckpt.json, recording the evaluation-only config).
    assert!(
        snapshot(&d.join("run")) == checkpoints,
        "a checkpoint changed"
    );
    let after = std::fs::read_to_string(&log).unwrap();
    let added = after
        .strip_prefix(before.as_str())
        .expect("every earlier row kept");
    let rows: Vec<serde_json::Value> = added
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{added}");
    assert!(rows[0]["val_loss"].is_number(), "{added}");
}

/// The `done: train loss X, val loss Y` line of a run's stdout, as printed.
fn done_line(stdout: &str) -> &str {
    let done = stdout.lines().find(|l| l.starts_with("done: "));
    done.unwrap_or_else(|| panic!("no closing line:\n{stdout}"))
}

/// The `train_loss`/`val_loss` row of `out_dir/metrics.jsonl` at `iter`, as printed.
fn eval_row(out_dir: &Path, iter: u64) -> String {
    let train = metric(out_dir, "train_loss");
    let val = metric(out_dir, "val_loss");
    let at = |rows: &[(u64, f64)]| {
        let row = rows.iter().find(|r| r.0 == iter);
        row.unwrap_or_else(|| panic!("no evaluation at {iter}: {rows:?}"))
            .1
    };
    format!(
        "done: train loss {:.4}, val loss {:.4}",
        at(&train),
        at(&val)
    )
}

/// A run whose `max_iters` ends before its first evaluation after iteration 0 (it
/// used to exit 0 with no checkpoint, report iteration 0's losses as "done", and
/// suggest a `sample` that failed): the final state is evaluated and checkpointed,
/// `sample` works, and `init_from=resume` continues from it.
#[test]
fn a_run_shorter_than_its_evaluation_interval_keeps_its_final_state() {
    let dir = temp_dir("short-run");
    let d = dir.path();
    let stdout = train(d, &["max_iters=3", "eval_interval=250", "ckpt_interval=0"]);
    let run_dir = d.join("run");
    // Iterations 0..=3 trained: the final state resumes at 4.
    assert_eq!(read_json(&run_dir.join("ckpt.json"))["iter_num"], 4);
    // (The final evaluation improved on iteration 0's, so it wrote ckpt.safetensors,
    // which holds the final state: nothing more to save.)
    let mut saved = stdout.lines().filter(|l| l.starts_with("saving"));
    assert_eq!(
        saved.next_back(),
        Some("saving checkpoint to run/ckpt.safetensors"),
        "{stdout}"
    );
    assert_eq!(done_line(&stdout), eval_row(&run_dir, 4), "{stdout}");
    let args = ["sample", "--out-dir", "run", "--max-new-tokens", "10"];
    succeeds(&mut command(d, args));
    let (stdout, _) = resume(d, 5);
    assert!(
        stdout.contains("resuming from run/ckpt.safetensors at iteration 4"),
        "{stdout}"
    );
}

/// With `always_save_checkpoint=False`, `ckpt.safetensors` stays the best-val
/// checkpoint (nanoGPT's meaning) and the final state goes to an interval checkpoint,
/// which `init_from=resume` takes as the newest. The last evaluation at `max_iters`
/// (nanoGPT's) is what the closing line reports, not a new one.
#[test]
fn without_always_save_the_final_state_is_an_interval_checkpoint() {
    let dir = temp_dir("final-interval");
    let d = dir.path();
    let args = [
        "max_iters=4",
        "ckpt_interval=0",
        "always_save_checkpoint=False",
    ];
    let stdout = train(d, &args);
    let run_dir = d.join("run");
    assert_eq!(read_json(&run_dir.join("ckpt-000005.json"))["iter_num"], 5);
    assert!(
        stdout.contains("saving the final state to run/ckpt-000005.safetensors"),
        "{stdout}"
    );
    // The best-val checkpoint is the evaluation's at 4 (the loss falls from 0 to 4).
    assert_eq!(read_json(&run_dir.join("ckpt.json"))["iter_num"], 4);
    assert_eq!(done_line(&stdout), eval_row(&run_dir, 4), "{stdout}");
    assert!(metric(&run_dir, "val_loss").iter().all(|r| r.0 <= 4));
    let (stdout, _) = resume(d, 6);
    assert!(
        stdout.contains("resuming from run/ckpt-000005.safetensors at iteration 5"),
        "{stdout}"
    );
    assert_eq!(step_losses(&run_dir), reference(6));
}

/// With `always_save_checkpoint=True`, `ckpt.safetensors` is the newest state: the
/// evaluation at `max_iters` writes it, and after the last step the final state
/// replaces it.
#[test]
fn with_always_save_the_final_state_is_ckpt_safetensors() {
    let dir = temp_dir("final-always");
    let d = dir.path();
    let args = [
        "max_iters=4",
        "ckpt_interval=0",
        "always_save_checkpoint=True",
    ];
    let stdout = train(d, &args);
    let run_dir = d.join("run");
    assert_eq!(read_json(&run_dir.join("ckpt.json"))["iter_num"], 5);
    assert!(
        stdout.contains("saving the final state to run/ckpt.safetensors"),
        "{stdout}"
    );
    assert!(
        checkpoint_files(&run_dir).is_empty(),
        "{:?}",
        files(&run_dir)
    );
}

/// The interval checkpoints of `dir`.
fn checkpoint_files(dir: &Path) -> Vec<String> {
    let mut names = files(dir);
    names.retain(|n| n.starts_with("ckpt-"));
    names
}

/// `d/ds`: a char dataset of its own (the test changes its files), prepared from
/// 20,000 characters of varied text.
fn private_dataset(d: &Path) {
    let text: String = (0..20_000u32)
        .map(|i| char::from(b'a' + (i * 7 % 23 + i / 300 % 3) as u8))
        .collect();
    std::fs::write(d.join("t.txt"), text).unwrap();
    let args = ["prepare", "t.txt", "--out", "ds", "--tokenizer", "char"];
    succeeds(&mut command(d, args));
}

/// A token file truncated, or rewritten in place, while a run reads it: the run
/// stops with one line naming the file and the fix (it used to die of SIGBUS, exit
/// 135, with no message: the file was memory-mapped); its checkpoints are intact.
#[test]
fn a_token_file_changed_during_training_is_an_error_not_a_crash() {
    type Change = fn(&Path);
    let changes: [(&str, Change, &str); 2] = [
        (
            "truncated",
            |p| {
                let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
                f.set_len(1000).unwrap();
            },
            "1000 bytes now",
        ),
        (
            "rewritten",
            |p| {
                let len = std::fs::metadata(p).unwrap().len() as usize;
                std::fs::write(p, vec![0xff; len]).unwrap();
            },
            "token id 65535 is outside the vocabulary",
        ),
    ];
    for (tag, change, phrase) in changes {
        let dir = temp_dir(&format!("changed-{tag}"));
        let d = dir.path();
        private_dataset(d);
        let mut cmd = train_command(
            d,
            &["dataset=ds", "max_iters=12"],
            Some("pause-during-step:5:1500"),
        );
        let (child, mut stderr, seen) = start_paused(cmd.stdout(Stdio::null()));
        let checkpoints = snapshot(&d.join("run"));
        assert!(!checkpoints.is_empty());
        change(&d.join("ds/train.bin"));
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
        let mut out = child.wait_with_output().unwrap();
        out.stderr = (seen + &rest).into_bytes();
        let msg = refused(&out);
        assert!(
            msg.contains("token file ds/train.bin changed while in use")
                && msg.contains(phrase)
                && msg.contains("re-run prepare into a new folder"),
            "{tag}: {msg}"
        );
        // (The step in progress finished and ckpt-000006 was written before the next
        // read failed.)
        let after = snapshot(&d.join("run"));
        assert!(checkpoints.iter().all(|c| after.contains(c)), "{tag}");
    }
}

/// `nanogpt export --from run --to hf` in `d`, paused (fault injection) with its
/// files written, then stopped by SIGTERM; returns the stopped process's pid.
fn export_stopped_by_sigterm(d: &Path) -> u32 {
    let mut cmd = command(d, ["export", "--from", "run", "--to", "hf"]);
    cmd.env("NANOGPT_FAULT", "pause-during-export:20000");
    let (mut child, _stderr, _) = start_paused(cmd.stdout(Stdio::null()));
    let pid = child.id();
    let sent = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(15), "{status:?}");
    pid
}

/// SIGTERM during `export` leaves the destination as it was (absent, or the previous
/// export byte for byte) and only a temporary folder `.hf.tmp-PID` beside it, which
/// the next export removes as the leftover of a process that ended. (The export used
/// to write into the destination directly: a stopped one left a partial model folder
/// whose temporary file made the next export refuse the folder.)
#[test]
fn an_export_stopped_by_sigterm_leaves_the_destination_untouched() {
    let dir = temp_dir("export-sigterm");
    let d = dir.path();
    train(d, &["max_iters=2"]);
    let pid = export_stopped_by_sigterm(d);
    let leftover = format!(".hf.tmp-{pid}");
    // Nothing else was created (`data` is the bundled dataset, if prepared here).
    let allowed = [leftover.as_str(), "data", "run"];
    assert!(
        files(d).iter().all(|n| allowed.contains(&n.as_str())),
        "{:?}",
        files(d)
    );
    assert!(!d.join("hf").exists(), "{:?}", files(d));
    assert!(d.join(&leftover).is_dir(), "{:?}", files(d));

    let (_, stderr) = succeeds(&mut command(d, ["export", "--from", "run", "--to", "hf"]));
    assert!(
        stderr.contains(&format!(
            "note: removed ./{leftover}, left by an interrupted export"
        )),
        "{stderr}"
    );
    assert!(!d.join(&leftover).exists(), "{:?}", files(d));
    let exported = contents(&d.join("hf"));
    assert!(exported.iter().any(|(n, _)| n == "model.safetensors"));

    // Stopped while replacing that export: it stays byte for byte.
    let pid = export_stopped_by_sigterm(d);
    assert!(
        contents(&d.join("hf")) == exported,
        "the previous export changed"
    );
    assert!(d.join(format!(".hf.tmp-{pid}")).is_dir());
    succeeds(&mut command(d, ["export", "--from", "run", "--to", "hf"]));
    assert!(temp_files(d).is_empty(), "{:?}", files(d));
    // The same files (model.safetensors's header may order its metadata otherwise).
    let names = |files: &[(String, Vec<u8>)]| files.iter().map(|f| f.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&contents(&d.join("hf"))), names(&exported));
}

/// `prepare` removes the temporary files that a killed `prepare` left in its `--out`:
/// it holds the folder's lock, which every writer of those files takes, so they are
/// leftovers whatever their process ids say (ids are reused). Other names are kept.
#[test]
fn prepare_removes_the_leftovers_of_a_killed_prepare() {
    let dir = temp_dir("prepare-leftovers");
    let d = dir.path();
    private_dataset(d);
    let leftovers = [
        ".train.bin.tmp-4194999".to_string(),
        format!(".val.bin.tmp-{}", std::process::id()),
    ];
    for name in &leftovers {
        std::fs::write(d.join("ds").join(name), b"partial").unwrap();
    }
    let other = ".notes.txt.tmp-1";
    std::fs::write(d.join("ds").join(other), b"user's").unwrap();
    let args = ["prepare", "t.txt", "--out", "ds", "--tokenizer", "char"];
    let (_, stderr) = succeeds(&mut command(d, args));
    for name in &leftovers {
        let note = format!("note: removed ds/{name}, left by an interrupted prepare");
        assert!(stderr.contains(&note), "{stderr}");
        assert!(!d.join("ds").join(name).exists());
    }
    assert!(
        d.join("ds").join(other).exists(),
        "not a name prepare writes"
    );
}

/// A run that finds the bundled dataset being prepared by another process waits for
/// it, says so, and then uses what that process prepared (it used to be refused:
/// "--out ... is in use by a prepare run").
#[test]
fn a_run_waits_for_another_preparing_the_bundled_dataset() {
    let dir = temp_dir("bundled-wait");
    let d = dir.path();
    let data = d.join("data/shakespeare_char");
    std::fs::create_dir_all(&data).unwrap();
    // This test plays the other process: it holds the lock while it "prepares".
    let lock = std::fs::File::create(data.join(".nanogpt.lock")).unwrap();
    lock.lock().unwrap();
    std::fs::write(
        data.join(".nanogpt.lock"),
        "a prepare run (pid 1 on host h)\n",
    )
    .unwrap();
    let mut cmd = train_command(d, &["max_iters=1"], None);
    let (mut child, mut stderr) = {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        (child, stderr)
    };
    let mut first = String::new();
    stderr.read_line(&mut first).unwrap();
    assert!(
        first.contains("note: waiting for a prepare run (pid 1 on host h) to finish preparing data/shakespeare_char"),
        "{first}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "it waits");
    let args = [
        "prepare",
        "shakespeare",
        "--out",
        "elsewhere",
        "--tokenizer",
        "char",
    ];
    succeeds(&mut command(d, args));
    for name in ["train.bin", "val.bin", "meta.json"] {
        std::fs::rename(d.join("elsewhere").join(name), data.join(name)).unwrap();
    }
    let inode = |name: &str| {
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(data.join(name)).unwrap())
    };
    let before = inode("train.bin");
    drop(lock);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    assert!(child.wait().unwrap().success(), "{rest}");
    assert_eq!(inode("train.bin"), before, "it used the prepared files");
}

/// A finished run's final state (an interval checkpoint when always_save_checkpoint
/// is off, as in the quick start) does not block running it again: like
/// ckpt.safetensors, it is replaced, with a warning, at the new run's first checkpoint.
#[test]
fn a_fresh_run_replaces_a_finished_run_s_final_state() {
    let dir = temp_dir("fresh-after-finished");
    let d = dir.path();
    let args = [
        "max_iters=4",
        "ckpt_interval=0",
        "always_save_checkpoint=False",
    ];
    train(d, &args);
    let run_dir = d.join("run");
    assert_eq!(
        checkpoint_files(&run_dir),
        ["ckpt-000005.json", "ckpt-000005.safetensors"]
    );
    let again = [
        "max_iters=2",
        "ckpt_interval=0",
        "always_save_checkpoint=False",
    ];
    let (_, stderr) = succeeds(&mut train_command(d, &again, None));
    assert!(
        stderr.contains(
            "warning: run/ckpt-000005.safetensors is the final state of an earlier run and \
             will be deleted at this run's first checkpoint"
        ),
        "{stderr}"
    );
    // Its final state, evaluated, improved on iteration 0: it is ckpt.safetensors.
    assert!(
        checkpoint_files(&run_dir).is_empty(),
        "{:?}",
        files(&run_dir)
    );
    assert_eq!(read_json(&run_dir.join("ckpt.json"))["iter_num"], 3);
    let (stdout, _) = resume(d, 4);
    assert!(stdout.contains("at iteration 3"), "{stdout}");
}

/// The temporary folder of an export still running is not a leftover: another
/// export into the same place leaves it alone (it is locked while its export lasts).
#[test]
fn an_export_keeps_the_temporary_folder_of_a_running_export() {
    let dir = temp_dir("export-running");
    let d = dir.path();
    train(d, &["max_iters=2"]);
    let mut cmd = command(d, ["export", "--from", "run", "--to", "hf"]);
    cmd.env("NANOGPT_FAULT", "pause-during-export:20000");
    let (mut first, _stderr, _) = start_paused(cmd.stdout(Stdio::null()));
    let staging = d.join(format!(".hf.tmp-{}", first.id()));
    assert!(staging.is_dir());
    let (_, stderr) = succeeds(&mut command(d, ["export", "--from", "run", "--to", "hf"]));
    assert!(!stderr.contains("note: removed"), "{stderr}");
    assert!(staging.is_dir(), "the running export's folder was removed");
    first.kill().unwrap();
    first.wait().unwrap();
}

/// A checkpoint that resume skips as damaged is moved aside, kept and named, before
/// the run that skipped it writes checkpoints: it used to say "restore it" and then
/// replace it with its own `ckpt.safetensors`.
#[test]
fn a_damaged_checkpoint_skipped_on_resume_is_moved_aside() {
    let dir = temp_dir("damaged-aside");
    let d = dir.path();
    train(d, &["max_iters=4"]);
    let best = d.join("run/ckpt.safetensors");
    let bytes = std::fs::read(&best).unwrap();
    std::fs::write(&best, &bytes[..bytes.len() - 100]).unwrap();
    let damaged = std::fs::read(&best).unwrap();
    let (stdout, stderr) = resume(d, 8);
    assert!(stdout.contains("resuming from run/ckpt-0000"), "{stdout}");
    assert!(
        stderr.contains(
            "note: skipping a damaged checkpoint, moved aside to run/ckpt.damaged.safetensors \
             (kept for you to inspect or restore): run/ckpt.safetensors is damaged or truncated"
        ),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read(d.join("run/ckpt.damaged.safetensors")).unwrap(),
        damaged
    );
    assert!(d.join("run/ckpt.damaged.json").exists());
    // The resumed run wrote its own best checkpoint beside it.
    assert!(read_json(&d.join("run/ckpt.json"))["iter_num"].as_u64() >= Some(8));
}

/// Settings a resumed run ignores, or that make it differ from the run it continues,
/// say so: `adapter=` (the checkpoint's adapters continue), another `dtype` (the
/// losses then differ); and `lora_*` keys without `lora_rank` on a fresh run.
#[test]
fn ignored_and_changed_settings_on_resume_say_so() {
    let dir = temp_dir("resume-settings");
    let d = dir.path();
    let (_, stderr) = succeeds(&mut train_command(
        d,
        &["max_iters=2", "lora_targets=c_fc", "lora_alpha=16"],
        None,
    ));
    assert!(
        stderr.contains(
            "note: ignoring lora_alpha, lora_targets: lora_rank = 0 trains the whole model"
        ),
        "{stderr}"
    );
    let args = [
        "max_iters=3",
        "init_from=resume",
        "dtype=bfloat16",
        "adapter=somewhere",
    ];
    let (_, stderr) = succeeds(&mut train_command(d, &args, None));
    assert!(
        stderr
            .contains("note: ignoring adapter=somewhere: resuming continues the training in run/"),
        "{stderr}"
    );
    assert!(
        stderr.contains("note: dtype = bfloat16 here, float32 in the run run/")
            && stderr.contains("the losses from here on differ from an uninterrupted run's"),
        "{stderr}"
    );
}
