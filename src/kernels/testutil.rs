//! Helpers for kernel tests: random inputs, f64 central differences, tolerant
//! comparisons that report the worst element, and a CPU-time clock for the speed
//! tests.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` uniform values in `[-1, 1)`, reproducible from `seed`.
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

pub fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Central-difference gradient of the scalar `f` at `x`, in f64.
pub fn numeric_grad(f: impl Fn(&[f64]) -> f64, x: &[f64], eps: f64) -> Vec<f64> {
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = x[i];
            x[i] = orig + eps;
            let plus = f(&x);
            x[i] = orig - eps;
            let minus = f(&x);
            x[i] = orig;
            (plus - minus) / (2.0 * eps)
        })
        .collect()
}

/// Dot product in f64: the scalar "loss" `sum(out · w)` used to turn a kernel's output
/// into something to differentiate (so `dout = w`).
pub fn dot(a: &[f64], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x * y as f64).sum()
}

/// Asserts `|got - want| <= atol + rtol·|want|` element-wise, naming the worst element.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0usize, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let excess = (g as f64 - w).abs() - (atol + rtol * w.abs());
        if excess > worst.1 || !g.is_finite() {
            worst = (i, excess.max(f64::MIN_POSITIVE));
        }
    }
    let i = worst.0;
    assert!(
        worst.1 <= 0.0,
        "{what}: element {i} is {} but should be {} (rtol {rtol}, atol {atol})",
        got[i],
        want[i]
    );
}

/// Seconds of CPU time on `clock` (`libc::CLOCK_PROCESS_CPUTIME_ID` or
/// `CLOCK_THREAD_CPUTIME_ID`): what a loaded machine does not steal from a speed test.
pub fn cpu_seconds(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the memory it is given.
    let ok = unsafe { libc::clock_gettime(clock, &mut ts) } == 0;
    assert!(ok, "clock_gettime failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The tensors transformers computed for the Llama-family kernels
/// (`scripts/reference/llama_kernels.py`, committed as
/// `tests/fixtures/kernels/llama_kernels.safetensors`).
pub struct LlamaFixture {
    bytes: Vec<u8>,
}

impl LlamaFixture {
    pub fn load() -> LlamaFixture {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/kernels/llama_kernels.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        LlamaFixture { bytes }
    }

    fn tensor(&self, name: &str) -> safetensors::tensor::TensorView<'_> {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).expect("a safetensors file");
        st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// An F32 tensor's values.
    pub fn f32(&self, name: &str) -> Vec<f32> {
        let t = self.tensor(name);
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// An F32 tensor's values in f64, for [`assert_close`].
    pub fn f64(&self, name: &str) -> Vec<f64> {
        to_f64(&self.f32(name))
    }

    /// The pass shape stored as `[B, T, NH, KV, HS]` (I32).
    pub fn dims(&self, name: &str) -> crate::kernels::Dims {
        let t = self.tensor(name);
        assert_eq!(t.dtype(), safetensors::Dtype::I32, "{name}");
        let v: Vec<usize> = t
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .collect();
        let [b, t, nh, kv, hs] = v[..] else {
            panic!("{name}: not [B, T, NH, KV, HS]")
        };
        crate::kernels::Dims::new(b, t, nh * hs, nh).with_heads(kv, hs)
    }
}
