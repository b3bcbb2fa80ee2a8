//! LoRA through the whole model: adapter gradients against finite differences, the
//! frozen base, the merge, and bf16 autocast.

use super::lora::LoraConfig;
use super::tests::{batch, check_finite_differences, random_model, with_adapters};
use super::*;

fn tiny(bias: bool, dropout: f32) -> ModelConfig {
    ModelConfig {
        vocab_size: 29,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 12,
        bias,
        dropout,
        llama: None,
    }
}

/// A random base (not GPT-2-init) with adapters on `targets`, `B` made non-zero.
fn adapted(cfg: ModelConfig, targets: &str, lora_dropout: f32, b: usize, t: usize) -> Gpt {
    with_adapters(random_model(cfg, b, t, 9), targets, lora_dropout)
}

const ALL: &str = "c_attn,attn.c_proj,c_fc,mlp.c_proj";

/// Every adapter element's gradient against central differences of the f32 loss.
fn check_adapter_gradients(bias: bool, dropout: f32, lora_dropout: f32) {
    let (b, t) = (2, 5);
    let mut gpt = adapted(tiny(bias, dropout), ALL, lora_dropout, b, t);
    let (x, y) = batch(b, t, gpt.config().vocab_size);
    let whole = |_: &Gpt, tensor: &TensorInfo| tensor.range();
    let (_, checked) = check_finite_differences(&mut gpt, (&x, &y, b, t), 3, whole);
    assert!(
        checked > 40,
        "too few non-zero gradients checked ({checked})"
    );
}

#[test]
fn adapter_gradients_match_finite_differences() {
    check_adapter_gradients(true, 0.0, 0.0);
    check_adapter_gradients(false, 0.0, 0.0);
}

#[test]
fn adapter_gradients_match_finite_differences_with_both_dropouts() {
    check_adapter_gradients(true, 0.1, 0.3);
}

#[test]
fn zero_b_gives_the_base_model_bit_for_bit() {
    let (b, t) = (2, 6);
    let cfg = tiny(true, 0.0);
    let (x, y) = batch(b, t, cfg.vocab_size);
    let mut base = Gpt::new(cfg, b, t).unwrap();
    base.init_gpt2(3);
    base.set_training(false);
    let want = base.logits(&x, b, t);
    let want_loss = base.forward(&x, &y, b, t);
    let lora = LoraConfig::new(4, 8.0, 0.0, ALL).unwrap();
    let mut gpt = base.with_lora(lora, ("test", 0), 1);
    gpt.set_training(false);
    assert!(gpt.params.iter().any(|&p| p != 0.0), "A is initialised");
    assert_eq!(gpt.logits(&x, b, t), want);
    assert_eq!(gpt.forward(&x, &y, b, t), want_loss);
}

#[test]
fn the_adapted_model_equals_its_merge() {
    let (b, t) = (2, 6);
    let mut gpt = adapted(tiny(true, 0.0), "c_attn,mlp.c_proj", 0.0, b, t);
    let (x, _) = batch(b, t, gpt.config().vocab_size);
    gpt.set_training(false);
    let got = gpt.logits(&x, b, t);
    let merged = gpt.merged_params().into_owned();
    let mut plain = Gpt::from_params(gpt.config().clone(), merged, b, t).unwrap();
    let want = plain.logits(&x, b, t);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
            "logit {i}: {g} vs {w}"
        );
    }
}

