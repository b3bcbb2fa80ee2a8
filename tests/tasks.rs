//! `nanogpt eval --task`: multiple-choice scores against lm-evaluation-harness's own
//! (scripts/reference/task_fixtures.py wrote the fixtures: the harness's `hf` model
//! on the tiny GPT-2 of tests/fixtures/instruct/model, whose context of 64 tokens
//! sends some questions through the harness's left-truncated window).

use nanogpt::model::ParamLayout;
use nanogpt::model_source::load_model;
use nanogpt::tasks::{load_task, Scorer, Tally, TaskKind, TaskReport, TaskSpec};
use serde_json::Value;

mod common;
use common::{fails, fixture, ok, read_json, temp_dir};

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
    let vocab = loaded.config.vocab_size;
    let questions = load_task(&spec, &bytes, None, &tokenizer, vocab).unwrap();
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
