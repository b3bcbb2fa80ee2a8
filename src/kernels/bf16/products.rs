//! GPT-2 124M's matmul products at B·T = 1,024 rows, the shapes the bf16 kernels are
//! timed on: their timing tests and `cargo bench --bench bf16` (benches/bf16.rs).

/// Every linear layer's three products (forward, input gradient dX, weight gradient
/// dW) and the classifier's forward and dX, the classifier's in its 256-row chunks
/// (src/kernels/classifier.rs); its dwte, blocked differently by each kernel, is
/// [`CLS_DWTE_BLOCK`] or left to the caller: (name, m, k, n, A stored transposed,
/// B stored transposed), for `dst (m × n) = a (m × k) · b (k × n)`. The products
/// whose B is a weight (forward and dX) can read it packed beforehand.
pub const GPT2_PRODUCTS: [(&str, usize, usize, usize, bool, bool); 14] = [
    ("qkv fwd  x·Wᵀ", 1024, 768, 2304, false, true),
    ("proj fwd x·Wᵀ", 1024, 768, 768, false, true),
    ("fc fwd   x·Wᵀ", 1024, 768, 3072, false, true),
    ("mlp fwd  x·Wᵀ", 1024, 3072, 768, false, true),
    ("qkv dx   dy·W", 1024, 2304, 768, false, false),
    ("proj dx  dy·W", 1024, 768, 768, false, false),
    ("fc dx    dy·W", 1024, 3072, 768, false, false),
    ("mlp dx   dy·W", 1024, 768, 3072, false, false),
    ("qkv dW   dyᵀ·x", 2304, 1024, 768, true, false),
    ("proj dW  dyᵀ·x", 768, 1024, 768, true, false),
    ("fc dW    dyᵀ·x", 3072, 1024, 768, true, false),
    ("mlp dW   dyᵀ·x", 768, 1024, 3072, true, false),
    ("cls fwd  x·wteᵀ", 256, 768, 50304, false, true),
    ("cls dx   dl·wte", 256, 50304, 768, false, false),
];

/// The classifier's dwte as the AVX512-BF16 kernel and oneDNN run it: one 4,096-row
/// block of the vocabulary per product (`DWTE_BLOCK` in src/kernels/classifier.rs),
/// 12.3 of them per chunk of rows.
pub const CLS_DWTE_BLOCK: (&str, usize, usize, usize, bool, bool) =
    ("cls dwte dlᵀ·x", 4096, 256, 768, true, false);
