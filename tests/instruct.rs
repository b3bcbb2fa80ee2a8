//! Instruction tuning end to end: `prepare` of Alpaca / chat `.jsonl` with loss masks,
//! training on the responses only, `eval --data FILE.jsonl` against a `transformers`
//! reference, sampling with templates and `chat`.

use std::path::Path;

mod common;
use common::{fails, metric, ok, temp_dir, TINY_MODEL};

/// Chat examples of a toy task, "is there an `a` in this word?" (answers `yes` or
/// `no`, which a tiny model learns in seconds): `n` lines, deterministic.
fn toy_chat_jsonl(n: usize, seed: u64) -> String {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    (0..n)
        .map(|_| {
            let len = 3 + next() % 3;
            let word: String = (0..len)
                .map(|_| (b'a' + (next() % 8) as u8) as char)
                .collect();
            let answer = if word.contains('a') { "yes" } else { "no" };
            format!(
                "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{word}\"}}, \
                 {{\"role\": \"assistant\", \"content\": \"{answer}\"}}]}}\n"
            )
        })
        .collect()
}

/// Prepares `n` examples of the toy task (chat form, char-level) into `dir/data/toy`.
fn prepare_toy(dir: &Path, n: usize) {
    std::fs::write(dir.join("toy.jsonl"), toy_chat_jsonl(n, 7)).unwrap();
    let stdout = ok(
        dir,
        &[
            "prepare",
            "toy.jsonl",
            "--out",
            "data/toy",
            "--tokenizer",
            "char",
            "--val-fraction",
            "0.2",
        ],
    );
    assert!(stdout.contains("wrote"), "{stdout}");
    assert!(dir.join("data/toy/train.mask").exists());
}

/// The same tokens without their masks: every token trained.
fn unmasked_copy(dir: &Path) {
    std::fs::create_dir_all(dir.join("data/toy-plain")).unwrap();
    for f in ["train.bin", "val.bin", "meta.json"] {
        std::fs::copy(
            dir.join("data/toy").join(f),
            dir.join("data/toy-plain").join(f),
        )
        .unwrap();
    }
}

/// A short run on `dataset`; returns the logged step losses.
fn train_losses(dir: &Path, dataset: &str, out: &str, extra: &[&str]) -> Vec<(u64, f64)> {
    let (dataset, out_dir) = (format!("dataset={dataset}"), format!("out_dir={out}"));
    let args = [
        &["train", &dataset, &out_dir] as &[&str],
        &TINY_MODEL,
        &[
            "block_size=32",
            "dropout=0",
            "eval_interval=0",
            "eval_iters=0",
            "log_interval=1",
            "warmup_iters=0",
            "learning_rate=1e-2",
            "threads=1",
        ],
        extra,
    ]
    .concat();
    ok(dir, &args);
    metric(&dir.join(out), "loss")
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(1e-12)
}

#[test]
fn masked_loss_is_the_mean_over_response_tokens_of_the_global_batch() {
    let tmp = temp_dir("inst-train");
    let d = tmp.path();
    prepare_toy(d, 300);
    unmasked_copy(d);
    let iters = ["max_iters=4"];
    let one = train_losses(
        d,
        "data/toy",
        "b4",
        &[&iters[..], &["batch_size=4"]].concat(),
    );
    let two = train_losses(
        d,
        "data/toy",
        "b2a2",
        &[
            &iters[..],
            &["batch_size=2", "gradient_accumulation_steps=2"],
        ]
        .concat(),
    );
    assert_eq!(one.len(), 5);
    // Same global batch, split in two micro-steps with different numbers of trained
    // targets: the same mean, hence the same gradient and the same next losses.
    assert!(rel(one[0].1, two[0].1) <= 1e-6, "{one:?} vs {two:?}");
    for ((_, a), (_, b)) in one.iter().zip(&two) {
        assert!(rel(*a, *b) <= 1e-5, "{one:?} vs {two:?}");
    }
    // The mask changes what is scored: every token (prompt included) is another mean.
    let plain = train_losses(
        d,
        "data/toy-plain",
        "plain",
        &[&iters[..], &["batch_size=4"]].concat(),
    );
    assert!(rel(one[0].1, plain[0].1) > 1e-3, "{one:?} vs {plain:?}");
}

#[test]
fn a_mask_without_its_pair_or_of_another_length_is_refused() {
    let tmp = temp_dir("inst-badmask");
    let d = tmp.path();
    prepare_toy(d, 60);
    std::fs::remove_file(d.join("data/toy/val.mask")).unwrap();
    let err = fails(
        d,
        &["train", "dataset=data/toy", "block_size=32", "max_iters=0"],
    );
    assert!(err.contains("only one of train.bin and val.bin"), "{err}");
    std::fs::write(d.join("data/toy/val.mask"), [1u8; 3]).unwrap();
    let err = fails(
        d,
        &["train", "dataset=data/toy", "block_size=32", "max_iters=0"],
    );
    assert!(err.contains("val.mask has 3 bytes"), "{err}");
}