#[test]
fn only_the_adapters_train_and_the_buckets_tile_them() {
    let (b, t) = (2, 8);
    let mut gpt = adapted(tiny(false, 0.1), "c_fc", 0.1, b, t);
    let base = gpt.frozen().unwrap().params.clone();
    let spans = &gpt.frozen().unwrap().adapters;
    let adapter_floats: usize = gpt.layout.tensors.iter().map(|t| t.numel()).sum();
    assert_eq!(
        adapter_floats,
        2 * 3 * (12 + 48),
        "A and B of c_fc per layer"
    );
    assert_eq!(
        gpt.grads.len(),
        gpt.layout.len,
        "gradients for adapters only"
    );
    let buckets = gpt.grad_buckets();
    assert_eq!(buckets, spans.buckets);
    assert_eq!(
        (buckets[0].end, buckets.last().unwrap().start),
        (gpt.layout.len, 0)
    );
    assert!(buckets.windows(2).all(|w| w[1].end == w[0].start), "tiles");
    let (x, y) = batch(b, t, gpt.config().vocab_size);
    let mut opt = crate::optim::AdamW::new(&gpt.layout.decay_ranges(), Default::default());
    let mut losses = Vec::new();
    for _ in 0..8 {
        gpt.zero_grad();
        losses.push(gpt.forward(&x, &y, b, t));
        let mut seen = Vec::new();
        gpt.backward_with(|range, _| seen.push(range));
        assert_eq!(seen, buckets);
        opt.step(&mut gpt.params, &gpt.grads, 3e-2);
    }
    assert_eq!(gpt.frozen().unwrap().params, base, "the base is frozen");
    assert!(losses[7] < losses[0] * 0.99, "{losses:?}");
}

#[test]
fn bf16_adapter_gradients_are_close_to_f32_ones() {
    let (b, t) = (2, 8);
    let grads = |dtype: Dtype| {
        let mut gpt = adapted(tiny(true, 0.0), ALL, 0.2, b, t);
        gpt.set_dtype(dtype, &Backend::detect(None));
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        gpt.zero_grad();
        gpt.set_dropout_seed(11);
        let loss = gpt.forward(&x, &y, b, t);
        gpt.backward();
        (loss, gpt.grads.clone())
    };
    let (loss32, g32) = grads(Dtype::Float32);
    let (loss16, g16) = grads(Dtype::Bfloat16);
    assert!(
        (loss32 - loss16).abs() < 2e-2 * loss32.abs(),
        "{loss32} vs {loss16}"
    );
    assert_ne!(g32, g16, "bf16 rounds the operands");
    let norm = |g: &[f32]| g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
    let diff: Vec<f32> = g32.iter().zip(&g16).map(|(a, b)| a - b).collect();
    let rel = norm(&diff) / norm(&g32);
    assert!(
        rel < 3e-2,
        "bf16 adapter gradients differ by {rel:.4} (relative norm)"
    );
}

#[test]
fn gpt2_r8_c_attn_adapters_are_a_fraction_of_a_percent() {
    // What a data-parallel LoRA step all-reduces (the trained arena) at 124M.
    let cfg = ModelConfig::preset("gpt2").unwrap();
    let full = ParamLayout::new(&cfg).len;
    let lora = LoraConfig::new(8, 16.0, 0.0, "c_attn").unwrap();
    let adapters = lora::LoraLayout::new(&cfg, &lora).params.len;
    // 12 layers × (A 8×768 + B 2304×8) = 294 912 floats.
    assert_eq!(adapters, 12 * (8 * 768 + 2304 * 8));
    let share = adapters as f64 / full as f64;
    assert!(
        share <= 0.01,
        "adapters are {:.3} % of the model",
        100.0 * share
    );
    println!(
        "gpt2, LoRA r8 c_attn: {adapters} of {full} floats ({:.3} %)",
        100.0 * share
    );
}

#[test]
fn lora_flops_count_no_weight_gradients_for_the_frozen_model() {
    // 2 layers, C 12, T 8; r 4 on c_attn: per layer A 4×12 + B 36×4.
    let cfg = tiny(true, 0.0);
    let t = 8;
    let gpt = Gpt::new(cfg.clone(), 1, t).unwrap();
    let full = gpt.flops_per_token(t);
    let lora = LoraConfig::new(4, 8.0, 0.0, "c_attn").unwrap();
    let adapted = gpt.with_lora(lora, ("scratch", 1), 1);
    let n = (cfg.num_params() - cfg.block_size * cfg.n_embd) as f64;
    let a = (cfg.n_layer * (4 * 12 + 36 * 4)) as f64;
    let attention = 12.0 * (cfg.n_layer * cfg.n_embd * t) as f64;
    assert_eq!(full, 6.0 * n + attention);
    assert_eq!(adapted.flops_per_token(t), 4.0 * n + 6.0 * a + attention);
}

