//! LoRA fine-tuning through the `nanogpt` binary: resuming exactly, the base's
//! identity, the merge that eval, sample and export see, and bad `lora_*` keys.
//! The adapters' numerics against PEFT are in `lora_golden` below.

use std::path::Path;

mod common;
use common::{
    command, fails, fixture, metric, ok, prepare_gpt2_text, read_json, refused, run, succeeds,
    temp_dir,
};
use common::{TINY_BATCH, TINY_MODEL, TINY_SHAKESPEARE};

/// Adapters on every kind of layer, with both dropouts on, every step logged.
const LORA: [&str; 5] = [
    "lora_rank=4",
    "lora_alpha=8",
    "lora_dropout=0.1",
    "lora_targets=c_attn,attn.c_proj,c_fc,mlp.c_proj",
    "lr_decay_iters=8",
];

fn train(dir: &Path, extra: &[&str]) -> (String, String) {
    let args = [
        &["train"],
        &TINY_SHAKESPEARE[..],
        &LORA,
        &["threads=1"],
        extra,
    ]
    .concat();
    succeeds(&mut command(dir, args))
}

/// Every step's loss and every evaluation, as bits.
fn trajectory(out_dir: &Path) -> Vec<(u64, u32)> {
    ["loss", "val_loss", "grad_norm"]
        .iter()
        .flat_map(|key| metric(out_dir, key))
        .map(|(iter, v)| (iter, (v as f32).to_bits()))
        .collect()
}

