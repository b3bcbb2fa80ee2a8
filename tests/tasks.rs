//! `nanogpt eval --task`: multiple-choice scores against lm-evaluation-harness's own
//! (scripts/reference/task_fixtures.py wrote the fixtures: the harness's `hf` model
//! on the tiny GPT-2 of tests/fixtures/instruct/model, whose context of 64 tokens
//! sends some questions through the harness's left-truncated window).

use nanogpt::model::ParamLayout;
use nanogpt::model_source::load_model;
use nanogpt::tasks::{load_task, Scorer, Tally, TaskKind, TaskReport, TaskSpec};
use serde_json::Value;

mod common;
use common::{fails, fixture, ok, read_json, temp_dir, TINY_SHAKESPEARE};

fn model_dir() -> String {
    fixture("instruct/model").display().to_string()
}

/// Each question's log-likelihoods and the metrics, for one task of the fixtures.
fn check_task(kind: TaskKind, file: &str, key: &str) {
    let expected = read_json(&fixture("tasks/expected.json"));
    let expected = &expected[key];
    let loaded = load_model(&model_dir()).unwrap();
    let tokenizer = loaded.tokenizer.clone();
    let spec = TaskSpec {
        kind,
        path: fixture(file),
    };
    let bytes = std::fs::read(&spec.path).unwrap();
    let questions = load_task(&spec, &bytes, None, &tokenizer, &loaded.config).unwrap();
    let want = expected["loglikelihoods"].as_array().unwrap();
    assert_eq!(questions.len(), want.len());
    let layout = ParamLayout::new(&loaded.config);
    let mut scorer = Scorer::new(&loaded.config, &questions);
    let mut tally = Tally::default();
    let mut worst = 0.0f64;
    for (i, (q, want)) in questions.iter().zip(want).enumerate() {
        let got = scorer.score(&loaded.params, &layout, q);
        let want: Vec<f64> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len(), "question {i}");
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max((g - w).abs());
            assert!(
                (g - w).abs() < 1e-4,
                "{key} question {i}: {got:?}, harness {want:?}"
            );
        }
        tally.add(q, &got);
    }
    eprintln!("{key}: largest difference from the harness's log-likelihoods {worst:.2e}");
    let report = TaskReport::new(key.into(), &tally);
    for (name, m) in [
        ("acc", report.acc),
        ("acc_norm", report.acc_norm),
        ("acc_bytes", report.acc_bytes),
    ] {
        assert_eq!(m.value, expected[name].as_f64().unwrap(), "{key} {name}");
        let stderr = expected[format!("{name}_stderr")].as_f64().unwrap();
        assert!((m.stderr - stderr).abs() < 1e-12, "{key} {name} stderr");
    }
}

#[test]
fn hellaswag_scores_match_the_harness() {
    check_task(TaskKind::Hellaswag, "tasks/hellaswag.jsonl", "hellaswag");
}

#[test]
fn generic_choice_scores_match_the_harness() {
    check_task(TaskKind::Choice, "tasks/choice.jsonl", "choice");
}

#[test]
fn eval_task_prints_the_metrics() {
    let dir = temp_dir("task");
    let data = fixture("tasks/hellaswag.jsonl").display().to_string();
    let model = model_dir();
    let args = [
        "eval",
        "--init-from",
        &model,
        "--task",
        "hellaswag",
        "--data",
        &data,
    ];
    let json = ok(dir.path(), &[&args[..], &["--json"]].concat());
    let got: Value = serde_json::from_str(json.trim()).unwrap();
    let expected = read_json(&fixture("tasks/expected.json"));
    assert_eq!(got["examples"], 24);
    for name in ["acc", "acc_norm", "acc_bytes"] {
        assert_eq!(got[name]["value"], expected["hellaswag"][name], "{name}");
    }
    assert!(got["acc_token"]["value"].is_number());
    let table = ok(dir.path(), &[&args[..], &["--limit", "5"]].concat());
    assert!(table.starts_with("hellaswag: 5 examples\n"), "{table}");
    assert!(
        table.contains("acc_norm") && table.contains("per token (llm.c)"),
        "{table}"
    );
    // A file that is not the task's form, and a missing one, are refused by name.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"context\": \"x\", \"choices\": [\"a\"], \"label\": 0}\n",
    )
    .unwrap();
    let bad = bad.display().to_string();
    let err = fails(
        dir.path(),
        &[
            "eval",
            "--init-from",
            &model,
            "--task",
            "hellaswag",
            "--data",
            &bad,
        ],
    );
    assert!(
        err.contains("bad.jsonl line 1") && err.contains("ctx_a"),
        "{err}"
    );
    let err = fails(
        dir.path(),
        &[
            "eval",
            "--init-from",
            &model,
            "--task",
            "choice",
            "--data",
            "nope.jsonl",
        ],
    );
    assert!(err.contains("nope.jsonl"), "{err}");
}

