//! Instruction tuning end to end: `prepare` of Alpaca / chat `.jsonl` with loss masks,
//! training on the responses only, `eval --data FILE.jsonl` against a `transformers`
//! reference, sampling with templates and `chat`.

use std::path::Path;

mod common;
use common::{fails, metric, ok, process_temp_dir, temp_dir, TINY_MODEL};

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

/// `eval --data FILE.parquet` reads the examples of a Hub-style parquet file as it
/// reads them from JSON Lines: the same tokens, the same loss
/// (scripts/fixtures/make_instruct_parquet.py writes both forms).
#[test]
fn eval_reads_parquet_examples_as_jsonl() {
    let fixtures = common::fixture("instruct_parquet");
    let model = common::fixture("instruct/model");
    let eval = |file: &str| -> serde_json::Value {
        let data = fixtures.join(file);
        let args = ["eval", "--init-from", model.to_str().unwrap(), "--json"];
        let args = [
            &args[..],
            &["--data", data.to_str().unwrap(), "--block-size", "16"],
        ];
        serde_json::from_str(&ok(&fixtures, &args.concat())).unwrap()
    };
    for (parquet, jsonl) in [
        ("chat.parquet", "chat.jsonl"),
        ("sharegpt.parquet", "chat.jsonl"),
        ("alpaca.parquet", "alpaca.jsonl"),
    ] {
        let (got, want) = (eval(parquet), eval(jsonl));
        assert!(want["tokens"].as_u64().unwrap() > 10, "{want}");
        assert_eq!(got, want, "{parquet} against {jsonl}");
    }
}

/// A tiny model that learned the toy task (chat template, char-level), trained once
/// for the sampling and chat tests.
fn toy_model() -> &'static Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = process_temp_dir("inst-model");
        let d = tmp.as_path();
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

// ---------------------------------------------------------------------------------
// Numbers that must not be silently wrong, and lines chat must survive (issue 38)

/// The toy dataset with its masks rewritten: `train` trains everything, `val` only
/// the tokens at the positions `trained`.
fn toy_with_val_mask(d: &Path, trained: impl Fn(usize) -> bool) {
    prepare_toy(d, 200);
    let dir = d.join("data/toy");
    let len = std::fs::metadata(dir.join("train.mask")).unwrap().len() as usize;
    std::fs::write(dir.join("train.mask"), vec![1u8; len]).unwrap();
    let len = std::fs::metadata(dir.join("val.mask")).unwrap().len() as usize;
    let mask: Vec<u8> = (0..len).map(|i| trained(i) as u8).collect();
    std::fs::write(dir.join("val.mask"), mask).unwrap();
}

fn train_toy(d: &Path, extra: &[&str]) -> (String, String) {
    let args = [
        &["train", "dataset=data/toy", "out_dir=run"] as &[&str],
        &TINY_MODEL,
        &[
            "block_size=16",
            "batch_size=4",
            "max_iters=2",
            "eval_interval=2",
            "eval_iters=2",
            "always_save_checkpoint=False",
            "threads=1",
        ],
        extra,
    ]
    .concat();
    common::succeeds(&mut common::command(d, args))
}

