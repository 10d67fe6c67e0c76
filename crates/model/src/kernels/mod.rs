//! The CPU kernels: SIMD bodies per instruction set and their portable definitions, the
//! product driver ([`matmul`]), CPU detection, activation quantization, attention,
//! activations and RoPE. Nothing here knows a weight format's place in a model: the formats
//! (`crate::quant`) call the bodies they choose.
//!
//! # Batch invariance
//!
//! Work is split by output row or by token, never inside a reduction, so a row's arithmetic
//! is the same in any batch. Decode-sized products (under 64 tokens, `matmul.rs`) are split
//! by weight rows, so each weight is read once per step; prefill-sized ones by blocks of 32
//! tokens, each walking the weights in 64-row blocks that stay in cache and writing its own
//! slice of the output. The 512-bit tiles of every block and super-block format write that
//! slice token-major directly (`tile_out.rs`, `QuantFormat::rows_token_major`); the 256-bit
//! kernels' row-major block results are transposed.
//!
//! # One arithmetic per operation, on every instruction set
//!
//! The wider kernels only change which lanes run side by side, never a lane's operations or
//! their order, and each is tested bit for bit against the narrower path (`tests.rs`; the
//! AVX-512 ones run where the CPU has it, `scripts/test.sh` says when it does not;
//! `KVWARDEN_CPU=avx2` keeps a machine on the 256-bit paths, `KVWARDEN_CPU=portable` on
//! the portable code):
//!
//! - `x86.rs`: 256-bit, two rows × four tokens for Q4_1.
//! - `x86_512.rs`: 512-bit, one generic tile for Q4_1 and Q5_1 (llama.cpp's eight float
//!   lanes per token; a `PairBlock` per format), four rows × eight tokens, two tokens per
//!   register, each token pair's `d_w * d_a` picked by an in-lane shuffle from one multiply
//!   per row and block.
//! - `block_chain.rs` (Q8_0, Q5_0, Q4_0): one float step per block (the definition there); eight
//!   rows in the lanes of a 256-bit register for one to seven tokens (`vpdpbusd` on
//!   unsigned weights where the CPU has AVX-512 VNNI), and from eight tokens
//!   `x86_512_block_lanes.rs`, the tokens as lanes as the k-quants' kernel below. On a
//!   2-core Zen 4, Gemma 3 270M (Q5_0 for its 640-wide matrices): pp512 1,100 -> 1,420
//!   tokens/s, a 30,000-token prompt's first token 69 -> 59-67 s; SmolLM2-135M Q8_0 pp512
//!   1,080 -> 1,330, its decode unchanged within noise; 2,048-wide synthetic files: Q8_0
//!   pp512 590-610 -> 1,020, Q4_0 570-585 -> 1,075, Q4_0's one-stream decode 8% slower
//!   (one token against rows of over 2 KiB goes a row at a time, `block_chain.rs` says why).
//! - `x86_512_lanes.rs` (Q4_K, Q6_K): sixteen tokens as the `i32` lanes of a register (the
//!   activations laid out so once per product, `blocks::LanesQ8K`), each weight quad
//!   broadcast, so one `vpdpbusd` does 64 multiply-adds, and four rows × two token groups
//!   share each load; these formats' float part is one chain per output
//!   (`quant::kquants::Q4K::dot_scalar`), so lanes need no reordering. On a 2-core Zen 4 a
//!   Llama-3.2-1B-shaped Q4_K prefill (pp512) went from 127 to 234 tokens/s. A group of at
//!   most eight tokens (a small decode batch) runs in 256-bit registers; one token goes one
//!   row at a time (`avx2_kquants`). Repacked into tiles, the rows take this kernel from 33
//!   tokens, each tile's sixteen rows prepared with 16 × 16 transpositions in registers.
//!   A product's tasks take up to 256 tokens each (`matmul::lanes_block`), so that a row's
//!   preparation serves many token groups.
//! - `x86_512_rows_lanes.rs` (Q4_K, Q6_K): decode-sized products (at most 32 tokens) with
//!   sixteen weight rows as the lanes, on the tiles `quant/interleaved.rs` repacks at load
//!   (a tile's word of sixteen rows is one 64-byte line, so each super-block's scales and
//!   float factors are unpacked once for sixteen rows). Passes of up to four tokens take
//!   each tile in turn, so a tile read from memory once serves every pass. On a 2-core Zen
//!   4 with the Llama-3.2-1B-shaped Q4_K_M file: decode batches of eight 150 tokens/s, of
//!   sixteen 152 (120 and 112 before the tile served every pass and took 9-32 tokens), one
//!   stream 37-39 (the hardware prefetcher alone, `cpu::one_token_prefetch`). The loads of
//!   one pass over a tile are kept behind `black_box`: hoisted over the whole tile by the
//!   compiler they spilled, and one stream ran 25 tokens/s; several tokens' activation
//!   quads are read as vectors for the same reason (30% on a four-token pass). Q6_K's tile
//!   holds its words in the order the kernel reads them (one forward stream: 29 to 34
//!   tokens/s).
//! - `x86_amx.rs` (Q4_K, Q6_K): prefill-sized products (from 33 tokens) on AMX tiles where
//!   the CPU has AMX-INT8 and the OS grants the tile state: each super-block of a repacked
//!   tile of sixteen rows is expanded once per task into the tile-product layout (the
//!   sub-block scales folded into the weights as two byte-sized parts, joined exactly after
//!   the products), against the activations laid out once per product as tiles
//!   (`blocks::TilesQ8K`), two groups of sixteen tokens per pass. On a 2-core Xeon
//!   (Emerald Rapids, one thread) an 8,192 × 2,048 Q4_K product of 256 tokens took 9.2-10.7
//!   ms against the AVX-512 kernel's 19.3-19.5: about 4.3 ms of tile products (the tile
//!   unit runs `tdpbssd` at 4 ns, 16 × 16 × 64 multiply-adds, with its operands in
//!   registers), 2.5 ms of float chains (Q4_K's mins on vector lanes; Q6_K's chains 1.0),
//!   0.35 ms expanding (Q6_K 1.3) and 1.6 ms around them (the Q8_K quantization, the tile
//!   layout, writing the output). Issuing each pair's products before the previous pair's
//!   float chains gained 4%; loading the activations from the Q8_K blocks themselves (rows
//!   292 bytes apart, across cache lines) cost 15%. The tile unit and the vector units
//!   do not overlap within a thread (16 `tdpbssd` with their loads 96 ns, a vector block
//!   68 ns, both 189 ns), so tile time plus float-chain time is this design's floor. The
//!   output is written with streaming stores (a 1B-shaped prefill 8% faster), which makes
//!   the `kernels` bench, whose output stays cached between runs, read 14 ms: compare
//!   this kernel's changes on the `throughput` bench.
//! - `x86_512_low_kquants.rs` (Q2_K, Q3_K): llama.cpp's eight lanes per token, two tokens
//!   per register; each weight first replaced by its group-scaled value through a
//!   per-group byte table (`sc·q`, or `sc·(q − 4) + 127` with the offset taken back once per
//!   pass from the activations' sums), so one `vpdpbusd` forms a lane where `maddubs` and
//!   `vpdpwssd` took two multiplies; the rows unpacked once per product in L2-sized chunks.
//! - `avx2_kquants.rs`, `avx2_low_kquants.rs`: the k-quants' 256-bit integer lanes.
//! - `quantize.rs`: Q8_1 and Q8_K activation quantization on vector lanes, the definition's
//!   first maximum and rounding lane for lane.
//! - `rope.rs`: the RoPE rotation compiled with FMA.
//! - `attention/`: attention's one arithmetic (f32 online softmax over key blocks aligned to
//!   absolute positions) compiled for 256 and 512 bits; tiles of up to 64 query rows × one
//!   KV head's query heads per widened key block, the block's K rows transposed so the
//!   keys are lanes (no cross-lane reduction per score).
//! - `libm_expf.rs`: the C library's `expf` on vector lanes, which llama.cpp calls once per
//!   key; compared with the linked C library's on every non-positive f32 by a test, and on a
//!   sample at run time, falling back to the library call if they ever differ.
//!
//! # The arithmetic and llama.cpp's
//!
//! The weight products reproduce llama.cpp's CPU arithmetic (its plain `vec_dot` kernels):
//! ggml's `expf` in SwiGLU, its rounding of Q8_1 scales and its RoPE contractions; each
//! format's float order is said in `crate::quant`. Q4_K and Q6_K are the exception: their
//! float part is one chain per output, which lets 16 tokens share a register (issue 20 gave
//! the last bits up for prefill speed; `kvwarden eval` holds it within llama.cpp's own
//! spread). Attention does not: llama.cpp's one-row
//! flash attention (an f16 accumulator rounded after every key) cannot take a tile of query
//! rows, so attention has an arithmetic of its own (`attention/`), an f32 online softmax
//! whose order depends only on positions, and agreement with llama.cpp is a stated tolerance
//! (`tests/llama_references.rs`, `kvwarden eval`) plus greedy equality over the decisive
//! prefix (the golden tests). llama.cpp itself switches kernels by batch size (a tiled f32
//! flash attention from 64 prompt rows, a tiled K-quant matmul from 8, a split-KV decode
//! once its KV view reaches 512 cells); its references are recorded with `-ub 32` and
//! `GGML_CPU_TILED_MM=0`, its one-row arithmetic.

