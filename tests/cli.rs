//! The `nanogpt` binary end to end on tiny data: prepare, train, resume, eval,
//! sample, and the errors a user sees. Nothing here needs the network.

use std::path::Path;

mod common;
use common::{
    command, fails, fixture, metric, ok, read_json, succeeds, temp_dir, TINY_MODEL,
    TINY_SHAKESPEARE,
};

fn tokens_in(path: &Path) -> usize {
    std::fs::metadata(path).unwrap().len() as usize / 2
}

/// Trains [`TINY_SHAKESPEARE`] with `extra` settings in `dir`; returns stdout.
fn train(dir: &Path, extra: &[&str]) -> String {
    ok(dir, &[&["train"], &TINY_SHAKESPEARE[..], extra].concat())
}

#[test]
fn prepare_reads_every_source_kind_with_both_tokenizers() {
    let dir = temp_dir("prepare");
    let d = dir.path();
    std::fs::write(d.join("one.txt"), "hello world, hello text.\n".repeat(50)).unwrap();
    std::fs::create_dir(d.join("docs")).unwrap();
    for (i, text) in ["first doc. ", "second doc! ", "third doc? "]
        .iter()
        .enumerate()
    {
        std::fs::write(d.join(format!("docs/{i}.txt")), text.repeat(20)).unwrap();
    }
    let jsonl: String = (0..6)
        .map(|i| format!("{{\"text\": \"line {i} of the corpus\", \"id\": {i}}}\n"))
        .collect();
    std::fs::write(d.join("docs.jsonl"), jsonl).unwrap();
    let parquet = fixture("docs.parquet");
    let sources = [
        "shakespeare",
        "one.txt",
        "docs",
        "docs.jsonl",
        parquet.to_str().unwrap(),
    ];
    for source in sources {
        for tokenizer in ["gpt2", "char"] {
            let out = format!("out-{}-{tokenizer}", source.len());
            ok(
                d,
                &["prepare", source, "--out", &out, "--tokenizer", tokenizer],
            );
            let meta = read_json(&d.join(&out).join("meta.json"));
            assert_eq!(meta["tokenizer"], tokenizer);
            let train = tokens_in(&d.join(&out).join("train.bin"));
            let val = tokens_in(&d.join(&out).join("val.bin"));
            assert_eq!(meta["train_tokens"], train as u64, "{source} {tokenizer}");
            assert_eq!(meta["val_tokens"], val as u64, "{source} {tokenizer}");
            assert!(
                train > 0 && val > 0,
                "{source} {tokenizer}: {train} / {val}"
            );
        }
    }
    // nanoGPT's published counts for the bundled text.
    let meta = read_json(&d.join("out-11-char/meta.json"));
    assert_eq!(meta["train_tokens"], 1_003_854);
    assert_eq!(meta["val_tokens"], 111_540);
    assert_eq!(meta["vocab_size"], 65);
    let meta = read_json(&d.join("out-11-gpt2/meta.json"));
    assert_eq!(meta["train_tokens"], 301_966);
    assert_eq!(meta["val_tokens"], 36_059);
}

#[test]
fn prepare_refuses_bad_input_clearly() {
    let dir = temp_dir("prepare-bad");
    let d = dir.path();
    std::fs::write(d.join("latin1.txt"), b"caf\xe9 au lait").unwrap();
    let err = fails(d, &["prepare", "latin1.txt", "--out", "x"]);
    assert!(err.contains("latin1.txt") && err.contains("UTF-8"), "{err}");
    let err = fails(d, &["prepare", "missing.txt", "--out", "x"]);
    assert!(err.contains("missing.txt"), "{err}");
    assert!(
        !d.join("x/train.bin").exists(),
        "nothing written on failure"
    );
}