/// `eval --data FILE.jsonl` against `transformers` (scripts/reference/instruct_eval.py):
/// the masked mean over the response tokens of each example evaluated alone, whole
/// and cut into windows of 16.
#[test]
fn eval_matches_transformers_on_alpaca_and_chat_examples() {
    let fixtures = common::fixture("instruct");
    let expected = common::read_json(&fixtures.join("expected.json"));
    let model = fixtures.join("model");
    for file in ["alpaca.jsonl", "chat.jsonl"] {
        for block in ["64", "16"] {
            let data = fixtures.join(file);
            let args = [
                "eval",
                "--init-from",
                model.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--block-size",
                block,
                "--json",
            ];
            let got: serde_json::Value = serde_json::from_str(&ok(&fixtures, &args)).unwrap();
            let want = &expected[format!("{file} block {block}")];
            assert_eq!(got["tokens"], want["tokens"], "{file} block {block}");
            let (g, w) = (
                got["loss"].as_f64().unwrap(),
                want["loss"].as_f64().unwrap(),
            );
            assert!(rel(w, g) <= 1e-5, "{file} block {block}: {g} vs {w}");
        }
    }
}

/// A tiny model that learned the toy task (chat template, char-level), trained once
/// for the sampling and chat tests.
fn toy_model() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = temp_dir("inst-model");
        let d = tmp.path();
        prepare_toy(d, 1000);
        let losses = train_losses(
            d,
            "data/toy",
            "run",
            &[
                // Examples of ~30 characters: a window of 64 mostly holds the word
                // with its answer (random windows of 32 often cut the word off).
                "block_size=64",
                "n_embd=64",
                "batch_size=16",
                "max_iters=800",
                "eval_interval=800",
                "eval_iters=4",
                "warmup_iters=20",
                "learning_rate=2e-3",
                "lr_decay_iters=800",
                "min_lr=2e-4",
            ],
        );
        eprintln!("toy task: loss {:?} -> {:?}", losses[0], losses.last());
        tmp
    })
    .path()
}

#[test]
fn sample_with_the_chat_template_stops_at_end_of_text() {
    let d = toy_model();
    let args = [
        "sample",
        "--out-dir",
        "run",
        "--template",
        "chat",
        "--start",
        "bcad",
        "--temperature",
        "0",
        "--num-samples",
        "1",
        "--max-new-tokens",
        "20",
    ];
    let out = ok(d, &args);
    let reply = out
        .strip_prefix("<|user|>\nbcad\n<|assistant|>\n")
        .unwrap_or_else(|| panic!("{out:?}"));
    assert_eq!(reply, "yes\n", "greedy reply, cut at end-of-text");
    // A stop string ends it earlier, without printing it.
    let out = ok(d, &[&args[..], &["--stop", "s"]].concat());
    assert!(out.ends_with("<|assistant|>\nye\n"), "{out:?}");
    let err = fails(d, &[&args[..], &["--top-p", "0"]].concat());
    assert!(err.contains("--top-p"), "{err}");
}

#[test]
fn chat_answers_each_line_and_ends_at_exit() {
    use std::io::Write;
    let d = toy_model();
    let mut child = common::command(
        d,
        [
            "chat",
            "--out-dir",
            "run",
            "--temperature",
            "0",
            "--max-new-tokens",
            "8",
        ],
    )
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"abc\nfghe\n/exit\nbcd\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (common::text(&out.stdout), common::text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout, "yes\nno\n", "{stderr}");
    // The block of 64 holds one turn and a reply of 8, not two: the first is left out.
    assert!(stderr.contains("left out the oldest 1 turn"), "{stderr}");
}

#[test]
fn bad_instruction_lines_are_refused_with_file_line_and_field() {
    let tmp = temp_dir("inst-bad");
    let d = tmp.path();
    std::fs::write(
        d.join("a.jsonl"),
        "{\"instruction\": \"i\", \"output\": \"o\"}\n{\"instruction\": \"i\", \"input\": 3, \"output\": \"o\"}\n",
    )
    .unwrap();
    let err = fails(d, &["prepare", "a.jsonl", "--out", "data/a"]);
    assert!(
        err.contains("a.jsonl line 2") && err.contains("`input` holds a number"),
        "{err}"
    );
    assert!(!d.join("data/a/train.bin").exists(), "nothing written");
    let err = fails(
        d,
        &["prepare", "a.jsonl", "--out", "data/a", "--format", "yaml"],
    );
    assert!(err.contains("yaml"), "{err}");
    let model = common::fixture("instruct/model");
    let model = model.to_str().unwrap();
    let err = fails(d, &["eval", "--init-from", model, "--data", "a.jsonl"]);
    assert!(err.contains("a.jsonl line 2"), "{err}");
}
