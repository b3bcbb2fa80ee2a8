//! Tokenizers end to end through the binary: token files of vocabularies beyond
//! uint16 (`"dtype": "uint32"`) prepared, trained on, evaluated and sampled.

use std::path::Path;

mod common;
use common::{ok, temp_dir, TINY_MODEL};

/// A text of `n` distinct characters from U+4E00 on (CJK ideographs and beyond,
/// skipping the surrogates), each once, then again in another order: a char-level
/// vocabulary of `n` ids.
fn wide_text(n: usize) -> String {
    let chars: Vec<char> = (0x4E00u32..).filter_map(char::from_u32).take(n).collect();
    let mut text: String = chars.iter().collect();
    text.extend(chars.iter().rev());
    text
}

/// The JSON state file of the (only) checkpoint in a run's `out_dir`.
fn checkpoint_state(out_dir: &Path) -> std::path::PathBuf {
    let mut states: Vec<_> = std::fs::read_dir(out_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("ckpt") && name.ends_with(".json")
        })
        .collect();
    assert_eq!(states.len(), 1, "{states:?}");
    states.pop().unwrap()
}

fn read_meta(dir: &Path) -> serde_json::Value {
    common::read_json(&dir.join("meta.json"))
}

#[test]
fn a_vocabulary_beyond_uint16_trains_evaluates_and_samples_from_uint32_files() {
    let dir = temp_dir("uint32");
    let d = dir.path();
    let vocab = 70_000;
    std::fs::write(d.join("wide.txt"), wide_text(vocab)).unwrap();
    let args = [
        "prepare",
        "wide.txt",
        "--out",
        "data",
        "--tokenizer",
        "char",
    ];
    ok(d, &[&args[..], &["--val-fraction", "0.01"]].concat());
    let meta = read_meta(&d.join("data"));
    assert_eq!(meta["dtype"], "uint32");
    assert_eq!(meta["vocab_size"], vocab);
    let tokens = meta["train_tokens"].as_u64().unwrap() + meta["val_tokens"].as_u64().unwrap();
    assert_eq!(tokens, 2 * vocab as u64);
    let bytes = std::fs::metadata(d.join("data/train.bin")).unwrap().len();
    assert_eq!(bytes, 4 * meta["train_tokens"].as_u64().unwrap());

    // The model's vocabulary comes from meta.json: ids up to 69,999 are embedded
    // and predicted (a wrong width or a u16 cut would read other ids, or fail the
    // vocabulary check).
    let run = [
        &["train", "dataset=data", "out_dir=run"] as &[&str],
        &TINY_MODEL,
        &[
            "block_size=16",
            "batch_size=2",
            "max_iters=2",
            "eval_interval=2",
            "eval_iters=1",
            "log_interval=1",
        ],
    ]
    .concat();
    let stdout = ok(d, &run);
    assert!(stdout.contains("step 2"), "{stdout}");
    let state = common::read_json(&checkpoint_state(&d.join("run")));
    assert_eq!(state["model"]["vocab_size"], vocab);
    assert_eq!(state["tokenizer"]["dtype"], "uint32");

    // eval reads the uint32 split (its meta.json beside it says so).
    let eval = ok(
        d,
        &[
            "eval",
            "--init-from",
            "run",
            "--data",
            "data/val.bin",
            "--json",
        ],
    );
    let report: serde_json::Value = serde_json::from_str(eval.trim()).unwrap();
    let loss = report["loss"].as_f64().unwrap();
    // Near ln(70000) = 11.16 after two steps from a random start.
    assert!((10.0..12.5).contains(&loss), "{eval}");

    // A prompt of ideographs with ids beyond 65,535 samples.
    let last: String = wide_text(vocab).chars().nth(vocab - 1).unwrap().to_string();
    let sample = [
        "sample",
        "--out-dir",
        "run",
        "--start",
        &last,
        "--num-samples",
        "1",
        "--max-new-tokens",
        "3",
    ];
    let text = ok(d, &sample);
    assert!(text.starts_with(&last), "{text:?}");
    assert_eq!(text.trim_end().chars().count(), 4, "{text:?}");
}