#[test]
fn train_writes_checkpoint_metrics_and_plot_then_eval_and_sample_use_it() {
    let dir = temp_dir("train");
    let d = dir.path();
    let stdout = train(d, &["max_iters=6", "eval_interval=3", "out_dir=run"]);
    assert!(stdout.contains("step 6: train loss"), "{stdout}");
    let run = d.join("run");
    for file in ["ckpt.safetensors", "ckpt.json", "metrics.jsonl", "loss.png"] {
        assert!(run.join(file).is_file(), "{file} missing");
    }
    let losses = metric(&run, "loss");
    assert_eq!(
        losses.iter().map(|r| r.0).collect::<Vec<_>>(),
        (0..=6).collect::<Vec<_>>()
    );
    assert!(losses.iter().all(|r| r.1.is_finite() && r.1 > 0.0));
    let evals = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("val_loss"))
        .count();
    assert_eq!(evals, 3, "evaluations at 0, 3 and 6");

    // eval: every whole window of val.bin, one JSON object.
    let data = d.join("data/shakespeare_char/val.bin");
    let json = ok(
        d,
        &[
            "eval",
            "--init-from",
            "run",
            "--data",
            data.to_str().unwrap(),
            "--json",
        ],
    );
    let report: serde_json::Value = serde_json::from_str(json.trim()).expect("one JSON object");
    let windows = (tokens_in(&data) - 1) / 16;
    assert_eq!(report["tokens"], (windows * 16) as u64);
    let loss = report["loss"].as_f64().unwrap();
    let ppl = report["perplexity"].as_f64().unwrap();
    assert!(loss > 0.5 && loss < 5.0, "{loss}");
    assert!((ppl - loss.exp()).abs() < 1e-6 * ppl);
    // The same data as text gives the same number (char tokenizer round trip).
    let text = &nanogpt::data::SHAKESPEARE_TEXT[1_003_854..];
    std::fs::write(d.join("val.txt"), text).unwrap();
    let json = ok(
        d,
        &["eval", "--init-from", "run", "--data", "val.txt", "--json"],
    );
    let from_text: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    assert_eq!(from_text, report);

    // sample: prompt, then the requested number of new characters, deterministically.
    let args = [
        "sample",
        "--out-dir",
        "run",
        "--start",
        "ROMEO:",
        "--num-samples",
        "2",
        "--max-new-tokens",
        "40",
        "--seed",
        "7",
    ];
    let first = ok(d, &args);
    assert!(first.starts_with("ROMEO:"), "{first}");
    let samples: Vec<&str> = first
        .split("---------------\n")
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(samples.len(), 2, "{first}");
    for s in &samples {
        let text = s.strip_suffix('\n').expect("each sample ends its line");
        assert_eq!(text.chars().count(), "ROMEO:".len() + 40, "{s:?}");
    }
    assert_eq!(first, ok(d, &args), "same seed, same samples");
    // With bf16 weights: as many characters, deterministically too.
    let half_args = [&args[..], &["--dtype", "bfloat16"]].concat();
    let half = ok(d, &half_args);
    assert!(half.starts_with("ROMEO:") && half.split("---------------\n").count() >= 2);
    assert_eq!(half, ok(d, &half_args), "same seed, same samples");
}

#[test]
fn resumed_run_repeats_the_uninterrupted_losses_exactly() {
    let dir = temp_dir("resume");
    let d = dir.path();
    let common = ["eval_interval=4", "always_save_checkpoint=true"];
    let mut straight = common.to_vec();
    straight.extend(["max_iters=9", "out_dir=straight"]);
    train(d, &straight);

    // Stop after iteration 3 (its final state checkpointed), then resume at 4 to 9.
    let mut first = common.to_vec();
    first.extend(["max_iters=3", "out_dir=split"]);
    train(d, &first);
    let mut second = common.to_vec();
    second.extend(["max_iters=9", "out_dir=split", "init_from=resume"]);
    let stdout = train(d, &second);
    assert!(
        stdout.contains("step 4:"),
        "resumes at iteration 4: {stdout}"
    );

    let a = metric(&d.join("straight"), "loss");
    let b = metric(&d.join("split"), "loss");
    assert_eq!(a.len(), 10);
    assert_eq!(a, b, "bit-identical losses after resuming");
}

#[test]
fn config_mistakes_are_refused_with_the_key_named() {
    let dir = temp_dir("config");
    let d = dir.path();
    let err = fails(d, &["train", "max_iter=3"]);
    assert!(
        err.contains("max_iter") && err.contains("max_iters"),
        "{err}"
    );
    let err = fails(d, &["train", "batch_size=many"]);
    assert!(err.contains("batch_size"), "{err}");
    let err = fails(d, &["train", "n_embd=100", "n_head=3"]);
    assert!(err.contains("n_embd") && err.contains("n_head"), "{err}");
    let err = fails(d, &["train", "block_size=0"]);
    assert!(err.contains("block_size"), "{err}");
    std::fs::write(d.join("bad.toml"), "learning_rate = \"fast\"\n").unwrap();
    let err = fails(d, &["train", "bad.toml"]);
    assert!(
        err.contains("bad.toml") && err.contains("learning_rate"),
        "{err}"
    );
    let err = fails(d, &["train", "missing.toml"]);
    assert!(err.contains("missing.toml"), "{err}");
    let err = fails(d, &["train", "init_from=resume", "out_dir=nothing-here"]);
    assert!(err.contains("no checkpoint"), "{err}");
    let err = fails(
        d,
        &["eval", "--init-from", "nothing-here", "--data", "x.bin"],
    );
    assert!(err.contains("nothing-here"), "{err}");
}

