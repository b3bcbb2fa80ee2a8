//! Hugging Face GPT-2 import and export against `transformers`.
//!
//! The fixtures in `tests/fixtures/hf/` come from `scripts/reference/hf_fixtures.py`:
//! small random `GPT2LMHeadModel`s saved by `transformers` (one file; the original
//! `gpt2` upload's layout in float16; sharded), with the logits and loss transformers
//! computes and the number `nanogpt eval` must give over `tokens.bin`. Nothing here
//! needs Python or the network. `export_for_python_check` also leaves an export for
//! the script's `--check-export` (see the script's docstring).

use nanogpt::checkpoint::{self, CheckpointState};
use nanogpt::data::{Meta, TokenDtype, Tokenizer, TokenizerKind};
use nanogpt::eval::evaluate_tokens;
use nanogpt::hf::{Located, Pretrained};
use nanogpt::hub::HubEnv;
use nanogpt::model::{Gpt, ModelConfig};
use nanogpt::optim::{AdamW, AdamWConfig};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

mod common;
use common::{command, ok, prepare_gpt2_text, read_json, refused, run, succeeds, temp_dir};

const FIXTURES: [&str; 3] = ["tiny_a", "tiny_b_legacy", "tiny_c_sharded"];

/// Logits: |got - want| <= ATOL + RTOL·|want|. transformers computes in float32
/// with other kernels (summation order), so a few ulps of the largest logits.
/// Observed: at most 7.2e-7 with logits up to about 4.
const LOGITS_ATOL: f32 = 5e-6;
const LOGITS_RTOL: f32 = 1e-6;
/// Losses, relative (observed: 8.4e-8 for the forward loss, 1.4e-8 for eval).
const LOSS_RTOL: f64 = 1e-6;

fn hf_dir() -> PathBuf {
    common::fixture("hf")
}

fn fixture(name: &str) -> PathBuf {
    hf_dir().join(name)
}

struct Expected {
    ids: Vec<u32>,
    b: usize,
    t: usize,
    logits: Vec<f32>,
    loss: f32,
    eval_loss: f64,
    eval_block_size: usize,
}

fn expected(name: &str) -> Expected {
    let bytes = std::fs::read(hf_dir().join(format!("{name}.expected.safetensors"))).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let eval_block_size = meta.metadata().as_ref().unwrap()["eval_block_size"]
        .parse()
        .unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let ids_view = st.tensor("ids").unwrap();
    let (b, t) = (ids_view.shape()[0], ids_view.shape()[1]);
    let ids = ids_view
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let eval = st.tensor("eval_loss").unwrap();
    assert_eq!(eval.dtype(), Dtype::F64);
    Expected {
        ids,
        b,
        t,
        logits: f32s("logits"),
        loss: f32s("loss")[0],
        eval_loss: f64::from_le_bytes(eval.data().try_into().unwrap()),
        eval_block_size,
    }
}

/// HF's loss shifts labels inside the model: targets are the next ids, the last
/// position of each row predicts nothing.
fn shifted_targets(ids: &[u32], b: usize, t: usize) -> Vec<i32> {
    let mut targets = vec![-1; b * t];
    for r in 0..b {
        for i in 0..t - 1 {
            targets[r * t + i] = ids[r * t + i + 1] as i32;
        }
    }
    targets
}

fn load(path: &Path, block: Option<usize>) -> (ModelConfig, Vec<f32>) {
    Pretrained::open(path.to_str().unwrap())
        .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
        .load(block, 0.0)
        .unwrap()
}

fn max_logit_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let err = (g - w).abs();
            assert!(
                err <= LOGITS_ATOL + LOGITS_RTOL * w.abs(),
                "logit {g} vs transformers' {w}"
            );
            err
        })
        .fold(0.0, f32::max)
}

#[test]
fn fixtures_give_transformers_logits_and_loss() {
    for name in FIXTURES {
        let want = expected(name);
        // The whole position table, and cropped to the batch's length.
        for block in [None, Some(want.t)] {
            let (cfg, params) = load(&fixture(name), block);
            let mut model = Gpt::from_params(cfg.clone(), params, want.b, want.t).unwrap();
            model.set_training(false);
            let logits = model.logits(&want.ids, want.b, want.t);
            let err = max_logit_error(&logits, &want.logits);
            let targets = shifted_targets(&want.ids, want.b, want.t);
            let loss = model.forward(&want.ids, &targets, want.b, want.t);
            let rel = ((loss - want.loss) / want.loss).abs() as f64;
            println!(
                "{name} block {}: max logit error {err:.2e}, loss {loss} vs {} (rel {rel:.1e})",
                cfg.block_size, want.loss
            );
            assert!(
                rel <= LOSS_RTOL,
                "{name}: loss {loss} vs transformers' {}",
                want.loss
            );
        }
    }
}

