//! Outputs of several files appear whole or not at all, and never over what the user
//! has: `export`, `export --adapter-only` and `prepare` of instruction data (tokens
//! and masks), stopped by an I/O error or SIGKILL at every file write and every
//! rename on their way (the `eio-*` / `kill-at-*` faults of src/fault.rs), leave
//! their destination as it was or as the uninterrupted command leaves it, never a
//! mix; and the folders they refuse to write into.
//!
//! `scripts/fault_outputs.sh` runs the same checks at random points, with SIGKILL
//! sent from outside too, for many more trials.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

mod common;
use common::{command, fails, fixture, ok, prepare_gpt2_text, refused, run, temp_dir, text};

/// Every file under `dir` (recursively) with its bytes; the lock file of `prepare`
/// left out. `None` when `dir` holds no file (or does not exist).
fn tree(dir: &Path) -> Option<BTreeMap<PathBuf, Vec<u8>>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else if !path.ends_with(".nanogpt.lock") {
                let rel = path.strip_prefix(root).unwrap().to_path_buf();
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    if dir.is_dir() {
        walk(dir, dir, &mut out);
    }
    (!out.is_empty()).then_some(out)
}

/// Makes `dir` hold exactly `files` (none: removes it).
fn restore(dir: &Path, files: Option<&BTreeMap<PathBuf, Vec<u8>>>) {
    let _ = std::fs::remove_dir_all(dir);
    for (rel, bytes) in files.into_iter().flatten() {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A tiny GPT-2-vocabulary base model in `d/base` (seed `seed`), GPT-2 text in
/// `d/data`, and two LoRA runs on it, `run1` (2 iterations) and `run2` (4), whose
/// adapters and merged models differ.
fn lora_runs(d: &Path) {
    let cfg = nanogpt::model::ModelConfig {
        vocab_size: 50257,
        block_size: 16,
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
        bias: true,
        dropout: 0.0,
        llama: None,
    };
    let mut model = nanogpt::model::Gpt::new(cfg, 1, 1).unwrap();
    model.init_gpt2(1);
    let gpt2 = nanogpt::data::Tokenizer::gpt2();
    let kind = Some(&gpt2);
    nanogpt::hf::export(&model.params, model.config(), kind, &d.join("base")).unwrap();
    prepare_gpt2_text(d, 40);
    for (out, iters) in [("run1", "max_iters=2"), ("run2", "max_iters=4")] {
        let out_dir = format!("out_dir={out}");
        let args = [
            "train",
            "init_from=base",
            "dataset=data",
            &out_dir,
            "block_size=8",
            "batch_size=2",
            iters,
            "eval_interval=2",
            "eval_iters=1",
            "lora_rank=2",
            "learning_rate=1e-2",
            "threads=1",
        ];
        ok(d, &args);
    }
}

/// Alpaca examples: `n` of them, whose answers depend on `salt`.
fn alpaca(n: usize, salt: &str) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{{\"instruction\": \"Count to {i}\", \"input\": \"\", \"output\": \"{salt} {i}\"}}\n"
            )
        })
        .collect()
}

/// One command whose output is checked: its arguments for the old and the new
/// output, and the folder it writes.
struct Case {
    name: &'static str,
    old: Vec<&'static str>,
    new: Vec<&'static str>,
    dest: &'static str,
}

fn cases() -> Vec<Case> {
    let prepare = |src: &'static str| {
        vec![
            "prepare",
            src,
            "--out",
            "ds",
            "--format",
            "alpaca",
            "--tokenizer",
            "char",
            "--val-fraction",
            "0.3",
        ]
    };
    vec![
        Case {
            name: "export",
            old: vec!["export", "--from", "run1", "--to", "hf"],
            new: vec!["export", "--from", "run2", "--to", "hf"],
            dest: "hf",
        },
        Case {
            name: "export --adapter-only",
            old: vec!["export", "--from", "run1", "--to", "peft", "--adapter-only"],
            new: vec!["export", "--from", "run2", "--to", "peft", "--adapter-only"],
            dest: "peft",
        },
        Case {
            name: "prepare --format alpaca",
            old: prepare("a.jsonl"),
            new: prepare("b.jsonl"),
            dest: "ds",
        },
    ]
}

/// Runs `args` with `NANOGPT_FAULT=fault`; returns whether the fault fired.
fn run_with_fault(d: &Path, args: &[&str], fault: &str) -> bool {
    let out = run(command(d, args).env("NANOGPT_FAULT", fault));
    let stderr = text(&out.stderr);
    if !stderr.contains("fault injection:") {
        assert!(out.status.success(), "{fault}: {stderr}");
        return false;
    }
    if fault.starts_with("kill") {
        assert_eq!(out.status.signal(), Some(9), "{fault}: {stderr}");
    } else {
        // One error line, naming the I/O error; a claim that the previous copy is
        // intact is checked by the caller against what the folder holds.
        assert_eq!(out.status.code(), Some(1), "{fault}: {stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: ") && last.contains("Input/output error"),
            "{fault}: {stderr}"
        );
        assert!(!stderr.to_lowercase().contains("panicked"), "{stderr}");
    }
    true
}

