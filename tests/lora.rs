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
        };
        let mut model = nanogpt::model::Gpt::new(cfg, 1, 1).unwrap();
        model.init_gpt2(seed);
        let kind = Some(nanogpt::data::TokenizerKind::Gpt2);
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
        let ours = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
        let peft = std::fs::read(fixture("lora/adapter/adapter_model.safetensors")).unwrap();
        let (ours, peft) = (
            SafeTensors::deserialize(&ours).unwrap(),
            SafeTensors::deserialize(&peft).unwrap(),
        );
        let mut names: Vec<_> = ours.names().into_iter().cloned().collect();
        let mut want: Vec<_> = peft.names().into_iter().cloned().collect();
        names.sort();
        want.sort();
        assert_eq!(names, want);
        for name in &names {
            let (a, b) = (ours.tensor(name).unwrap(), peft.tensor(name).unwrap());
            assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
            assert_eq!(a.data(), b.data(), "{name}");
        }
        let cfg = |p: &std::path::Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p.join("adapter_config.json")).unwrap())
                .unwrap()
        };
        let (ours, peft) = (cfg(&out), cfg(&fixture("lora/adapter")));
        for key in [
            "peft_type",
            "r",
            "fan_in_fan_out",
            "bias",
            "use_rslora",
            "use_dora",
        ] {
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