// ---------------------------------------------------------------------------------
// Accuracy during training (`eval_tasks`)

const METRICS: [&str; 4] = ["acc", "acc_norm", "acc_bytes", "acc_token"];

#[test]
fn accuracy_logged_in_training_is_eval_task_on_the_checkpoint() {
    let dir = temp_dir("train-tasks");
    let d = dir.path();
    common::write_shakespeare_task(d, 30);
    let run = [
        "max_iters=5",
        "eval_interval=3",
        "lr_decay_iters=5",
        "out_dir=run",
        "eval_tasks=choice:lines.jsonl",
        "eval_tasks_limit=24",
    ];
    let stdout = ok(d, &[&["train"], &TINY_SHAKESPEARE[..], &run].concat());
    // With each loss evaluation (0, 3) and of the final state (6).
    let rows = common::task_rows(&d.join("run"));
    let iters: Vec<u64> = rows.iter().map(|r| r["iter"].as_u64().unwrap()).collect();
    assert_eq!(iters, [0, 3, 6]);
    for row in &rows {
        assert_eq!(
            (row["task"].as_str(), row["examples"].as_u64()),
            (Some("choice/lines"), Some(24))
        );
    }
    // ckpt.safetensors holds the final state: `eval --task` on it gives the last row.
    let args = [
        "eval",
        "--init-from",
        "run",
        "--task",
        "choice",
        "--data",
        "lines.jsonl",
    ];
    let json = ok(d, &[&args[..], &["--limit", "24", "--json"]].concat());
    let eval: Value = serde_json::from_str(json.trim()).unwrap();
    let last = &rows[2];
    assert_eq!(eval["examples"], 24);
    for name in METRICS {
        assert_eq!(last[name].as_f64(), eval[name]["value"].as_f64(), "{name}");
    }
    let hits = |v: f64| (v * 24.0).round();
    assert!(METRICS
        .iter()
        .all(|m| hits(last[m].as_f64().unwrap()) == last[m].as_f64().unwrap() * 24.0));
    // The closing lines say it, as eval's summary does.
    let summary = format!(
        "done: choice/lines: acc {:.4} ± {:.4}, acc_norm {:.4} ± {:.4} (24 examples)",
        eval["acc"]["value"].as_f64().unwrap(),
        eval["acc"]["stderr"].as_f64().unwrap(),
        eval["acc_norm"]["value"].as_f64().unwrap(),
        eval["acc_norm"]["stderr"].as_f64().unwrap(),
    );
    assert!(stdout.contains(&summary), "{summary}\n{stdout}");
    assert!(d.join("run/loss.png").is_file());

    // On an interval of their own, without loss evaluations: 0, 2, 4 and the end.
    let own = ["eval_interval=0", "eval_tasks_interval=2", "out_dir=run2"];
    ok(
        d,
        &[&["train"], &TINY_SHAKESPEARE[..], &run[..5], &own].concat(),
    );
    let rows2 = common::task_rows(&d.join("run2"));
    let iters: Vec<u64> = rows2.iter().map(|r| r["iter"].as_u64().unwrap()).collect();
    assert_eq!(iters, [0, 2, 4, 6]);
    assert_eq!(rows2[0]["examples"], 30, "no limit: every question");
    assert!(common::metric(&d.join("run2"), "val_loss").is_empty());
    // An evaluation-only run on the final checkpoint scores the same again.
    let only = [
        "eval_only=true",
        "init_from=resume",
        "out_dir=run",
        "eval_tasks_limit=24",
    ];
    ok(
        d,
        &[
            &["train"],
            &TINY_SHAKESPEARE[..],
            &run[..4],
            &["eval_tasks=choice:lines.jsonl"],
            &only,
        ]
        .concat(),
    );
    let again = common::task_rows(&d.join("run"));
    assert_eq!(again.len(), 4);
    for name in METRICS {
        assert_eq!(again[3][name], last[name], "{name}");
    }
}

