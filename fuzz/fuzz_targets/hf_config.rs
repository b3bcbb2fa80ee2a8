//! A Hugging Face `config.json` (GPT-2's or a Llama family's): read as `init_from=DIR`
//! reads it, checked, turned into the engine's model config (with and without a
//! block_size crop).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::hf::HfConfig;

fuzz_target!(|data: &[u8]| {
    let path = nanogpt_fuzz::scratch_file("config.json", data);
    let path = path.as_path();
    let Ok(config) = HfConfig::load(path) else {
        return;
    };
    if config.check(path).is_err() {
        return;
    }
    for block_size in [None, Some(1), Some(64)] {
        if let Ok(model) = config.model_config(block_size, 0.0, path) {
            let _ = model.num_params();
        }
    }
});