#[test]
fn bfloat16_training_reports_its_matmul_path_and_its_checkpoint_serves_eval_and_sample() {
    let dir = temp_dir("bf16");
    let d = dir.path();
    let extra = [
        "max_iters=4",
        "eval_interval=4",
        "out_dir=run",
        "dtype=bfloat16",
    ];
    let stdout = train(d, &extra);
    let path = format!(
        "bf16 matmuls: {}",
        nanogpt::kernels::bf16::Backend::detect(None).describe()
    );
    assert!(stdout.contains(&path), "{stdout}");
    let losses = metric(&d.join("run"), "loss");
    assert_eq!(losses.len(), 5);
    assert!(losses.iter().all(|r| r.1.is_finite() && r.1 > 0.0));
    // The checkpoint holds f32 master weights: eval and sample read it as usual.
    let data = d.join("data/shakespeare_char/val.bin");
    let data = data.to_str().unwrap();
    let json = ok(d, &["eval", "--init-from", "run", "--data", data, "--json"]);
    let report: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    let loss = report["loss"].as_f64().unwrap();
    assert!(loss > 0.5 && loss < 5.0, "{loss}");
    let args = [
        "sample",
        "--out-dir",
        "run",
        "--start",
        "A",
        "--max-new-tokens",
        "10",
    ];
    let text = ok(d, &args);
    assert!(text.starts_with('A'), "{text}");
    // The checkpoint records the kernel its products ran on.
    let here = nanogpt::kernels::bf16::Backend::detect(None).kernel();
    let ckpt = nanogpt::checkpoint::Checkpoint::open(&d.join("run")).unwrap();
    assert_eq!(ckpt.state.bf16_kernel.as_deref(), Some(here.name()));
    // And training resumes from it in bf16 where it stopped, saying so when its
    // products now run on another kernel (the f32 GEMM, asked for).
    let mut resume = vec!["train"];
    resume.extend(TINY_SHAKESPEARE);
    resume.extend([
        "max_iters=6",
        "eval_interval=6",
        "out_dir=run",
        "dtype=bfloat16",
    ]);
    resume.extend(["init_from=resume", "bf16_kernel=f32"]);
    let (resumed, err) = succeeds(&mut command(d, resume));
    assert!(resumed.contains("step 6: train loss"), "{resumed}");
    let other = format!(
        "its bf16 products ran on {}, this run's run on f32",
        here.name()
    );
    let f32 = nanogpt::kernels::bf16::Kernel::F32;
    assert_eq!(err.contains(&other), here != f32, "{err}");
}

/// `nanogpt bench --json` on a tiny model (B 2, T 16), with `extra` options; the
/// report it prints.
fn bench_json(dir: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["bench", "--batch-size", "2", "--block-size", "16"];
    args.extend(["--peak-gflops", "100", "--json"]);
    args.extend(extra);
    args.extend(TINY_MODEL);
    args.push("vocab_size=65");
    serde_json::from_str(ok(dir, &args).trim()).expect("one JSON object")
}

#[test]
fn bench_takes_a_dtype() {
    let dir = temp_dir("bench-dtype");
    let d = dir.path();
    let mut report = Vec::new();
    for dtype in ["float32", "bfloat16"] {
        let r = bench_json(d, &["--steps", "1", "--dtype", dtype]);
        assert_eq!(r["dtype"], dtype);
        assert!(r["ms_per_step"].as_f64().unwrap() > 0.0);
        report.push(r["activation_mb"].as_f64().unwrap());
    }
    assert!(
        report[1] < report[0],
        "bf16 activations are smaller: {report:?}"
    );
    let err = fails(d, &["bench", "--dtype", "float16"]);
    assert!(err.contains("float16") && err.contains("bfloat16"), "{err}");
}

#[test]
fn bench_profile_rows_are_exclusive_and_add_up_to_at_most_the_step() {
    // Every profiled span lies inside a timed step, so the rows (each section's own
    // time, nested sections taken out; means over the steps) cannot exceed the mean step.
    let dir = temp_dir("bench-profile");
    let d = dir.path();
    let r = bench_json(d, &["--steps", "3", "--profile", "--dtype", "bfloat16"]);
    let step = r["ms_per_step_mean"].as_f64().unwrap();
    let rows: Vec<(String, f64)> = r["profile"]
        .as_array()
        .expect("profile rows")
        .iter()
        .map(|row| {
            (
                row[0].as_str().unwrap().to_string(),
                row[1].as_f64().unwrap(),
            )
        })
        .collect();
    for (name, ms) in &rows {
        assert!(*ms >= 0.0, "{name}: {ms} ms");
    }
    for family in [
        "classifier matmuls",
        "softmax + cross-entropy",
        "linear forward",
        "adamw",
        "bf16 rounding + widening",
    ] {
        assert!(
            rows.iter().any(|(n, _)| n == family),
            "no {family} row: {rows:?}"
        );
    }
    let covered: f64 = rows.iter().map(|r| r.1).sum();
    assert!(
        covered <= step * 1.001,
        "rows add to {covered} ms, the step took {step}: {rows:?}"
    );
}

