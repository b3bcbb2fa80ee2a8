//! The readers of `nanogpt prepare`: the input is written as a .txt, .jsonl or
//! .parquet file (chosen by its first byte) and read to the end, as prepare does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::data::readers::Source;

fuzz_target!(|data: &[u8]| {
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    let name = match kind % 3 {
        0 => "input.txt",
        1 => "input.jsonl",
        _ => "input.parquet",
    };
    let path = nanogpt_fuzz::scratch_file(name, bytes);
    let Ok(source) = Source::resolve(path.to_str().expect("UTF-8 path"), "text") else {
        return;
    };
    let _ = source.progress_total();
    let Ok(pieces) = source.pieces() else {
        return;
    };
    for piece in pieces {
        if piece.is_err() {
            break;
        }
    }
});