/// For each case, over the case's previous output, every file write and every
/// rename failed (EIO) or killed (SIGKILL) in turn, and over a missing destination,
/// every rename killed. After each, the destination is what it was or the complete
/// new output; after an error, nothing is left beside it; after SIGKILL, the command
/// run again leaves the new output and nothing beside it.
#[test]
fn a_multi_file_output_stopped_at_any_step_is_whole_or_absent() {
    let dir = temp_dir("outputs-faults");
    let d = dir.path();
    lora_runs(d);
    std::fs::write(d.join("a.jsonl"), alpaca(12, "old")).unwrap();
    std::fs::write(d.join("b.jsonl"), alpaca(14, "new")).unwrap();
    let listing = |dest: &str| {
        let mut names = names(d);
        names.retain(|n| n != dest);
        names
    };
    let mut trials = 0;
    for case in cases() {
        let dest = d.join(case.dest);
        // The two outputs, uninterrupted.
        ok(d, &case.new);
        let new = tree(&dest).unwrap();
        restore(&dest, None);
        ok(d, &case.old);
        let old = tree(&dest).unwrap();
        assert_ne!(old, new, "{}", case.name);
        let clean = listing(case.dest);
        let faults = [
            (true, "eio-write"),
            (true, "eio-rename"),
            (true, "kill-at-write"),
            (true, "kill-at-rename"),
            (false, "kill-at-rename"),
        ];
        for (previous, fault) in faults {
            let before = previous.then_some(&old);
            for n in 1.. {
                restore(&dest, before);
                let spec = format!("{fault}:{n}");
                let fired = run_with_fault(d, &case.new, &spec);
                let what = format!("{} ({spec}, previous output: {previous})", case.name);
                let now = tree(&dest);
                assert!(
                    now.as_ref() == before || now.as_ref() == Some(&new),
                    "{what}: the destination is a mix or partial: {:?}",
                    now.map(|t| t.keys().cloned().collect::<Vec<_>>())
                );
                if !fired {
                    assert!(n > 1, "{what}: the fault never fired");
                    break;
                }
                trials += 1;
                if fault.starts_with("eio") {
                    assert_eq!(now.as_ref(), before, "{what}: an error changed the output");
                } else {
                    // The next run finishes or removes what the killed one left.
                    ok(d, &case.new);
                    assert_eq!(tree(&dest).as_ref(), Some(&new), "{what}");
                }
                assert_eq!(listing(case.dest), clean, "{what}: leftovers");
            }
        }
        restore(&dest, None);
    }
    assert!(trials >= 40, "{trials} trials");
}

/// An I/O error while replacing a previous adapter export says so truthfully: the
/// previous adapter is intact (it used to rename the new weights in before the config
/// failed, leaving rank-4 weights beside a rank-2 config under that same message).
#[test]
fn an_adapter_export_that_fails_leaves_the_previous_adapter_whole() {
    let dir = temp_dir("outputs-adapter-eio");
    let d = dir.path();
    lora_runs(d);
    ok(
        d,
        &["export", "--from", "run1", "--to", "peft", "--adapter-only"],
    );
    let old = tree(&d.join("peft")).unwrap();
    // Make run2's adapters differ in rank from run1's.
    let args = [
        "train",
        "init_from=base",
        "dataset=data",
        "out_dir=run3",
        "block_size=8",
        "batch_size=2",
        "max_iters=2",
        "eval_interval=2",
        "eval_iters=1",
        "lora_rank=4",
        "threads=1",
    ];
    ok(d, &args);
    for fault in ["eio-rename:2", "eio-rename:3", "eio-write:2"] {
        let new = ["export", "--from", "run3", "--to", "peft", "--adapter-only"];
        let out = run(command(d, new).env("NANOGPT_FAULT", fault));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{fault}: {stderr}");
        assert!(stderr.contains("Input/output error"), "{fault}: {stderr}");
        assert_eq!(tree(&d.join("peft")).unwrap(), old, "{fault}: {stderr}");
        let config: serde_json::Value =
            serde_json::from_slice(&old[Path::new("adapter_config.json")]).unwrap();
        assert_eq!(config["r"], 2);
    }
}

