//! A request body of `nanogpt serve` (completions or chat, chosen by the first byte),
//! checked against a GPT-2 model with a context of 64: an error or a request the
//! model can run, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::chat::ChatFormat;
use nanogpt::data::Tokenizer;
use nanogpt::serve::request::{chat_request, completion_request, Model};
use std::sync::{Arc, OnceLock};

fuzz_target!(|data: &[u8]| {
    static MODEL: OnceLock<Model> = OnceLock::new();
    let model = MODEL.get_or_init(|| Model {
        tokenizer: Arc::new(Tokenizer::gpt2()),
        eot: Some(50256),
        vocab: 50257,
        block: 64,
        template: ChatFormat::Chat,
    });
    let Some((&kind, body)) = data.split_first() else {
        return;
    };
    let request = match kind % 2 {
        0 => completion_request(model, body),
        _ => chat_request(model, body),
    };
    if let Ok(r) = request {
        let job = &r.generation;
        for p in &job.prompts {
            assert!(!p.is_empty() && p.len() + job.max_tokens <= 64);
            assert!(p.iter().all(|&id| id < 50257));
        }
    }
});
