//! The one place that maps GGUF tensor types to weight formats: adding a format is one line
//! here (and its file). The command-line names of the types (`q4_k`) come from the same
//! table, as gguf names them.

use gguf::{GgmlType, TensorData};

use super::*;

/// Builds a matrix of `rows` × `cols` from a tensor's type and bytes.
type Constructor = fn(GgmlType, usize, usize, &TensorData, &Repack<'_>) -> Box<dyn WeightMatrix>;

fn boxed<F: QuantFormat>(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: &TensorData,
    _: &Repack<'_>,
) -> Box<dyn WeightMatrix> {
    Box::new(QuantMatrix::<F>::new(ty, rows, cols, data))
}

/// A format repacked into tiles of sixteen rows where the CPU runs its rows-in-lanes
/// kernel (`interleaved.rs`), else kept as in the file.
#[cfg(target_arch = "x86_64")]
fn tiled<F: interleaved::Interleave>(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: &TensorData,
    repack: &Repack<'_>,
) -> Box<dyn WeightMatrix> {
    if interleaved::applies::<F>(rows) {
        return Box::new(interleaved::InterleavedMatrix::<F>::new(
            ty, rows, cols, data, repack,
        ));
    }
    boxed::<F>(ty, rows, cols, data, repack)
}

/// Off x86-64 there are no tiles.
#[cfg(not(target_arch = "x86_64"))]
use boxed as tiled;

/// Every GGUF type a matrix can be loaded from, and the format that multiplies it.
const FORMATS: &[(GgmlType, Constructor)] = &[
    (GgmlType::F32, boxed::<float::F32>),
    (GgmlType::F16, boxed::<float::F32>),
    (GgmlType::BF16, boxed::<float::F32>),
    (GgmlType::Q4_0, boxed::<q4_0::Q4_0>),
    (GgmlType::Q4_1, boxed::<q4_1::Q4_1>),
    (GgmlType::Q8_0, boxed::<q8_0::Q8_0>),
    (GgmlType::Q5_0, boxed::<q5::Q5_0>),
    (GgmlType::Q5_1, boxed::<q5::Q5_1>),
    (GgmlType::Q2_K, boxed::<low_kquants::Q2K>),
    (GgmlType::Q3_K, boxed::<low_kquants::Q3K>),
    (GgmlType::Q4_K, tiled::<kquants::Q4K>),
    (GgmlType::Q5_K, boxed::<kquants::Q5K>),
    (GgmlType::Q6_K, tiled::<kquants::Q6K>),
    (GgmlType::IQ4_NL, boxed::<iq4_nl::IQ4NL>),
];

/// A matrix of GGUF type `ty` (`data`: `rows` rows of `cols` elements, `cols` whole
/// blocks), or `None` if no format here multiplies it.
pub fn matrix(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: &TensorData,
    repack: &Repack<'_>,
) -> Option<Box<dyn WeightMatrix>> {
    let (_, make) = FORMATS.iter().find(|(t, _)| *t == ty)?;
    Some(make(ty, rows, cols, data, repack))
}

/// The types a matrix can be loaded from, in the table's order.
pub fn types() -> impl Iterator<Item = GgmlType> {
    FORMATS.iter().map(|&(ty, _)| ty)
}

/// A type's command-line name: gguf's name in lower case (`q4_k`).
pub fn name(ty: GgmlType) -> String {
    gguf::ggml_type_name(ty.id()).to_ascii_lowercase()
}

/// The loadable type named `name` (as [`name`] writes it; any case).
pub fn by_name(name: &str) -> Option<GgmlType> {
    types().find(|&ty| gguf::ggml_type_name(ty.id()).eq_ignore_ascii_case(name))
}

/// Every loadable type's name, comma-separated (for error messages).
pub fn names() -> String {
    types().map(name).collect::<Vec<_>>().join(", ")
}