#[test]
fn padded_vocabulary_rows_are_zero_and_shapes_follow_the_config() {
    let (cfg, params) = load(&fixture("tiny_a"), Some(32));
    assert_eq!(
        (
            cfg.vocab_size,
            cfg.block_size,
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.bias
        ),
        (259, 32, 2, 4, 32, true)
    );
    let layout = nanogpt::model::ParamLayout::new(&cfg);
    let wte = &params[layout.wte];
    assert_eq!(wte.len(), 320 * 32);
    assert!(wte[259 * 32..].iter().all(|&x| x == 0.0));
    assert!(wte[..259 * 32].iter().any(|&x| x != 0.0));
}

#[test]
fn eval_over_a_token_file_equals_the_scripts_number() {
    let bytes = std::fs::read(hf_dir().join("tokens.bin")).unwrap();
    let tokens: Vec<u32> = bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]).into())
        .collect();
    for name in FIXTURES {
        let want = expected(name);
        let (cfg, params) = load(&fixture(name), None);
        let t = want.eval_block_size;
        let mut model = Gpt::from_params(cfg, params, 4, t).unwrap();
        let report = evaluate_tokens(&mut model, &tokens, t, 4, |_, _| {}).unwrap();
        let rel = (report.loss - want.eval_loss).abs() / want.eval_loss;
        println!(
            "{name}: eval loss {} vs {} (rel {rel:.1e})",
            report.loss, want.eval_loss
        );
        assert!(
            rel <= LOSS_RTOL,
            "{name}: {} vs {}",
            report.loss,
            want.eval_loss
        );
    }
}

#[test]
fn eval_command_reads_a_hugging_face_directory() {
    let want = expected("tiny_c_sharded");
    let out = ok(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        &[
            "eval",
            "--init-from",
            fixture("tiny_c_sharded").to_str().unwrap(),
            "--data",
            hf_dir().join("tokens.bin").to_str().unwrap(),
            "--block-size",
            &want.eval_block_size.to_string(),
            "--json",
        ],
    );
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let loss = json["loss"].as_f64().unwrap();
    assert!(
        (loss - want.eval_loss).abs() / want.eval_loss <= LOSS_RTOL,
        "{loss} vs {}",
        want.eval_loss
    );
}

// ---------------------------------------------------------------------------------
// Export

#[test]
fn export_then_load_round_trips_bit_exactly() {
    for name in FIXTURES {
        let (cfg, params) = load(&fixture(name), None);
        let dir = temp_dir("hf-roundtrip");
        let dest = dir.path().join("export");
        nanogpt::hf::export(
            &params,
            &cfg,
            Some(&Tokenizer::char_level("ab".chars()).unwrap()),
            &dest,
        )
        .unwrap();
        let (cfg2, params2) = load(&dest, None);
        assert_eq!(cfg2, cfg);
        assert!(
            params2
                .iter()
                .zip(&params)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}"
        );
        // The file holds HF's names and Conv1D layout, the real vocabulary, no lm_head.
        let bytes = std::fs::read(dest.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let c = cfg.n_embd;
        assert_eq!(
            st.tensor("transformer.wte.weight").unwrap().shape(),
            [cfg.vocab_size, c]
        );
        assert_eq!(
            st.tensor("transformer.h.0.attn.c_attn.weight")
                .unwrap()
                .shape(),
            [c, 3 * c]
        );
        assert_eq!(
            st.tensor("transformer.h.0.mlp.c_proj.weight")
                .unwrap()
                .shape(),
            [4 * c, c]
        );
        assert!(st.tensor("lm_head.weight").is_err());
        // Exporting again over a previous export is allowed.
        nanogpt::hf::export(&params, &cfg, None, &dest).unwrap();
    }
}

