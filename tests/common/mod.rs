//! Helpers shared by the integration tests that run the `nanogpt` binary: the tiny
//! settings they train with, running the binary, and the checks every successful
//! or refused run must pass.

// Each test crate includes this module and uses a different part of it.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, Once};

pub const BIN: &str = env!("CARGO_BIN_EXE_nanogpt");

/// A tiny GPT: 2 layers, 2 heads, width 32.
pub const TINY_MODEL: [&str; 3] = ["n_layer=2", "n_head=2", "n_embd=32"];

/// Tiny batches: 4 rows of 16 tokens (with [`TINY_MODEL`], seconds of training).
pub const TINY_BATCH: [&str; 2] = ["block_size=16", "batch_size=4"];

/// [`TINY_MODEL`] and [`TINY_BATCH`] on the bundled Shakespeare (characters),
/// learning fast, with dropout on (so the seeds matter) and every step logged.
pub const TINY_SHAKESPEARE: [&str; 11] = [
    "dataset=shakespeare_char",
    TINY_MODEL[0],
    TINY_MODEL[1],
    TINY_MODEL[2],
    TINY_BATCH[0],
    TINY_BATCH[1],
    "eval_iters=2",
    "log_interval=1",
    "warmup_iters=2",
    "learning_rate=3e-3",
    "dropout=0.1",
];

/// A scratch directory `nanogpt-<tag>-…` under the system temp dir, removed on drop.
pub fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("nanogpt-{tag}-"))
        .tempdir()
        .expect("temp dir")
}

/// Scratch directories of [`process_temp_dir`], removed when the process exits.
static AT_EXIT: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A scratch directory like [`temp_dir`] for what a test crate makes once and keeps
/// in a static (a trained model, a prepared dataset): statics are never dropped, so
/// a `TempDir` held there would stay behind after every run. This one is removed
/// when the process exits, however its tests ended (not if it is killed).
pub fn process_temp_dir(tag: &str) -> PathBuf {
    static REGISTER: Once = Once::new();
    extern "C" fn remove_all() {
        // A thread still holding the lock at exit: leave the directories, not hang.
        if let Ok(dirs) = AT_EXIT.try_lock() {
            for dir in dirs.iter() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
    REGISTER.call_once(|| {
        // SAFETY: `remove_all` is a plain function that neither unwinds nor
        // registers anything; atexit only records its address.
        let failed = unsafe { libc::atexit(remove_all) } != 0;
        assert!(!failed, "atexit refused to register the scratch clean-up");
    });
    let dir = temp_dir(tag).keep();
    AT_EXIT.lock().unwrap().push(dir.clone());
    dir
}

/// A process's output stream as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `nanogpt ARGS` in `dir`, as every suite runs it: two rayon threads (the machine
/// may have two cores), no fault injection inherited from the environment, and
/// `RUST_BACKTRACE=1`, so that a backtrace, were one ever printed, would be seen.
pub fn command<S: AsRef<OsStr>>(dir: &Path, args: impl IntoIterator<Item = S>) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .current_dir(dir)
        .env("RAYON_NUM_THREADS", "2")
        .env("RUST_BACKTRACE", "1")
        .env_remove("NANOGPT_FAULT");
    cmd
}

/// Runs `cmd` to its end.
pub fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("run nanogpt")
}

/// Runs `cmd` and expects success; returns its stdout and stderr.
pub fn succeeds(cmd: &mut Command) -> (String, String) {
    let out = run(cmd);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed:\n{stderr}");
    let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    (stdout, stderr)
}

/// `nanogpt ARGS` in `dir`, expected to succeed; its stdout.
pub fn ok(dir: &Path, args: &[&str]) -> String {
    succeeds(&mut command(dir, args)).0
}

/// `nanogpt ARGS` in `dir`, expected to fail with nothing on stderr but the error
/// (ours or a usage error of the command line's parser); returns stderr.
pub fn fails(dir: &Path, args: &[&str]) -> String {
    let stderr = failed(&run(&mut command(dir, args)));
    assert!(
        stderr.starts_with("error: "),
        "more than the error on stderr:\n{stderr}"
    );
    stderr
}

/// What every refused run must show: exit status 1, no panic, no backtrace, and
/// exactly one `error:` line, the last of stderr. Returns stderr.
pub fn refused(out: &Output) -> String {
    let stderr = refused_multiline(out);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: "),
        "the error is not the last line:\n{stderr}"
    );
    stderr
}

/// [`refused`], the error allowed to continue on further lines (a message that
/// carries a command to copy).
pub fn refused_multiline(out: &Output) -> String {
    let stderr = failed(out);
    assert_eq!(out.status.code(), Some(1), "exit status:\n{stderr}");
    stderr
}

/// A failure, not a crash: a non-zero exit status, no panic, no backtrace, and
/// exactly one `error:` line. Returns stderr.
fn failed(out: &Output) -> String {
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "no failure:\n{stderr}");
    let lower = stderr.to_lowercase();
    assert!(!lower.contains("panicked"), "a panic:\n{stderr}");
    assert!(!lower.contains("backtrace"), "a backtrace:\n{stderr}");
    let errors = stderr.lines().filter(|l| l.starts_with("error")).count();
    assert_eq!(errors, 1, "not one error line:\n{stderr}");
    stderr
}

