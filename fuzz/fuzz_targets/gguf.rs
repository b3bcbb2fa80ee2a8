//! GGUF files (llama.cpp's, Ollama's): the header parsed and checked, every tensor
//! dequantized, the file opened as a model and loaded into the parameter arena as
//! init_from=FILE.gguf does, its tokenizer recognised, and read as a LoRA adapter.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::gguf::{adapter, vocab, GgufFile};
use nanogpt::hf::Pretrained;
use nanogpt::model::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let path = nanogpt_fuzz::scratch_file("model.gguf", data);
    if let Ok(file) = GgufFile::open(&path) {
        for t in &file.header.tensors {
            let _ = file.tensor_f32(t);
        }
        let _ = vocab::recognise(&file.header);
    }
    if let Ok(model) = Pretrained::open_gguf(&path) {
        let _ = model.load(None, 0.0);
        if let Some(gguf) = model.gguf() {
            let _ = gguf.tokenizer();
        }
    }
    let base = ModelConfig {
        vocab_size: 96,
        block_size: 32,
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        bias: true,
        dropout: 0.0,
        llama: None,
    };
    let _ = adapter::read_adapter(&path, &base);
});
