//! Where one long text can be cut into pieces that a model's tokenizer encodes, each
//! on its own, into exactly the ids of the whole: `prepare` streams a single large
//! document through the tokenizer in such pieces (a whole `.txt` of gigabytes would
//! not fit in memory as one `tokenizers` encoding).
//!
//! A cut goes right after a line break that a letter or digit follows. The
//! pre-tokenizers of Llama 3, Qwen and GPT-2-style models end a pre-token there (a
//! line break joins the punctuation before it, `.\n`, but never the word after it),
//! and byte-pair merging never crosses pre-tokens. A tokenizer may still disagree
//! (a SentencePiece-style one prepends `▁` to every text it is given), so each cut is
//! checked: the text around it must encode to the ids of its two sides. A candidate
//! that fails is skipped; a tokenizer that fails them all is given the text whole.

use anyhow::Result;

use super::tokenizer::hf::HfTokenizer;

/// Bytes of context each side of a cut that the check encodes.
const CHECK_BYTES: usize = 256;

/// Byte positions in `text`, about `every` bytes apart, where `text` may be cut (see
/// the module notes). The end of `text` is not among them.
pub fn safe_cuts(tokenizer: &HfTokenizer, text: &str, every: usize) -> Result<Vec<usize>> {
    let mut cuts = Vec::new();
    let mut from = every;
    while from < text.len() {
        match next_safe_cut(tokenizer, text, from)? {
            Some(at) => {
                cuts.push(at);
                from = at + every;
            }
            None => break,
        }
    }
    Ok(cuts)
}

/// The first safe cut at or after byte `from`.
fn next_safe_cut(tokenizer: &HfTokenizer, text: &str, from: usize) -> Result<Option<usize>> {
    let bytes = text.as_bytes();
    let mut at = from.max(1);
    while at < bytes.len() {
        let Some(offset) = bytes[at - 1..].iter().position(|&b| b == b'\n') else {
            return Ok(None);
        };
        at += offset;
        if at < bytes.len()
            && starts_alphanumeric(&text[at..])
            && cut_is_exact(tokenizer, text, at)?
        {
            return Ok(Some(at));
        }
        at += 1;
    }
    Ok(None)
}

fn starts_alphanumeric(s: &str) -> bool {
    s.chars().next().is_some_and(char::is_alphanumeric)
}

/// Whether the text around `at` encodes to the ids of its two sides.
fn cut_is_exact(tokenizer: &HfTokenizer, text: &str, at: usize) -> Result<bool> {
    let start = floor_boundary(text, at.saturating_sub(CHECK_BYTES));
    let end = floor_boundary(text, (at + CHECK_BYTES).min(text.len()));
    let whole = tokenizer.encode(&text[start..end])?;
    let mut parts = tokenizer.encode(&text[start..at])?;
    parts.extend(tokenizer.encode(&text[at..end])?);
    Ok(whole == parts)
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokenizer::files::TokenizerFiles;

    fn fixture(name: &str) -> TokenizerFiles {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers")
            .join(name);
        TokenizerFiles::read(&dir).unwrap()
    }

    fn encode_in_pieces(t: &HfTokenizer, text: &str, cuts: &[usize]) -> Vec<u32> {
        let mut bounds = vec![0];
        bounds.extend(cuts);
        bounds.push(text.len());
        bounds
            .windows(2)
            .flat_map(|w| t.encode(&text[w[0]..w[1]]).unwrap())
            .collect()
    }

    #[test]
    fn pieces_encode_to_the_ids_of_the_whole() {
        let text = format!(
            "{}\n12 apples.\nZürich!\n\n  indented\nend",
            &crate::data::SHAKESPEARE_TEXT[..6000]
        );
        for name in ["llama3", "qwen3", "smollm2"] {
            let t = HfTokenizer::from_files(fixture(name)).unwrap();
            let cuts = safe_cuts(&t, &text, 200).unwrap();
            assert!(cuts.len() > 10, "{name}: {} cuts", cuts.len());
            assert!(cuts.windows(2).all(|w| w[1] >= w[0] + 200), "{name}");
            for &at in &cuts {
                assert_eq!(&text[at - 1..at], "\n");
            }
            let whole = t.encode(&text).unwrap();
            assert_eq!(encode_in_pieces(&t, &text, &cuts), whole, "{name}");
        }
    }

    #[test]
    fn a_tokenizer_that_reads_pieces_otherwise_is_given_the_text_whole() {
        // A normalizer that prepends `▁` to every text given (as SentencePiece-style
        // tokenizers do): no line break is a safe cut.
        let mut files = fixture("smollm2");
        let mut json: serde_json::Value = serde_json::from_slice(&files.tokenizer_json).unwrap();
        json["normalizer"] = serde_json::json!({"type": "Prepend", "prepend": "▁"});
        files.tokenizer_json = serde_json::to_vec(&json).unwrap();
        let t = HfTokenizer::from_files(files).unwrap();
        let text = "one line\ntwo lines\nthree\n".repeat(50);
        assert_eq!(safe_cuts(&t, &text, 10).unwrap(), Vec::<usize>::new());
    }
}
