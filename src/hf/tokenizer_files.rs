//! GPT-2's tokenizer in Hugging Face's files (`vocab.json`, `merges.txt`,
//! `tokenizer_config.json`), from [`crate::data::gpt2_vocab`], so that an exported
//! model comes with the tokenizer `transformers` and its converters expect, offline.

use crate::data::gpt2_vocab::gpt2_vocab;
use anyhow::Result;

/// The files, as (name, contents).
pub fn gpt2_tokenizer_files(model_max_length: usize) -> Result<Vec<(&'static str, String)>> {
    let vocab_words = gpt2_vocab()?;
    let mut merges = String::from("#version: 0.2\n");
    for m in &vocab_words.merges {
        merges.push_str(m);
        merges.push('\n');
    }
    let mut vocab = serde_json::Map::new();
    for (id, token) in vocab_words.tokens.iter().enumerate() {
        vocab.insert(token.clone(), id.into());
    }
    let config = serde_json::json!({
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": model_max_length,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "add_prefix_space": false,
        "add_bos_token": false,
    });
    Ok(vec![
        ("vocab.json", serde_json::to_string(&vocab)?),
        ("merges.txt", merges),
        (
            "tokenizer_config.json",
            serde_json::to_string_pretty(&config)? + "\n",
        ),
    ])
}

/// The file names [`gpt2_tokenizer_files`] writes.
pub const FILE_NAMES: [&str; 3] = ["vocab.json", "merges.txt", "tokenizer_config.json"];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::GPT2_VOCAB_SIZE;

    #[test]
    fn files_match_gpt2s_published_vocabulary() {
        let files = gpt2_tokenizer_files(1024).unwrap();
        let vocab: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&files[0].1).unwrap();
        assert_eq!(vocab.len(), GPT2_VOCAB_SIZE);
        // Well-known ids: "Hello" 15496, " world" 995, "<|endoftext|>" 50256, "!" 0.
        assert_eq!(vocab["Hello"], 15496);
        assert_eq!(vocab["\u{120}world"], 995);
        assert_eq!(vocab["<|endoftext|>"], 50256);
        assert_eq!(vocab["!"], 0);
        let merges: Vec<&str> = files[1].1.lines().collect();
        assert_eq!(merges.len(), 1 + 50000);
        assert_eq!(merges[1], "\u{120} t");
    }
}
