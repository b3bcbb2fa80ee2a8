//! A `.bin` token file: opened and checked as training and `eval` do (length,
//! vocabulary, block size), then batches and evaluation windows cut from it. The
//! first 4 bytes choose the vocabulary size, block size, rows and the ids' width.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::data::{
    batch_offsets, eval_window_count, eval_window_offsets, Draw, TokenDtype, TokenFile,
};

fuzz_target!(|data: &[u8]| {
    let Some((head, tokens)) = data.split_first_chunk::<4>() else {
        return;
    };
    let vocab = usize::from(u16::from_le_bytes([head[0], head[1]])) + 1;
    let block = usize::from(head[2]) + 1;
    let rows = usize::from(head[3] % 8) + 1;
    let dtype = match head[3] & 0x80 {
        0 => TokenDtype::Uint16,
        _ => TokenDtype::Uint32,
    };
    let path = nanogpt_fuzz::scratch_file("train.bin", tokens);
    let Ok(file) = TokenFile::open(&path, dtype) else {
        return;
    };
    if file.check_vocab(vocab).is_err() || file.check_block_size(block).is_err() {
        return;
    }
    let offsets = batch_offsets(1337, Draw::Train, 0, rows, file.len(), block)
        .expect("a checked file has room for a window");
    let (mut inputs, mut targets) = (vec![0; rows * block], vec![0; rows * block]);
    let mut window = Vec::new();
    file.read_batch(&offsets, block, &mut window, &mut inputs, &mut targets)
        .expect("buffers sized for the batch");
    let windows = eval_window_count(file.len(), block);
    let _ = eval_window_offsets(0..windows, block);
});
