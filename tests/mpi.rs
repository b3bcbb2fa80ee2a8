//! Data-parallel training under a real MPI launcher (`mpirun`): the same run on 1, 2
//! and 3 ranks, with and without ZeRO-1, resumed across world sizes; errors, killed
//! and stopped ranks end the job. Built only with `--features mpi`; needs `mpirun`
//! on PATH (or `NANOGPT_MPIRUN`). Open MPI and MPICH are both driven.

#![cfg(feature = "mpi")]

use nanogpt::checkpoint::Checkpoint;
use nanogpt::model::ParamLayout;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

mod common;
use common::{
    metric, process_temp_dir, read_json, succeeds, temp_dir, text, BIN, TINY_SHAKESPEARE,
};

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
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = process_temp_dir("mpi");
        let prepare = ["prepare", "shakespeare", "--out", "data/shakespeare_char"];
        succeeds(common::command(&dir, prepare).args(["--tokenizer", "char"]));
        dir
    })
}

fn mpirun() -> String {
    let named = nanogpt::tuning::env::get().mpirun.clone();
    named.unwrap_or_else(|| "mpirun".into())
}

fn is_open_mpi() -> bool {
    static OPEN: OnceLock<bool> = OnceLock::new();
    *OPEN.get_or_init(|| {
        let out = Command::new(mpirun()).arg("--version").output();
        let out = out.unwrap_or_else(|e| panic!("cannot run `{}`: {e}; install an MPI", mpirun()));
        let version = text(&out.stdout);
        // `mpirun.openmpi --version` says OpenRTE, `mpirun --version` Open MPI.
        version.contains("Open MPI") || version.contains("OpenRTE")
    })
}

/// `mpirun -n N nanogpt train TINY... extra...` (N = 0: no launcher at all).
fn command(ranks: usize, extra: &[&str]) -> Command {
    let mut cmd = launcher(ranks);
    cmd.args(train_args(extra));
    cmd
}

/// `mpirun -n N nanogpt` in [`workdir`], ready for a subcommand (N = 0: no launcher).
fn launcher(ranks: usize) -> Command {
    let mut cmd = if ranks == 0 {
        Command::new(BIN)
    } else {
        let mut cmd = Command::new(mpirun());
        cmd.args(["-n", &ranks.to_string()]);
        if is_open_mpi() {
            open_mpi_on_this_machine(&mut cmd);
        }
        cmd.arg(BIN);
        cmd
    };
    cmd.current_dir(workdir());
    cmd
}

/// Open MPI's `mpirun` as the tests run it here: up to three ranks on two cores,
/// root in CI containers, and PMIx's munge plugin left out (where munge is installed
/// but its daemon is not running, as after the Slurm check, every start retried the
/// daemon's socket for 2.3 s).
fn open_mpi_on_this_machine(cmd: &mut Command) {
    cmd.args(["--oversubscribe", "--bind-to", "none"]);
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("PMIX_MCA_psec", "^munge");
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
    train_env(ranks, out, extra, &[])
}

/// [`train`] with environment variables set for the ranks.
fn train_env(ranks: usize, out: &str, extra: &[&str], env: &[(&str, &str)]) -> String {
    let mut args = vec![format!("out_dir={out}")];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = command(ranks, &args);
    cmd.envs(env.iter().copied());
    let out = run_for(cmd, Duration::from_secs(300));
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

/// Every step's loss and every evaluation of `b` within 1e-5 (relative) of `a`'s,
/// row for row; returns the largest relative difference.
fn assert_same_losses(a: &str, b: &str) -> f64 {
    assert_close_losses(a, b, 1e-5)
}

/// [`assert_same_losses`] within `tolerance` (relative).
fn assert_close_losses(a: &str, b: &str, tolerance: f64) -> f64 {
    let ((sa, ea), (sb, eb)) = (losses(a), losses(b));
    assert_eq!(sa.len(), sb.len(), "{a} vs {b}: step rows");
    assert_eq!(ea.len(), eb.len(), "{a} vs {b}: eval rows");
    let mut worst = 0.0f64;
    for ((ia, la), (ib, lb)) in sa.iter().chain(&ea).zip(sb.iter().chain(&eb)) {
        assert_eq!(ia, ib);
        let rel = (la - lb).abs() / la.abs().max(1e-6);
        assert!(
            rel <= tolerance,
            "{a} vs {b} at iteration {ia}: loss {la} vs {lb}"
        );
        worst = worst.max(rel);
    }
    worst
}

/// [`assert_same_losses`], and the same final weights within float noise; returns
/// the largest relative loss difference.
fn assert_same_run(a: &str, b: &str) -> f64 {
    let losses = assert_same_losses(a, b);
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
    losses
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
        // The slowest rank's extra compute, taken out of the wait, can only raise
        // the hidden share.
        let num = |k: &str| {
            report[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{k}: {report}"))
        };
        assert!(num("skew_ms") >= 0.0, "{report}");
        assert!(
            num("hidden_fraction_net_of_skew") >= num("hidden_fraction"),
            "{report}"
        );
    }
}

/// LoRA (adapters on every kind of layer, with their dropout): 2 ranks and 3 ranks
/// with ZeRO-1 follow the one-process run, and only the adapters' gradients are
/// reduced.
#[test]
fn lora_runs_follow_the_one_process_run() {
    use nanogpt::model::lora::LoraLayout;
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let lora = [
        "lora_rank=4",
        "lora_dropout=0.1",
        "lora_targets=c_attn,attn.c_proj,c_fc,mlp.c_proj",
        "gradient_accumulation_steps=6",
        "max_iters=6",
    ];
    let one = reference(&lora);
    for (ranks, stage) in [(2, "zero_stage=0"), (3, "zero_stage=1")] {
        let out = format!("lora-{ranks}");
        train(ranks, &out, &[&lora[..], &[stage]].concat());
        let ((sa, ea), (sb, eb)) = (losses(&one), losses(&out));
        assert_eq!((sa.len(), ea.len()), (sb.len(), eb.len()), "{out}: rows");
        for ((i, a), (_, b)) in sa.iter().chain(&ea).zip(sb.iter().chain(&eb)) {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "{out} at {i}: {a} vs {b}");
        }
        let ((model, config, pa), (_, _, pb)) = (lora_params(&one), lora_params(&out));
        let worst = pa
            .iter()
            .zip(&pb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 1e-5, "{out}: adapters differ by up to {worst}");
        // What each step all-reduces: the adapter arena, not the model's.
        let report = read_json(&workdir().join(&out).join("comm.json"));
        let adapter_bytes = LoraLayout::new(&model, &config).params.len * 4;
        let full_bytes = ParamLayout::new(&model).len * 4;
        assert_eq!(report["grad_bytes"], adapter_bytes, "{report}");
        eprintln!(
            "{out}: {adapter_bytes} gradient bytes per step reduced, {:.1} % of full training's {full_bytes}",
            100.0 * adapter_bytes as f64 / full_bytes as f64
        );
    }
    // Saved by 3 ranks at iteration 5, resumed on 2: rank 0 reloads the base and
    // sends it, and the run ends as the one-process run did.
    let out = "lora-resume";
    train(
        3,
        out,
        &[&lora[..4], &["max_iters=5", "zero_stage=1"]].concat(),
    );
    train(2, out, &[&lora[..], &["init_from=resume"]].concat());
    let ((sa, ea), (sb, eb)) = (losses(&one), losses(out));
    assert_eq!((sa.len(), ea.len()), (sb.len(), eb.len()), "{out}: rows");
    for ((i, a), (_, b)) in sa.iter().chain(&ea).zip(sb.iter().chain(&eb)) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{out} at {i}: {a} vs {b}");
    }
}

#[test]
fn checkpointed_ranks_follow_the_one_process_run_and_the_plan_refuses_oversized_jobs() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (acc, iters) = ("gradient_accumulation_steps=4", "max_iters=10");
    let one = reference(&[acc, iters]);
    for stage in ["zero_stage=0", "zero_stage=1"] {
        let out = format!("ckpt-{stage}");
        let extra = [acc, iters, stage, "activation_checkpointing=true"];
        let stdout = train(2, &out, &extra);
        assert!(stdout.contains("memory plan:"), "{stdout}");
        assert_same_run(&one, &out);
    }
    // Rank 0 plans for every rank of its host and stops the whole job, exit 1.
    let mut cmd = command(2, &[acc, iters, "out_dir=too-big"]);
    cmd.env("NANOGPT_MEMORY_LIMIT_MB", "1");
    let out = run_for(cmd, Duration::from_secs(120));
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("MB are available (NANOGPT_MEMORY_LIMIT_MB)"),
        "{stderr}"
    );
    assert!(
        !workdir().join("too-big").exists(),
        "refused before out_dir"
    );
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

