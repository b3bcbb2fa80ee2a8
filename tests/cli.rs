//! The `nanogpt` binary end to end on tiny data: prepare, train, resume, eval,
//! sample, and the errors a user sees. Nothing here needs the network.

use std::path::Path;

mod common;
use common::{fails, fixture, metric, ok, read_json, temp_dir, TINY_MODEL, TINY_SHAKESPEARE};

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
    let path = format!("bf16 matmuls: {}", nanogpt::cli::bf16_matmuls());
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
    // And training resumes from it in bf16 where it stopped.
    let resumed = train(
        d,
        &[
            "max_iters=6",
            "eval_interval=6",
            "out_dir=run",
            "dtype=bfloat16",
            "init_from=resume",
        ],
    );
    assert!(resumed.contains("step 6: train loss"), "{resumed}");
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
        "classifier + loss",
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