#[test]
fn activation_checkpointing_trains_the_same_losses_in_a_smaller_arena() {
    let dir = temp_dir("checkpointing");
    let d = dir.path();
    for dtype in ["float32", "bfloat16"] {
        let run = |ckpt: &str| {
            let out = format!("out_dir={dtype}-{ckpt}");
            let dt = format!("dtype={dtype}");
            let ck = format!("activation_checkpointing={ckpt}");
            train(d, &["max_iters=3", "dropout=0.1", &out, &dt, &ck]);
            metric(&d.join(format!("{dtype}-{ckpt}")), "loss")
        };
        let plain = run("false");
        assert_eq!(plain.len(), 4);
        assert_eq!(plain, run("true"), "{dtype}: bit-identical losses");
    }
    let r = [false, true].map(|on| {
        let key = format!("activation_checkpointing={on}");
        let r = bench_json(d, &["--steps", "1", &key]);
        assert_eq!(r["activation_checkpointing"], on);
        r["activation_mb"].as_f64().unwrap()
    });
    assert!(r[1] < r[0], "checkpointed arena is smaller: {r:?}");
    let err = fails(d, &["bench", "activation_checkpointing=yes"]);
    assert!(
        err.contains("activation_checkpointing must be true or false"),
        "{err}"
    );
}

/// A run whose activations dominate its memory: about 280 MB planned, 140 MB with
/// activation checkpointing.
const ACTIVATION_HEAVY: [&str; 7] = [
    "dataset=shakespeare_char",
    "n_layer=4",
    "n_head=2",
    "n_embd=64",
    "batch_size=64",
    "block_size=256",
    "max_iters=1",
];

#[test]
fn plan_reports_each_part_and_train_refuses_a_run_that_does_not_fit() {
    let dir = temp_dir("plan");
    let d = dir.path();
    let plan = |extra: &[&str]| -> serde_json::Value {
        let args = [&["plan", "--json"], &ACTIVATION_HEAVY[..], extra].concat();
        serde_json::from_str(ok(d, &args).trim()).expect("one JSON object")
    };
    let peak = |p: &serde_json::Value| p["ranks"][0]["peak_rss_mb"].as_f64().unwrap();
    let full = plan(&[]);
    let ckpt = plan(&["activation_checkpointing=true"]);
    assert!(full["fits"].as_bool().is_some());
    let parts = full["ranks"][0]["parts"].as_array().unwrap();
    assert!(parts.iter().any(|p| p["name"] == "activations"));
    assert!(peak(&ckpt) + 100.0 < peak(&full), "{ckpt} vs {full}");
    // LoRA: the model is the frozen base, the trained weights are the adapters.
    let lora = plan(&["lora_rank=4"]);
    let part = |p: &serde_json::Value, name: &str| {
        let parts = p["ranks"][0]["parts"].as_array().unwrap();
        let part = parts.iter().find(|q| q["name"] == name);
        part.map_or(0, |q| q["bytes"].as_u64().unwrap())
    };
    assert_eq!(part(&lora, "frozen base weights"), part(&full, "weights"));
    assert_eq!(part(&full, "frozen base weights"), 0);
    assert!(
        part(&lora, "weights") * 20 < part(&full, "weights"),
        "{lora}"
    );
    // Two ranks: every rank listed by its peak; ZeRO-1 shards the moments.
    let two = plan(&["--world-size", "2", "gradient_accumulation_steps=2"]);
    let sharded = plan(&[
        "--world-size",
        "2",
        "gradient_accumulation_steps=2",
        "zero_stage=1",
    ]);
    assert_eq!(two["ranks"].as_array().unwrap().len(), 2);
    let r1 = |p: &serde_json::Value| p["ranks"][1]["peak_rss_mb"].as_f64().unwrap();
    assert!(r1(&sharded) < r1(&two), "{sharded} vs {two}");

    // Between the two plans: train refuses before creating out_dir, naming the fix.
    let limit = ((peak(&full) + peak(&ckpt)) / 2.0) as u64;
    let args = [&["train"], &ACTIVATION_HEAVY[..], &["out_dir=refused"]].concat();
    let out =
        common::run(common::command(d, &args).env("NANOGPT_MEMORY_LIMIT_MB", limit.to_string()));
    let stdout = common::text(&out.stdout);
    let err = common::refused(&out);
    assert!(stdout.contains("memory plan:"), "{stdout}");
    assert!(err.contains("NANOGPT_MEMORY_LIMIT_MB"), "{err}");
    assert!(err.contains("cheapest settings that fit:"), "{err}");
    assert!(
        err.contains("activation_checkpointing=true") || err.contains("batch_size=32"),
        "{err}"
    );
    assert!(
        !d.join("refused").exists(),
        "refused before creating out_dir"
    );
    // The same run under a limit it fits passes the check and trains.
    let quick = [&args[..], &["max_iters=0", "eval_iters=1"]].concat();
    let out = common::run(common::command(d, &quick).env("NANOGPT_MEMORY_LIMIT_MB", "100000"));
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let bad = common::run(common::command(d, &args).env("NANOGPT_MEMORY_LIMIT_MB", "lots"));
    assert!(common::refused(&bad).contains("NANOGPT_MEMORY_LIMIT_MB must be a whole number"));
}

