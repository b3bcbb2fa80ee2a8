//! GGUF against the `gguf` Python package (llama.cpp's gguf-py), through fixtures
//! it wrote (scripts/reference/gguf_fixtures.py): dequantization bit for bit,
//! quantization byte for byte, and a tiny GPT-2 file read into logits.

mod common;

use nanogpt::data::{Tokenizer, TokenizerKind};
use nanogpt::gguf::{quants, ExportOptions, GgmlType, GgufFile, GgufWriter, OutType, TensorSpec};
use nanogpt::hf::Pretrained;
use nanogpt::model::{Gpt, ModelConfig};

fn quants_fixture() -> GgufFile {
    GgufFile::open(&common::fixture("gguf/quants.gguf")).unwrap()
}

#[test]
fn dequantization_matches_the_gguf_package_bit_for_bit() {
    let f = quants_fixture();
    let types = [
        "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k",
    ];
    for name in types {
        let raw = f.tensor(&format!("{name}.raw")).unwrap();
        let expected = f.tensor(&format!("{name}.expected")).unwrap();
        assert_eq!(raw.ty.unwrap().name().to_lowercase(), name);
        assert_eq!(raw.dims, expected.dims, "{name}");
        let ours = f.tensor_f32(raw).unwrap();
        let theirs = f.tensor_f32(expected).unwrap();
        let differ = ours
            .iter()
            .zip(&theirs)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{name}: {differ} of {} values differ",
            ours.len()
        );
        assert!(theirs.iter().all(|x| x.is_finite()), "{name}");
    }
}

#[test]
fn quantization_matches_the_gguf_package_byte_for_byte() {
    let f = quants_fixture();
    for (name, ty) in [
        ("f16", GgmlType::F16),
        ("bf16", GgmlType::BF16),
        ("q8_0", GgmlType::Q8_0),
    ] {
        let input = f
            .tensor_f32(f.tensor(&format!("{name}.input")).unwrap())
            .unwrap();
        let expected = f.tensor(&format!("{name}.quantized")).unwrap();
        assert_eq!(expected.ty, Some(ty));
        let theirs = f.tensor_bytes(expected).unwrap();
        let mut ours = vec![0u8; theirs.len()];
        quants::quantize(ty, &input, &mut ours);
        let differ: Vec<usize> = (0..ours.len()).filter(|&i| ours[i] != theirs[i]).collect();
        assert!(differ.is_empty(), "{name}: bytes {differ:?} differ");
    }
}