fn random_model(bias: bool, vocab_size: usize, seed: u64) -> Gpt {
    let cfg = ModelConfig {
        vocab_size,
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
    // GPT-2 init leaves biases at 0 and gains at 1: perturb everything.
    for (i, p) in model.params.iter_mut().enumerate() {
        *p += 0.01 * ((i as f32 * 0.37).sin());
    }
    let pad = model.layout.wte.start + vocab_size * 32..model.layout.wte.end;
    model.params[pad].fill(0.0);
    model
}

fn save_checkpoint(out_dir: &Path, model: &Gpt, meta: &Meta) {
    std::fs::create_dir_all(out_dir).unwrap();
    let state = CheckpointState {
        model: model.config().clone(),
        train_config: serde_json::json!({}),
        iter_num: 3,
        best_val_loss: 1.0,
        adam_step: 3,
        tokenizer: serde_json::to_value(meta).unwrap(),
        world_size: 1,
        lora: None,
        dataset: None,
        bf16_kernel: None,
        ab_switches: Vec::new(),
    };
    checkpoint::save(out_dir, &state, &model.layout, &model.params, None).unwrap();
}

fn char_meta(vocab: usize) -> Meta {
    let chars: String = (0..vocab as u32)
        .map(|i| char::from_u32(0x100 + i).unwrap())
        .collect();
    Meta {
        tokenizer: TokenizerKind::Char,
        vocab_size: vocab,
        dtype: TokenDtype::Uint16,
        train_tokens: 0,
        val_tokens: 0,
        chars: Some(chars),
        tokenizer_sha256: None,
        source: "test".into(),
    }
}

#[test]
fn export_command_writes_what_loads_back_with_the_same_logits() {
    // Without biases the export writes zero biases: exactly the same function.
    for bias in [true, false] {
        let dir = temp_dir("hf-export-cli");
        let mut model = random_model(bias, 77, 5);
        save_checkpoint(&dir.path().join("out"), &model, &char_meta(77));
        let stdout = ok(dir.path(), &["export", "--from", "out", "--to", "hf"]);
        assert!(stdout.contains("from_pretrained"), "{stdout}");
        assert!(stdout.contains("char tokenizer"), "{stdout}");
        let mut files: Vec<String> = std::fs::read_dir(dir.path().join("hf"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            ["config.json", "generation_config.json", "model.safetensors"]
        );
        let config = read_json(&dir.path().join("hf/config.json"));
        assert_eq!(config["n_positions"], 16);
        assert_eq!(config["vocab_size"], 77);
        assert!(config["eos_token_id"].is_null());

        let (cfg, params) = load(&dir.path().join("hf"), None);
        assert!(cfg.bias);
        let ids: Vec<u32> = (0..32).map(|i| (i * 7 % 77) as u32).collect();
        let want = model.logits(&ids, 2, 16);
        let got = Gpt::from_params(cfg, params, 2, 16)
            .unwrap()
            .logits(&ids, 2, 16);
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err <= 1e-6, "bias {bias}: max logit difference {err}");
    }
}

#[test]
fn exports_of_the_same_weights_are_byte_identical() {
    // The header's metadata has two keys: written from a HashMap, about half of the
    // exports ordered them the other way round (each map has its own random seed).
    let (cfg, params) = load(&fixture(FIXTURES[0]), None);
    let dir = temp_dir("hf-export-twice");
    let read = |i: usize| {
        let dest = dir.path().join(format!("export{i}"));
        nanogpt::hf::export(
            &params,
            &cfg,
            Some(&Tokenizer::char_level("ab".chars()).unwrap()),
            &dest,
        )
        .unwrap();
        std::fs::read(dest.join("model.safetensors")).unwrap()
    };
    let first = read(0);
    for i in 1..12 {
        assert!(read(i) == first, "export {i} differs from the first");
    }
}

#[test]
fn gpt2_tokenized_exports_carry_the_tokenizer() {
    let dir = temp_dir("hf-export-gpt2");
    let model = random_model(true, 50257, 1);
    nanogpt::hf::export(
        &model.params,
        model.config(),
        Some(&Tokenizer::gpt2()),
        dir.path(),
    )
    .unwrap();
    for f in ["vocab.json", "merges.txt", "tokenizer_config.json"] {
        assert!(dir.path().join(f).is_file(), "{f}");
    }
    let gen = read_json(&dir.path().join("generation_config.json"));
    assert_eq!(gen["eos_token_id"], 50256);
}

#[test]
fn export_refuses_a_directory_with_other_files() {
    let (cfg, params) = load(&fixture("tiny_a"), None);
    let dir = temp_dir("hf-export-dest");
    std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    std::fs::write(dir.path().join("config.json"), "{}").unwrap();
    let err = format!(
        "{:#}",
        nanogpt::hf::export(&params, &cfg, None, dir.path()).unwrap_err()
    );
    assert!(
        err.contains("notes.txt") && err.contains("new or empty directory"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("config.json")).unwrap(),
        "{}"
    );
    // Only files with the names an export writes, but not an export (a Hugging Face
    // model of the user's): refused too (it used to be overwritten).
    std::fs::remove_file(dir.path().join("notes.txt")).unwrap();
    let err = format!(
        "{:#}",
        nanogpt::hf::export(&params, &cfg, None, dir.path()).unwrap_err()
    );
    assert!(err.contains("did not write (config.json)"), "{err}");
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    nanogpt::hf::export(&params, &cfg, None, dir.path()).unwrap();
    // A previous export with the user's own files beside it: replaced, theirs kept.
    std::fs::write(dir.path().join("README.md"), "model card").unwrap();
    nanogpt::hf::export(&params, &cfg, None, dir.path()).unwrap();
    assert!(dir.path().join("README.md").exists());
    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let err = format!(
        "{:#}",
        nanogpt::hf::export(&params, &cfg, None, &file).unwrap_err()
    );
    assert!(err.contains("is a file"), "{err}");
}

/// Trains a fixture a few steps, saves a nanogpt checkpoint, exports it with the
/// command and writes nanogpt's logits beside it; the same for a GPT-2-vocabulary
/// model, whose export carries the tokenizer files. For
/// `hf_fixtures.py --check-export DIR` (DIR = $NANOGPT_EXPORT_CHECK_DIR, else a
/// temporary directory that is removed).
#[test]
fn export_for_python_check() {
    let keep = nanogpt::tuning::env::get().export_check_dir.clone();
    let tmp = temp_dir("hf-pycheck");
    let base = keep.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let want = expected("tiny_a");
    let (b, t) = (want.b, want.t);
    let (cfg, params) = load(&fixture("tiny_a"), Some(32));
    let mut model = Gpt::from_params(cfg, params, b, t).unwrap();
    let targets = shifted_targets(&want.ids, b, t);
    let mut opt = AdamW::new(
        &model.layout.decay_ranges(),
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
    );
    let first = model.forward(&want.ids, &targets, b, t);
    for _ in 0..5 {
        model.zero_grad();
        model.forward(&want.ids, &targets, b, t);
        model.backward();
        opt.step(&mut model.params, &model.grads, 1e-2);
    }
    model.set_training(false);
    let loss = model.forward(&want.ids, &targets, b, t);
    assert!(
        loss < first - 0.1,
        "training moved the loss from {first} to {loss}"
    );
    check_case(&base, "", &mut model, &char_meta(259), &want.ids, b, t);

    let mut gpt2 = random_model(true, 50257, 3);
    let ids: Vec<u32> = (0..2 * 16).map(|i| (i * 7919 % 50257) as u32).collect();
    check_case(
        &base,
        "_gpt2",
        &mut gpt2,
        &nanogpt::model_source::gpt2_meta(Path::new("test")),
        &ids,
        2,
        16,
    );
    if keep.is_some() {
        println!(
            "wrote {0}/hf, {0}/hf_gpt2 and their expected*.safetensors; now run \
             python scripts/reference/hf_fixtures.py --check-export {0}",
            base.display()
        );
    }
}

/// Saves `model` as a checkpoint, exports it with the command to `base/hf{tag}`,
/// writes nanogpt's logits and loss on `ids` to `base/expected{tag}.safetensors`.
fn check_case(
    base: &Path,
    tag: &str,
    model: &mut Gpt,
    meta: &Meta,
    ids: &[u32],
    b: usize,
    t: usize,
) {
    let (out, hf) = (format!("out{tag}"), format!("hf{tag}"));
    let _ = std::fs::remove_dir_all(base.join(&hf));
    save_checkpoint(&base.join(&out), model, meta);
    ok(base, &["export", "--from", &out, "--to", &hf]);
    model.set_training(false);
    let logits = model.logits(ids, b, t);
    let loss = model.forward(ids, &shifted_targets(ids, b, t), b, t);
    let id_bytes: Vec<u8> = ids.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
    let logit_bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let loss_bytes = loss.to_le_bytes().to_vec();
    let v = model.config().vocab_size;
    let tensors = vec![
        (
            "ids",
            TensorView::new(Dtype::I32, vec![b, t], &id_bytes).unwrap(),
        ),
        (
            "logits",
            TensorView::new(Dtype::F32, vec![b, t, v], &logit_bytes).unwrap(),
        ),
        (
            "loss",
            TensorView::new(Dtype::F32, vec![], &loss_bytes).unwrap(),
        ),
    ];
    // GPT-2's tokenizer (tiktoken's ranks) on a test text, for the exported
    // tokenizer files to match.
    let text = &nanogpt::data::SHAKESPEARE_TEXT[..2000];
    let text_ids: Vec<u8> = nanogpt::data::Tokenizer::gpt2()
        .encode(text)
        .unwrap()
        .iter()
        .flat_map(|&x| (x as i32).to_le_bytes())
        .collect();
    let mut tensors = tensors;
    tensors.push((
        "text_ids",
        TensorView::new(Dtype::I32, vec![text_ids.len() / 4], &text_ids).unwrap(),
    ));
    let metadata = HashMap::from([("text".to_string(), text.to_string())]);
    let path = base.join(format!("expected{tag}.safetensors"));
    safetensors::serialize_to_file(tensors, &Some(metadata), &path).unwrap();
    // The export reloads here to the same logits.
    let (cfg2, params2) = load(&base.join(&hf), None);
    let again = Gpt::from_params(cfg2, params2, b, t)
        .unwrap()
        .logits(ids, b, t);
    assert_eq!(again, logits);
}

// ---------------------------------------------------------------------------------
// Loader errors

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn open_err(path: &Path) -> String {
    match Pretrained::open(path.to_str().unwrap()).and_then(|p| p.load(None, 0.0)) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn edit_config(dir: &Path, key: &str, value: serde_json::Value) {
    let path = dir.join("config.json");
    let mut json = read_json(&path);
    json[key] = value;
    std::fs::write(&path, json.to_string()).unwrap();
}

/// Rewrites `dir/model.safetensors` through `edit` of its tensors (as f32).
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::F32);
            let data = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, view.shape().to_vec(), data)
        })
        .collect();
    edit(&mut tensors);
    let raw: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, d)| (n, s, d.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView)> = raw
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, &Some(meta), &path).unwrap();
}