/// Evaluation windows whose targets the val mask trains nowhere are skipped and
/// counted; an evaluation where no window holds one has no val loss (it is not the
/// best, so it writes no best checkpoint) and says so. It used to report `val loss
/// 0.0000`, which no later evaluation could beat.
#[test]
fn evaluation_windows_without_a_trained_token_are_skipped_and_counted() {
    let tmp = temp_dir("inst-empty-windows");
    let d = tmp.path();
    // Only the first token is "trained": it is never a target, so no window has one.
    toy_with_val_mask(d, |i| i == 0);
    let (stdout, _) = train_toy(d, &[]);
    assert!(
        stdout.contains("step 0: train loss ")
            && stdout
                .contains(", val loss n/a (8 of 8 val windows hold no trained token: skipped)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("done: train loss ") && stdout.contains("val loss n/a"),
        "{stdout}"
    );
    assert!(metric(&d.join("run"), "val_loss")
        .iter()
        .all(|(_, v)| v.is_nan()));
    assert!(
        !d.join("run/ckpt.safetensors").exists(),
        "an evaluation with no loss is no best"
    );
    // Half the val tokens trained: some windows skipped, the loss over the others.
    let tmp = temp_dir("inst-some-windows");
    let d = tmp.path();
    toy_with_val_mask(d, |i| (i / 200) % 2 == 0);
    let (stdout, _) = train_toy(d, &["seed=3"]);
    let line = stdout.lines().find(|l| l.starts_with("step 0:")).unwrap();
    assert!(
        line.contains("val windows hold no trained token: skipped)"),
        "{line}"
    );
    assert!(!line.contains("val loss n/a"), "{line}");
    assert!(metric(&d.join("run"), "val_loss")
        .iter()
        .all(|(_, v)| v.is_finite()));
}

/// A dataset whose mask trains no token at all is refused (an all-zero mask used to
/// "train" to loss 0.0 with exit 0).
#[test]
fn a_dataset_that_trains_no_token_is_refused() {
    let tmp = temp_dir("inst-zero-mask");
    let d = tmp.path();
    prepare_toy(d, 60);
    let len = std::fs::metadata(d.join("data/toy/train.mask"))
        .unwrap()
        .len() as usize;
    std::fs::write(d.join("data/toy/train.mask"), vec![0u8; len]).unwrap();
    let err = fails(
        d,
        &["train", "dataset=data/toy", "block_size=16", "max_iters=2"],
    );
    assert!(
        err.contains(
            "data/toy/train.mask trains no token (every byte is 0), so nothing would be trained"
        ),
        "{err}"
    );
}

/// `eval --data FILE.jsonl` of plain text reads each line's `text` field, as `prepare`
/// does (it used to score the raw JSON, braces and keys); an empty one, or one whose
/// lines have no text, says so (it used to advise a smaller --block-size); a
/// byte-order mark at its start is read past.
#[test]
fn eval_reads_the_text_field_of_a_plain_jsonl() {
    let d = toy_model();
    let tmp = temp_dir("inst-eval-jsonl");
    let t = tmp.path();
    let docs = ["abcdefghyes", "hgfedcbano", "badcabfed"];
    let jsonl: String = docs
        .iter()
        .map(|s| format!("{{\"text\": \"{s}\"}}\n"))
        .collect();
    std::fs::write(t.join("docs.jsonl"), format!("\u{feff}{jsonl}")).unwrap();
    std::fs::write(t.join("docs.txt"), docs.concat()).unwrap();
    let run = d.join("run");
    let eval = |file: &str| {
        let data = t.join(file);
        let args = [
            "eval",
            "--init-from",
            run.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--json",
            "--block-size",
            "8",
        ];
        let out = ok(d, &args);
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    // Char tokens have no end-of-text: the documents' tokens are the text's, in order.
    assert_eq!(eval("docs.jsonl"), eval("docs.txt"));
    std::fs::write(t.join("empty.jsonl"), "").unwrap();
    std::fs::write(
        t.join("untitled.jsonl"),
        "{\"text\": \"\"}\n{\"body\": null, \"text\": null}\n",
    )
    .unwrap();
    for file in ["empty.jsonl", "untitled.jsonl"] {
        let data = t.join(file);
        let err = fails(
            d,
            &[
                "eval",
                "--init-from",
                run.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
            ],
        );
        assert!(
            err.contains("holds no text (no line with a non-empty `text` field)"),
            "{file}: {err}"
        );
        assert!(!err.contains("--block-size"), "{err}");
    }
}

/// `eval --data val.bin` of instruction data reads the `val.mask` beside it, says so,
/// and scores the masked tokens only, as training's val loss does (it used to score
/// every token).
#[test]
fn eval_of_an_instruction_val_bin_uses_its_mask() {
    let d = toy_model();
    let run = d.join("run");
    let args = [
        "eval",
        "--init-from",
        run.to_str().unwrap(),
        "--data",
        "data/toy/val.bin",
        "--json",
        "--block-size",
        "16",
    ];
    let (stdout, stderr) = common::succeeds(&mut common::command(d, args));
    assert!(
        stderr.contains(
            "note: using data/toy/val.mask beside data/toy/val.bin: the loss is over the"
        ),
        "{stderr}"
    );
    let masked: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    // Exactly the trained targets of the windows of 16 are scored.
    let mask = std::fs::read(d.join("data/toy/val.mask")).unwrap();
    let windows = (mask.len() - 1) / 16;
    let trained: u64 = (0..windows)
        .map(|k| {
            mask[k * 16 + 1..k * 16 + 17]
                .iter()
                .map(|&b| b as u64)
                .sum::<u64>()
        })
        .sum();
    assert_eq!(masked["tokens"].as_u64(), Some(trained));
    assert!(trained < (windows * 16) as u64);
}

/// `--text-column` with instruction examples is not used, and says so; so is
/// `chat --template alpaca --system`.
#[test]
fn settings_that_do_nothing_say_so() {
    let tmp = temp_dir("inst-ignored");
    let d = tmp.path();
    std::fs::write(
        d.join("a.jsonl"),
        "{\"instruction\": \"i\", \"output\": \"o\"}\n".repeat(4),
    )
    .unwrap();
    let args = [
        "prepare",
        "a.jsonl",
        "--out",
        "ds",
        "--format",
        "alpaca",
        "--text-column",
        "body",
    ];
    let (_, stderr) = common::succeeds(&mut common::command(d, args));
    assert!(stderr.contains("note: --text-column body is not used: instruction examples are read from their own fields"), "{stderr}");
    let toy = toy_model();
    let args = [
        "chat",
        "--out-dir",
        "run",
        "--template",
        "alpaca",
        "--system",
        "Be brief.",
    ];
    let out = common::command(toy, args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = common::text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("note: ignoring --system: Stanford Alpaca's prompt has no system message"),
        "{stderr}"
    );
}

/// `chat` with lines the vocabulary cannot encode and bytes that are not UTF-8 skips
/// those lines with a word and answers the rest (one of them used to end the whole
/// conversation); a message longer than the context is cut, with a note; `--json`
/// prints each reply as one JSON line.
#[test]
fn chat_survives_bad_lines_and_cuts_long_ones() {
    use std::io::Write;
    let d = toy_model();
    let chat = |input: &[u8], extra: &[&str]| {
        let args = [
            &[
                "chat",
                "--out-dir",
                "run",
                "--temperature",
                "0",
                "--max-new-tokens",
                "8",
            ][..],
            extra,
        ]
        .concat();
        let mut child = common::command(d, args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        let out = child.wait_with_output().unwrap();
        let stderr = common::text(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        (common::text(&out.stdout), stderr)
    };
    let (stdout, stderr) = chat(b"abc\nZZZ \xc3\xa9\n\xff\xfe\nfghe\n", &[]);
    assert_eq!(stdout, "yes\nno\n", "{stderr}");
    assert!(
        stderr.contains("(the model's vocabulary cannot encode that line"),
        "{stderr}"
    );
    assert!(
        stderr.contains("(that line is not UTF-8 text: skipped)"),
        "{stderr}"
    );
    let long = format!("{}\n", "abcdefgh".repeat(20));
    let (stdout, stderr) = chat(long.as_bytes(), &[]);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(
        stderr.contains("only its last 56 tokens are read"),
        "{stderr}"
    );
    let (stdout, _) = chat(b"abc\nfghe\n", &["--json"]);
    let replies: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        replies,
        [
            serde_json::json!({"reply": "yes"}),
            serde_json::json!({"reply": "no"})
        ]
    );
}