/// ZeRO-2 (gradients sharded) and ZeRO-3 (weights too), with and without activation
/// checkpointing, on 2 and 3 ranks: every step's loss and evaluation within 1e-5 of
/// the one-process run, and the same final weights.
#[test]
fn zero_2_and_3_follow_the_one_process_run() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (acc, iters) = ("gradient_accumulation_steps=6", "max_iters=10");
    let one = reference(&[acc, iters]);
    for stage in ["zero_stage=2", "zero_stage=3"] {
        for (ranks, ckpt) in [(2, false), (3, true), (2, true), (3, false)] {
            let out = format!("{stage}-{ranks}-{ckpt}");
            let checkpointing = format!("activation_checkpointing={ckpt}");
            train(ranks, &out, &[acc, iters, stage, &checkpointing]);
            assert_same_run(&one, &out);
            let report = read_json(&workdir().join(&out).join("comm.json"));
            assert_eq!(report["zero_stage"], stage[11..].parse::<u8>().unwrap());
            // ZeRO-3 reduces every bucket on every micro-step, in backward's order;
            // below, the size rule picks embeddings first on 2 ranks of 4 × 16
            // tokens (2 · 64 ≤ 128 + 16 rows of wte and wpe), not on 3.
            let first = stage == "zero_stage=2" && ranks == 2;
            assert_eq!(report["embeddings_first"], first, "{out}: {report}");
        }
    }
}

/// A 3-rank ZeRO-3 checkpoint (weights gathered to rank 0 for saving) resumes on one
/// process, whose checkpoint resumes on 3 ranks with ZeRO-3 (weights scattered at
/// start), and the run ends as the uninterrupted one-process run did.
#[test]
fn zero_3_checkpoints_resume_on_one_process_and_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let acc = "gradient_accumulation_steps=6";
    let full = reference(&[acc, "max_iters=10"]);
    let out = "resume-zero3";
    train(3, out, &[acc, "max_iters=3", "zero_stage=3"]);
    assert_eq!(params(out).2, 4);
    train(0, out, &[acc, "max_iters=6", "init_from=resume"]);
    assert_eq!(params(out).2, 7);
    let resumed = [acc, "max_iters=10", "init_from=resume", "zero_stage=3"];
    train(3, out, &resumed);
    assert_same_run(&full, out);
}

/// Llama with grouped-query attention (tests/fixtures/llama/llama_gqa, made by
/// scripts/reference/llama_fixtures.py: RMSNorm, RoPE, SwiGLU, 6 query heads over 2
/// key/value heads, tied head) fine-tuned on the characters (65 of its 97 tokens):
/// 2 and 3 ranks at ZeRO stages 0 to 3 follow the one-process run (every step's loss
/// and every evaluation within 1e-5 relative, the same weights within float noise),
/// and so do bf16 under ZeRO-3 and LoRA on Hugging Face's module names under ZeRO-2.
#[test]
fn llama_with_gqa_follows_the_one_process_run_at_every_zero_stage() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let init = format!("init_from={}", common::fixture("llama/llama_gqa").display());
    let llama = |ranks: usize, out: &str, extra: &[&str]| {
        let job = [
            init.as_str(),
            "gradient_accumulation_steps=6",
            "max_iters=5",
        ];
        train(ranks, out, &[&job[..], extra].concat());
        let state = read_json(&workdir().join(out).join("ckpt.json"));
        assert_eq!(state["model"]["llama"]["n_kv_head"], 2, "{out}: {state}");
    };
    llama(0, "llama-1", &[]);
    for (ranks, stage) in [
        (2, 0),
        (3, 0),
        (2, 1),
        (3, 1),
        (2, 2),
        (3, 2),
        (2, 3),
        (3, 3),
    ] {
        let out = format!("llama-{ranks}-zero{stage}");
        llama(ranks, &out, &[&format!("zero_stage={stage}")]);
        let worst = assert_same_run("llama-1", &out);
        eprintln!("llama-1 vs {out}: largest relative loss difference {worst:e}");
    }
    let bf16 = ["dtype=bfloat16", "zero_stage=3"];
    llama(0, "llama-bf16-1", &bf16[..1]);
    llama(3, "llama-bf16-3", &bf16);
    // Ranks sum their micro-steps' gradients in another order than one process
    // does: the weights then differ by an f32 ulp (1.2e-7 above), and in bf16 such
    // an ulp can carry a weight across a rounding boundary of its bf16 copy. On
    // AVX512-BF16 that moved the loss by 2.6e-5 (relative) by iteration 5; a
    // missed or stale micro-step moves it by 1e-3 and more.
    let worst = assert_close_losses("llama-bf16-1", "llama-bf16-3", 2e-4);
    eprintln!("llama-bf16-1 vs llama-bf16-3: largest relative loss difference {worst:e}");
    let lora = [
        "lora_rank=4",
        "lora_alpha=8",
        "lora_dropout=0.1",
        "lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    ];
    llama(0, "llama-lora-1", &lora);
    for (ranks, stage) in [(2, "zero_stage=1"), (3, "zero_stage=2")] {
        let out = format!("llama-lora-{ranks}");
        llama(ranks, &out, &[&lora[..], &[stage]].concat());
        let worst = assert_same_losses("llama-lora-1", &out);
        eprintln!("llama-lora-1 vs {out}: largest relative loss difference {worst:e}");
        let (a, b) = (lora_params("llama-lora-1").2, lora_params(&out).2);
        let moved = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(moved > 0.0, "{out}: the adapters did not train");
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs());
        let worst = worst.fold(0.0, f32::max);
        assert!(worst <= 1e-5, "{out}: adapters differ by up to {worst}");
    }
}

/// A LoRA run's last checkpoint in the work directory: its model, its adapters'
/// config and the trained adapter arena.
fn lora_params(
    out: &str,
) -> (
    nanogpt::model::ModelConfig,
    nanogpt::model::lora::LoraConfig,
    Vec<f32>,
) {
    let ckpt = Checkpoint::open(&workdir().join(out)).unwrap();
    let state = ckpt.state.lora.clone().expect("a LoRA checkpoint");
    let layout = nanogpt::model::lora::LoraLayout::new(&ckpt.state.model, &state.config).params;
    let mut p = vec![0.0; layout.len];
    ckpt.load_params(&layout, &mut p).unwrap();
    (ckpt.state.model.clone(), state.config, p)
}

/// Instruction data (chat examples, char-level, with loss masks) in the work directory.
fn instruct_dataset() -> &'static str {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let lines: String = (0..300)
            .map(|i| {
                let word: String = (0..3 + i % 3)
                    .map(|k| (b'a' + ((i * 7 + k * 3) % 8) as u8) as char)
                    .collect();
                let answer = if word.contains('a') { "yes" } else { "no" };
                format!(
                    "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{word}\"}}, \
                     {{\"role\": \"assistant\", \"content\": \"{answer}\"}}]}}\n"
                )
            })
            .collect();
        std::fs::write(workdir().join("inst.jsonl"), lines).unwrap();
        let prepare = [
            "prepare",
            "inst.jsonl",
            "--out",
            "data/inst",
            "--tokenizer",
            "char",
        ];
        succeeds(common::command(workdir(), prepare).args(["--val-fraction", "0.2"]));
        assert!(workdir().join("data/inst/train.mask").exists());
    });
    // Found as data/inst (the name keeps the reference run's folder name flat).
    "dataset=inst"
}

/// With a loss mask the micro-steps of a global batch train different numbers of
/// targets; the step's loss is still the mean over all of them, on any rank count.
#[test]
fn masked_instruction_data_trains_the_same_on_two_ranks() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let data = instruct_dataset();
    let extra = [
        data,
        "block_size=32",
        "gradient_accumulation_steps=4",
        "max_iters=5",
    ];
    let one = reference(&extra);
    let out = "two-masked";
    train(2, out, &extra);
    assert_same_run(&one, out);
}

/// The four accuracies of a task row or of `eval --task --json`'s report.
const ACCURACIES: [&str; 4] = ["acc", "acc_norm", "acc_bytes", "acc_token"];