#[test]
fn the_closing_hint_names_the_binary_as_it_was_invoked() {
    let dir = temp_dir("cli-argv0");
    let stdout = train(dir.path(), &["max_iters=1", "eval_interval=1", "out_dir=o"]);
    let want = format!("sample more with: {} sample --out-dir o", common::BIN);
    assert!(stdout.contains(&want), "{stdout}");
}

/// Without the `mpi` feature, a process started by a launcher as one of several
/// refuses, naming its host.
#[cfg(not(feature = "mpi"))]
#[test]
fn several_processes_without_mpi_are_refused_naming_the_host() {
    let dir = temp_dir("cli-no-mpi");
    let mut cmd = common::command(dir.path(), ["train", "max_iters=1"]);
    cmd.env("OMPI_COMM_WORLD_SIZE", "3");
    let err = common::refused(&common::run(&mut cmd));
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert!(
        err.contains(&format!("host {}: started as one of 3", host.trim())),
        "{err}"
    );
}

#[test]
fn doctor_json_reports_one_rank_and_exits_non_zero_when_out_dir_cannot_be_written() {
    let dir = temp_dir("cli-doctor");
    let d = dir.path();
    let args = [
        "doctor",
        "--json",
        "dataset=shakespeare_char",
        "n_layer=2",
        "n_embd=32",
    ];
    let stdout = ok(d, &[&args[..], &["out_dir=o"]].concat());
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["ok"], true, "{report}");
    let ranks = report["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 1);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(ranks[0]["host"], host.trim());
    assert!(ranks[0]["binary"].as_str().unwrap().starts_with("nanogpt "));
    assert_eq!(ranks[0]["out_dir_writable"], true);
    assert_eq!(ranks[0]["data_fingerprint"].as_str().unwrap().len(), 16);
    // Alone, there is no other host to route to.
    assert_eq!(ranks[0]["interface"], "local");
    assert!(
        report["all_reduce"]["bytes"].as_u64().unwrap() > 0,
        "{report}"
    );
    // The planned peak is `nanogpt plan`'s for the same run.
    let plan = ok(
        d,
        &[
            "plan",
            "--json",
            "dataset=shakespeare_char",
            "n_layer=2",
            "n_embd=32",
        ],
    );
    let plan: serde_json::Value = serde_json::from_str(plan.trim()).unwrap();
    let planned = ranks[0]["planned_mb"].as_f64().unwrap();
    assert!(planned > 0.0, "{report}");
    assert_eq!(
        planned,
        plan["ranks"][0]["peak_rss_mb"].as_f64().unwrap(),
        "{plan}"
    );
    // Less memory than the plan needs (as `train` would refuse): not ok, exit 1.
    let tight = |mb: f64| {
        let mut cmd = common::command(d, [&args[..], &["out_dir=o"]].concat());
        cmd.env("NANOGPT_MEMORY_LIMIT_MB", format!("{mb:.0}"));
        let out = common::run(&mut cmd);
        let text = common::text(&out.stdout);
        (
            out.status.code(),
            serde_json::from_str::<serde_json::Value>(text.trim()).unwrap(),
        )
    };
    let (code, report) = tight(planned * 0.9);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(report["ok"], false, "{report}");
    let problems = report["ranks"][0]["problems"].to_string();
    assert!(
        problems.contains("the run needs") && problems.contains("NANOGPT_MEMORY_LIMIT_MB"),
        "{problems}"
    );
    let (code, report) = tight(planned * 1.1 + 1.0);
    assert_eq!(code, Some(0), "{report}");
    // An out_dir under a file cannot be created: not ok, exit 1.
    std::fs::write(d.join("f"), "x").unwrap();
    let out = common::run(&mut common::command(
        d,
        [&args[..], &["out_dir=f/o"]].concat(),
    ));
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_str(common::text(&out.stdout).trim()).unwrap();
    assert_eq!(report["ok"], false, "{report}");
    assert_eq!(report["ranks"][0]["out_dir_writable"], false);
}