/// Inputs and logits that transformers computed from tiny_gpt2.gguf.
fn tiny_expected() -> (Vec<u32>, Vec<f32>, usize, usize) {
    let bytes = std::fs::read(common::fixture("gguf/tiny_gpt2.expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let inputs = st.tensor("inputs").unwrap();
    let (b, t) = (inputs.shape()[0], inputs.shape()[1]);
    let ids = inputs
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let logits = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (ids, logits, b, t)
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

#[test]
fn a_gguf_gpt2_in_many_types_gives_transformers_logits() {
    let path = common::fixture("gguf/tiny_gpt2.gguf");
    let (ids, want, b, t) = tiny_expected();
    let pretrained = Pretrained::open(path.to_str().unwrap()).unwrap();
    // The whole position table, and cropped.
    for block in [None, Some(t)] {
        let (cfg, params) = pretrained.load(block, 0.0).unwrap();
        assert_eq!(
            (cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd),
            (96, 2, 4, 64)
        );
        assert_eq!(cfg.block_size, block.unwrap_or(32));
        let mut model = Gpt::from_params(cfg, params, b, t).unwrap();
        model.set_training(false);
        let logits = model.logits(&ids, b, t);
        let rel = relative_error(&logits, &want);
        println!("tiny_gpt2.gguf: logits within {rel:.1e} of transformers'");
        assert!(rel <= 1e-5, "{rel}");
    }
    let gguf = pretrained.gguf().unwrap();
    assert!(gguf.chat_template().unwrap().contains("m['role']"));
    // A small BPE that is not GPT-2's: the weights load, text cannot be encoded yet.
    let err = format!("{:#}", gguf.tokenizer().unwrap_err());
    assert!(
        err.contains("`gpt2` tokenizer") && err.contains("96 tokens"),
        "{err}"
    );
}

fn gpt2_tokens_model(bias: bool, seed: u64) -> Gpt {
    let cfg = ModelConfig {
        vocab_size: 50257,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        bias,
        dropout: 0.0,
        llama: None,
    };
    let mut model = Gpt::new(cfg, 2, 16).unwrap();
    model.init_gpt2(seed);
    model
}

fn export(model: &Gpt, outtype: OutType, dest: &std::path::Path) -> nanogpt::gguf::model::Exported {
    let gpt2 = Tokenizer::gpt2();
    let opts = ExportOptions {
        outtype,
        name: "tiny",
        tokenizer: &gpt2,
        chat_template: Some("{{ messages }}"),
    };
    nanogpt::gguf::model::export(&model.params, model.config(), &opts, dest).unwrap()
}

#[test]
fn an_f32_export_reads_back_exactly_with_gpt2s_tokenizer() {
    let dir = common::temp_dir("gguf");
    let model = gpt2_tokens_model(true, 3);
    let path = dir.path().join("m.gguf");
    let out = export(&model, OutType::F32, &path);
    assert_eq!(out.tensors, 4 + 12 * 2);
    let f = GgufFile::open(&path).unwrap();
    let get = |k: &str| f.get(k).unwrap().clone();
    assert_eq!(get("general.architecture").as_str(), Some("gpt2"));
    assert_eq!(get("general.file_type").as_u64(), Some(0));
    for (key, want) in [
        ("gpt2.context_length", 16),
        ("gpt2.embedding_length", 32),
        ("gpt2.feed_forward_length", 128),
        ("gpt2.block_count", 2),
        ("gpt2.attention.head_count", 2),
        ("tokenizer.ggml.bos_token_id", 50256),
        ("tokenizer.ggml.eos_token_id", 50256),
    ] {
        assert_eq!(get(key).as_u64(), Some(want), "{key}");
    }
    assert_eq!(
        get("gpt2.attention.layer_norm_epsilon").as_f64(),
        Some(1e-5f32 as f64)
    );
    assert_eq!(get("tokenizer.ggml.model").as_str(), Some("gpt2"));
    assert_eq!(get("tokenizer.ggml.pre").as_str(), Some("gpt-2"));
    let tokens = get("tokenizer.ggml.tokens");
    let tokens = tokens.as_array().unwrap();
    assert_eq!(tokens.len(), 50257);
    assert_eq!(tokens[15496].as_str(), Some("Hello"));
    assert_eq!(tokens[50256].as_str(), Some("<|endoftext|>"));
    let types = get("tokenizer.ggml.token_type");
    let types = types.as_array().unwrap();
    assert_eq!(
        (types[0].as_u64(), types[50256].as_u64()),
        (Some(1), Some(3))
    );
    assert_eq!(
        get("tokenizer.ggml.merges").as_array().unwrap().len(),
        50000
    );
    assert!(
        f.tensor("output.weight").is_none(),
        "the classifier is tied"
    );
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, [32, 50257]);
    assert_eq!(f.tensor("blk.1.attn_qkv.weight").unwrap().dims, [32, 96]);
    assert_eq!(f.tensor("blk.0.ffn_down.weight").unwrap().dims, [128, 32]);

    let pretrained = Pretrained::open(path.to_str().unwrap()).unwrap();
    let gguf = pretrained.gguf().unwrap();
    assert_eq!(gguf.tokenizer().unwrap().kind(), TokenizerKind::Gpt2);
    assert_eq!(gguf.chat_template(), Some("{{ messages }}"));
    let (cfg, params) = pretrained.load(None, 0.0).unwrap();
    assert_eq!(&cfg, model.config());
    assert!(params == model.params, "f32 round trip is exact");
}

#[test]
fn quantized_exports_are_smaller_and_close() {
    let dir = common::temp_dir("gguf");
    let model = gpt2_tokens_model(false, 4);
    let (b, t) = (2, 16);
    let ids: Vec<u32> = (0..(b * t) as u32).map(|i| i * 997 % 50257).collect();
    let mut reference =
        Gpt::from_params(model.config().clone(), model.params.clone(), b, t).unwrap();
    let want = reference.logits(&ids, b, t);
    let mut sizes = Vec::new();
    for (outtype, tolerance) in [
        (OutType::F32, 0.0),
        (OutType::F16, 2e-3),
        (OutType::Bf16, 2e-2),
        (OutType::Q8_0, 2e-2),
    ] {
        let path = dir.path().join(format!("m-{outtype}.gguf"));
        let out = export(&model, outtype, &path);
        sizes.push(out.bytes);
        let f = GgufFile::open(&path).unwrap();
        let qkv = f.tensor("blk.0.attn_qkv.weight").unwrap();
        assert_eq!(qkv.ty, Some(outtype.weight_type()));
        for norm in [
            "blk.0.attn_norm.weight",
            "output_norm.bias",
            "position_embd.weight",
        ] {
            assert_eq!(f.tensor(norm).unwrap().ty, Some(GgmlType::F32), "{norm}");
        }
        // Trained without biases: zero biases, which llama.cpp's GPT-2 requires.
        let bias = f
            .tensor_f32(f.tensor("blk.1.ffn_up.bias").unwrap())
            .unwrap();
        assert!(bias.len() == 128 && bias.iter().all(|&x| x == 0.0));
        let (cfg, params) = Pretrained::open(path.to_str().unwrap())
            .unwrap()
            .load(None, 0.0)
            .unwrap();
        assert!(cfg.bias);
        let mut m = Gpt::from_params(cfg, params, b, t).unwrap();
        let rel = relative_error(&m.logits(&ids, b, t), &want);
        println!("{outtype}: {} bytes, logits within {rel:.1e}", out.bytes);
        assert!(rel <= tolerance, "{outtype}: {rel}");
    }
    assert!(sizes[1] < sizes[0] && sizes[3] < sizes[1], "{sizes:?}");
}

#[test]
fn an_export_replaces_its_own_file_but_nothing_else() {
    let dir = common::temp_dir("gguf");
    let model = gpt2_tokens_model(true, 5);
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, "someone's file").unwrap();
    let gpt2 = Tokenizer::gpt2();
    let opts = ExportOptions {
        outtype: OutType::F16,
        name: "tiny",
        tokenizer: &gpt2,
        chat_template: None,
    };
    let err = nanogpt::gguf::model::export(&model.params, model.config(), &opts, &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a GGUF file that nanogpt wrote"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "someone's file");
    std::fs::remove_file(&path).unwrap();
    export(&model, OutType::Q8_0, &path);
    // Files the user made from an export of ours carry our mark: refused all the same.
    let requantized = dir.path().join("q.gguf");
    rewrite_as_llama_quantize(&path, &requantized);
    let theirs = common::fixture("gguf/tiny_gpt2.gguf");
    let copied = dir.path().join("theirs.gguf");
    std::fs::copy(&theirs, &copied).unwrap();
    for file in [&requantized, &copied] {
        let before = std::fs::read(file).unwrap();
        let err = nanogpt::gguf::model::export(&model.params, model.config(), &opts, file)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a GGUF file that nanogpt wrote"), "{err}");
        assert!(std::fs::read(file).unwrap() == before, "{}", file.display());
        std::fs::remove_file(file).unwrap();
    }
    let dangling = dir.path().join("link.gguf");
    std::os::unix::fs::symlink("nowhere", &dangling).unwrap();
    let err = nanogpt::gguf::model::export(&model.params, model.config(), &opts, &dangling)
        .unwrap_err()
        .to_string();
    assert!(err.contains("symbolic link to nothing"), "{err}");
    std::fs::remove_file(&dangling).unwrap();
    export(&model, OutType::F16, &path);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get("general.file_type").unwrap().as_u64(), Some(1));
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["m.gguf"]);
    // A char-level model has no tokenizer llama.cpp reads: refused, naming the way out.
    let chars = Tokenizer::char_level("ab".chars()).unwrap();
    let opts = ExportOptions {
        tokenizer: &chars,
        ..opts
    };
    let err = nanogpt::gguf::model::export(
        &model.params,
        model.config(),
        &opts,
        &dir.path().join("c.gguf"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("char tokenizer") && err.contains("Hugging Face folder"),
        "{err}"
    );
}

/// Writes `src` again as `llama-quantize` writes its output: every key of the input
/// copied (nanogpt's mark included), `general.quantization_version` and
/// `general.file_type` removed and set again at the end (ggml's `gguf_set_val_*`),
/// the tensors as they are (the same types: a requantization to q8_0).
fn rewrite_as_llama_quantize(src: &std::path::Path, dest: &std::path::Path) {
    let file = GgufFile::open(src).unwrap();
    let moved = ["general.quantization_version", "general.file_type"];
    let mut metadata: Vec<_> = file
        .header
        .metadata
        .iter()
        .filter(|(k, _)| !moved.contains(&k.as_str()))
        .cloned()
        .collect();
    for key in moved {
        metadata.push((key.to_string(), file.get(key).unwrap().clone()));
    }
    let specs = file
        .header
        .tensors
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ty: t.ty.unwrap(),
        })
        .collect();
    let mut w = GgufWriter::create(dest, &metadata, specs).unwrap();
    for t in &file.header.tensors {
        w.write_f32(&file.tensor_f32(t).unwrap()).unwrap();
    }
    w.finish().unwrap();
    assert!(GgufFile::open(dest)
        .unwrap()
        .get("nanogpt.producer")
        .is_some());
}

