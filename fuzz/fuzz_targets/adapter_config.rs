//! A PEFT adapter directory, as `eval --adapter`, `sample --adapter`, `export
//! --adapter` and `train adapter=` read it: the input is `adapter_config.json`,
//! optionally followed by a NUL byte and the bytes of `adapter_model.safetensors`
//! (without one, the weights of PEFT's fixture adapter, so that the config's
//! selection of modules and layers, its rank and its settings are what varies). The
//! base is the fixture's architecture; an adapter that loads is merged into it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::hf::adapter::{read_adapter, CONFIG_FILE, WEIGHTS_FILE};
use nanogpt::model::{lora, ModelConfig, ParamLayout};

/// PEFT's adapter of tests/fixtures/lora (r 4 on every linear layer of 2 blocks).
const FIXTURE_WEIGHTS: &[u8] =
    include_bytes!("../../tests/fixtures/lora/adapter/adapter_model.safetensors");

fuzz_target!(|data: &[u8]| {
    let (config, weights) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, FIXTURE_WEIGHTS),
    };
    let path = nanogpt_fuzz::scratch_file(CONFIG_FILE, config);
    let dir = path.parent().expect("a scratch folder");
    std::fs::write(dir.join(WEIGHTS_FILE), weights).expect("scratch file");
    // The fixture base's architecture (tests/fixtures/lora/base/config.json).
    let model = ModelConfig {
        vocab_size: 101,
        block_size: 16,
        n_layer: 2,
        n_head: 4,
        n_embd: 48,
        bias: true,
        dropout: 0.0,
        llama: None,
    };
    let Ok(adapter) = read_adapter(dir, &model) else {
        return;
    };
    assert_eq!(adapter.weights.len(), adapter.layout.params.len);
    assert!(adapter.weights.iter().all(|x| x.is_finite()), "refused on load");
    let base = ParamLayout::new(&model);
    let mut params = vec![0.0; base.len];
    lora::merge_into(&mut params, &base, &adapter.layout, &adapter.weights, &adapter.config);
});