#[test]
fn missing_files_are_named() {
    let dir = temp_dir("hf-missing");
    let model = dir.path().join("m");
    copy_dir(&fixture("tiny_a"), &model);
    std::fs::remove_file(model.join("config.json")).unwrap();
    let err = open_err(&model);
    assert!(
        err.contains("config.json") && err.contains("cannot read"),
        "{err}"
    );

    copy_dir(&fixture("tiny_a"), &model);
    std::fs::remove_file(model.join("model.safetensors")).unwrap();
    let err = open_err(&model);
    assert!(
        err.contains("no model.safetensors") && err.contains("huggingface-cli download"),
        "{err}"
    );

    let sharded = dir.path().join("s");
    copy_dir(&fixture("tiny_c_sharded"), &sharded);
    std::fs::remove_file(sharded.join("model-00002-of-00004.safetensors")).unwrap();
    let err = open_err(&sharded);
    assert!(
        err.contains("model-00002-of-00004.safetensors") && err.contains("missing"),
        "{err}"
    );

    let err = open_err(&dir.path().join("nowhere"));
    assert!(err.contains("not a file or directory"), "{err}");

    // A training run's out_dir is not a pretrained model: say what to do instead.
    let run = dir.path().join("run");
    save_checkpoint(&run, &random_model(false, 50, 1), &char_meta(50));
    let err = open_err(&run);
    assert!(
        err.contains("init_from=resume") && err.contains("nanogpt export"),
        "{err}"
    );
}

