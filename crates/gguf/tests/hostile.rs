//! Hostile and malformed GGUF inputs: each is a clear error, never a panic or a huge
//! allocation.

use gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetaValue};

fn valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("llama".into()));
    w.meta(
        "test.list",
        MetaValue::Array(vec![MetaValue::U32(1), MetaValue::U32(2)]),
    );
    let vals: Vec<f32> = (0..64).map(|i| i as f32 / 10.0).collect();
    w.tensor_f32("a", &[32, 2], GgmlType::Q8_0, &vals);
    w.tensor_f32("b", &[64], GgmlType::F32, &vals);
    w.to_bytes()
}

#[test]
fn valid_file_roundtrips() {
    let f = GgufFile::parse(valid_file()).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_array("test.list").unwrap().len(), 2);
    let b = f.tensor("b").unwrap();
    assert_eq!(f.tensor_f32(b)[63], 6.3);
    let a = f.tensor("a").unwrap();
    assert_eq!(a.ty, GgmlType::Q8_0);
    let deq = f.tensor_f32(a);
    assert!((deq[40] - 4.0).abs() < 0.03);
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = valid_file();
    for cut in 0..bytes.len() {
        let r = GgufFile::parse(bytes[..cut].to_vec());
        assert!(r.is_err(), "truncated at {cut} of {} parsed", bytes.len());
    }
}

#[test]
fn bad_magic() {
    let mut bytes = valid_file();
    bytes[0] = b'X';
    assert!(matches!(
        GgufFile::parse(bytes),
        Err(GgufError::BadMagic(_))
    ));
}

#[test]
fn bad_version() {
    let mut bytes = valid_file();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        GgufFile::parse(bytes),
        Err(GgufError::UnsupportedVersion(1))
    ));
}

#[test]
fn absurd_counts_are_rejected_before_allocation() {
    let mut bytes = valid_file();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        GgufFile::parse(bytes),
        Err(GgufError::Implausible { .. })
    ));
    let mut bytes = valid_file();
    bytes[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(matches!(
        GgufFile::parse(bytes),
        Err(GgufError::Implausible { .. })
    ));
}

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

fn push_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

#[test]
fn absurd_string_and_array_lengths() {
    let mut b = header(0, 1);
    b.extend_from_slice(&(u64::MAX - 3).to_le_bytes());
    b.extend_from_slice(&[0u8; 64]);
    assert!(matches!(
        GgufFile::parse(b),
        Err(GgufError::Truncated { .. })
    ));

    let mut b = header(0, 1);
    push_str(&mut b, "k");
    b.extend_from_slice(&9u32.to_le_bytes()); // array
    b.extend_from_slice(&4u32.to_le_bytes()); // of u32
    b.extend_from_slice(&(1u64 << 40).to_le_bytes());
    b.extend_from_slice(&[0u8; 64]);
    assert!(matches!(
        GgufFile::parse(b),
        Err(GgufError::Implausible { .. })
    ));
}

#[test]
fn unknown_value_and_tensor_types() {
    let mut b = header(0, 1);
    push_str(&mut b, "k");
    b.extend_from_slice(&99u32.to_le_bytes());
    b.extend_from_slice(&[0u8; 16]);
    assert!(matches!(
        GgufFile::parse(b),
        Err(GgufError::UnknownValueType(99))
    ));

    let mut b = header(1, 0);
    push_str(&mut b, "t");
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&32u64.to_le_bytes());
    b.extend_from_slice(&77u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&[0u8; 256]);
    assert!(matches!(
        GgufFile::parse(b),
        Err(GgufError::UnknownTensorType { ty: 77, .. })
    ));
}

fn one_tensor(dims: &[u64], ty: u32, offset: u64, data: usize) -> Vec<u8> {
    let mut b = header(1, 0);
    push_str(&mut b, "t");
    b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    b.resize(b.len().div_ceil(32) * 32 + data, 0);
    b
}

#[test]
fn tensor_data_out_of_bounds() {
    // 64 f32 = 256 bytes, file holds 128.
    let r = GgufFile::parse(one_tensor(&[64], 0, 0, 128));
    assert!(matches!(r, Err(GgufError::BadTensor { .. })), "{r:?}");
    // Offset far past the end.
    let r = GgufFile::parse(one_tensor(&[8], 0, 1 << 40, 4096));
    assert!(matches!(r, Err(GgufError::BadTensor { .. })), "{r:?}");
    // Offset that overflows when added.
    let r = GgufFile::parse(one_tensor(&[8], 0, u64::MAX - 31, 4096));
    assert!(matches!(r, Err(GgufError::BadTensor { .. })), "{r:?}");
    // Dimensions whose product overflows.
    let r = GgufFile::parse(one_tensor(&[1 << 40, 1 << 40], 0, 0, 64));
    assert!(matches!(r, Err(GgufError::BadTensor { .. })), "{r:?}");
    // Quantized row not a whole number of blocks.
    let r = GgufFile::parse(one_tensor(&[31], 8, 0, 64));
    assert!(matches!(r, Err(GgufError::BadTensor { .. })), "{r:?}");
    // Zero or too many dimensions.
    let r = GgufFile::parse(one_tensor(&[], 0, 0, 64));
    assert!(matches!(r, Err(GgufError::BadTensor { .. })), "{r:?}");
    let r = GgufFile::parse(one_tensor(&[1, 1, 1, 1, 1], 0, 0, 64));
    assert!(matches!(r, Err(GgufError::BadTensor { .. })), "{r:?}");
    // In bounds works.
    GgufFile::parse(one_tensor(&[8], 0, 0, 32)).unwrap();
}

#[test]
fn errors_have_readable_messages() {
    let e = GgufFile::parse(b"GGU".to_vec()).unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
    let e = GgufFile::open("/nonexistent/x.gguf")
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/x.gguf"), "{e}");
}