/// A directory with a fake `mpirun` whose `--version` prints `version`.
fn fake_mpirun(dir: &Path, version: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("fakebin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = bin.join("mpirun");
    std::fs::write(&script, format!("#!/bin/sh\nprintf '%s\\n' '{version}'\n")).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

#[test]
fn launch_dry_run_writes_the_line_of_each_mpi() {
    let dir = temp_dir("cli-launch");
    let d = dir.path();
    std::fs::write(d.join("hosts"), "h1\nh2 # the second\n\nh3\n").unwrap();
    let cases = [
        (
            "mpirun (Open MPI) 4.1.4",
            "--hostfile hosts -n 3 --map-by node --bind-to none",
        ),
        (
            "HYDRA build details:",
            "-f hosts -n 3 -ppn 1 -bind-to none -genvall -disable-auto-cleanup -iface eth0 \
             -genv UCX_NET_DEVICES eth0 -genv FI_TCP_IFACE eth0",
        ),
    ];
    for (version, flags) in cases {
        let bin = fake_mpirun(d, version);
        let mut cmd = common::command(
            d,
            [
                "launch",
                "--hosts",
                "hosts",
                "-n",
                "3",
                "--iface",
                "eth0",
                "--dry-run",
            ],
        );
        cmd.args(["--", "train", "c.toml", "max_iters=5"]);
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
        cmd.env("PATH", path).env_remove("NANOGPT_MPIRUN");
        let (stdout, _) = common::succeeds(&mut cmd);
        assert!(stdout.starts_with(&format!("mpirun {flags}")), "{stdout}");
        let tail = format!(" {} train c.toml max_iters=5\n", common::BIN);
        assert!(stdout.ends_with(&tail), "{stdout}");
        if version.contains("Open MPI") {
            assert!(stdout.contains("--mca btl_tcp_if_include eth0"), "{stdout}");
            assert!(
                stdout.contains("--mca oob_tcp_keepalive_time 5"),
                "{stdout}"
            );
        }
    }
    // More ranks than hosts, and the other MPI's hosts-file syntax, are refused.
    let bin = fake_mpirun(d, "mpirun (Open MPI) 4.1.4");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let mut cmd = common::command(d, ["launch", "--hosts", "hosts", "-n", "4", "--", "train"]);
    cmd.env("PATH", &path).env_remove("NANOGPT_MPIRUN");
    let err = common::refused(&common::run(&mut cmd));
    assert!(
        err.contains("lists 3 host(s)") && err.contains("-n 1..=3"),
        "{err}"
    );
    std::fs::write(d.join("hydra"), "h1:2\n").unwrap();
    let mut cmd = common::command(d, ["launch", "--hosts", "hydra", "-n", "1", "--", "train"]);
    cmd.env("PATH", &path).env_remove("NANOGPT_MPIRUN");
    let err = common::refused(&common::run(&mut cmd));
    assert!(err.contains("hydra:1: `h1:2` is Hydra's syntax"), "{err}");
    // Without MPI support the job itself is refused: each rank would train alone.
    #[cfg(not(feature = "mpi"))]
    {
        let mut cmd = common::command(d, ["launch", "--hosts", "hosts", "-n", "3", "--", "train"]);
        cmd.env("PATH", &path).env_remove("NANOGPT_MPIRUN");
        let err = common::refused(&common::run(&mut cmd));
        assert!(err.contains("built without MPI support"), "{err}");
    }
}

#[test]
fn the_example_configs_load_and_split_over_2_3_and_4_ranks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    for name in [
        "finetune_shakespeare.toml",
        "train_gpt2.toml",
        "finetune_gpt2_openwebtext_3nodes.toml",
    ] {
        let cfg = nanogpt::config::TrainConfig::load(Some(&root.join(name)), &[]).unwrap();
        for ranks in 2..=4 {
            cfg.check_world_size(ranks)
                .unwrap_or_else(|e| panic!("{name}, {ranks} ranks: {e}"));
        }
    }
}

/// A dataset `id` (OWNER/NAME) in the Hugging Face cache `dir/hub`, laid out as
/// huggingface_hub writes it, holding `source` as the file `rel` of its snapshot.
fn cache_dataset(dir: &Path, id: &str, rel: &str, source: &Path) {
    let repo = dir.join(format!("hub/datasets--{}", id.replace('/', "--")));
    let file = repo.join("snapshots/abc123").join(rel);
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "abc123").unwrap();
    std::fs::copy(source, file).unwrap();
}