#[test]
fn llama_cpp_and_transformers_read_our_export_with_our_logits() {
    let Some(python) = common::venv_python() else {
        println!(
            "SKIPPED: no /work/venv with llama_cpp, transformers and gguf (NANOGPT_VENV_PYTHON)"
        );
        return;
    };
    let dir = common::temp_dir("gguf");
    let model = gpt2_tokens_model(true, 6);
    let t = 16;
    let ids: Vec<u32> = (0..t as u32).map(|i| (i * 7919 + 11) % 50257).collect();
    let mut ours = Gpt::from_params(model.config().clone(), model.params.clone(), 1, t).unwrap();
    let want = ours.logits(&ids, 1, t);
    let path = dir.path().join("m.gguf");
    export(&model, OutType::F32, &path);
    let got = common::other_readers(&python, &path, &ids, None);
    assert_eq!(got["gguf_tensors"], [28.0]);
    let transformers = relative_error(&got["transformers"], &want);
    println!("f32 export read by transformers: logits within {transformers:.1e} of ours");
    assert!(transformers <= 1e-5, "{transformers}");
    // llama.cpp's CPU GELU rounds through an f16 table: against that GELU (the
    // script's emulation) its logits agree to 1e-5; against exact f32 they differ
    // by llama.cpp's rounding alone.
    let emulated = relative_error(&got["llama_cpp"], &got["transformers_gelu_f16"]);
    let exact = relative_error(&got["llama_cpp"], &want);
    println!(
        "f32 export read by llama.cpp: logits within {emulated:.1e} of ours with its f16 GELU \
         table, {exact:.1e} of ours"
    );
    assert!(emulated <= 1e-5, "{emulated}");
    assert!(exact <= 1e-3, "{exact}");
    // q8_0: transformers dequantizes it as we do, so its logits are those of our model
    // loaded from the same file; llama.cpp's stay close to our f32 model's.
    let path = dir.path().join("q.gguf");
    export(&model, OutType::Q8_0, &path);
    let (config, params) = Pretrained::open_gguf(&path)
        .unwrap()
        .load(None, 0.0)
        .unwrap();
    let mut loaded = Gpt::from_params(config, params, 1, t).unwrap();
    let dequantized = loaded.logits(&ids, 1, t);
    let got = common::other_readers(&python, &path, &ids, None);
    let rel = relative_error(&got["transformers"], &dequantized);
    println!("q8_0 export read by transformers: logits within {rel:.1e} of ours read back");
    assert!(rel <= 1e-5, "{rel}");
    match got.get("llama_cpp") {
        Some(theirs) => {
            let rel = relative_error(theirs, &want);
            println!("q8_0 export read by llama.cpp: logits within {rel:.1e} of ours (f32)");
            assert!(rel <= 3e-2, "{rel}");
        }
        None => println!(
            "SKIPPED llama.cpp on the q8_0 export: it ended by signal {:?} (llama.cpp's own \
             q8_0 files crash it on this CPU too; seen on a Xeon with AMX)",
            got.get("llama_cpp_signal")
        ),
    }
}

