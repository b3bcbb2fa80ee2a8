//! A Hugging Face GPT-2 `config.json`: parsed, checked, turned into the engine's
//! model config (with and without a block_size crop).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::hf::HfConfig;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(config) = HfConfig::parse(data) else {
        return;
    };
    let path = Path::new("fuzz/config.json");
    if config.check(path).is_err() {
        return;
    }
    for block_size in [None, Some(1), Some(64)] {
        if let Ok(model) = config.model_config(block_size, 0.0, path) {
            let _ = model.num_params();
        }
    }
});