#[test]
fn prepare_reads_a_hub_dataset_from_the_cache() {
    let dir = temp_dir("cli-hub");
    let d = dir.path();
    // hf:openwebtext's repository.
    let file = "plain_text/train-00000-of-00001.parquet";
    cache_dataset(d, "Skylion007/openwebtext", file, &fixture("docs.parquet"));
    let prepare = |spec: &str, out: &str| {
        let mut cmd = common::command(d, ["prepare", spec, "--out", out, "--tokenizer", "char"]);
        cmd.env("HF_HUB_CACHE", d.join("hub"))
            .env("HF_HUB_OFFLINE", "1");
        common::run(&mut cmd)
    };
    let out = prepare("hf:openwebtext", "owt");
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    assert!(common::text(&out.stderr).contains("1 parquet file(s) of split `train`"));
    // The same text as the parquet file given directly.
    let direct = fixture("docs.parquet");
    ok(
        d,
        &[
            "prepare",
            direct.to_str().unwrap(),
            "--out",
            "direct",
            "--tokenizer",
            "char",
        ],
    );
    for f in ["train.bin", "val.bin"] {
        assert_eq!(
            std::fs::read(d.join("owt").join(f)).unwrap(),
            std::fs::read(d.join("direct").join(f)).unwrap(),
            "{f}"
        );
    }
    // Another split, offline: a clear refusal naming where it looked.
    let mut cmd = common::command(
        d,
        [
            "prepare",
            "hf:openwebtext",
            "--out",
            "v",
            "--split",
            "validation",
        ],
    );
    cmd.env("HF_HUB_CACHE", d.join("hub"))
        .env("HF_HUB_OFFLINE", "1");
    let err = common::refused(&common::run(&mut cmd));
    assert!(
        err.contains("no parquet files of split `validation`")
            && err.contains("datasets--Skylion007--openwebtext")
            && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
}

/// Instruction data as the Hub publishes it, in parquet (a chat dataset's `messages`
/// column of structs, ShareGPT's `conversations`, an Alpaca one's string columns):
/// `prepare` writes the tokens and masks it writes from the same examples in JSON
/// Lines, from a file or the Hub's cache (scripts/fixtures/make_instruct_parquet.py
/// writes both forms).
#[test]
fn prepare_reads_instruction_data_from_parquet_as_from_jsonl() {
    let dir = temp_dir("cli-instruct-parquet");
    let d = dir.path();
    let files = fixture("instruct_parquet");
    let smollm2 = fixture("tokenizers/smollm2");
    let outputs = ["train.bin", "val.bin", "train.mask", "val.mask"];
    let prepare = |src: &Path, out: &str, tokenizer: &Path| {
        let args = ["prepare", src.to_str().unwrap(), "--out", out];
        let args = [&args[..], &["--tokenizer", tokenizer.to_str().unwrap()]].concat();
        let err = succeeds(&mut command(
            d,
            [&args[..], &["--val-fraction", "0.4"]].concat(),
        ))
        .1;
        assert!(!err.contains("note: --text-column"), "{err}");
    };
    let same = |a: &str, b: &str| {
        for f in outputs {
            let read = |run: &str| std::fs::read(d.join(run).join(f)).unwrap();
            assert!(
                !read(a).is_empty() || f.starts_with("val"),
                "{a}/{f} is empty"
            );
            assert_eq!(read(a), read(b), "{a} and {b} differ in {f}");
        }
    };
    for (kind, tokenizer) in [("chat", &smollm2), ("alpaca", &smollm2)] {
        let parquet = files.join(format!("{kind}.parquet"));
        prepare(&parquet, &format!("{kind}-pq"), tokenizer);
        prepare(
            &files.join(format!("{kind}.jsonl")),
            &format!("{kind}-jl"),
            tokenizer,
        );
        same(&format!("{kind}-pq"), &format!("{kind}-jl"));
        let meta = read_json(&d.join(format!("{kind}-pq/meta.json")));
        assert!(meta["source"].as_str().unwrap().contains(kind), "{meta}");
    }
    // ShareGPT's `conversations` (`from`, `value`) are the same messages.
    prepare(&files.join("sharegpt.parquet"), "sharegpt-pq", &smollm2);
    same("sharegpt-pq", "chat-jl");
    // The chat template wrote the conversations (SmolLM2's <|im_start|> turns).
    let chat = std::fs::read(d.join("chat-pq/train.bin")).unwrap();
    assert!(chat.len() > 100, "{} bytes", chat.len());

    // From the Hub's cache, as `prepare hf:` finds a dataset.
    let file = "data/train-00000-of-00001.parquet";
    cache_dataset(
        d,
        "HuggingFaceTB/smol-smoltalk",
        file,
        &files.join("chat.parquet"),
    );
    let args = ["prepare", "hf:HuggingFaceTB/smol-smoltalk", "--out", "hub"];
    let tokenizer = [
        "--tokenizer",
        smollm2.to_str().unwrap(),
        "--val-fraction",
        "0.4",
    ];
    let mut cmd = command(d, [&args[..], &tokenizer[..]].concat());
    cmd.env("HF_HUB_CACHE", d.join("hub"))
        .env("HF_HUB_OFFLINE", "1");
    succeeds(&mut cmd);
    same("hub", "chat-pq");

    // A row that is not an example names its file, row and field.
    let err = fails(
        d,
        &[
            "prepare",
            files.join("alpaca.parquet").to_str().unwrap(),
            "--out",
            "x",
            "--format",
            "chat",
        ],
    );
    assert!(
        err.contains("alpaca.parquet row 1") && err.contains("messages"),
        "{err}"
    );
}

#[test]
fn bench_mfu_is_against_the_peak_of_the_precision_that_runs() {
    let dir = temp_dir("bench-peaks");
    let d = dir.path();
    for dtype in ["float32", "bfloat16"] {
        let mut args = vec!["bench", "--batch-size", "2", "--block-size", "16"];
        args.extend(["--steps", "1", "--json", "--dtype", dtype]);
        args.extend(TINY_MODEL);
        let r: serde_json::Value = serde_json::from_str(ok(d, &args).trim()).unwrap();
        let num = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
        let (f32, bf16) = (num("peak_gflops_f32"), num("peak_gflops_bf16"));
        assert!(f32 > 0.0 && bf16 > 0.0, "{r}");
        let own = if dtype == "float32" { f32 } else { bf16 };
        assert_eq!(num("peak_gflops"), own, "{dtype}: {r}");
        let mfu = num("achieved_gflops") / own;
        assert!((num("mfu") - mfu).abs() <= 1e-12 * mfu, "{r}");
    }
    // A given peak replaces the measurements.
    let r = bench_json(d, &["--steps", "1", "--dtype", "bfloat16"]);
    assert_eq!(r["peak_gflops"], 100.0);
    assert!(r["peak_gflops_f32"].is_null() && r["peak_gflops_bf16"].is_null());
    // A step above its peak is not printed as if it were plausible.
    let mut args = vec![
        "bench",
        "--batch-size",
        "2",
        "--block-size",
        "16",
        "--steps",
        "1",
    ];
    args.extend(["--peak-gflops", "0.000001"]);
    args.extend(TINY_MODEL);
    let (out, err) = succeeds(&mut command(d, &args));
    assert!(out.contains("MFU of 0.0 GFLOP/s (--peak-gflops)"), "{out}");
    assert!(
        err.contains("MFU above 100 %") && err.contains("--peak-gflops"),
        "{err}"
    );
}

#[test]
fn bench_sample_times_prefill_and_decoding() {
    let dir = temp_dir("bench-sample");
    let d = dir.path();
    let mut args = vec![
        "bench",
        "--sample",
        "5",
        "--batch-size",
        "2",
        "--block-size",
        "4",
    ];
    args.extend(["--steps", "1", "--json"]);
    args.extend(TINY_MODEL);
    let r: serde_json::Value = serde_json::from_str(ok(d, &args).trim()).unwrap();
    assert_eq!(
        (&r["prompt_tokens"], &r["new_tokens"]),
        (&4.into(), &5.into())
    );
    let num = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    // Two samples of 4 decoding steps (the first new token ends the prefill).
    let decode = num("decode_tokens_per_sec");
    assert!((decode - 2.0 * 4.0 / (4.0 * num("decode_ms_per_token") / 1e3)).abs() < 1e-6 * decode);
    assert!(
        num("prefill_ms") > 0.0 && num("total_ms") >= num("prefill_ms"),
        "{r}"
    );
    assert_eq!(num("bf16_copy_ms"), 0.0, "f32 weights are not copied");
    // bf16 weights: the copy, made once as at load, is timed on its own.
    args.extend(["--dtype", "bfloat16"]);
    let r: serde_json::Value = serde_json::from_str(ok(d, &args).trim()).unwrap();
    assert!(r["bf16_copy_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{r}");
    assert_eq!(r["dtype"], "bfloat16");
    let err = fails(d, &["bench", "--sample", "1"]);
    assert!(err.contains("2 new tokens"), "{err}");
}