/// A LoRA fine-tune of a GGUF base through the binary: the base stays as loaded,
/// the adapters export as a GGUF adapter (and merged, as a whole GGUF model), eval
/// sees the same model every way, and llama.cpp applies the adapter as we do.
#[test]
fn lora_on_a_gguf_base_exports_an_adapter_llama_cpp_applies() {
    let dir = common::temp_dir("gguf-lora");
    let d = dir.path();
    let base = gpt2_tokens_model(true, 7);
    export(&base, OutType::F32, &d.join("base.gguf"));
    common::prepare_gpt2_text(d, 40);
    let train = [
        "train",
        "init_from=base.gguf",
        "dataset=data",
        "out_dir=out",
        "block_size=16",
        "batch_size=2",
        "max_iters=6",
        "eval_interval=6",
        "eval_iters=1",
        "lora_rank=2",
        "lora_alpha=4",
        "lora_targets=c_attn,attn.c_proj,c_fc,mlp.c_proj",
        "learning_rate=3e-2",
        "warmup_iters=0",
        "threads=1",
    ];
    common::ok(d, &train);
    let state = common::read_json(&d.join("out/ckpt.json"));
    assert_eq!(state["lora"]["base"], "base.gguf");
    common::ok(
        d,
        &[
            "export",
            "--from",
            "out",
            "--to",
            "lora.gguf",
            "--adapter-only",
            "--outtype",
            "f32",
        ],
    );
    common::ok(
        d,
        &[
            "export",
            "--from",
            "out",
            "--to",
            "merged.gguf",
            "--outtype",
            "f32",
        ],
    );
    let f = GgufFile::open(&d.join("lora.gguf")).unwrap();
    let s = |k: &str| f.get(k).and_then(|v| v.as_str()).unwrap().to_string();
    assert_eq!(
        (s("general.type"), s("adapter.type")),
        ("adapter".into(), "lora".into())
    );
    assert_eq!(f.get("adapter.lora.alpha").unwrap().as_f64(), Some(4.0));
    let a = f.tensor("blk.1.attn_qkv.weight.lora_a").unwrap();
    let b = f.tensor("blk.1.attn_qkv.weight.lora_b").unwrap();
    assert_eq!((a.dims.clone(), b.dims.clone()), (vec![32, 2], vec![2, 96]));
    assert_eq!(f.header.tensors.len(), 2 * 4 * 2);

    // The run, its merged export, and the base with the GGUF adapter evaluate alike.
    let eval = |args: &[&str]| -> f64 {
        let base = ["eval", "--data", "text.txt", "--json", "--block-size", "16"];
        let out = common::ok(d, &[&base[..], args].concat());
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    let run = eval(&["--init-from", "out"]);
    let merged = eval(&["--init-from", "merged.gguf"]);
    let adapted = eval(&["--init-from", "base.gguf", "--adapter", "lora.gguf"]);
    let plain = eval(&["--init-from", "base.gguf"]);
    println!("eval loss: run {run}, merged {merged}, base + adapter {adapted}, base {plain}");
    assert!(
        (run - merged).abs() < 1e-5 && (run - adapted).abs() < 1e-5,
        "{run} {merged} {adapted}"
    );
    assert!(
        (run - plain).abs() > 1e-3,
        "the adapters changed nothing: {run} vs {plain}"
    );

    let Some(python) = common::venv_python() else {
        println!("SKIPPED: llama.cpp's --lora check needs /work/venv (NANOGPT_VENV_PYTHON)");
        return;
    };
    let ids: Vec<u32> = (0..16u32).map(|i| (i * 4099 + 5) % 50257).collect();
    let with_lora = common::other_readers(
        &python,
        &d.join("base.gguf"),
        &ids,
        Some(&d.join("lora.gguf")),
    );
    let merged = common::other_readers(&python, &d.join("merged.gguf"), &ids, None);
    let base_only = common::other_readers(&python, &d.join("base.gguf"), &ids, None);
    let rel = relative_error(&with_lora["llama_cpp"], &merged["llama_cpp"]);
    let moved = relative_error(&base_only["llama_cpp"], &merged["llama_cpp"]);
    // Ours, for the merged model: llama.cpp with the adapter against it, through
    // llama.cpp's f16 GELU table (as transformers emulates it).
    let ours = relative_error(&with_lora["llama_cpp"], &merged["transformers_gelu_f16"]);
    println!(
        "llama.cpp: base + lora.gguf within {rel:.1e} of merged.gguf ({ours:.1e} of ours with \
         its GELU); the adapters move the logits by {moved:.1e}"
    );
    // (Against the emulation, an activation that lands on the other side of an f16
    // rounding boundary moves by one f16 step: a looser bound.)
    assert!(rel <= 1e-5 && ours <= 5e-5, "{rel} {ours}");
    assert!(moved > 1e-3, "{moved}");
}
