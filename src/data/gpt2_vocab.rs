//! GPT-2's vocabulary as printable strings, the way Hugging Face (`vocab.json`,
//! `merges.txt`) and llama.cpp (`tokenizer.ggml.tokens`, `.merges`) write it,
//! derived from the BPE ranks that tiktoken-rs ships, so that exports carry GPT-2's
//! tokenizer offline.
//!
//! GPT-2's BPE: ranks 0..256 are single bytes, every later rank (up to 50255) is the
//! merge of two earlier tokens, 50256 is `<|endoftext|>`. A token's merge is found by
//! running byte-pair merging on its bytes with the ranks below its own: the last two
//! pieces are the pair. Bytes are written as printable characters (GPT-2's
//! `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the other 68
//! bytes map to U+0100 onwards).

use super::{GPT2_EOT, GPT2_VOCAB_SIZE};
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
    fn bytes_show_as_gpt2s_printable_characters() {
        assert_eq!(byte_chars()[b' ' as usize], '\u{120}');
        assert_eq!(byte_chars()[b'\n' as usize], '\u{10a}');
        assert_eq!(byte_chars()[b'A' as usize], 'A');
        let v = gpt2_vocab().unwrap();
        assert_eq!(v.tokens.len(), GPT2_VOCAB_SIZE);
        assert_eq!(v.merges.len(), 50_000);
        assert_eq!(v.merges[0], "\u{120} t");
    }
}
