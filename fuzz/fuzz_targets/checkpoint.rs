//! A training checkpoint (`ckpt.safetensors`): safetensors header, the JSON run
//! state in its metadata, then every tensor copied out as resuming does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::checkpoint::Checkpoint;
use nanogpt::data::Meta;
use nanogpt::model::ParamLayout;

fuzz_target!(|data: &[u8]| {
    let Ok(ckpt) = Checkpoint::from_vec("fuzz/ckpt.safetensors".into(), data.to_vec()) else {
        return;
    };
    let layout = ParamLayout::new(&ckpt.state.model);
    let mut params = vec![0.0; layout.len];
    if ckpt.load_params(&layout, &mut params).is_err() {
        return;
    }
    let (mut m, mut v) = (vec![0.0; layout.len], vec![0.0; layout.len]);
    let _ = ckpt.load_moments(&layout, &mut m, &mut v);
    // The tokenizer description, as `eval` and `sample` read it.
    let _ = serde_json::from_value::<Meta>(ckpt.state.tokenizer.clone()).map(|meta| meta.check());
});