#[test]
fn multiple_choice_accuracy_is_the_same_on_any_number_of_ranks() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    common::write_shakespeare_task(workdir(), 30);
    let task = [
        "gradient_accumulation_steps=3",
        "max_iters=4",
        "eval_interval=2",
        "lr_decay_iters=4",
        "eval_tasks=choice:lines.jsonl",
        "eval_tasks_limit=25",
    ];
    // During training: each rank scores every W-th question, rank 0 adds them up.
    train(0, "tasks-1", &task);
    train(3, "tasks-3", &task);
    let one = common::task_rows(&workdir().join("tasks-1"));
    let three = common::task_rows(&workdir().join("tasks-3"));
    let iters = |rows: &[serde_json::Value]| -> Vec<u64> {
        rows.iter().map(|r| r["iter"].as_u64().unwrap()).collect()
    };
    assert_eq!(iters(&one), [0, 2, 4]);
    assert_eq!(iters(&three), iters(&one));
    for (a, b) in one.iter().zip(&three) {
        assert_eq!(b["examples"], 25);
        for name in ACCURACIES {
            let (x, y) = (a[name].as_f64().unwrap(), b[name].as_f64().unwrap());
            // The same weights at iteration 0; later the ranks' sums differ by float
            // noise (within 1e-5), which may at most tip one question.
            let allowed = if a["iter"] == 0 {
                0.0
            } else {
                1.0 / 25.0 + 1e-9
            };
            assert!(
                (x - y).abs() <= allowed,
                "iter {}: {name} {x} vs {y}",
                a["iter"]
            );
        }
    }
    // `eval --task` of one checkpoint: every question scored alike on any rank.
    let eval = |ranks: usize| -> serde_json::Value {
        let mut cmd = launcher(ranks);
        cmd.args(["eval", "--init-from", "tasks-1", "--task", "choice"]);
        cmd.args(["--data", "lines.jsonl", "--json", "--threads", "1"]);
        let out = run_for(cmd, Duration::from_secs(120));
        assert!(out.status.success(), "{ranks} ranks: {}", text(&out.stderr));
        serde_json::from_str(text(&out.stdout).trim()).unwrap()
    };
    let alone = eval(0);
    assert_eq!(alone["examples"], 30);
    for ranks in [2, 3] {
        let split = eval(ranks);
        assert_eq!(split["examples"], 30, "{ranks} ranks");
        for name in ACCURACIES {
            assert_eq!(split[name], alone[name], "{ranks} ranks: {name}");
        }
    }
}