/// bf16 LoRA, on the portable back-end (a rounded copy of the base) and on this
/// machine's (its packs on AMX and AVX512-BF16, else a copy): giving the base's f32
/// linears back, as the copy or the packs are made or after, changes no bit of
/// training or evaluation, as the products read the copy or the packs. Exactly those
/// weights then read as zeros; norms, biases and embeddings stay. With
/// `NANOGPT_BF16_PACKS=0` the products read the f32 base, and nothing is given back.
#[test]
fn a_bf16_base_without_its_f32_linears_trains_bit_for_bit() {
    use super::family::LlamaType;
    use super::tests_llama::tiny_llama;
    let (b, t) = (2, 8);
    let cases = [
        (tiny(true, 0.1), ALL),
        (
            tiny_llama(LlamaType::Qwen2, false, 0.1),
            "q_proj,v_proj,down_proj",
        ),
    ];
    // When the linears are given back: never, before the copy is made, after.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Release {
        Never,
        Before,
        After,
    }
    for (cfg, targets) in cases {
        for backend in [Backend::portable(), Backend::detect(None)] {
            let run = |release: Release| {
                let mut gpt = adapted(cfg.clone(), targets, 0.2, b, t);
                let base = gpt.frozen().unwrap().params.clone();
                let mut now = 0;
                if release == Release::Before {
                    now = gpt.release_frozen_linears();
                }
                gpt.set_dtype(Dtype::Bfloat16, &backend);
                if release == Release::After {
                    now = gpt.release_frozen_linears();
                }
                let (x, y) = batch(b, t, gpt.config().vocab_size);
                let decay = gpt.layout.decay_ranges();
                let mut opt = crate::optim::AdamW::new(&decay, Default::default());
                let mut losses = Vec::new();
                for step in 0..3 {
                    gpt.set_dropout_seed(step);
                    losses.push(gpt.forward(&x, &y, b, t));
                    gpt.backward();
                    gpt.step_adamw(&mut opt, 1e-2, 1.0);
                }
                gpt.set_training(false);
                let logits = gpt.logits(&x, b, t);
                (losses, gpt.params.clone(), logits, base, now, gpt)
            };
            let kept = run(Release::Never);
            for release in [Release::Before, Release::After] {
                let (losses, adapters, logits, base, now, gpt) = run(release);
                let family = cfg.llama.as_ref().map_or("gpt2", |l| l.model_type.name());
                let case = format!("{family} on {}, {release:?}", backend.kernel().name());
                let got = (&losses, &adapters, &logits);
                assert_eq!(got, (&kept.0, &kept.1, &kept.2), "{case}");
                let frozen = gpt.frozen().unwrap();
                let copied = Frozen::gives_back_linears(true, &backend);
                assert_eq!(frozen.released(), copied, "{case}");
                let linears: Vec<_> = (frozen.layout.layers.iter())
                    .flat_map(|l| l.linears().map(|s| s.weight.range()))
                    .collect();
                let floats: usize = linears.iter().map(|r| r.len()).sum();
                let after = copied && release == Release::After;
                assert_eq!(now, if after { 4 * floats } else { 0 }, "{case}");
                for (i, (&got, &was)) in frozen.params.iter().zip(&base).enumerate() {
                    let gone = copied && linears.iter().any(|r| r.contains(&i));
                    assert_eq!(got, if gone { 0.0 } else { was }, "{case}: float {i}");
                }
            }
        }
    }
}
