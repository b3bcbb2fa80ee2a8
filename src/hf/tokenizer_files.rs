//! GPT-2's tokenizer in Hugging Face's files (`vocab.json`, `merges.txt`,
//! `tokenizer_config.json`), derived from the BPE ranks that tiktoken-rs ships, so
//! that an exported model comes with the tokenizer `transformers` and its
//! converters expect, offline.
//!
//! GPT-2's BPE: ranks 0..256 are single bytes, every later rank (up to 50255) is the
//! merge of two earlier tokens, 50256 is `<|endoftext|>`. A token's merge is found by
//! running byte-pair merging on its bytes with the ranks below its own: the last two
//! pieces are the pair. Hugging Face writes bytes as printable characters (GPT-2's
//! `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the other 68
//! bytes map to U+0100 onwards).

use crate::data::{GPT2_EOT, GPT2_VOCAB_SIZE};
use anyhow::{anyhow, Result};
use std::collections::HashMap;

/// GPT-2's vocabulary as Hugging Face and llama.cpp write it: each token's bytes as
/// printable characters (`<|endoftext|>` as itself), in id order, and the 50,000
/// merges as `"left right"` in rank order.
#[derive(Debug)]
pub struct Gpt2Vocab {
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
}

/// [`Gpt2Vocab`], derived once per process (a fraction of a second).
pub fn gpt2_vocab() -> Result<&'static Gpt2Vocab> {
    static VOCAB: std::sync::OnceLock<std::result::Result<Gpt2Vocab, String>> =
        std::sync::OnceLock::new();
    VOCAB
        .get_or_init(|| derive_gpt2_vocab().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|e| anyhow!("{e}"))
}

fn derive_gpt2_vocab() -> Result<Gpt2Vocab> {
    let bpe = tiktoken_rs::r50k_base_singleton();
    let tokens: Vec<Vec<u8>> = (0..GPT2_VOCAB_SIZE as u32)
        .map(|id| {
            bpe.decode_bytes(&[id])
                .map_err(|e| anyhow!("GPT-2 token {id}: {e:?}"))
        })
        .collect::<Result<_>>()?;
    let unicode = byte_chars();
    let show = |bytes: &[u8]| -> String { bytes.iter().map(|&b| unicode[b as usize]).collect() };

    let rank: HashMap<&[u8], u32> = tokens
        .iter()
        .enumerate()
        .take(GPT2_EOT as usize)
        .map(|(id, t)| (t.as_slice(), id as u32))
        .collect();
    let mut merges = Vec::with_capacity(50_000);
    for (id, token) in tokens.iter().enumerate().take(GPT2_EOT as usize) {
        if token.len() < 2 {
            continue;
        }
        let (a, b) = last_merge(token, id as u32, &rank)
            .ok_or_else(|| anyhow!("GPT-2 token {id} is not the merge of two earlier tokens"))?;
        merges.push(format!("{} {}", show(a), show(b)));
    }
    let tokens = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| match id as u32 == GPT2_EOT {
            true => String::from_utf8_lossy(token).into_owned(),
            false => show(token),
        })
        .collect();
    Ok(Gpt2Vocab { tokens, merges })
}

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

/// Byte-pair merging of `token`'s bytes with ranks below `limit`; the two pieces
/// merged last.
fn last_merge<'t>(
    token: &'t [u8],
    limit: u32,
    rank: &HashMap<&[u8], u32>,
) -> Option<(&'t [u8], &'t [u8])> {
    // Piece boundaries: piece k is token[cuts[k]..cuts[k+1]].
    let mut cuts: Vec<usize> = (0..=token.len()).collect();
    while cuts.len() > 3 {
        let best = (0..cuts.len() - 2)
            .filter_map(|k| {
                let r = *rank.get(&token[cuts[k]..cuts[k + 2]])?;
                (r < limit).then_some((r, k))
            })
            .min()?;
        cuts.remove(best.1 + 1);
    }
    (cuts.len() == 3).then(|| (&token[cuts[0]..cuts[1]], &token[cuts[1]..cuts[2]]))
}

/// GPT-2's byte → printable character table.
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("Latin-1")
            } else {
                let ch = char::from_u32(next).expect("U+0100..");
                next += 1;
                ch
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(byte_chars()[b' ' as usize], '\u{120}');
        assert_eq!(byte_chars()[b'\n' as usize], '\u{10a}');
    }
}
