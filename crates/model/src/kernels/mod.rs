//! The CPU kernels: SIMD bodies per instruction set and their portable definitions, the
//! product driver ([`matmul`]), CPU detection, activation quantization, attention,
//! activations and RoPE. Nothing here knows a weight format's place in a model: the formats
//! (`crate::quant`) call the bodies they choose.

mod activation;
mod attention;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_kquants;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_low_kquants;
#[cfg(target_arch = "x86_64")]
pub(crate) mod cpu;
mod f32_dot;
mod libm_expf;
mod matmul;
mod quant_dot;
mod quantize;
mod rope;
#[cfg(target_arch = "x86_64")]
mod tile_out;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512_kquants;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512_low_kquants;

pub use activation::{ggml_expf, silu, swiglu, table_glu};
pub use attention::{dot_f16_ggml, KvElem};
#[cfg(target_arch = "x86_64")]
pub use cpu::wide_available;
pub use f32_dot::dot_f32;
pub use matmul::{matmul, matmul_group, ActKind, WeightRows};
pub use quant_dot::{
    dot_q4_0, dot_q4_1, dot_q8_0, q4_0_product, q4_0_token_major, q4_1_product, q4_1_token_major,
    q8_0_product, q8_0_token_major, rows_q4_0, rows_q4_1, rows_q8_0, scalar,
};
pub use quantize::{
    quantize_blocks_q8_1, quantize_blocks_q8_k, quantize_row_q8_1, quantize_row_q8_1_scalar,
    quantize_row_q8_k, quantize_row_q8_k_portable,
};
pub use rope::rope_row;

#[cfg(test)]
mod tests;
