//! GGUF files: a reader that treats every byte as hostile, and a writer for the synthetic
//! models that tests generate.
//!
//! The reader never trusts a count or an offset: every length is checked against the bytes
//! that remain before anything is allocated for it, so a malicious header cannot make the
//! process allocate more than the file's own size.

// Memory safety here rests on the compiler alone but for `mapping`, which maps the model
// file (its safety argument and tests are there); the only other unsafe code in the
// workspace is the SIMD kernels of the `model` crate.
#![deny(unsafe_code)]

mod float;
mod iq4_nl;
mod legacy;
mod low_kquants;
#[allow(unsafe_code)]
mod mapping;
mod quants;
mod reader;
mod types;
mod writer;

pub use iq4_nl::KVALUES_IQ4NL;
pub use low_kquants::{q2_bits, q3_high_bit, q3_k_scales};
pub use quants::{k4_scale_min, q6_at, QK_K};
pub use reader::{GgufFile, Load, TensorData, TensorInfo};
pub use types::{ggml_type_name, GgmlType, MetaValue};
pub use writer::GgufWriter;

/// Everything that can be wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file (magic {0:#010x})")]
    BadMagic(u32),
    #[error("unsupported GGUF version {0} (1 is obsolete; 2 and 3 are supported)")]
    UnsupportedVersion(u32),
    #[error("file truncated: needed {needed} bytes at offset {offset}, file has {len}")]
    Truncated { offset: u64, needed: u64, len: u64 },
    #[error("implausible {what}: {value} (limit {limit})")]
    Implausible {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    #[error("unknown metadata value type {0}")]
    UnknownValueType(u32),
    #[error(
        "tensor {name}: ggml type {} ({ty}) is not supported (kvwarden loads F32, F16, BF16, \
         Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)",
        types::ggml_type_name(*ty)
    )]
    UnknownTensorType { name: String, ty: u32 },
    #[error("tensor {name}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("string is not valid UTF-8 at offset {0}")]
    BadUtf8(u64),
    #[error("duplicate {what} {name:?}")]
    Duplicate { what: &'static str, name: String },
    #[error("metadata key {key:?}: {reason}")]
    Metadata { key: String, reason: String },
}

pub type Result<T> = std::result::Result<T, GgufError>;
