"""OpenBLAS (through numpy) on the GEMM shapes of benches/gemm.rs, for the same table.

    python3 -m venv .venv && .venv/bin/pip install numpy
    OPENBLAS_NUM_THREADS=2 .venv/bin/python scripts/compare/gemm_numpy.py
"""
import time

import numpy as np

SHAPES = [
    ("qkv forward", 1024, 768, 2304),
    ("attn proj forward", 1024, 768, 768),
    ("fc forward", 1024, 768, 3072),
    ("mlp proj forward", 1024, 3072, 768),
    ("fc dW (768×1024·1024×3072)", 3072, 1024, 768),
    ("classifier chunk", 166, 768, 50257),
    ("square 2048", 2048, 2048, 2048),
]

print(f"{'shape':<28} {'OpenBLAS GF/s':>14}")
for name, m, k, n in SHAPES:
    a = np.random.rand(m, k).astype(np.float32)
    b = np.random.rand(k, n).astype(np.float32)
    c = np.empty((m, n), dtype=np.float32)
    np.matmul(a, b, out=c)
    rates = []
    for _ in range(7):
        start = time.perf_counter()
        np.matmul(a, b, out=c)
        rates.append(2 * m * n * k / (time.perf_counter() - start) / 1e9)
    print(f"{name:<28} {sorted(rates)[3]:>14.1f}")
