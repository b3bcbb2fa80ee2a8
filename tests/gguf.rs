//! GGUF against the `gguf` Python package (llama.cpp's gguf-py), through fixtures
//! it wrote (scripts/reference/gguf_fixtures.py): dequantization bit for bit,
//! quantization byte for byte, and a tiny GPT-2 file read into logits.

mod common;

use nanogpt::gguf::{quants, GgmlType, GgufFile};

fn quants_fixture() -> GgufFile {
    GgufFile::open(&common::fixture("gguf/quants.gguf")).unwrap()
}

#[test]
fn dequantization_matches_the_gguf_package_bit_for_bit() {
    let f = quants_fixture();
    let types = [
        "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k",
    ];
    for name in types {
        let raw = f.tensor(&format!("{name}.raw")).unwrap();
        let expected = f.tensor(&format!("{name}.expected")).unwrap();
        assert_eq!(raw.ty.unwrap().name().to_lowercase(), name);
        assert_eq!(raw.dims, expected.dims, "{name}");
        let ours = f.tensor_f32(raw).unwrap();
        let theirs = f.tensor_f32(expected).unwrap();
        let differ = ours
            .iter()
            .zip(&theirs)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{name}: {differ} of {} values differ",
            ours.len()
        );
        assert!(theirs.iter().all(|x| x.is_finite()), "{name}");
    }
}

#[test]
fn quantization_matches_the_gguf_package_byte_for_byte() {
    let f = quants_fixture();
    for (name, ty) in [
        ("f16", GgmlType::F16),
        ("bf16", GgmlType::BF16),
        ("q8_0", GgmlType::Q8_0),
    ] {
        let input = f
            .tensor_f32(f.tensor(&format!("{name}.input")).unwrap())
            .unwrap();
        let expected = f.tensor(&format!("{name}.quantized")).unwrap();
        assert_eq!(expected.ty, Some(ty));
        let theirs = f.tensor_bytes(expected).unwrap();
        let mut ours = vec![0u8; theirs.len()];
        quants::quantize(ty, &input, &mut ours);
        let differ: Vec<usize> = (0..ours.len()).filter(|&i| ours[i] != theirs[i]).collect();
        assert!(differ.is_empty(), "{name}: bytes {differ:?} differ");
    }
}