/// LoRA in bf16 on the f32 GEMM gives its base's f32 linears back (the rounded copy
/// holds them). The tasks scored during training then need the base again: rank 0
/// loads it and sends it to the other ranks, which score the same questions as one
/// process does (iteration 0: the same weights, the same accuracy).
#[test]
fn bf16_lora_scores_tasks_on_the_base_rank_0_loads_again() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    common::write_shakespeare_task(workdir(), 30);
    let task = [
        "gradient_accumulation_steps=3",
        "max_iters=2",
        "eval_interval=2",
        "lr_decay_iters=2",
        "eval_tasks=choice:lines.jsonl",
        "eval_tasks_limit=25",
        "dtype=bfloat16",
        "bf16_kernel=f32",
        "lora_rank=4",
        "lora_targets=c_attn,mlp.c_proj",
    ];
    train(0, "lora-tasks-1", &task);
    train(3, "lora-tasks-3", &task);
    let one = common::task_rows(&workdir().join("lora-tasks-1"));
    let three = common::task_rows(&workdir().join("lora-tasks-3"));
    assert_eq!((one.len(), three.len()), (2, 2));
    for name in ACCURACIES {
        assert_eq!(one[0][name], three[0][name], "iteration 0: {name}");
        let (x, y) = (
            one[1][name].as_f64().unwrap(),
            three[1][name].as_f64().unwrap(),
        );
        assert!(
            (x - y).abs() <= 1.0 / 25.0 + 1e-9,
            "iteration 2: {name} {x} vs {y}"
        );
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

/// `dataset=tiny`: the test's Shakespeare copied to `DIR/data/tiny` (not a built-in
/// name, so a rank whose folder lacks it fails rather than preparing it); with
/// `alter`, train.bin holds other tokens (same size, same vocabulary).
fn copy_dataset(dir: &Path, alter: bool) {
    let from = workdir().join("data/shakespeare_char");
    let to = dir.join("data/tiny");
    std::fs::create_dir_all(&to).unwrap();
    for name in ["meta.json", "train.bin", "val.bin"] {
        let mut bytes = std::fs::read(from.join(name)).unwrap();
        if alter && name == "train.bin" {
            // Two u16 tokens swapped in the middle: only a sampled hash sees it.
            let mid = (bytes.len() / 2) & !3;
            bytes.swap(mid, mid + 2);
            bytes.swap(mid + 1, mid + 3);
            assert_ne!(bytes, std::fs::read(from.join(name)).unwrap());
        }
        std::fs::write(to.join(name), bytes).unwrap();
    }
}

/// A two-rank MPMD job: rank 0 runs `train TINY... common` in the work dir, rank 1
/// the same plus `rank1_extra`, in `rank1_dir` (if given) with `rank1_env` set.
fn two_ranks_apart(
    common: &[&str],
    rank1_extra: &[&str],
    rank1_dir: Option<&Path>,
    rank1_env: &[&str],
) -> Output {
    let mut cmd = command(1, common);
    let dir = rank1_dir.unwrap_or(workdir());
    // `env -C DIR VAR=... BIN ...`: another working directory and environment on
    // rank 1 only, as on another host.
    cmd.args([":", "-n", "1", "env", "-C"])
        .arg(dir)
        .args(rank1_env)
        .arg(BIN)
        .args(train_args(common))
        .args(rank1_extra);
    run_for(cmd, Duration::from_secs(120))
}

#[test]
fn an_error_on_one_rank_ends_every_rank() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Rank 1's working directory has no dataset `tiny`.
    copy_dataset(workdir(), false);
    let empty = temp_dir("mpi-empty");
    let common = [
        "out_dir=one-bad",
        "gradient_accumulation_steps=2",
        "dataset=tiny",
    ];
    let start = Instant::now();
    let out = two_ranks_apart(&common, &[], Some(empty.path()), &[]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("error: rank 1 of 2"), "{stderr}");
    assert!(stderr.contains("dataset `tiny`"), "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(60), "ended promptly");
}

#[test]
fn a_rank_with_other_data_is_refused_before_step_1() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    copy_dataset(workdir(), false);
    let other = temp_dir("mpi-other-data");
    copy_dataset(other.path(), true);
    let common = [
        "out_dir=other-data",
        "gradient_accumulation_steps=2",
        "dataset=tiny",
        "max_iters=5",
    ];
    let start = Instant::now();
    let out = two_ranks_apart(&common, &[], Some(other.path()), &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("error: rank 0 of 2"), "{stderr}");
    assert!(stderr.contains("refusing to start"), "{stderr}");
    assert!(
        stderr.contains("rank 1 (host ")
            && stderr.contains("data/tiny/train.bin has other content"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("meta.json"),
        "only the file that differs: {stderr}"
    );
    // Before the model was built, before step 1, before any checkpoint.
    assert!(
        !stdout.contains("iter 0:") && !stdout.contains("model:"),
        "{stdout}"
    );
    assert!(!workdir().join("other-data/ckpt.safetensors").exists());
    assert!(start.elapsed() < Duration::from_secs(60), "ended promptly");

    // The same files on both ranks: accepted.
    let same = temp_dir("mpi-same-data");
    copy_dataset(same.path(), false);
    let common = [
        "out_dir=same-data",
        "gradient_accumulation_steps=2",
        "dataset=tiny",
        "max_iters=1",
    ];
    let out = two_ranks_apart(&common, &[], Some(same.path()), &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn another_ranks_config_is_reported_and_ignored() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let acc = ["gradient_accumulation_steps=4", "max_iters=10"];
    let one = reference(&acc);
    // Rank 1 is given another learning rate: rank 0's config is the job's.
    let common = [acc[0], acc[1], "out_dir=other-config"];
    let out = two_ranks_apart(&common, &["learning_rate=0.5"], None, &[]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("note: rank 1 (host ")
            && stderr.contains("learning_rate=0.5] here differ from rank 0's")
            && stderr.contains("using rank 0's"),
        "{stderr}"
    );
    assert_same_run(&one, "other-config");
}

#[test]
fn ranks_whose_weights_diverge_stop_with_a_clear_message() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Rank 1 alone gets a NaN weight after iteration 2; the check at the evaluation
    // of iteration 5 finds the ranks' weights differ.
    let common = [
        "out_dir=diverged",
        "gradient_accumulation_steps=2",
        "max_iters=10",
    ];
    let out = two_ranks_apart(&common, &[], None, &["NANOGPT_FAULT=nan-param:2"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("weights differ at iteration 5"))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(!line.contains("  "), "{line}");
    assert!(line.contains("they were equal at iteration 0"), "{line}");
    assert!(!line.contains("resume from the last checkpoint"), "{line}");
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

/// Starts a long 2-rank run (`settings` last), waits for its first checkpoint, sends
/// `signal` to rank 1, and returns the job's output and how long it took to end
/// after the signal.
fn fault(out: &str, signal: &str, settings: &[&str]) -> (Output, Duration) {
    let out_dir = format!("out_dir={out}");
    let long = [
        out_dir.as_str(),
        "gradient_accumulation_steps=2",
        "max_iters=100000",
        "lr_decay_iters=100000",
        "eval_interval=20",
    ];
    let mut cmd = command(2, &[&long[..], settings].concat());
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
    let (out, took) = fault("killed", "-KILL", &["collective_timeout_s=20"]);
    assert!(!out.status.success(), "the job must fail");
    assert!(took < Duration::from_secs(30), "ended after {took:?}");
    // Rank 0 names the rank that is gone (its heartbeat connection closed) and the
    // checkpoint to resume from, before the launcher tears the job down.
    let stderr = text(&out.stderr);
    let saved = params("killed").2;
    let ckpt = workdir().join("killed/ckpt.safetensors");
    match stderr
        .lines()
        .find(|l| l.contains(" is gone: its heartbeat connection closed"))
    {
        Some(line) => {
            assert!(
                line.starts_with("error: rank 0 of 2 (host ") && line.contains("rank 1 (host "),
                "{line}"
            );
            // The last checkpoint is named as written, or as being written when the
            // rank was lost.
            let named = format!("resume from {} (iteration {saved})", ckpt.display());
            let writing = format!("iteration {saved} was being written to {}", ckpt.display());
            assert!(line.contains(&named) || line.contains(&writing), "{line}");
        }
        None => {
            // MPICH's Hydra can end every rank within ~50 ms of one's death (seen in
            // 1 run of 20 on 2 cores), before rank 0's report is out; Hydra's own
            // report then names the killed process.
            let stdout = text(&out.stdout);
            assert!(
                stdout.contains("BAD TERMINATION") && stdout.contains("Killed (signal 9)"),
                "no heartbeat message after {took:?}:\n{stderr}\nstdout:\n{stdout}"
            );
        }
    }
    // The last checkpoint is intact and the run continues from it.
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
    let (out, took) = fault("stopped", "-STOP", &["collective_timeout_s=3"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "the job must fail:\n{stderr}");
    assert!(stderr.contains("rank 0 of 2"), "{stderr}");
    assert!(stderr.contains("made no progress for 3 s"), "{stderr}");
    assert!(
        stderr.contains("rank 1 (host ") && stderr.contains(") did not arrive"),
        "the stopped rank is named: {stderr}"
    );
    assert!(took < Duration::from_secs(30), "ended after {took:?}");
}

/// With the collective timeout at its default (300 s), a stopped rank is named by
/// the heartbeat after `heartbeat_timeout_s`, with the checkpoint to resume from.
#[test]
fn a_stopped_rank_is_named_by_the_heartbeat_long_before_the_collective_timeout() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let settings = ["collective_timeout_s=300", "heartbeat_timeout_s=3"];
    let (out, took) = fault("silent", "-STOP", &settings);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "the job must fail:\n{stderr}");
    assert!(took < Duration::from_secs(20), "ended after {took:?}");
    let line = stderr
        .lines()
        .find(|l| l.contains("no heartbeat from rank 1 (host "))
        .unwrap_or_else(|| panic!("no heartbeat message:\n{stderr}"));
    assert!(line.starts_with("error: rank 0 of 2 (host "), "{line}");
    assert!(line.contains("(heartbeat_timeout_s = 3)"), "{line}");
    assert!(
        line.contains("silent/ckpt.safetensors (iteration "),
        "{line}"
    );
    assert!(!stderr.contains("made no progress"), "{stderr}");
}

#[test]
fn sigterm_to_one_rank_stops_every_rank_at_the_same_step() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Only rank 1 is signalled; rank 0 learns of it with the step's loss all-reduce,
    // writes the checkpoint and says so. Disagreeing ranks would hang (watchdog).
    let (out, took) = fault("sigterm", "-TERM", &["collective_timeout_s=20"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(took < Duration::from_secs(30), "ended after {took:?}");
    assert_eq!(out.status.code(), Some(143), "{stdout}\n{stderr}");
    assert!(!stderr.contains("made no progress"), "{stderr}");
    // It resumes from there.
    assert_stopped_with_a_checkpoint_that_resumes("SIGTERM", "sigterm", &stdout, &stderr);
}

#[test]
fn sigusr1_to_mpirun_stops_the_job_with_a_checkpoint_that_resumes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The launcher itself is signalled: Open MPI's and Hydra's forward SIGUSR1 to
    // every rank (SIGTERM to Open MPI's kills the ranks a second later).
    let mut cmd = command(
        2,
        &[
            "out_dir=sigusr1",
            "gradient_accumulation_steps=2",
            "max_iters=100000",
            "lr_decay_iters=100000",
            "eval_interval=20",
        ],
    );
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let ckpt = workdir().join("sigusr1/ckpt.safetensors");
    let start = Instant::now();
    while !ckpt.exists() {
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(100));
    }
    Command::new("kill")
        .args(["-USR1", &child.id().to_string()])
        .status()
        .unwrap();
    let signalled = Instant::now();
    let out = wait_for(child, Duration::from_secs(60));
    let took = signalled.elapsed();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(took < Duration::from_secs(30), "ended after {took:?}");
    if is_open_mpi() {
        assert_eq!(out.status.code(), Some(138), "{stdout}\n{stderr}");
    }
    assert_stopped_with_a_checkpoint_that_resumes("SIGUSR1", "sigusr1", &stdout, &stderr);
}

/// A 2-rank run in `out_dir` stopped by `signal`: its stop line names the checkpoint
/// of the step after the last finished one, which holds that iteration, and a run
/// with `init_from=resume` continues from it.
fn assert_stopped_with_a_checkpoint_that_resumes(
    signal: &str,
    out_dir: &str,
    stdout: &str,
    stderr: &str,
) {
    let prefix = format!("stopped by {signal} after iteration ");
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no stop line:\n{stdout}\n{stderr}"));
    let last: u64 = line[prefix.len()..]
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let ckpt = format!("{out_dir}/ckpt-{:06}.safetensors", last + 1);
    assert!(line.contains(&ckpt), "{line}");
    let saved = Checkpoint::open_file(&workdir().join(&ckpt)).unwrap();
    assert_eq!(saved.state.iter_num, last + 1);
    let until = format!("max_iters={}", last + 3);
    let stdout = train(
        2,
        out_dir,
        &["gradient_accumulation_steps=2", &until, "init_from=resume"],
    );
    assert!(
        stdout.contains(&format!("resuming from {ckpt} at iteration {}", last + 1)),
        "{stdout}"
    );
}

#[test]
fn a_start_up_that_hangs_ends_with_the_likely_causes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Rank 1 starts 20 s late: rank 0 waits in MPI_Init for it, past its start-up
    // limit of 2 s, as it would for a peer it cannot reach.
    let common = ["out_dir=late", "gradient_accumulation_steps=2"];
    let mut cmd = Command::new(mpirun());
    cmd.args(["-n", "1"]);
    if is_open_mpi() {
        open_mpi_on_this_machine(&mut cmd);
    }
    cmd.args(["env", "NANOGPT_START_TIMEOUT_S=2", BIN])
        .args(train_args(&common))
        .args([
            ":",
            "-n",
            "1",
            "sh",
            "-c",
            "sleep 20; exec \"$0\" \"$@\"",
            BIN,
        ])
        .args(train_args(&common))
        .current_dir(workdir());
    let start = Instant::now();
    let out = run_for(cmd, Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("rank 0, host ")
            && stderr.contains(
                "MPI start-up (MPI_Init and the first collectives) did not complete in 2 s"
            ),
        "{stderr}"
    );
    // Started by hand on this host, rank 0 serves the check-in: it knows that rank 1
    // never started (not a network fault), and says so first.
    assert!(
        stderr.contains("never started (see the launcher's output for why")
            && stderr.contains(": rank 1"),
        "{stderr}"
    );
    assert!(!stderr.contains("Likely causes"), "{stderr}");
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "ended after {:?}",
        start.elapsed()
    );
}