#[test]
fn pickle_is_refused_with_the_way_to_convert() {
    let dir = temp_dir("hf-pickle");
    let model = dir.path().join("m");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        fixture("tiny_a").join("config.json"),
        model.join("config.json"),
    )
    .unwrap();
    // Not even a valid pickle: it must never be opened.
    std::fs::write(model.join("pytorch_model.bin"), b"\x80\x02 not parsed").unwrap();
    for path in [model.clone(), model.join("pytorch_model.bin")] {
        let err = open_err(&path);
        assert!(err.contains("pickle"), "{err}");
        assert!(err.contains("save_pretrained"), "{err}");
        assert!(err.contains("arbitrary code"), "{err}");
    }
}

#[test]
fn config_the_engine_cannot_represent_is_refused() {
    let dir = temp_dir("hf-config");
    let cases = [
        ("activation_function", serde_json::json!("relu"), "\"relu\""),
        (
            "layer_norm_epsilon",
            serde_json::json!(1e-6),
            "layer_norm_epsilon",
        ),
        ("model_type", serde_json::json!("bloom"), "\"bloom\""),
        ("n_inner", serde_json::json!(100), "n_inner"),
        (
            "scale_attn_by_inverse_layer_idx",
            serde_json::json!(true),
            "scale_attn_by_inverse_layer_idx",
        ),
    ];
    for (i, (key, value, want)) in cases.into_iter().enumerate() {
        let model = dir.path().join(format!("m{i}"));
        copy_dir(&fixture("tiny_a"), &model);
        edit_config(&model, key, value);
        let err = open_err(&model);
        assert!(
            err.contains(want) && err.contains("cannot be loaded"),
            "{key}: {err}"
        );
    }
    let err = match Pretrained::open(fixture("tiny_a").to_str().unwrap())
        .unwrap()
        .load(Some(65), 0.0)
    {
        Err(e) => e.to_string(),
        Ok(_) => panic!("block_size 65 > n_positions 64 accepted"),
    };
    assert!(err.contains("n_positions 64"), "{err}");
}

