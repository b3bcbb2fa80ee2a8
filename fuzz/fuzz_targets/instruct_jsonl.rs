//! Instruction data as `prepare` and `eval --data FILE.jsonl` read it: the input is
//! written as a `.jsonl` file read in the format its first byte chooses (detected
//! from its first record, Alpaca, chat or plain text); every example is then encoded
//! with GPT-2's tokenizer and a char-level one, each token with its mask byte.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::data::instruct::{instruct_eot, CHAR_EOT};
use nanogpt::data::readers::Source;
use nanogpt::data::{DataFormat, Tokenizer};

fuzz_target!(|data: &[u8]| {
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    let format = match kind % 4 {
        0 => None,
        1 => Some(DataFormat::Alpaca),
        2 => Some(DataFormat::Chat),
        _ => Some(DataFormat::Text),
    };
    let path = nanogpt_fuzz::scratch_file("input.jsonl", bytes);
    let Ok(source) = Source::resolve_as(path.to_str().expect("UTF-8 path"), "text", format)
    else {
        return;
    };
    if !source.is_instruct() {
        if let Ok(pieces) = source.pieces() {
            pieces.take_while(Result::is_ok).for_each(drop);
        }
        return;
    }
    let gpt2 = Tokenizer::gpt2();
    let no_variables = serde_json::Map::new();
    for example in source.examples() {
        let Ok((example, _)) = example else {
            break;
        };
        // An error (a role the built-in format has no turn for, say) is an answer;
        // only a panic is a finding.
        let eot = instruct_eot(&gpt2).expect("GPT-2 has end-of-text");
        let Ok((ids, mask)) = example.encode(&gpt2, eot, &no_variables) else {
            continue;
        };
        assert_eq!(ids.len(), mask.len(), "one mask byte per token");
        assert!(mask.iter().all(|&m| m <= 1));
        // A char vocabulary of the example's own characters, with end-of-text.
        let text = example.full_text();
        let chars = Tokenizer::char_level(text.chars().chain([CHAR_EOT]));
        if let Ok(chars) = chars {
            let eot = instruct_eot(&chars).expect("U+0003 is in the vocabulary");
            if let Ok((ids, mask)) = example.encode(&chars, eot, &no_variables) {
                assert_eq!(ids.len(), mask.len());
            }
        }
    }
});