/// The MPI library this binary links, as `host-info` says.
fn linked_mpi() -> String {
    let (stdout, _) = succeeds(&mut common::command(workdir(), ["host-info"]));
    let info: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    info["mpi"].as_str().expect("built with MPI").to_string()
}

/// Started by the other MPI's launcher, every process refuses before it trains,
/// naming both MPIs: no rank trains alone.
#[test]
fn the_other_mpis_launcher_is_refused_on_every_rank() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (other, built, by) = match is_open_mpi() {
        true => (
            "mpiexec.hydra",
            "Open MPI",
            "MPICH's or Intel MPI's mpiexec (Hydra)",
        ),
        false => ("mpirun.openmpi", "MPICH", "Open MPI's mpirun"),
    };
    if Command::new(other).arg("--version").output().is_err() {
        println!("SKIPPED: {other} is not installed");
        return;
    }
    assert!(linked_mpi().starts_with(built), "{}", linked_mpi());
    let mut cmd = Command::new(other);
    cmd.args(["-n", "2"]);
    if other.contains("openmpi") {
        open_mpi_on_this_machine(&mut cmd);
    }
    cmd.arg(BIN)
        .args(train_args(&[
            "out_dir=solo",
            "gradient_accumulation_steps=2",
        ]))
        .current_dir(workdir());
    let out = run_for(cmd, Duration::from_secs(60));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let refusals = stderr
        .lines()
        .filter(|l| {
            l.contains(&format!("built against {built} ("))
                && l.contains(&format!("started by {by}"))
        })
        .count();
    // Each rank refuses as it starts; Open MPI's launcher may kill the other one
    // before it says so (it ends a job as soon as one process fails).
    assert!(refusals >= 1, "a rank refuses:\n{stderr}");
    assert!(!stdout.contains("iter 0:"), "{stdout}");
    assert!(!workdir().join("solo").exists(), "no rank trained alone");
}

/// Another build of nanogpt on one rank (here: a copy of the binary with one byte
/// more) is refused as MPI starts, naming the rank, its host and both builds.
#[test]
fn another_build_on_one_rank_is_refused_at_start() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let copy = workdir().join("other-build");
    let mut bytes = std::fs::read(BIN).unwrap();
    bytes.push(0);
    std::fs::write(&copy, bytes).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let args = train_args(&["out_dir=builds", "gradient_accumulation_steps=2"]);
    let mut cmd = Command::new(mpirun());
    if is_open_mpi() {
        open_mpi_on_this_machine(&mut cmd);
    }
    cmd.args(["-n", "1", BIN])
        .args(&args)
        .args([":", "-n", "1"])
        .arg(&copy)
        .args(&args)
        .current_dir(workdir());
    let out = run_for(cmd, Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("refusing to start: rank 1 (host "))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(
        line.contains(") runs build ") && line.contains(", rank 0 (host "),
        "{line}"
    );
    assert!(!workdir().join("builds").exists(), "{stderr}");
}