#[test]
fn weights_that_do_not_fit_the_config_are_refused() {
    let dir = temp_dir("hf-weights");
    let model = dir.path().join("shape");
    copy_dir(&fixture("tiny_a"), &model);
    // nn.Linear orientation instead of Conv1D.
    edit_weights(&model, |ts| {
        let t = ts
            .iter_mut()
            .find(|t| t.0 == "transformer.h.1.attn.c_attn.weight")
            .unwrap();
        t.1 = vec![96, 32];
    });
    let err = open_err(&model);
    assert!(
        err.contains("transformer.h.1.attn.c_attn.weight")
            && err.contains("[96, 32]")
            && err.contains("[32, 96]"),
        "{err}"
    );

    let model = dir.path().join("vocab");
    copy_dir(&fixture("tiny_a"), &model);
    edit_config(&model, "vocab_size", serde_json::json!(300));
    let err = open_err(&model);
    assert!(
        err.contains("wte.weight") && err.contains("[259, 32]") && err.contains("[300, 32]"),
        "{err}"
    );

    let model = dir.path().join("missing");
    copy_dir(&fixture("tiny_a"), &model);
    edit_weights(&model, |ts| {
        ts.retain(|t| t.0 != "transformer.h.1.mlp.c_fc.bias")
    });
    let err = open_err(&model);
    assert!(err.contains("no tensor h.1.mlp.c_fc.bias"), "{err}");

    let model = dir.path().join("layers");
    copy_dir(&fixture("tiny_a"), &model);
    edit_config(&model, "n_layer", serde_json::json!(1));
    let err = open_err(&model);
    assert!(
        err.contains("not part of a GPT-2") && err.contains("transformer.h.1."),
        "{err}"
    );

    let model = dir.path().join("untied");
    copy_dir(&fixture("tiny_a"), &model);
    edit_weights(&model, |ts| {
        let wte = ts.iter().find(|t| t.0 == "transformer.wte.weight").unwrap();
        let mut head = wte.clone();
        head.0 = "lm_head.weight".into();
        head.2[0] += 1.0;
        ts.push(head);
    });
    edit_config(&model, "tie_word_embeddings", serde_json::json!(false));
    let err = open_err(&model);
    assert!(err.contains("lm_head.weight differs"), "{err}");

    let model = dir.path().join("truncated");
    copy_dir(&fixture("tiny_a"), &model);
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    std::fs::write(model.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let err = open_err(&model);
    assert!(
        err.contains("not a valid safetensors file") && err.contains("download it again"),
        "{err}"
    );
}

#[test]
fn a_lone_safetensors_file_loads_with_or_without_config_beside_it() {
    let want = expected("tiny_a");
    let file = fixture("tiny_a").join("model.safetensors");
    let (cfg, params) = load(&file, None);
    let logits = Gpt::from_params(cfg, params, want.b, want.t)
        .unwrap()
        .logits(&want.ids, want.b, want.t);
    max_logit_error(&logits, &want.logits);
    // Without config.json the heads are taken as 64 wide: C=32 cannot say.
    let dir = temp_dir("hf-lone");
    std::fs::copy(&file, dir.path().join("w.safetensors")).unwrap();
    let err = open_err(&dir.path().join("w.safetensors"));
    assert!(err.contains("config.json"), "{err}");
}

// ---------------------------------------------------------------------------------
// Names: local directory, Hugging Face cache, download

/// A fake hub cache holding `fixture` as repository `id`.
fn fake_cache(root: &Path, id: &str, fixture_name: &str, commit: &str) -> PathBuf {
    let repo = root.join(format!("models--{}", id.replace('/', "--")));
    copy_dir(&fixture(fixture_name), &repo.join("snapshots").join(commit));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    repo.join("snapshots").join(commit)
}

fn offline(cache: &Path) -> HubEnv {
    HubEnv {
        cache: Some(cache.to_path_buf()),
        offline: true,
        endpoint: None,
    }
}

#[test]
fn names_resolve_through_the_hugging_face_cache() {
    let cache = temp_dir("hf-cache");
    let snap = fake_cache(cache.path(), "gpt2", "tiny_a", "abc123");
    // An older, incomplete snapshot must not be chosen.
    std::fs::create_dir_all(cache.path().join("models--gpt2/snapshots/old")).unwrap();
    let located = nanogpt::hf::resolve::locate("gpt2", &offline(cache.path())).unwrap();
    assert_eq!(located, Located::Dir(snap));
    let m = Pretrained::open_with("gpt2", &offline(cache.path())).unwrap();
    assert_eq!(m.config.vocab_size(), 259);

    // The presets' new home, openai-community/…, is found for the short name too.
    let cache2 = temp_dir("hf-cache2");
    let snap2 = fake_cache(
        cache2.path(),
        "openai-community/gpt2-medium",
        "tiny_c_sharded",
        "f00d",
    );
    let located = nanogpt::hf::resolve::locate("gpt2-medium", &offline(cache2.path())).unwrap();
    assert_eq!(located, Located::Dir(snap2));

    // A snapshot with only pickle weights: the pickle message, not "not found".
    let cache3 = temp_dir("hf-cache3");
    let snap3 = cache3.path().join("models--gpt2/snapshots/1");
    std::fs::create_dir_all(&snap3).unwrap();
    std::fs::copy(
        fixture("tiny_a").join("config.json"),
        snap3.join("config.json"),
    )
    .unwrap();
    std::fs::write(snap3.join("pytorch_model.bin"), b"x").unwrap();
    let err = format!(
        "{:#}",
        Pretrained::open_with("gpt2", &offline(cache3.path()))
            .err()
            .unwrap()
    );
    assert!(err.contains("pickle"), "{err}");
}

#[test]
fn a_name_not_found_offline_says_where_it_looked_and_what_to_do() {
    let cache = temp_dir("hf-empty-cache");
    let err = format!(
        "{:#}",
        Pretrained::open_with("gpt2-xl", &offline(cache.path()))
            .err()
            .unwrap()
    );
    for want in [
        "models--gpt2-xl/snapshots",
        "models--openai-community--gpt2-xl/snapshots",
        "HF_HUB_OFFLINE",
        "huggingface-cli download gpt2-xl",
    ] {
        assert!(err.contains(want), "{want} not in: {err}");
    }
}

#[test]
fn commands_find_names_in_the_cache_given_by_the_environment() {
    let cache = temp_dir("hf-env-cache");
    fake_cache(cache.path(), "gpt2", "tiny_b_legacy", "0123");
    let want = expected("tiny_b_legacy");
    let env = [
        ("HF_HUB_CACHE", cache.path().to_str().unwrap()),
        ("HF_HUB_OFFLINE", "1"),
    ];
    let mut cmd = command(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        [
            "eval",
            "--init-from",
            "gpt2",
            "--data",
            hf_dir().join("tokens.bin").to_str().unwrap(),
            "--block-size",
            &want.eval_block_size.to_string(),
            "--json",
        ],
    );
    let (out, _) = succeeds(cmd.envs(env));
    let loss = serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["loss"]
        .as_f64()
        .unwrap();
    assert!((loss - want.eval_loss).abs() / want.eval_loss <= LOSS_RTOL);
    // With HF_HOME instead: $HF_HOME/hub.
    let home = temp_dir("hf-hf-home");
    fake_cache(&home.path().join("hub"), "gpt2", "tiny_b_legacy", "0123");
    let located = {
        let env = HubEnv {
            cache: Some(home.path().join("hub")),
            offline: true,
            endpoint: None,
        };
        nanogpt::hf::resolve::locate("gpt2", &env).unwrap()
    };
    assert!(matches!(located, Located::Dir(_)));
    let args = ["eval", "--init-from", "gpt2-large", "--data", "x.bin"];
    let mut cmd = command(Path::new(env!("CARGO_MANIFEST_DIR")), args);
    let err = refused(&run(cmd
        .env("HF_HOME", home.path())
        .env("HF_HUB_OFFLINE", "1")));
    assert!(
        err.contains(&format!("{}/hub/models--gpt2-large", home.path().display())),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------
// Fine-tuning through the command line

#[test]
fn fine_tune_from_a_hugging_face_directory_then_export() {
    let dir = temp_dir("hf-finetune");
    let root = dir.path();
    // A GPT-2-vocabulary model (tiny width) as a Hugging Face directory.
    let model = random_model(true, 50257, 9);
    nanogpt::hf::export(
        &model.params,
        model.config(),
        Some(&Tokenizer::gpt2()),
        &root.join("pretrained"),
    )
    .unwrap();
    prepare_gpt2_text(root, 60);
    let args = [
        "train",
        "init_from=pretrained",
        "dataset=data",
        "out_dir=out",
        "block_size=8",
        "batch_size=2",
        "max_iters=2",
        "eval_interval=2",
        "eval_iters=2",
        "learning_rate=1e-3",
        "decay_lr=false",
        "dropout=0.1",
        "n_layer=6",
    ];
    let (stdout, stderr) = succeeds(&mut command(root, args));
    let log = stdout + &stderr;
    assert!(log.contains("ignoring n_layer = 6 (it has 2)"), "{log}");
    let state = read_json(&root.join("out/ckpt.json"));
    assert_eq!(state["model"]["n_embd"], 32);
    assert_eq!(state["model"]["n_layer"], 2);
    assert_eq!(state["model"]["block_size"], 8);
    assert_eq!(state["model"]["bias"], true);
    assert_eq!(state["tokenizer"]["tokenizer"], "gpt2");

    let stdout = ok(root, &["export", "--from", "out", "--to", "hf"]);
    assert!(stdout.contains("vocab.json"), "{stdout}");
    let (cfg, _) = load(&root.join("hf"), None);
    assert_eq!((cfg.vocab_size, cfg.block_size), (50257, 8));
    let sample = ok(
        root,
        &[
            "sample",
            "--init-from",
            "hf",
            "--start",
            "To be",
            "--num-samples",
            "1",
            "--max-new-tokens",
            "4",
        ],
    );
    assert!(sample.starts_with("To be"), "{sample}");

    // A char-level dataset cannot be fine-tuned from GPT-2.
    std::fs::write(root.join("chars.txt"), "abcabcabc\n".repeat(100)).unwrap();
    ok(
        root,
        &[
            "prepare",
            "chars.txt",
            "--out",
            "cdata",
            "--tokenizer",
            "char",
        ],
    );
    let err = refused(&run(&mut command(
        root,
        [
            "train",
            "init_from=pretrained",
            "dataset=cdata",
            "out_dir=out2",
            "block_size=8",
        ],
    )));
    assert!(err.contains("--tokenizer gpt2"), "{err}");
    let err = refused(&run(&mut command(
        root,
        [
            "train",
            "init_from=pretrained",
            "dataset=data",
            "out_dir=out3",
            "block_size=64",
        ],
    )));
    assert!(err.contains("n_positions 16"), "{err}");
}
