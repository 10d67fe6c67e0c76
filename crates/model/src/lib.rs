//! A llama-family forward pass on CPU (llama, qwen2, qwen3, gemma3): GGUF weights kept quantized, integer dot-product
//! kernels, batched prompt processing, attention over the paged KV pool.
//!
//! Every output row is computed by the same sequence of floating-point operations whatever
//! else is in the batch (kernels split work across threads by output row only, never
//! across a reduction), so a greedy request gives the same tokens alone or batched.

mod attention;
mod batch;
pub mod blocks;
pub mod config;
pub mod forward;
pub mod gemma3;
pub mod kernels;
mod kv_rotation;
pub mod lora;
pub mod quant;
pub mod sampling;
pub mod synth;
pub mod weights;

pub use batch::{BatchItem, Logits, LogitsWanted};
pub use config::LlamaConfig;
pub use forward::Model;
pub use sampling::{History, Penalties, Sampler, SamplingParams};

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tensor {name}: {reason}")]
    Tensor { name: String, reason: String },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("the LoRA adapter was not loaded for this model's shapes")]
    AdapterDoesNotFit,
    #[error("KV cache: {0}")]
    Kv(#[from] kv::KvError),
}
