//! ggml's tensor encodings to and from f32.
//!
//! Dequantization of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
//! Q6_K gives the same f32 bits as the `gguf` Python package's
//! `gguf.quants.dequantize` (and so as llama.cpp's reference code): each value is
//! computed with the same f32 operations in the same order (a scale times a
//! quant, then minus or plus an offset, each product rounded to f32; Rust never
//! fuses them into one multiply-add). Quantization to F16, BF16 and Q8_0 gives the
//! bytes of `gguf.quants.quantize` and llama.cpp's `quantize_row_q8_0_ref`.
//! `tests/fixtures/gguf/quants.gguf`, written by
//! `scripts/reference/gguf_fixtures.py`, holds random blocks of every type with
//! the package's results.
//!
//! Block layouts (all little-endian; `d`, `m`, `dmin` are f16 scales):
//!
//! | type | elements | bytes |
//! |---|---|---|
//! | Q4_0 | 32 | `d`, 16 bytes of 4-bit quants (low nibbles: elements 0-15, high: 16-31) |
//! | Q4_1 | 32 | `d`, `m`, 16 bytes of 4-bit quants |
//! | Q5_0 | 32 | `d`, 32 high bits (u32), 16 bytes of low nibbles |
//! | Q5_1 | 32 | `d`, `m`, 32 high bits, 16 bytes of low nibbles |
//! | Q8_0 | 32 | `d`, 32 `i8` |
//! | Q4_K | 256 | `d`, `dmin`, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles |
//! | Q5_K | 256 | as Q4_K, then 32 bytes of high bits before the nibbles |
//! | Q6_K | 256 | 128 bytes of low nibbles, 64 of 2-bit highs, 16 `i8` scales, `d` |

use super::types::GgmlType;
use half::f16;
use rayon::prelude::*;

/// Blocks per parallel task.
const TASK_BLOCKS: usize = 4096;

/// Decodes `bytes` of type `ty` into `out` (`out.len()` elements; `bytes` holds
/// exactly their blocks). Panics on a type [`GgmlType::can_dequantize`] refuses or
/// on mismatched lengths: callers check both.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let (block, size) = ty.block();
    assert!(ty.can_dequantize(), "{ty} cannot be dequantized");
    assert!(
        out.len().is_multiple_of(block) && bytes.len() == out.len() / block * size,
        "{} bytes of {ty} for {} elements",
        bytes.len(),
        out.len()
    );
    let decode: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => f32_block,
        GgmlType::F16 => f16_block,
        GgmlType::BF16 => bf16_block,
        GgmlType::Q4_0 => q4_0_block,
        GgmlType::Q4_1 => q4_1_block,
        GgmlType::Q5_0 => q5_0_block,
        GgmlType::Q5_1 => q5_1_block,
        GgmlType::Q8_0 => q8_0_block,
        GgmlType::Q4_K => q4_k_block,
        GgmlType::Q5_K => q5_k_block,
        GgmlType::Q6_K => q6_k_block,
        _ => unreachable!("checked by can_dequantize"),
    };
    // Scalar types decode a whole task's elements per call, blocks one at a time.
    let blocks_per_task = match block {
        1 => 1 << 16,
        _ => TASK_BLOCKS,
    };
    out.par_chunks_mut(block * blocks_per_task)
        .zip(bytes.par_chunks(size * blocks_per_task))
        .for_each(|(out, bytes)| match block {
            1 => decode(bytes, out),
            _ => {
                for (o, b) in out.chunks_exact_mut(block).zip(bytes.chunks_exact(size)) {
                    decode(b, o);
                }
            }
        });
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

fn f32_block(b: &[u8], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
    }
}

fn f16_block(b: &[u8], out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = f16_at(b, 2 * i);
    }
}

fn bf16_block(b: &[u8], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16);
    }
}

