use super::*;
use std::path::Path;

fn sample_metadata() -> Vec<(String, Value)> {
    vec![
        ("general.architecture".into(), Value::String("gpt2".into())),
        ("a.u8".into(), Value::U8(200)),
        ("a.i8".into(), Value::I8(-5)),
        ("a.u16".into(), Value::U16(60000)),
        ("a.i16".into(), Value::I16(-30000)),
        ("a.u32".into(), Value::U32(4_000_000_000)),
        ("a.i32".into(), Value::I32(-2_000_000_000)),
        ("a.f32".into(), Value::F32(1.5e-5)),
        ("a.bool".into(), Value::Bool(true)),
        ("a.u64".into(), Value::U64(u64::MAX)),
        ("a.i64".into(), Value::I64(i64::MIN)),
        ("a.f64".into(), Value::F64(-2.25)),
        ("a.strings".into(), Value::strings(["Ġt", "", "日本"])),
        ("a.ints".into(), Value::i32s([1, -2, 3])),
        (
            "a.nested".into(),
            Value::Array(
                ValueType::Array,
                vec![
                    Value::i32s([7]),
                    Value::Array(ValueType::Bool, vec![Value::Bool(false)]),
                ],
            ),
        ),
    ]
}

fn write_sample(path: &Path, alignment: Option<u32>) -> Vec<Vec<f32>> {
    let mut meta = sample_metadata();
    if let Some(a) = alignment {
        meta.push(("general.alignment".into(), Value::U32(a)));
    }
    let specs = vec![
        TensorSpec::new("x.f32", &[3, 5], GgmlType::F32),
        TensorSpec::new("x.f16", &[2, 4], GgmlType::F16),
        TensorSpec::new("x.bf16", &[7], GgmlType::BF16),
        TensorSpec::new("x.q8_0", &[3, 64], GgmlType::Q8_0),
    ];
    let data: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(k, s)| {
            (0..s.n_elements())
                .map(|i| (i as f32 * 0.37 + k as f32).sin() * 3.0)
                .collect()
        })
        .collect();
    let mut w = GgufWriter::create(path, &meta, specs).unwrap();
    for d in &data[..3] {
        w.write_f32(d).unwrap();
    }
    // The last tensor in two pieces of whole rows.
    w.write_f32(&data[3][..64]).unwrap();
    w.write_f32(&data[3][64..]).unwrap();
    w.finish().unwrap();
    data
}

/// The codes are the format's (`gguf_type`: UINT8 0, ..., BOOL 7, STRING 8, ARRAY 9,
/// ..., FLOAT64 12), written and read back alike.
#[test]
fn value_type_codes_are_the_formats() {
    let codes = [
        (ValueType::U8, 0),
        (ValueType::I32, 5),
        (ValueType::Bool, 7),
        (ValueType::String, 8),
        (ValueType::Array, 9),
        (ValueType::F64, 12),
    ];
    for (ty, code) in codes {
        assert_eq!((ty as u32, ValueType::from_code(code)), (code, Some(ty)));
    }
    assert_eq!(ValueType::from_code(13), None);
}

#[test]
fn written_files_read_back_with_every_value_type() {
    let dir = tempfile::tempdir().unwrap();
    for alignment in [None, Some(64), Some(1)] {
        let path = dir.path().join("m.gguf");
        let data = write_sample(&path, alignment);
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.header.version, 3);
        assert_eq!(f.header.alignment, alignment.unwrap_or(32) as u64);
        let mut expected = sample_metadata();
        if let Some(a) = alignment {
            expected.push(("general.alignment".into(), Value::U32(a)));
        }
        assert_eq!(f.header.metadata, expected);
        assert_eq!(f.header.data_start % f.header.alignment, 0);
        let names: Vec<&str> = f.header.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["x.f32", "x.f16", "x.bf16", "x.q8_0"]);
        let t = f.tensor("x.f32").unwrap();
        assert_eq!((t.dims.clone(), t.shape()), (vec![5, 3], vec![3, 5]));
        assert_eq!(f.tensor_f32(t).unwrap(), data[0], "f32 is exact");
        for t in &f.header.tensors {
            assert_eq!(t.offset % f.header.alignment, 0, "{}", t.name);
        }
        let f16 = f.tensor_f32(f.tensor("x.f16").unwrap()).unwrap();
        for (a, b) in f16.iter().zip(&data[1]) {
            assert!((a - b).abs() <= b.abs() / 1024.0, "{a} {b}");
        }
        let bf16 = f.tensor_f32(f.tensor("x.bf16").unwrap()).unwrap();
        for (a, b) in bf16.iter().zip(&data[2]) {
            assert!((a - b).abs() <= b.abs() / 128.0, "{a} {b}");
        }
        let q8 = f.tensor_f32(f.tensor("x.q8_0").unwrap()).unwrap();
        for (a, b) in q8.iter().zip(&data[3]) {
            assert!((a - b).abs() <= 3.0 / 127.0, "{a} {b}");
        }
    }
}