/// A directory with a fake launcher (`mpirun`, of the linked MPI's flavour) whose
/// doctor run succeeds and whose job writes each signal it receives to `got` and
/// ends on SIGTERM (143) or after a SIGUSR1 (138, when `signals` is 1), or at once
/// (when `signals` is 0), and a fake
/// ssh (`ssh`) that runs the command here, except on a host named `bad`, where it
/// fails as ssh does with `bad_status` and `bad_stderr`.
fn fake_launcher(
    d: &Path,
    signals: usize,
    bad_status: i32,
    bad_stderr: &str,
) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let bin = d.join("fakebin");
    std::fs::create_dir_all(&bin).unwrap();
    let version = match linked_mpi().starts_with("Open MPI") {
        true => "mpirun (Open MPI) 4.1.4",
        false => "HYDRA build details:",
    };
    let got = d.join("got");
    let mpirun = format!(
        r#"#!/bin/bash
[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}
case " $* " in *" doctor "*) exit 0 ;; esac
usr1=0
trap 'echo USR1 >> {got}; usr1=1' USR1
trap 'echo TERM >> {got}; exit 143' TERM
trap 'echo INT >> {got}; exit 130' INT
touch {got}
[ {signals} = 0 ] && exit 0
for i in $(seq 1 600); do sleep 0.1; [ $usr1 = 1 ] && [ {signals} = 1 ] && exit 138; done
exit 0
"#,
        got = got.display()
    );
    let ssh = format!(
        r#"#!/bin/sh
while [ $# -gt 0 ]; do case $1 in -o) shift 2;; -*) shift;; *) break;; esac; done
host=$1; shift
[ "$host" = bad ] && {{ printf '%s\n' '{bad_stderr}' >&2; exit {bad_status}; }}
eval "$*"
"#
    );
    for (name, text) in [("mpirun", mpirun), ("ssh", ssh)] {
        std::fs::write(bin.join(name), text).unwrap();
        std::fs::set_permissions(bin.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    bin
}

/// `nanogpt launch` on `hosts` with [`fake_launcher`]'s launcher and ssh.
fn launch_command(d: &Path, bin: &Path, hosts: &str) -> Command {
    std::fs::write(d.join("hosts"), hosts).unwrap();
    let n = hosts.lines().count().to_string();
    let mut cmd = common::command(d, ["launch", "--hosts", "hosts", "-n", &n, "--mpirun"]);
    cmd.arg(bin.join("mpirun"))
        .args(["--", "train", "max_iters=5"])
        .env("HYDRA_LAUNCHER_EXEC", bin.join("ssh"))
        .env("OMPI_MCA_plm_rsh_agent", bin.join("ssh"))
        .env_remove("NANOGPT_MPIRUN");
    cmd
}

/// `launch`, signalled `signals` times (SIGINT, as Ctrl-C) once the job runs:
/// its exit status and what the job received.
fn launch_signalled(d: &Path, signals: usize) -> (Option<i32>, String) {
    let bin = fake_launcher(d, signals, 0, "");
    let got = d.join("got");
    let _ = std::fs::remove_file(&got);
    let mut cmd = launch_command(d, &bin, "localhost\n127.0.0.1\n");
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let start = Instant::now();
    while !got.exists() {
        assert!(start.elapsed().as_secs() < 60, "the fake job never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    for _ in 0..signals {
        let pid = child.id().to_string();
        assert!(Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success());
        std::thread::sleep(Duration::from_millis(500));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(stderr.contains("launch: passing the signal on"), "{stderr}");
    (out.status.code(), std::fs::read_to_string(&got).unwrap())
}

#[test]
fn launch_turns_ctrl_c_into_sigusr1_for_the_job_and_exits_130() {
    let dir = temp_dir("mpi-launch-signal");
    // One Ctrl-C: the job gets SIGUSR1 (a stop with a checkpoint), never SIGINT, and
    // launch exits 130 whatever the launcher reports (here 138, as Open MPI's).
    let (code, got) = launch_signalled(dir.path(), 1);
    assert_eq!(got, "USR1\n");
    assert_eq!(code, Some(130));
    // A second one: SIGTERM, the launcher's abort.
    let (code, got) = launch_signalled(dir.path(), 2);
    assert_eq!(got, "USR1\nTERM\n");
    assert_eq!(code, Some(130));
}

/// `launch` asks every host over ssh before MPI starts: a missing binary, another
/// build or an unknown host key is refused naming the host and the fix.
#[test]
fn launch_refuses_a_host_that_cannot_run_the_job_before_mpi_starts() {
    let dir = temp_dir("mpi-launch-probe");
    let d = dir.path();
    let cases = [
        (
            127,
            "sh: 1: /x/nanogpt: not found",
            "host bad: there is no nanogpt at ",
        ),
        (
            255,
            "Host key verification failed.",
            "host bad: its SSH host key is not in known_hosts",
        ),
    ];
    for (status, stderr, want) in cases {
        let bin = fake_launcher(d, 1, status, stderr);
        let _ = std::fs::remove_file(d.join("got"));
        let out = common::run(&mut launch_command(d, &bin, "localhost\nbad\n"));
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(
            err.contains("refusing to start: 1 problem(s) above"),
            "{err}"
        );
        assert!(!d.join("got").exists(), "the job never started");
    }
    // Every host answers with this build: the job runs (here the fake one).
    let bin = fake_launcher(d, 0, 0, "");
    let out = common::run(&mut launch_command(d, &bin, "localhost\n127.0.0.1\n"));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("launch: 2 host(s) reached over ")
            && stdout.contains("each with this build ("),
        "{stdout}"
    );
}

#[test]
fn doctor_under_mpirun_reports_every_rank_and_fails_on_other_data() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    copy_dataset(workdir(), false);
    let other = temp_dir("mpi-doctor-other");
    copy_dataset(other.path(), true);
    let doctor = ["doctor", "--json", "dataset=tiny", "n_layer=2", "n_embd=32"];
    let job = |rank1_dir: &Path| {
        let mut cmd = launcher(1);
        cmd.args(doctor).args([":", "-n", "1", "env", "-C"]);
        cmd.arg(rank1_dir).arg(BIN).args(doctor);
        let out = run_for(cmd, Duration::from_secs(60));
        let json = text(&out.stdout);
        let json = json
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("no JSON:\n{json}\n{}", text(&out.stderr)));
        (
            out.status.success(),
            serde_json::from_str::<serde_json::Value>(json).unwrap(),
        )
    };
    let (ok, report) = job(workdir());
    assert!(ok, "{report}");
    assert_eq!(report["ok"], true, "{report}");
    let ranks = report["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    assert_eq!(ranks[0]["data_fingerprint"], ranks[1]["data_fingerprint"]);
    // Both ranks on this host: no network between them.
    assert_eq!(ranks[0]["interface"], "local", "{report}");
    assert_eq!(ranks[1]["interface"], "local", "{report}");
    assert!(
        report["all_reduce"]["ms"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    let (ok, report) = job(other.path());
    assert!(!ok, "{report}");
    assert_eq!(report["ok"], false, "{report}");
    let problems = report["ranks"][1]["problems"].to_string();
    assert!(
        problems.contains("train.bin has other content"),
        "{problems}"
    );
    // Loss masks (instruction data) on rank 1 only: refused, naming the mask.
    let masked = temp_dir("mpi-doctor-mask");
    copy_dataset(masked.path(), false);
    for name in ["train.mask", "val.mask"] {
        std::fs::write(masked.path().join("data/tiny").join(name), [1u8; 4]).unwrap();
    }
    let (ok, report) = job(masked.path());
    assert!(!ok, "{report}");
    let problems = report["ranks"][1]["problems"].to_string();
    assert!(
        problems.contains("train.mask is 4 bytes here, missing on rank 0"),
        "{problems}"
    );
}

/// ZeRO 0-3's gradient reductions (our rings by default) give exactly MPI's
/// blocking collectives' sums of integer-valued gradients, and the weights'
/// all-gathers put every piece in its place, on 2 and 3 ranks, with uneven pieces
/// and (3 ranks) empty ones: `doctor` compares them (src/dist/reduce_check.rs). A
/// round skipped or a piece misplaced changes a sum (checked by hand: the first
/// round's addition left out fails at 3 ranks, and so does the all-reduce's last
/// all-gather round left out at 2 ranks).
#[test]
fn the_rings_sum_and_gather_exactly_as_mpi_does() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    copy_dataset(workdir(), false);
    for ranks in [2, 3] {
        let mut cmd = launcher(ranks);
        cmd.args(["doctor", "--json", "dataset=tiny", "n_layer=2", "n_embd=32"]);
        let out = run_for(cmd, Duration::from_secs(60));
        let stdout = text(&out.stdout);
        let json = stdout.lines().find(|l| l.starts_with('{'));
        let json = json.unwrap_or_else(|| panic!("no JSON:\n{stdout}\n{}", text(&out.stderr)));
        let report: serde_json::Value = serde_json::from_str(json).unwrap();
        assert!(out.status.success(), "{ranks} ranks: {report}");
        assert_eq!(report["ok"], true, "{ranks} ranks: {report}");
        let check = report["reduce_check"].as_str().unwrap();
        assert!(
            check.starts_with("our ring collectives: reductions = MPI_Allreduce"),
            "{ranks} ranks: {check}"
        );
    }
}

/// How far (relative) a bf16 run on several ranks may follow the one-process bf16
/// run: the issue's 1e-5. The gradients are summed in another order (f32 noise,
/// about 1e-7 relative), which moves a weight's bf16 rounding only where it lies
/// within that noise of a rounding boundary; measured 8.8e-7 (2 ranks) and 7.9e-8
/// (3 ranks) over 6 steps.
const BF16_TOLERANCE: f64 = 1e-5;

/// ZeRO-3 in bf16: the bf16 weight copy is rounded per bucket as each arrives, not
/// from the whole arena. With one micro-step per rank, ZeRO-2 and ZeRO-3 sum the
/// same gradients in the same order (ZeRO-2 with the embeddings' bucket in its
/// place, `NANOGPT_EMBEDDINGS_FIRST=0`, as ZeRO-3 always has it) and rounding is per
/// element, so the two runs are bit-identical (losses and weights). Against one process, whose gradients are
/// summed in another order before AdamW and the rounding to bf16, the run follows
/// within [`BF16_TOLERANCE`].
#[test]
fn zero_3_in_bf16_rounds_each_bucket_as_the_whole_copy_does() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (iters, bf16) = ("max_iters=6", "dtype=bfloat16");
    for (ranks, ckpt) in [(2, true), (3, false)] {
        let acc = format!("gradient_accumulation_steps={ranks}");
        let ckpt = format!("activation_checkpointing={ckpt}");
        let run = |stage: &str| {
            let out = format!("bf16-{ranks}-{stage}");
            let args = [&acc, iters, bf16, stage, &ckpt];
            train_env(ranks, &out, &args, &[("NANOGPT_EMBEDDINGS_FIRST", "0")]);
            out
        };
        let (two, three) = (run("zero_stage=2"), run("zero_stage=3"));
        assert_eq!(losses(&two), losses(&three), "{two} vs {three}");
        let same = params(&two).1 == params(&three).1;
        assert!(same, "{two} vs {three}: bit-identical weights");
        let one = reference(&[&acc, iters, bf16]);
        let ((sa, ea), (sb, eb)) = (losses(&one), losses(&three));
        assert_eq!((sa.len(), ea.len()), (sb.len(), eb.len()));
        let mut worst = 0.0f64;
        for ((ia, la), (ib, lb)) in sa.iter().chain(&ea).zip(sb.iter().chain(&eb)) {
            assert_eq!(ia, ib);
            worst = worst.max((la - lb).abs() / la.abs());
        }
        eprintln!("{one} vs {three}: largest relative loss difference {worst:e}");
        assert!(worst <= BF16_TOLERANCE, "{one} vs {three}: {worst:e}");
    }
}

/// The embeddings' bucket reduced first (its reduction started before the blocks'
/// backward) and every rank's encoder gradient added after: stages 0, 1 and 2 on 2
/// and 3 ranks follow the one-process run (the size rule would not pick it on 3
/// ranks of this tiny vocabulary: forced by NANOGPT_EMBEDDINGS_FIRST=1), and forced
/// off the same run stays the same.
#[test]
fn embeddings_reduced_first_follow_the_one_process_run() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (acc, iters) = ("gradient_accumulation_steps=6", "max_iters=10");
    let one = reference(&[acc, iters]);
    for (stage, ranks, first) in [(0, 3, "1"), (1, 2, "1"), (2, 3, "1"), (1, 3, "0")] {
        let out = format!("first-{stage}-{ranks}-{first}");
        let zero = format!("zero_stage={stage}");
        let args = [format!("out_dir={out}"), acc.into(), iters.into(), zero];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = command(ranks, &args);
        cmd.env("NANOGPT_EMBEDDINGS_FIRST", first);
        let done = run_for(cmd, Duration::from_secs(300));
        assert!(done.status.success(), "{out}: {}", text(&done.stderr));
        assert_same_run(&one, &out);
        let report = read_json(&workdir().join(&out).join("comm.json"));
        assert_eq!(report["embeddings_first"], first == "1", "{out}: {report}");
    }
}

/// `grad_reduce_dtype = "bfloat16"` (ZeRO 0 and 1, 2 ranks): the gradients really
/// travel rounded (the weights move off the one-process run's far beyond f32
/// noise) yet every step's loss stays within 1e-4 relative of it (measured 5e-6),
/// and comm.json counts half the bytes.
#[test]
fn bf16_gradient_reduction_stays_close_and_halves_the_bytes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (acc, iters) = ("gradient_accumulation_steps=4", "max_iters=10");
    let one = reference(&[acc, iters]);
    let (layout, _, _) = params(&one);
    for stage in ["zero_stage=0", "zero_stage=1"] {
        let out = format!("bf16-wire-{stage}");
        train(2, &out, &[acc, iters, stage, "grad_reduce_dtype=bfloat16"]);
        let ((want, _), (got, _)) = (losses(&one), losses(&out));
        assert_eq!(want.len(), got.len());
        let rel = |(a, b): (&(u64, f64), &(u64, f64))| (a.1 - b.1).abs() / a.1.abs();
        let worst = want.iter().zip(&got).map(rel).fold(0.0, f64::max);
        eprintln!("{out}: largest relative loss difference {worst:e}");
        assert!(worst <= 1e-4, "{out}: losses differ by up to {worst}");
        // f32 reduction on 2 ranks moves the weights off 1 process by ~2e-8 here,
        // bf16 by ~1e-3.
        let (_, want, _) = params(&one);
        let (_, got, _) = params(&out);
        let moved = want.iter().zip(&got).map(|(a, b)| (a - b).abs());
        let moved = moved.fold(0.0, f32::max);
        eprintln!("{out}: largest parameter difference {moved:e}");
        assert!(
            moved > 1e-5,
            "{out}: the weights are f32 reduction's ({moved})"
        );
        let report = read_json(&workdir().join(&out).join("comm.json"));
        assert_eq!(report["grad_bytes"], layout.len * 2, "{report}");
    }
}