/// `(iter, value)` of every row of `out_dir/metrics.jsonl` that has `key` (a value
/// logged as null, i.e. not finite, reads as NaN).
pub fn metric(out_dir: &Path, key: &str) -> Vec<(u64, f64)> {
    let path = out_dir.join("metrics.jsonl");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|row| row.get(key).is_some())
        .map(|row| {
            let value = row[key].as_f64().unwrap_or(f64::NAN);
            (row["iter"].as_u64().unwrap(), value)
        })
        .collect()
}

/// A fixture file or folder under `tests/fixtures`.
pub fn fixture(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// A JSON file, parsed.
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Asserts that the PEFT adapter folder `ours` is `peft`'s: the same tensors (names,
/// dtypes, shapes and bytes) in adapter_model.safetensors, and in adapter_config.json
/// the same `keys`, `lora_alpha` and set of `target_modules`.
pub fn assert_same_adapter(ours: &Path, peft: &Path, keys: &[&str]) {
    let read = |p: &Path| std::fs::read(p.join("adapter_model.safetensors")).unwrap();
    let (ours_bytes, peft_bytes) = (read(ours), read(peft));
    let a = safetensors::SafeTensors::deserialize(&ours_bytes).unwrap();
    let b = safetensors::SafeTensors::deserialize(&peft_bytes).unwrap();
    let sorted = |st: &safetensors::SafeTensors| {
        let mut names: Vec<String> = st.names().into_iter().cloned().collect();
        names.sort();
        names
    };
    assert_eq!(sorted(&a), sorted(&b));
    for name in sorted(&a) {
        let (x, y) = (a.tensor(&name).unwrap(), b.tensor(&name).unwrap());
        assert_eq!((x.dtype(), x.shape()), (y.dtype(), y.shape()), "{name}");
        assert_eq!(x.data(), y.data(), "{name}");
    }
    let config = |p: &Path| read_json(&p.join("adapter_config.json"));
    let (ours, peft) = (config(ours), config(peft));
    for &key in keys {
        assert_eq!(ours[key], peft[key], "{key}");
    }
    assert_eq!(ours["lora_alpha"].as_f64(), peft["lora_alpha"].as_f64());
    let set = |v: &serde_json::Value| {
        let mut s: Vec<String> = serde_json::from_value(v["target_modules"].clone()).unwrap();
        s.sort();
        s
    };
    assert_eq!(set(&ours), set(&peft));
}

/// Writes `lines` copies of a line of Hamlet to `dir/text.txt` and prepares them with
/// GPT-2's tokenizer into `dir/data` (a fifth for validation): the data of the tests
/// that fine-tune GPT-2-vocabulary models.
pub fn prepare_gpt2_text(dir: &Path, lines: usize) {
    let text = "To be, or not to be, that is the question:\n".repeat(lines);
    std::fs::write(dir.join("text.txt"), text).unwrap();
    let args = [
        "prepare",
        "text.txt",
        "--out",
        "data",
        "--tokenizer",
        "gpt2",
    ];
    ok(dir, &[&args[..], &["--val-fraction", "0.2"]].concat());
}

/// Writes `d/lines.jsonl`: `n` questions cut from the bundled Shakespeare, each a
/// line's first characters and four continuations, the line's own (at a rotating
/// index) and three from other lines. Contexts of 6 to 25 characters: some fit the
/// tiny model's block of 16, some are scored in the harness's window.
pub fn write_shakespeare_task(d: &Path, n: usize) {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare/input.txt"),
    )
    .unwrap();
    let lines: Vec<&str> = (text.lines())
        .filter(|l| l.len() >= 40 && l.is_ascii())
        .collect();
    let mut out = String::new();
    for i in 0..n {
        let line = lines[i * 7];
        let cut = 6 + (i * 5) % 20;
        let tail = |l: &str| l[cut..cut + 6].trim().to_string();
        let label = i % 4;
        let mut choices: Vec<String> = (1..4).map(|k| tail(lines[i * 7 + k * 3])).collect();
        choices.insert(label, tail(line));
        let q = serde_json::json!({"context": line[..cut].trim_end(), "choices": choices, "label": label});
        out.push_str(&format!("{q}\n"));
    }
    std::fs::write(d.join("lines.jsonl"), out).unwrap();
}

/// The task rows of `run/metrics.jsonl`.
pub fn task_rows(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|row| row.get("task").is_some())
        .collect()
}

/// The venv with llama-cpp-python, transformers and gguf or `None` (the test then says it is skipped).
pub fn venv_python() -> Option<std::path::PathBuf> {
    let named = nanogpt::tuning::env::get().venv_python.clone();
    let python = named.unwrap_or_else(|| "/work/venv/bin/python".into());
    let ok = std::process::Command::new(&python)
        .args(["-c", "import llama_cpp, transformers, gguf"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(python)
}

/// Logits of `model` by llama.cpp and transformers (scripts/reference/gguf_readers.py).
pub fn other_readers(
    python: &std::path::Path,
    model: &std::path::Path,
    ids: &[u32],
    lora: Option<&std::path::Path>,
) -> std::collections::HashMap<String, Vec<f32>> {
    let out = model.with_extension("readers.safetensors");
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let mut cmd = std::process::Command::new(python);
    cmd.arg(fixture("../../scripts/reference/gguf_readers.py"))
        .arg(model)
        .arg(ids.join(","))
        .arg(&out);
    if let Some(lora) = lora {
        cmd.arg("--lora").arg(lora);
    }
    let run = cmd.output().unwrap();
    assert!(
        run.status.success(),
        "gguf_readers.py failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| match view.dtype() {
                    safetensors::Dtype::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f32,
                    _ => f32::from_le_bytes(c.try_into().unwrap()),
                })
                .collect();
            (name, values)
        })
        .collect()
}