#[test]
fn a_resumed_lora_run_repeats_the_uninterrupted_one() {
    for dtype in ["float32", "bfloat16"] {
        let dir = temp_dir("lora-resume");
        let d = dir.path();
        let dt = format!("dtype={dtype}");
        let whole = ["out_dir=whole", "max_iters=8", "eval_interval=4", &dt];
        train(d, &whole);
        // Stopped after iteration 4 with a checkpoint that resumes at 5.
        let part = ["out_dir=part", "max_iters=4", "eval_interval=4", &dt];
        train(d, &[&part[..], &["ckpt_interval=5"]].concat());
        let resumed = ["out_dir=part", "max_iters=8", "eval_interval=4", &dt];
        let (stdout, _) = train(d, &[&resumed[..], &["init_from=resume"]].concat());
        assert!(stdout.contains("at iteration 5"), "{stdout}");
        let (a, b) = (trajectory(&d.join("whole")), trajectory(&d.join("part")));
        assert_eq!(a.len(), 9 + 3 + 9, "{dtype}: steps, evaluations, norms");
        assert_eq!(a, b, "{dtype}: the resumed run differs");
        // The checkpoint holds the adapters and their moments, and names the base.
        let state = read_json(&d.join("part/ckpt-000005.json"));
        assert_eq!(state["lora"]["config"]["rank"], 4);
        assert_eq!(state["lora"]["base"], "scratch");
        assert!(state["lora"]["base_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("fnv64:"));
    }
}

#[test]
fn a_lora_checkpoint_is_small_and_evaluates_as_its_merge() {
    let dir = temp_dir("lora-merge");
    let d = dir.path();
    train(d, &["out_dir=run", "max_iters=6", "eval_interval=6"]);
    let ckpt = std::fs::metadata(d.join("run/ckpt.safetensors"))
        .unwrap()
        .len();
    // 2 layers × 2048 adapter floats (A and B of 4 targets at r = 4), with two
    // moments: 49 kB plus the header; the whole model's would be ~320 kB.
    assert!((49_152..64_000).contains(&ckpt), "checkpoint {ckpt} bytes");
    // The merged export is the whole model, and evaluates like the run's checkpoint.
    let out = ok(d, &["export", "--from", "run", "--to", "hf"]);
    assert!(out.contains("exported"), "{out}");
    // Tokens of the character vocabulary (65), as a nanoGPT .bin file.
    let tokens: Vec<u8> = (0..400u16)
        .flat_map(|i| (i * 7 % 65).to_le_bytes())
        .collect();
    std::fs::write(d.join("val.bin"), tokens).unwrap();
    let eval = |src: &str| -> f64 {
        let args = ["eval", "--init-from", src, "--data", "val.bin", "--json"];
        let out = ok(d, &args);
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    let (lora, merged) = (eval("run"), eval("hf"));
    assert!((lora - merged).abs() < 1e-5, "{lora} vs {merged}");
    let sample = ok(
        d,
        &["sample", "--init-from", "run", "--max-new-tokens", "8"],
    );
    assert!(!sample.is_empty());
}

#[test]
fn lora_keys_are_checked() {
    let dir = temp_dir("lora-keys");
    let d = dir.path();
    let base = [&["train"], &TINY_MODEL[..], &TINY_BATCH, &["max_iters=1"]].concat();
    for (key, names) in [
        ("lora_targets=c_attn,q_proj", "lora_targets"),
        ("lora_dropout=1.5", "lora_dropout"),
        ("lora_alpha=-1", "lora_alpha"),
    ] {
        let args = [&base[..], &["lora_rank=2", key]].concat();
        let err = refused(&run(&mut command(d, args)));
        assert!(err.contains(names), "{key}: {err}");
    }
    let err = fails(d, &[&base[..], &["lora_rank=x"]].concat());
    assert!(err.contains("lora_rank"), "{err}");
}

/// The adapters (and their state) in the checkpoint of `out_dir`.
fn adapters(out_dir: &Path) -> (serde_json::Value, Vec<f32>) {
    let ckpt = nanogpt::checkpoint::Checkpoint::open(out_dir).unwrap();
    let state = ckpt.state.lora.clone().expect("a LoRA checkpoint");
    let layout = nanogpt::model::lora::LoraLayout::new(&ckpt.state.model, &state.config);
    let mut weights = vec![0.0; layout.params.len];
    ckpt.load_params(&layout.params, &mut weights).unwrap();
    (serde_json::to_value(&state.config).unwrap(), weights)
}

/// A base that is a Hugging Face directory: changed after training, the adapters'
/// run refuses to resume, and eval refuses to merge them.
#[test]
fn a_changed_base_is_refused() {
    let dir = temp_dir("lora-base");
    let d = dir.path();
    let write_base = |seed: u64| {
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
        model.init_gpt2(seed);
        let gpt2 = nanogpt::data::Tokenizer::gpt2();
        let kind = Some(&gpt2);
        nanogpt::hf::export(&model.params, model.config(), kind, &d.join("base")).unwrap();
    };
    write_base(1);
    prepare_gpt2_text(d, 40);
    let args = [
        "train",
        "init_from=base",
        "dataset=data",
        "out_dir=out",
        "block_size=8",
        "batch_size=2",
        "max_iters=2",
        "eval_interval=2",
        "eval_iters=1",
        "lora_rank=2",
        "threads=1",
    ];
    succeeds(&mut command(d, args));
    let state = read_json(&d.join("out/ckpt.json"));
    assert_eq!(state["lora"]["base"], "base");
    // Its adapters as a PEFT directory continue training on the same base: after a
    // step too small to change an f32 (lr 1e-30), the new run's checkpoint holds them.
    ok(
        d,
        &["export", "--from", "out", "--to", "peft", "--adapter-only"],
    );
    let cont = [
        "out_dir=cont",
        "adapter=peft",
        "max_iters=1",
        "eval_interval=1",
    ];
    let tiny_step = ["learning_rate=1e-30", "decay_lr=false", "lora_rank=3"];
    let cont = [
        &args[..],
        &cont,
        &tiny_step,
        &["always_save_checkpoint=true"],
    ]
    .concat();
    let (_, stderr) = succeeds(&mut command(d, cont));
    assert!(
        stderr.contains("ignoring the config's lora_* keys"),
        "{stderr}"
    );
    assert_eq!(adapters(&d.join("cont")), adapters(&d.join("out")));
    // A whole-model run has no adapters to export alone.
    let whole = [&args[..9], &["out_dir=whole", "threads=1"]].concat();
    succeeds(&mut command(d, whole));
    let err = fails(
        d,
        &["export", "--from", "whole", "--to", "x", "--adapter-only"],
    );
    assert!(
        err.contains("holds a whole model, not LoRA adapters"),
        "{err}"
    );
    let bad = [&args[..], &["out_dir=o2", "adapter=nowhere"]].concat();
    let err = refused(&run(&mut command(d, bad)));
    assert!(err.contains("adapter=nowhere"), "{err}");
    write_base(2);
    let resume = [&args[..], &["init_from=resume", "max_iters=4"]].concat();
    let err = refused(&run(&mut command(d, resume)));
    assert!(err.contains("LoRA adapters trained on base base"), "{err}");
    assert!(err.contains("restore the base weights"), "{err}");
    let err = refused(&run(&mut command(
        d,
        ["eval", "--init-from", "out", "--data", "text.txt"],
    )));
    assert!(err.contains("fingerprint"), "{err}");
}

// ---------------------------------------------------------------------------------
// Against PEFT (tests/fixtures/lora, scripts/reference/lora_fixtures.py)

mod lora_golden {
    use super::common::{fixture, temp_dir};
    use nanogpt::hf::adapter::{read_adapter, write_adapter, PREFIX};
    use nanogpt::model::Gpt;
    use safetensors::SafeTensors;

    fn f32s(st: &SafeTensors, key: &str) -> Vec<f32> {
        let view = st
            .tensor(key)
            .unwrap_or_else(|_| panic!("fixture lacks {key}"));
        view.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn ints(st: &SafeTensors, key: &str) -> Vec<i32> {
        let view = st.tensor(key).unwrap();
        view.data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    /// `max |got − want| / max |want|`, the relative error of a whole tensor.
    fn rel_err(got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len());
        let diff = got
            .iter()
            .zip(want)
            .map(|(g, w)| (*g as f64 - *w as f64).abs())
            .fold(0.0, f64::max);
        let scale = want.iter().map(|w| (*w as f64).abs()).fold(0.0, f64::max);
        diff / scale
    }

    /// The fixture's base with PEFT's adapters, as nanogpt loads them.
    fn adapted(b: usize, t: usize) -> Gpt {
        let base = fixture("lora/base");
        let pretrained = nanogpt::hf::Pretrained::open(base.to_str().unwrap()).unwrap();
        let (cfg, params) = pretrained.load(None, 0.0).unwrap();
        let adapter = read_adapter(&fixture("lora/adapter"), &cfg).unwrap();
        let c = &adapter.config;
        assert_eq!((c.rank, c.alpha, c.targets.len()), (4, 12.0, 4));
        let gpt = Gpt::from_params(cfg, params, b, t).unwrap();
        let mut gpt = gpt.with_lora(adapter.config.clone(), ("base", 0), 0);
        gpt.params.copy_from_slice(&adapter.weights);
        gpt
    }

    #[test]
    fn golden_logits_loss_and_adapter_gradients_match_peft() {
        let bytes = std::fs::read(fixture("lora/expected.safetensors")).unwrap();
        let want = SafeTensors::deserialize(&bytes).unwrap();
        let (b, t) = (2, 16);
        let mut gpt = adapted(b, t);
        let ids: Vec<u32> = ints(&want, "ids").iter().map(|&i| i as u32).collect();
        let targets = ints(&want, "targets");
        gpt.set_training(false);
        let logits = gpt.logits(&ids, b, t);
        let err = rel_err(&logits, &f32s(&want, "logits"));
        assert!(err <= 1e-5, "logits differ from PEFT's by {err:.2e}");
        gpt.set_training(true);
        gpt.zero_grad();
        let loss = gpt.forward(&ids, &targets, b, t);
        gpt.backward();
        let want_loss = f32s(&want, "loss")[0];
        assert!(
            ((loss - want_loss) / want_loss).abs() <= 1e-5,
            "{loss} vs {want_loss}"
        );
        let mut checked = 0;
        for tensor in gpt.layout.tensors.clone() {
            let key = format!("{PREFIX}{}.grad", tensor.name);
            let err = rel_err(&gpt.grads[tensor.range()], &f32s(&want, &key));
            assert!(err <= 1e-5, "{key}: differs from PEFT's by {err:.2e}");
            checked += 1;
        }
        assert_eq!(checked, 16, "A and B of 4 targets in 2 layers");
    }

    /// The adapter written back is PEFT's file: the same tensors, names, shapes and
    /// values, and a config naming the same settings.
    #[test]
    fn an_exported_adapter_is_what_peft_saves() {
        let gpt = adapted(1, 4);
        let frozen = gpt.frozen().unwrap();
        let dir = temp_dir("lora-adapter");
        let out = dir.path().join("adapter");
        write_adapter(&out, &frozen.state, &frozen.adapters, &gpt.params).unwrap();
        let keys = [
            "peft_type",
            "r",
            "fan_in_fan_out",
            "bias",
            "use_rslora",
            "use_dora",
        ];
        crate::common::assert_same_adapter(&out, &fixture("lora/adapter"), &keys);
    }
}

/// `nanogpt eval` of PEFT's adapter on its base (`--adapter`) gives PEFT's number,
/// and a LoRA run's exported adapter evaluates on its base as the run's checkpoint.
#[test]
fn peft_adapters_evaluate_through_the_adapter_flag() {
    let bytes = std::fs::read(fixture("lora/expected.safetensors")).unwrap();
    let want = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = want.tensor("eval_loss").unwrap();
    let want = f64::from_le_bytes(view.data()[..8].try_into().unwrap());
    let dir = temp_dir("lora-adapter-flag");
    let (base, adapter) = (fixture("lora/base"), fixture("lora/adapter"));
    let tokens = fixture("lora/tokens.bin");
    let args = [
        "eval",
        "--init-from",
        base.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--data",
        tokens.to_str().unwrap(),
        "--block-size",
        "16",
        "--json",
    ];
    let out = ok(dir.path(), &args);
    let got = serde_json::from_str::<serde_json::Value>(&out).unwrap()["loss"]
        .as_f64()
        .unwrap();
    assert!(((got - want) / want).abs() < 1e-5, "{got} vs PEFT's {want}");
    // Without the adapter the base alone scores differently.
    let plain = ok(dir.path(), &[&args[..3], &args[5..]].concat());
    let plain = serde_json::from_str::<serde_json::Value>(&plain).unwrap()["loss"]
        .as_f64()
        .unwrap();
    assert!((plain - want).abs() > 1e-3, "{plain} vs {want}");
}

/// `nanogpt chat --adapter` loads the adapter as `sample` does: a missing one is
/// refused naming its file, and PEFT's fixture merges into its base (an empty stdin
/// then ends the chat cleanly).
#[test]
fn chat_takes_a_peft_adapter() {
    let dir = temp_dir("lora-chat-adapter");
    let base = fixture("lora/base");
    let chat = |adapter: &str| {
        let out = command(
            dir.path(),
            [
                "chat",
                "--init-from",
                base.to_str().unwrap(),
                "--adapter",
                adapter,
            ],
        )
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
        (out.status.code(), common::text(&out.stderr))
    };
    let (code, err) = chat("nowhere");
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nowhere/adapter_config.json"), "{err}");
    let (code, err) = chat(fixture("lora/adapter").to_str().unwrap());
    assert_eq!(code, Some(0), "{err}");
}

// ---------------------------------------------------------------------------------
// Adapters and their bases (issue 38)

/// A tiny GPT-2-vocabulary model (2 layers, width `n_embd`, initialised from `seed`)
/// exported as a Hugging Face directory `d/name`.
fn gpt2_base(d: &Path, name: &str, seed: u64, n_embd: usize) {
    let cfg = nanogpt::model::ModelConfig {
        vocab_size: 50257,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd,
        bias: true,
        dropout: 0.0,
        llama: None,
    };
    let mut model = nanogpt::model::Gpt::new(cfg, 1, 1).unwrap();
    model.init_gpt2(seed);
    let gpt2 = nanogpt::data::Tokenizer::gpt2();
    let kind = Some(&gpt2);
    let dir = d.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    nanogpt::hf::export(&model.params, model.config(), kind, &dir).unwrap();
}

/// `train init_from=BASE dataset=data out_dir=OUT` with tiny LoRA settings, then `extra`.
fn lora_args<'a>(base: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<String> {
    let fixed = [
        format!("init_from={base}"),
        "dataset=data".into(),
        format!("out_dir={out}"),
        "block_size=8".into(),
        "batch_size=2".into(),
        "max_iters=2".into(),
        "eval_interval=2".into(),
        "eval_iters=1".into(),
        "lora_rank=2".into(),
        "threads=1".into(),
    ];
    let mut args = vec!["train".to_string()];
    args.extend(fixed);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A copy of PEFT's fixture adapter in `dir`, its config changed by `edit`.
fn fixture_adapter(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    std::fs::create_dir_all(dir).unwrap();
    let src = fixture("lora/adapter");
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut config = read_json(&src.join("adapter_config.json"));
    edit(&mut config);
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
}

/// `nanogpt eval --json` of the fixture base with `adapter` over the fixture tokens.
fn fixture_eval(d: &Path, adapter: &str) -> std::process::Output {
    let (base, tokens) = (fixture("lora/base"), fixture("lora/tokens.bin"));
    let args = [
        "eval",
        "--init-from",
        base.to_str().unwrap(),
        "--adapter",
        adapter,
        "--data",
        tokens.to_str().unwrap(),
        "--block-size",
        "16",
        "--json",
    ];
    run(&mut command(d, args))
}

/// An adapter whose config selects fewer modules or layers than its file holds is
/// applied exactly where PEFT applies it: the losses of `eval --adapter` match PEFT's
/// for each selection (tests/fixtures/lora/selection.json, made by
/// scripts/reference/peft_selection.py). It used to apply every tensor of the file.
/// Such an adapter is refused for further training (adapters here span every layer).
#[test]
fn peft_applies_an_adapter_where_its_config_says() {
    let dir = temp_dir("lora-selection");
    let d = dir.path();
    let want = read_json(&fixture("lora/selection.json"));
    for variant in want["variants"].as_array().unwrap() {
        let name = variant["name"].as_str().unwrap();
        let adapter = d.join("ad");
        let _ = std::fs::remove_dir_all(&adapter);
        fixture_adapter(&adapter, |c| {
            for (k, v) in variant["config"].as_object().unwrap() {
                c[k] = v.clone();
            }
        });
        let out = fixture_eval(d, "ad");
        let stderr = common::text(&out.stderr);
        assert!(out.status.success(), "{name}: {stderr}");
        let got = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["loss"]
            .as_f64()
            .unwrap();
        let peft = variant["eval_loss"].as_f64().unwrap();
        assert!(
            ((got - peft) / peft).abs() < 1e-5,
            "{name}: {got} vs PEFT's {peft}"
        );
    }
    // Training continues only adapters that cover every layer.
    gpt2_base(d, "base", 1, 8);
    prepare_gpt2_text(d, 40);
    succeeds(&mut command(d, lora_args("base", "out", &[])));
    ok(
        d,
        &["export", "--from", "out", "--to", "peft", "--adapter-only"],
    );
    let config = d.join("peft/adapter_config.json");
    let mut json = read_json(&config);
    json["layers_to_transform"] = serde_json::json!([1]);
    std::fs::write(&config, json.to_string()).unwrap();
    let args = lora_args("base", "cont", &["adapter=peft"]);
    let err = refused(&run(&mut command(d, args)));
    assert!(
        err.contains("adapter=peft: its config puts adapters on some layers only"),
        "{err}"
    );
}

/// Sets the first value of the first tensor of the safetensors file `path` to `value`.
fn poison(path: &Path, value: f32) {
    let mut bytes = std::fs::read(path).unwrap();
    let at = {
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names = st.names();
        names.sort();
        let view = st.tensor(names[0]).unwrap();
        view.data().as_ptr() as usize - bytes.as_ptr() as usize
    };
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

/// Adapters holding NaN or infinity are refused on load by eval, sample, export and
/// train, as damaged checkpoints are (eval used to report loss NaN with exit 0, export
/// to write NaN weights).
#[test]
fn adapters_holding_nan_are_refused() {
    let dir = temp_dir("lora-nan");
    let d = dir.path();
    fixture_adapter(&d.join("ad"), |_| {});
    poison(&d.join("ad/adapter_model.safetensors"), f32::NAN);
    let base = fixture("lora/base");
    let base = base.to_str().unwrap();
    let phrase = "holds NaN or infinite values; the adapter is damaged";
    let err = refused(&fixture_eval(d, "ad"));
    assert!(err.contains(phrase), "eval: {err}");
    let sample = [
        "sample",
        "--init-from",
        base,
        "--adapter",
        "ad",
        "--max-new-tokens",
        "2",
    ];
    let err = refused(&run(&mut command(d, sample)));
    assert!(err.contains(phrase), "sample: {err}");
    let export = [
        "export",
        "--from",
        base,
        "--adapter",
        "ad",
        "--to",
        "merged",
    ];
    let err = refused(&run(&mut command(d, export)));
    assert!(err.contains(phrase), "export: {err}");
    assert!(!d.join("merged").exists());
    gpt2_base(d, "base", 1, 8);
    prepare_gpt2_text(d, 40);
    succeeds(&mut command(d, lora_args("base", "out", &[])));
    ok(
        d,
        &["export", "--from", "out", "--to", "peft", "--adapter-only"],
    );
    poison(&d.join("peft/adapter_model.safetensors"), f32::INFINITY);
    let err = refused(&run(&mut command(
        d,
        lora_args("base", "cont", &["adapter=peft"]),
    )));
    assert!(err.contains(phrase), "train: {err}");
}

/// An adapter nanogpt exported names its base by a fingerprint of the base's blocks:
/// on another model of the same shapes it is refused (it used to be applied without
/// a word). A PEFT adapter whose `base_model_name_or_path` names another model gets
/// a warning. A run on a scratch base has no PEFT base to name: `--adapter-only`
/// refuses it (it wrote `base_model_name_or_path: null`).
#[test]
fn an_adapter_is_checked_against_its_base() {
    let dir = temp_dir("lora-identity");
    let d = dir.path();
    gpt2_base(d, "base", 1, 8);
    gpt2_base(d, "other", 2, 8);
    prepare_gpt2_text(d, 40);
    succeeds(&mut command(d, lora_args("base", "out", &[])));
    ok(
        d,
        &["export", "--from", "out", "--to", "peft", "--adapter-only"],
    );
    let eval = |base: &str| {
        let args = [
            "eval",
            "--init-from",
            base,
            "--adapter",
            "peft",
            "--data",
            "data/val.bin",
        ];
        run(&mut command(d, args))
    };
    let (stdout, stderr) = succeeds(&mut command(
        d,
        [
            "eval",
            "--init-from",
            "base",
            "--adapter",
            "peft",
            "--data",
            "data/val.bin",
        ],
    ));
    assert!(
        stdout.contains("loss") && !stderr.contains("warning"),
        "{stderr}"
    );
    let err = refused(&eval("other"));
    assert!(
        err.contains("peft holds LoRA adapters trained on another base than other")
            && err.contains("named base"),
        "{err}"
    );
    let err = refused(&run(&mut command(
        d,
        lora_args("other", "cont", &["adapter=peft"]),
    )));
    assert!(err.contains("trained on another base than other"), "{err}");
    // A PEFT adapter naming its base: a warning when the name is another model's.
    fixture_adapter(&d.join("named"), |c| {
        c["base_model_name_or_path"] = "gpt2-xl".into()
    });
    let out = fixture_eval(d, "named");
    let stderr = common::text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: named was trained on gpt2-xl (its base_model_name_or_path)"),
        "{stderr}"
    );
    // Adapters on a scratch base (the bundled data, in a folder of its own).
    let elsewhere = temp_dir("lora-identity-scratch");
    let e = elsewhere.path();
    let scratch = [
        &[
            "train",
            "out_dir=scratch",
            "max_iters=1",
            "eval_interval=1",
            "lora_rank=2",
        ][..],
        &TINY_MODEL,
        &TINY_BATCH,
    ]
    .concat();
    succeeds(&mut command(e, scratch));
    let err = fails(
        e,
        &["export", "--from", "scratch", "--to", "x", "--adapter-only"],
    );
    assert!(
        err.contains("randomly initialised base") && err.contains("export the whole model instead"),
        "{err}"
    );
    assert!(!e.join("x").exists());
}

/// Bad values in adapter_config.json name the file and the key (`"r": -4` used to say
/// only "missing r").
#[test]
fn adapter_config_errors_name_the_file_and_the_key() {
    let dir = temp_dir("lora-config-errors");
    let d = dir.path();
    let cases: [(serde_json::Value, &str); 4] = [
        (
            (-4).into(),
            "ad/adapter_config.json: r must be the adapters' rank, a whole number from 1, got -4",
        ),
        (
            "4".into(),
            "r must be the adapters' rank, a whole number from 1, got \"4\"",
        ),
        (
            serde_json::Value::Null,
            "ad/adapter_config.json: r (the adapters' rank) is missing",
        ),
        (0.into(), "got 0"),
    ];
    for (r, phrase) in cases {
        let _ = std::fs::remove_dir_all(d.join("ad"));
        fixture_adapter(&d.join("ad"), |c| c["r"] = r.clone());
        let err = refused(&fixture_eval(d, "ad"));
        assert!(err.contains(phrase), "{r}: {err}");
    }
    let _ = std::fs::remove_dir_all(d.join("ad"));
    fixture_adapter(&d.join("ad"), |c| c["lora_alpha"] = "x".into());
    let err = refused(&fixture_eval(d, "ad"));
    assert!(
        err.contains("ad/adapter_config.json: lora_alpha must be a number, got \"x\""),
        "{err}"
    );
}

/// Resuming a LoRA run whose base folder now holds a model of other shapes says that
/// the base is not the one the adapters were trained on (it used to report a tensor
/// shape against "config.json", contradicting itself).
#[test]
fn a_lora_base_replaced_by_another_model_is_named_as_such() {
    let dir = temp_dir("lora-base-shape");
    let d = dir.path();
    gpt2_base(d, "base", 1, 8);
    prepare_gpt2_text(d, 40);
    succeeds(&mut command(
        d,
        lora_args("base", "out", &["ckpt_interval=1"]),
    ));
    gpt2_base(d, "base", 1, 16);
    let resume = lora_args("base", "out", &["init_from=resume", "max_iters=4"]);
    let err = refused(&run(&mut command(d, resume)));
    assert!(
        err.contains("the LoRA base base now holds another model (n_layer 2, n_head 2, n_embd 16")
            && err.contains(
                "than the one the adapters were trained on (n_layer 2, n_head 2, n_embd 8"
            ),
        "{err}"
    );
}

/// A `lora_rank` above the width of the layers it adapts is refused, naming the limit.
#[test]
fn a_lora_rank_wider_than_its_layers_is_refused() {
    let dir = temp_dir("lora-rank-wide");
    let args = [
        &["train", "max_iters=1", "lora_rank=64"][..],
        &TINY_MODEL,
        &TINY_BATCH,
    ]
    .concat();
    let err = refused(&run(&mut command(dir.path(), args)));
    assert!(
        err.contains("`lora_rank` = 64 is more than the 32 features of the layers it adapts")
            && err.contains("lora_rank <= 32"),
        "{err}"
    );
}