/// Element `j` (0..32) of a 32-element block's 16 bytes of nibbles.
fn nibble(qs: &[u8], j: usize) -> u8 {
    match j < 16 {
        true => qs[j] & 0x0F,
        false => qs[j - 16] >> 4,
    }
}

fn q4_0_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * (nibble(&b[2..], j) as i32 - 8) as f32;
    }
}

fn q4_1_block(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * nibble(&b[4..], j) as f32 + m;
    }
}

/// The 5-bit quant `j` of a Q5 block whose high bits are `qh` and nibbles `qs`.
fn five_bits(qh: u32, qs: &[u8], j: usize) -> u8 {
    nibble(qs, j) | ((((qh >> j) & 1) as u8) << 4)
}

fn q5_0_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * (five_bits(qh, &b[6..], j) as i32 - 16) as f32;
    }
}

fn q5_1_block(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * five_bits(qh, &b[8..], j) as f32 + m;
    }
}

fn q8_0_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

/// The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block's 12 scale bytes.
fn k_scales(s: &[u8]) -> [(u8, u8); 8] {
    let mut out = [(0, 0); 8];
    for j in 0..4 {
        out[j] = (s[j] & 0x3F, s[j + 4] & 0x3F);
        out[j + 4] = (
            (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30),
            (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30),
        );
    }
    out
}

fn q4_k_block(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[16..144];
    for (i, (sc, m)) in k_scales(&b[4..16]).into_iter().enumerate() {
        let (scale, offset) = (d * sc as f32, dmin * m as f32);
        let bytes = &qs[32 * (i / 2)..32 * (i / 2) + 32];
        let shift = 4 * (i % 2);
        for (o, &q) in out[32 * i..32 * i + 32].iter_mut().zip(bytes) {
            *o = scale * ((q >> shift) & 0x0F) as f32 - offset;
        }
    }
}

fn q5_k_block(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for (i, (sc, m)) in k_scales(&b[4..16]).into_iter().enumerate() {
        let (scale, offset) = (d * sc as f32, dmin * m as f32);
        let bytes = &qs[32 * (i / 2)..32 * (i / 2) + 32];
        let shift = 4 * (i % 2);
        for (l, o) in out[32 * i..32 * i + 32].iter_mut().enumerate() {
            let q = ((bytes[l] >> shift) & 0x0F) | (((qh[l] >> i) & 1) << 4);
            *o = scale * q as f32 - offset;
        }
    }
}

fn q6_k_block(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (p, o) in out.iter_mut().enumerate() {
        // Halves of 128; in each, element r takes its low 4 bits from ql[64h + r % 64]
        // (low nibble for r < 64) and its high 2 bits from qh[32h + r % 32].
        let (h, r) = (p / 128, p % 128);
        let low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
        let high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
        let q = (low | (high << 4)) as i32 - 32;
        let scale = d * scales[p / 16] as i8 as f32;
        *o = scale * q as f32;
    }
}

/// Types nanogpt writes.
pub fn can_quantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
    )
}

/// Encodes `src` as `ty` (one of [`can_quantize`]'s) into `out`, which must be
/// exactly the encoded size. `src` is a whole number of blocks.
pub fn quantize(ty: GgmlType, src: &[f32], out: &mut [u8]) {
    let (block, size) = ty.block();
    assert!(can_quantize(ty), "{ty} cannot be written");
    assert!(
        src.len().is_multiple_of(block) && out.len() == src.len() / block * size,
        "{} bytes of {ty} for {} elements",
        out.len(),
        src.len()
    );
    let encode: fn(&[f32], &mut [u8]) = match ty {
        GgmlType::F32 => |s, o| {
            for (o, x) in o.chunks_exact_mut(4).zip(s) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        },
        GgmlType::F16 => |s, o| {
            for (o, x) in o.chunks_exact_mut(2).zip(s) {
                o.copy_from_slice(&f16::from_f32(*x).to_bits().to_le_bytes());
            }
        },
        GgmlType::BF16 => |s, o| {
            for (o, x) in o.chunks_exact_mut(2).zip(s) {
                o.copy_from_slice(&to_bf16(*x).to_le_bytes());
            }
        },
        GgmlType::Q8_0 => |s, o| {
            for (o, x) in o.chunks_exact_mut(34).zip(s.chunks_exact(32)) {
                q8_0_encode(x, o);
            }
        },
        _ => unreachable!("checked by can_quantize"),
    };
    let blocks_per_task = match block {
        1 => 1 << 16,
        _ => TASK_BLOCKS,
    };
    src.par_chunks(block * blocks_per_task)
        .zip(out.par_chunks_mut(size * blocks_per_task))
        .for_each(|(s, o)| encode(s, o));
}