//! Measured slower and left out: several weight rows against one token (decode) in one
//! register or in interleaved streams (the rows' separate streams defeat the prefetcher; a
//! repacked, row-interleaved weight layout is what would make that pay), a two-phase Q4_0
//! layout (13% slower), Q4_1 unpacked per product (1.5% slower).

mod activation;
mod attention;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_kquants;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_low_kquants;
pub(crate) mod block_chain;
#[cfg(target_arch = "x86_64")]
pub(crate) mod cpu;
pub(crate) mod f32_dot;
mod libm_expf;
mod low_rank;
mod matmul;
mod quant_dot;
mod quantize;
mod rope;
#[cfg(target_arch = "x86_64")]
pub(crate) mod tile_out;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512_block_lanes;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512_lanes;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512_low_kquants;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512_rows_lanes;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_amx;

pub use activation::{ggml_expf, silu, swiglu, table_glu};
pub use attention::{attend_rows, attend_rows_portable, KvElem, RowsShape, KEY_BLOCK};
#[cfg(target_arch = "x86_64")]
pub use cpu::{path_name as cpu_path, wide_available, CpuPath};

/// The instruction-set path the kernels take: only the portable one off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub fn cpu_path() -> &'static str {
    "portable"
}

/// Checks `KVWARDEN_CPU` (`portable`, `avx2`, `avx512`, `amx`, or unset for the CPU's widest
/// path) and returns the path the kernels will take; an unknown value, or a path this CPU
/// cannot run, is an error naming it, for the binary to refuse at start.
pub fn check_cpu_request() -> Result<&'static str, String> {
    #[cfg(target_arch = "x86_64")]
    {
        cpu::requested_path().map(CpuPath::name)
    }
    #[cfg(not(target_arch = "x86_64"))]
    match std::env::var("KVWARDEN_CPU") {
        Ok(v) if v.trim() != "portable" => Err(format!(
            "KVWARDEN_CPU={v:?}: this CPU runs only the portable kernels"
        )),
        _ => Ok("portable"),
    }
}
pub use f32_dot::{dot_f32, dot_f32_portable};
pub use low_rank::{add_scaled_combination, add_scaled_combination_portable, dot_rows_f32};
pub use matmul::{matmul, matmul_group, ActKind, RowSlice, WeightRows};
#[cfg(test)]
pub(crate) use matmul::{q8_1_lanes, q8_k_lanes, q8_k_tiles};
pub use quant_dot::{dot_q4_1, q4_1_product, q4_1_token_major, rows_q4_1, scalar};
pub use quantize::{
    quantize_blocks_q8_1, quantize_blocks_q8_k, quantize_row_q8_1, quantize_row_q8_1_scalar,
    quantize_row_q8_k, quantize_row_q8_k_portable,
};
pub use rope::rope_row;

#[cfg(test)]
mod tests;