/// The tensors of `out`'s checkpoint: the header's entries (names, shapes, offsets;
/// not the metadata, which names the world size and stage) and the bytes after it.
fn tensor_bytes(out: &str) -> (serde_json::Value, Vec<u8>) {
    tensor_bytes_of(out, "ckpt.safetensors")
}

/// [`tensor_bytes`] of checkpoint file `file` of `out`.
fn tensor_bytes_of(out: &str, file: &str) -> (serde_json::Value, Vec<u8>) {
    let bytes = std::fs::read(workdir().join(out).join(file)).unwrap();
    let n = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..n]).unwrap();
    header.as_object_mut().unwrap().remove("__metadata__");
    (header, bytes[n..].to_vec())
}

/// Every tensor of `a`'s and `b`'s checkpoints, moments included, within float noise
/// of each other (relative to the tensor's largest value).
fn assert_close_checkpoints(a: &str, b: &str) {
    let open = |out: &str| {
        let ckpt = Checkpoint::open(&workdir().join(out)).unwrap();
        let layout = ParamLayout::new(&ckpt.state.model);
        let mut state = vec![vec![0.0f32; layout.len]; 3];
        ckpt.load_params(&layout, &mut state[0]).unwrap();
        let [_, m, v] = &mut state[..] else {
            unreachable!()
        };
        assert!(ckpt.load_moments(&layout, m, v).unwrap(), "{out}: moments");
        (layout, state)
    };
    let ((layout, sa), (_, sb)) = (open(a), open(b));
    for (xa, xb) in sa.iter().zip(&sb) {
        for t in &layout.tensors {
            let (ta, tb) = (&xa[t.range()], &xb[t.range()]);
            let scale = ta.iter().fold(0.0f32, |s, x| s.max(x.abs()));
            let worst = ta
                .iter()
                .zip(tb)
                .fold(0.0f32, |w, (x, y)| w.max((x - y).abs()));
            assert!(worst <= 1e-4 * scale, "{a} vs {b}: {} {worst}", t.name);
        }
    }
}

/// Rank 0 writes a checkpoint tensor by tensor, gathering what ZeRO shards (the
/// moments at stages 1-3, the weights at 3) one tensor at a time: the files hold the
/// same tensors, byte for byte, whatever the stage. (With one micro-step per rank and
/// no clipping, 2 ranks sum the same gradients at every stage; 3 ranks with two
/// micro-steps each at stages 1-2 — stage 3 adds each micro-step's reduced gradients,
/// another order; stage 0's all-reduce (MPI's) sums 3 ranks in another order than
/// the ring reduce-scatter of stages 1-3, so it is compared within float noise.)
/// They match one process's file within float noise.
#[test]
fn checkpoints_hold_the_same_bytes_at_every_zero_stage() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (ranks, acc, stages) in [
        (2, "gradient_accumulation_steps=2", 0..=3),
        (3, "gradient_accumulation_steps=6", 1..=2),
    ] {
        let args = [acc, "grad_clip=0", "max_iters=3"];
        let one = reference(&args);
        let mut first = None;
        for stage in stages {
            let out = format!("bytes-{ranks}-{stage}");
            let zero = format!("zero_stage={stage}");
            // The embeddings' bucket in its place at every stage (ZeRO-3 never
            // reduces it first), so that every stage sums the gradients alike.
            let args = [&args[..], &[zero.as_str()]].concat();
            train_env(ranks, &out, &args, &[("NANOGPT_EMBEDDINGS_FIRST", "0")]);
            let tensors = tensor_bytes(&out);
            match &first {
                None => first = Some(tensors),
                Some(first) => assert!(first == &tensors, "{out}: not the first stage's tensors"),
            }
        }
        assert_close_checkpoints(&one, &format!("bytes-{ranks}-1"));
        if ranks == 3 {
            let args = [&args[..], &["zero_stage=0"]].concat();
            train_env(
                ranks,
                "bytes-3-0",
                &args,
                &[("NANOGPT_EMBEDDINGS_FIRST", "0")],
            );
            assert_close_checkpoints("bytes-3-0", "bytes-3-1");
        }
    }
}

/// ZeRO-3: a rank killed as it enters a gather of a layer's weights (the other rank
/// waits in that all-gather) ends the job well within `collective_timeout_s` (the
/// launcher sees the death); a rank stopped there (alive and silent: only the
/// watchdog can tell) is named by the waiting rank's watchdog, which ends the job.
#[test]
fn a_rank_killed_or_stopped_in_a_zero_3_gather_ends_the_job() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (fault, timeout_s) in [
        ("kill-during-gather:40:1", 20),
        ("stop-during-gather:40:1", 3),
    ] {
        let out = format!("gather-{}", &fault[..4]);
        let timeout = format!("collective_timeout_s={timeout_s}");
        let mut cmd = command(
            2,
            &[
                &format!("out_dir={out}"),
                "zero_stage=3",
                "gradient_accumulation_steps=2",
                "max_iters=100000",
                "lr_decay_iters=100000",
                &timeout,
            ],
        );
        cmd.env("NANOGPT_FAULT", fault);
        let start = Instant::now();
        let run = run_for(cmd, Duration::from_secs(90));
        let took = start.elapsed();
        // A stopped rank would outlive the job if the launcher left it behind.
        if let Some(pid) = rank_pid(&out, 1) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let stderr = text(&run.stderr);
        assert!(
            !run.status.success(),
            "{fault}: the job must fail:\n{stderr}"
        );
        let signal = if timeout_s == 3 { "SIGSTOP" } else { "SIGKILL" };
        let injected = format!("fault injection: {signal} rank 1 in ZeRO-3 weight gather 40");
        assert!(stderr.contains(&injected), "{stderr}");
        if signal == "SIGKILL" {
            assert!(
                took < Duration::from_secs(timeout_s),
                "ended after {took:?}"
            );
            // Open MPI names the signal on stderr. Hydra's banner ("KILLED BY SIGNAL:
            // 9", on stdout) was missing from about one run in five here, so under
            // Hydra the failure, its speed and the injection are what is checked.
            if is_open_mpi() {
                assert!(stderr.contains("signal 9"), "{stderr}");
            }
        } else {
            let waited = "rank 0 of 2 (host ";
            assert!(stderr.contains(waited), "{stderr}");
            // Rank 0 waits in the gather rank 1 never joins, or (prefetching) in the
            // reduction or gather it had started before.
            assert!(
                stderr.contains("made no progress for 3 s (collective_timeout_s = 3)"),
                "{stderr}"
            );
            assert!(stderr.contains("rank 1 (host ") && stderr.contains(") did not arrive"));
            assert!(took < Duration::from_secs(30), "ended after {took:?}");
        }
    }
}

