//! A dataset's `meta.json`, then the tokenizer it describes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::data::{Meta, Tokenizer, TokenizerKind};
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(meta) = Meta::parse(data) else {
        return;
    };
    // GPT-2's BPE is built in and fixed; the char vocabulary comes from the file.
    if meta.tokenizer == TokenizerKind::Char {
        let tokenizer =
            // A char vocabulary reads no file beside the meta.json.
            Tokenizer::from_meta(&meta, Path::new("/nonexistent"))
                .expect("a checked meta.json builds its tokenizer");
        let ids: Vec<u32> = (0..meta.vocab_size as u32).collect();
        let text = tokenizer.decode(&ids);
        let _ = tokenizer.encode(&text);
    }
});