/// LoRA in bf16 on the f32 GEMM keeps its base as the rounded copy and gives the
/// f32 linears back; the accuracy it logs is still that of the adapted model `eval`
/// loads (the base loaded again, the adapters merged in, as `eval` does with the
/// checkpoint), and the closing sample is drawn from it.
#[test]
fn bf16_lora_logs_the_accuracy_eval_task_gives() {
    let dir = temp_dir("train-tasks-lora");
    let d = dir.path();
    common::write_shakespeare_task(d, 24);
    let run = [
        "max_iters=4",
        "eval_interval=4",
        "lr_decay_iters=4",
        "out_dir=run",
        "eval_tasks=choice:lines.jsonl",
        "dtype=bfloat16",
        "bf16_kernel=f32",
        "lora_rank=4",
        "lora_alpha=8",
        "lora_targets=c_attn,mlp.c_proj",
    ];
    let stdout = ok(d, &[&["train"], &TINY_SHAKESPEARE[..], &run].concat());
    assert!(
        stdout.contains("A sample from the trained model:"),
        "{stdout}"
    );
    let rows = common::task_rows(&d.join("run"));
    let iters: Vec<u64> = rows.iter().map(|r| r["iter"].as_u64().unwrap()).collect();
    assert_eq!(iters, [0, 4]);
    let args = ["eval", "--init-from", "run", "--task", "choice"];
    let json = ok(
        d,
        &[&args[..], &["--data", "lines.jsonl", "--json"]].concat(),
    );
    let eval: Value = serde_json::from_str(json.trim()).unwrap();
    assert_eq!(eval["examples"], 24);
    for name in METRICS {
        assert_eq!(
            rows[1][name].as_f64(),
            eval[name]["value"].as_f64(),
            "{name}"
        );
    }
}

#[test]
fn eval_tasks_that_cannot_be_read_are_refused_before_training() {
    let dir = temp_dir("train-tasks-bad");
    let d = dir.path();
    std::fs::write(
        d.join("h.jsonl"),
        "{\"context\": \"x\", \"choices\": [\"a\"], \"label\": 0}\n",
    )
    .unwrap();
    // A choice longer than the block (the tiny model's, 16) cannot be scored.
    let long = "word ".repeat(10);
    let line = format!("{{\"context\": \"x\", \"choices\": [\"a\", \"{long}\"], \"label\": 0}}\n");
    std::fs::write(d.join("long.jsonl"), line.repeat(2)).unwrap();
    let base = [
        &["train"],
        &TINY_SHAKESPEARE[..],
        &["max_iters=2", "out_dir=run"],
    ]
    .concat();
    for (task, want) in [
        ("eval_tasks=choice:missing.jsonl", "missing.jsonl"),
        ("eval_tasks=hellaswag:h.jsonl", "h.jsonl line 1"),
        ("eval_tasks=hellaswag", "is not KIND:PATH"),
        (
            "eval_tasks=choice:long.jsonl",
            "long.jsonl: question 1: choice 1 encodes to 51 tokens, more than the block of 16",
        ),
    ] {
        let err = fails(d, &[&base[..], &[task]].concat());
        assert!(
            err.contains("`eval_tasks`") && err.contains(want),
            "{task}: {err}"
        );
        assert!(!d.join("run/ckpt.safetensors").exists(), "{task}: trained");
    }
}