/// `export --adapter-only` writes only into a new or empty folder or over its own
/// previous adapter export: a user's PEFT adapter, a training run's out_dir, a merged
/// export or a file are refused, byte for byte untouched (it used to write into any
/// of them; after a merged export, `from_pretrained(DIR)` then loaded the adapter on
/// top of the merged weights).
#[test]
fn an_adapter_export_refuses_a_folder_it_did_not_write() {
    let dir = temp_dir("outputs-adapter-dest");
    let d = dir.path();
    lora_runs(d);
    // A user's own PEFT adapter.
    std::fs::create_dir(d.join("theirs")).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixture("lora/adapter").join(f), d.join("theirs").join(f)).unwrap();
    }
    ok(d, &["export", "--from", "run1", "--to", "merged"]);
    std::fs::write(d.join("file"), "a file").unwrap();
    for (to, phrase) in [
        ("theirs", "already holds files that nanogpt's adapter export did not write (adapter_config.json, adapter_model.safetensors)"),
        ("run1", "already holds files that nanogpt's adapter export did not write"),
        ("merged", "already holds files that nanogpt's adapter export did not write (config.json, generation_config.json, merges.txt, model.safetensors, tokenizer_config.json, ...)"),
        ("file", "--to file is a file, not a folder"),
    ] {
        let before = tree(d);
        let err = fails(d, &["export", "--from", "run2", "--to", to, "--adapter-only"]);
        assert!(err.contains(phrase), "{to}: {err}");
        assert!(err.contains("nothing was written"), "{to}: {err}");
        assert!(tree(d) == before, "{to}: something changed");
    }
    // Its own previous export is replaced; so is a merged export by a merged export.
    ok(
        d,
        &["export", "--from", "run1", "--to", "peft", "--adapter-only"],
    );
    ok(
        d,
        &["export", "--from", "run2", "--to", "peft", "--adapter-only"],
    );
    ok(d, &["export", "--from", "run2", "--to", "merged"]);
    // A merged export does not go into an adapter folder either.
    let err = fails(d, &["export", "--from", "run2", "--to", "peft"]);
    assert!(
        err.contains("already holds files that nanogpt's export did not write"),
        "{err}"
    );
}

/// `prepare` of instruction data replaces a previous dataset whole, keeping the
/// other files of the folder (here its own source), and plain text replaces an
/// instruction dataset without its masks.
#[test]
fn prepare_replaces_a_dataset_whole_and_keeps_other_files() {
    let dir = temp_dir("outputs-prepare");
    let d = dir.path();
    std::fs::create_dir(d.join("ds")).unwrap();
    std::fs::write(d.join("ds/a.jsonl"), alpaca(12, "old")).unwrap();
    let args = [
        "prepare",
        "ds/a.jsonl",
        "--out",
        "ds",
        "--tokenizer",
        "char",
    ];
    ok(d, &args);
    assert_eq!(
        names(&d.join("ds")),
        [
            ".nanogpt.lock",
            "a.jsonl",
            "meta.json",
            "train.bin",
            "train.mask",
            "val.bin",
            "val.mask"
        ]
    );
    let args = [
        "prepare",
        "ds/a.jsonl",
        "--out",
        "ds",
        "--tokenizer",
        "char",
        "--format",
        "text",
        "--text-column",
        "output",
    ];
    ok(d, &args);
    assert_eq!(
        names(&d.join("ds")),
        [
            ".nanogpt.lock",
            "a.jsonl",
            "meta.json",
            "train.bin",
            "val.bin"
        ]
    );
    assert_eq!(names(d), ["ds"]);
}

#[test]
fn a_refused_run_leaves_no_folder_it_created() {
    let dir = temp_dir("outputs-refused");
    let d = dir.path();
    std::fs::write(
        d.join("text.txt"),
        "to be or not to be, that is the question\n".repeat(40),
    )
    .unwrap();
    ok(
        d,
        &["prepare", "text.txt", "--out", "ds", "--tokenizer", "char"],
    );
    // A Llama config without its weights: the plan reads the config, so the run
    // is refused only when the weights are loaded, after out_dir is made and locked.
    let config = r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 40,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": true}"#;
    std::fs::create_dir(d.join("llama")).unwrap();
    std::fs::write(d.join("llama/config.json"), config).unwrap();
    let err = refused(&run(&mut command(
        d,
        [
            "train",
            "dataset=ds",
            "init_from=llama",
            "out_dir=runs/a/out",
            "max_iters=1",
        ],
    )));
    assert!(err.contains("no model.safetensors"), "{err}");
    assert!(
        !d.join("runs").exists(),
        "left behind: {:?}",
        names(&d.join("runs"))
    );
    // An out_dir that existed stays, with what it held.
    std::fs::create_dir(d.join("mine")).unwrap();
    std::fs::write(d.join("mine/notes.txt"), "mine").unwrap();
    refused(&run(&mut command(
        d,
        [
            "train",
            "dataset=ds",
            "init_from=llama",
            "out_dir=mine",
            "max_iters=1",
        ],
    )));
    assert!(names(&d.join("mine")).contains(&"notes.txt".to_string()));
    // prepare, refused after its --out is made: a record that is not JSON.
    std::fs::write(
        d.join("bad.jsonl"),
        format!("{}{{not json\n", alpaca(1, "x")),
    )
    .unwrap();
    let args = [
        "prepare",
        "bad.jsonl",
        "--out",
        "new/ds",
        "--tokenizer",
        "char",
    ];
    refused(&run(&mut command(d, args)));
    assert!(!d.join("new/ds").exists(), "{:?}", names(&d.join("new")));
}