#[test]
fn every_truncation_is_refused_with_a_message_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_sample(&path, None);
    let bytes = std::fs::read(&path).unwrap();
    // The last tensor's data ends before the final padding: cuts inside the padding
    // leave a readable file.
    let f = GgufFile::open(&path).unwrap();
    let last = f.header.tensors.last().unwrap();
    let end = (f.header.data_start + last.offset + last.n_bytes().unwrap()) as usize;
    for len in 0..end {
        let err = match Header::parse(&bytes[..len]) {
            Ok(_) => panic!("a file cut at {len} of {} bytes was accepted", bytes.len()),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            err.contains("truncated") || err.contains("magic"),
            "at {len}: {err}"
        );
    }
    assert!(Header::parse(&bytes[..end]).is_ok());
    let cut = dir.path().join("cut.gguf");
    for len in [0, 7, 30, end / 2, end - 1] {
        std::fs::write(&cut, &bytes[..len]).unwrap();
        let err = format!("{:#}", GgufFile::open(&cut).err().unwrap());
        assert!(
            err.starts_with(&format!("{} is not a valid GGUF file: ", cut.display())),
            "{err}"
        );
    }
}

#[test]
fn damaged_headers_are_refused_without_panics() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_sample(&path, None);
    let bytes = std::fs::read(&path).unwrap();
    let header_len = GgufFile::open(&path).unwrap().header.data_start as usize;
    // Every byte of the header set to each of a few values: never a panic.
    let mut refused = 0;
    for at in 0..header_len {
        for v in [0x00, 0x01, 0x7f, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[at] = v;
            match Header::parse(&b) {
                Err(_) => refused += 1,
                Ok(h) => {
                    for t in &h.tensors {
                        assert!(t
                            .n_bytes()
                            .is_none_or(|n| h.data_start + t.offset + n <= b.len() as u64));
                    }
                }
            }
        }
    }
    assert!(refused > header_len, "{refused}");
}

#[test]
fn specific_damage_gets_specific_messages() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    let check = |bytes: &[u8], expect: &str| {
        std::fs::write(&path, bytes).unwrap();
        let err = format!("{:#}", GgufFile::open(&path).err().expect("refused"));
        assert!(err.contains(expect), "{err}");
    };
    check(b"GGML\x03\0\0\0", "magic");
    check(b"GGUF\x01\0\0\0", "version 1");
    check(b"GGUF\0\0\0\x03", "big-endian");
    check(b"GGUF\x09\0\0\0", "version 9");
    let mut huge = b"GGUF\x03\0\0\0".to_vec();
    huge.extend_from_slice(&0u64.to_le_bytes());
    huge.extend_from_slice(&u64::MAX.to_le_bytes());
    check(&huge, "claims 18446744073709551615 metadata entries");
    // A tensor with an unknown type code is listed; reading it names the code.
    let mut file = b"GGUF\x03\0\0\0".to_vec();
    file.extend_from_slice(&1u64.to_le_bytes());
    file.extend_from_slice(&0u64.to_le_bytes());
    file.extend_from_slice(&3u64.to_le_bytes());
    file.extend_from_slice(b"w.x");
    file.extend_from_slice(&1u32.to_le_bytes());
    file.extend_from_slice(&32u64.to_le_bytes());
    file.extend_from_slice(&99u32.to_le_bytes());
    file.extend_from_slice(&0u64.to_le_bytes());
    file.resize(64 + 32, 0);
    std::fs::write(&path, &file).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let err = format!("{:#}", f.tensor_f32(&f.header.tensors[0]).unwrap_err());
    assert!(
        err.contains("w.x is stored as type code 99") && err.contains("x.gguf"),
        "{err}"
    );
    // A known type nanogpt does not decode is named.
    file[8 + 16 + 8 + 3 + 4 + 8..][..4].copy_from_slice(&20u32.to_le_bytes());
    std::fs::write(&path, &file).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let err = format!("{:#}", f.tensor_f32(&f.header.tensors[0]).unwrap_err());
    assert!(err.contains("w.x is stored as IQ4_NL"), "{err}");
}

#[test]
fn a_writer_dropped_before_finish_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, "previous").unwrap();
    let specs = vec![TensorSpec::new("t", &[32], GgmlType::Q8_0)];
    let w = GgufWriter::create(&path, &[], specs).unwrap();
    drop(w);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "previous");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    // finish() before the data is refused, and the previous file stays.
    let specs = vec![TensorSpec::new("t", &[32], GgmlType::Q8_0)];
    let w = GgufWriter::create(&path, &[], specs).unwrap();
    assert!(w.finish().is_err());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "previous");
}