/// f32 to bf16, rounding to nearest even and keeping NaNs NaN (quiet), as ggml's
/// `ggml_compute_fp32_to_bf16`.
pub fn to_bf16(x: f32) -> u16 {
    let mut n = x.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        n = (n & 0xffff_0000) | (64 << 16);
    }
    ((n as u64 + (0x7fff + ((n >> 16) & 1)) as u64) >> 16) as u16
}

/// One Q8_0 block: the scale `max |x| / 127` (stored as f16), each value times its
/// f32 inverse rounded half away from zero.
fn q8_0_encode(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    out[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(x) {
        *o = round_half_away(v * id) as i8 as u8;
    }
}

/// C's `roundf` (halves away from zero), in operations that vectorise on any
/// x86-64 (the libm calls do not): the integer part by conversion to `i32`, plus
/// the sign where the rest is at least ½. Exact: from 2²³ on every f32 is an
/// integer (returned as it is), and below it the conversion and `x - trunc(x)` are
/// exact.
fn round_half_away(x: f32) -> f32 {
    if x.is_nan() || x.abs() >= 8_388_608.0 {
        return x;
    }
    let t = x as i32 as f32;
    match (x - t).abs() >= 0.5 {
        true => t + 1f32.copysign(x),
        false => t.copysign(x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_nan() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is half-way between bf16 1.0 and the next value: ties to even.
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(to_bf16(f32::INFINITY), 0x7f80);
        assert!(f32::from_bits((to_bf16(f32::NAN) as u32) << 16).is_nan());
        // A NaN whose payload is only in the low bits stays NaN, not infinity.
        assert_eq!(to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
    }

    #[test]
    fn rounding_is_cs_roundf() {
        let below_half = 0.5f32.next_down();
        for x in [
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -2.5,
            below_half,
            -below_half,
            126.5,
            127.49,
            8388607.5,
            8388608.0,
            1e20,
            -1e20,
            0.7,
            -0.3,
        ] {
            assert_eq!(round_half_away(x).to_bits(), x.round().to_bits(), "{x}");
        }
        for i in 0..100_000u32 {
            let x = f32::from_bits(i.wrapping_mul(2_654_435_761));
            if x.is_finite() {
                assert_eq!(round_half_away(x), x.round(), "{x}");
            }
        }
    }

    #[test]
    fn q8_0_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 31.5) / 7.0)
            .collect();
        let mut q = vec![0u8; 68];
        quantize(GgmlType::Q8_0, &x, &mut q);
        let mut back = vec![0f32; 64];
        dequantize(GgmlType::Q8_0, &q, &mut back);
        for (block, (x, y)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
            let d = f16_at(&q, 34 * block);
            for (a, b) in x.iter().zip(y) {
                assert!((a - b).abs() <= 0.5 * d * 1.01 + 1e-3 * d, "{a} {b} {d}");
            }
        }
        // An all-zero block has scale 0 and decodes to zeros.
        let mut z = vec![0u8; 34];
        quantize(GgmlType::Q8_0, &[0.0; 32], &mut z);
        assert!(z.iter().all(|&b| b == 0));
    }
}