/// ZeRO-1 and ZeRO-2 leave the all-gathers of the updated weights in flight: the
/// next forward waits for each bucket just before it reads it (rounding its bf16
/// copy then), and every other reader — evaluation, checkpoint — waits for all first.
/// Against the blocking gather (`NANOGPT_AG_OVERLAP=0`), 2 ranks, f32 and bf16:
/// every loss and evaluation, and the tensors of every checkpoint (at each
/// evaluation, every 3 iterations, at iteration 4, written right after an update,
/// and the final one) are bit-identical. With `NANOGPT_FAULT=late-gathers` a gather
/// starts only when waited for, so a reader that did not wait would see the other
/// rank's pieces from before the update (checked by hand: without the checkpoint's
/// wait, `ckpt-000004` differs); without the fault MPI moves them meanwhile, as in
/// a real run.
#[test]
fn weights_gathered_in_flight_train_and_save_as_the_blocking_gather() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let job = [
        "gradient_accumulation_steps=2",
        "max_iters=5",
        "eval_interval=3",
        "ckpt_interval=4",
    ];
    let runs = [
        (1, "float32", true),
        (1, "bfloat16", true),
        (2, "float32", true),
        (2, "bfloat16", true),
        (1, "float32", false),
    ];
    for (stage, dtype, late) in runs {
        let (zero, dtype_key) = (format!("zero_stage={stage}"), format!("dtype={dtype}"));
        let args = [&job[..], &[zero.as_str(), dtype_key.as_str()]].concat();
        let blocking = format!("ag-{stage}-{dtype}-blocking");
        if !workdir().join(&blocking).join("ckpt.safetensors").exists() {
            train_env(2, &blocking, &args, &[("NANOGPT_AG_OVERLAP", "0")]);
        }
        let fault = if late { "late-gathers" } else { "" };
        let in_flight = format!("ag-{stage}-{dtype}-in-flight-{fault}");
        train_env(2, &in_flight, &args, &[("NANOGPT_FAULT", fault)]);
        assert_eq!(losses(&in_flight), losses(&blocking), "{in_flight}");
        for file in ["ckpt-000004.safetensors", "ckpt.safetensors"] {
            let same = tensor_bytes_of(&in_flight, file) == tensor_bytes_of(&blocking, file);
            assert!(same, "{in_flight}: {file} is not the blocking run's");
        }
        for (out, on) in [(&in_flight, true), (&blocking, false)] {
            let report = read_json(&workdir().join(out).join("comm.json"));
            assert_eq!(report["gathers_in_flight"], on, "{out}: {report}");
            let gather = report["exposed_gather_ms"].as_f64().unwrap();
            assert!(gather > 0.0, "{out}: {report}");
        }
    }
}

/// ZeRO-3 keeps buckets whole from one pass to the next where the next needs them
/// first (the last two blocks into backward; the first block, `ln_f` and the
/// embeddings into the next micro-step's forward): the same bits as gathering them
/// again (`NANOGPT_ZERO3_KEEP=0`), and exactly those gathers fewer per step. It
/// also keeps the embeddings' gradient, summed over a rank's micro-steps and
/// reduced in the last one only: every other bucket is reduced once per micro-step.
#[test]
fn zero_3_keeps_buckets_whole_between_passes_for_the_same_bits() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // 2 ranks of 4 micro-steps: 2 micro-steps per rank and step.
    let args = [
        "gradient_accumulation_steps=4",
        "max_iters=6",
        "zero_stage=3",
    ];
    let (again, kept) = ("zero3-gather-again", "zero3-kept-whole");
    train_env(2, again, &args, &[("NANOGPT_ZERO3_KEEP", "0")]);
    train(2, kept, &args);
    assert_eq!(losses(again), losses(kept), "losses bit for bit");
    assert!(
        tensor_bytes(again) == tensor_bytes(kept),
        "checkpoints byte for byte"
    );
    let gathered = |out: &str| {
        let report = read_json(&workdir().join(out).join("comm.json"));
        report["gathered_bytes"].as_u64().unwrap() as usize
    };
    // Buckets (floats, alignment included): the embeddings, each block, `ln_f`.
    let layout = params(kept).0;
    let emb = layout.layers[0].span.start;
    let block = layout.layers[1].span.start - emb;
    let n_layer = layout.layers.len();
    let ln_f = layout.len - emb - n_layer * block;
    let micro = 2;
    // Every pass gathers all it reads: forward the whole arena, backward the blocks.
    assert_eq!(gathered(again), 4 * micro * (layout.len + n_layer * block));
    let saved = micro * 2 * block + (micro - 1) * (emb + ln_f + block);
    assert_eq!(gathered(again) - gathered(kept), 4 * saved);
    let report = read_json(&workdir().join(kept).join("comm.json"));
    let reduced = report["reduced_bytes"].as_u64().unwrap() as usize;
    assert_eq!(reduced, 4 * (micro * layout.len - (micro - 1) * emb));
}

/// bf16 weights packed once per optimizer step (where the kernel reads packs: AMX,
/// AVX512-BF16) give the same bits as packing them per product
/// (`NANOGPT_BF16_PACKS=0`): one process, and ZeRO-1 on 2 ranks, whose next
/// forward rounds and packs each bucket as its all-gather arrives; 2 micro-steps per
/// rank at least, where the linear weights are packed once per step. The model is
/// wide enough (C = 64, 128 rows) that the linear products reach the bf16 kernel.
#[test]
fn bf16_packs_made_once_per_step_give_the_same_bits() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let packed = nanogpt::kernels::bf16::Backend::detect(None).reads_packs();
    for (ranks, stage) in [(0, "zero_stage=0"), (2, "zero_stage=1")] {
        let args = [
            "dtype=bfloat16",
            "n_embd=64",
            "batch_size=8",
            "gradient_accumulation_steps=4",
            "max_iters=4",
            stage,
        ];
        let per_call = format!("packs-off-{ranks}");
        let once = format!("packs-on-{ranks}");
        train_env(ranks, &per_call, &args, &[("NANOGPT_BF16_PACKS", "0")]);
        let stdout = train(ranks, &once, &args);
        // The plan counts the packs exactly where the run makes them.
        assert_eq!(stdout.contains("packed bf16 weights"), packed, "{stdout}");
        assert_eq!(losses(&per_call), losses(&once), "{per_call} vs {once}");
        let same = params(&per_call).1 == params(&once).1;
        assert!(same, "{per_call} vs {once}: bit-identical weights");
        if ranks > 1 {
            let report = read_json(&workdir().join(&once).join("comm.json"));
            assert_eq!(report["gathers_in_flight"], true, "{once}: {report}");
        }
    }
}

/// ZeRO-1 on two ranks maps no fresh pages per step. The block's bucket here holds
/// 9.6 M floats: a reduction that allocates per step, as Open MPI's
/// `MPI_Ireduce_scatter_block` does (twice the bucket, beyond glibc's largest mmap
/// threshold of 32 MiB in f32 and in bf16), has rank 0 fault those pages in every
/// step: 9,410 per step in f32 and 4,705 in bf16 with MPI's, under 1 with our ring
/// reduce-scatter (`NANOGPT_RING_REDUCE=0` brings MPI's back). What remains is the
/// progress thread that moves the weights' ring all-gathers on, started afresh each
/// step: its new stack faults in 90–315 pages per step (0.25–0.5 faults with
/// `NANOGPT_PROGRESS_THREAD=0`), whatever the model's size, hence the bound.
#[test]
fn zero_1_on_two_ranks_reuses_its_memory_every_step() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = [
        "n_layer=1",
        "n_embd=896",
        "n_head=7",
        "block_size=8",
        "batch_size=1",
    ];
    let job = [
        "gradient_accumulation_steps=2",
        "max_iters=4",
        "eval_interval=100",
        "always_save_checkpoint=false",
    ];
    for wire in ["float32", "bfloat16"] {
        let out = format!("faults-{wire}");
        let wire_key = format!("grad_reduce_dtype={wire}");
        let args = [&model[..], &job, &["zero_stage=1", wire_key.as_str()]].concat();
        train(2, &out, &args);
        let report = read_json(&workdir().join(&out).join("comm.json"));
        let faults = report["minor_faults"].as_f64().unwrap();
        eprintln!("{out}: {faults} minor faults per step on rank 0");
        assert!(faults < 1000.0, "{out}: {report}");
    }
}
