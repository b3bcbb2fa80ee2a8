//! Pretrained weights: a lone `model.safetensors` (config read off the tensor
//! shapes), loaded into the parameter arena as fine-tuning, eval and sample do.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::hf::Pretrained;

fuzz_target!(|data: &[u8]| {
    let path = nanogpt_fuzz::scratch_file("model.safetensors", data);
    if let Ok(model) = Pretrained::open_file(&path) {
        let _ = model.load(None, 0.0);
    }
});
