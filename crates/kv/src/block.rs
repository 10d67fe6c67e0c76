//! What a block format of stored K/V (llama.cpp's `-ctk`/`-ctv` types) provides, so that a
//! page of any of them is stored, scrubbed, read and moved between nodes by the same code
//! (`layout.rs`, `transfer.rs`): a new format is one file implementing this and a
//! [`crate::KvDtype`] line.
//!
//! Every format dequantizes exactly in f32 (an f16 scale times a small integer), so
//! attention reading a block page computes on exactly the values an f32 page holding the
//! dequantized rows would give it: one quantization per format, defined in its file and
//! used on every CPU path, and the same request stores the same bytes on every node.

use std::fmt::Debug;

/// One block of [`KvBlock::VALUES`] stored values: plain bytes (`Pod`), so a page of them
/// can live in a mapping (`crate::page_memory`).
pub trait KvBlock: bytemuck::Pod + PartialEq + Debug + Send + Sync {
    /// Values per block.
    const VALUES: usize = 32;
    /// Bytes of one block on the wire (and of llama.cpp's struct).
    const BYTES: usize;
    /// The block whose every value reads as 0 (a fresh page).
    const ZERO: Self;

    /// llama.cpp's reference quantization of `x` (`VALUES` values).
    fn quantize(x: &[f32]) -> Self;

    /// The `VALUES` values, exactly, into `out`.
    fn dequantize(&self, out: &mut [f32]);

    /// A block whose every value reads as `value` (scrubbing: 0, or NaN for poison).
    fn filled(value: f32) -> Self;

    /// Appends the block's wire form (llama.cpp's layout, little-endian scale first).
    fn push_bytes(&self, out: &mut Vec<u8>);

    /// The block of a wire form (`BYTES` bytes) as it left, not requantized.
    fn from_bytes(b: &[u8]) -> Self;
}

/// `rows` (whole blocks) into `out`, block by block.
pub(crate) fn quantize_into<B: KvBlock>(rows: &[f32], out: &mut [B]) {
    for (block, x) in out.iter_mut().zip(rows.chunks_exact(B::VALUES)) {
        *block = B::quantize(x);
    }
}

/// Wire blocks into `out`, as they came.
pub(crate) fn from_wire<B: KvBlock>(bytes: &[u8], out: &mut [B]) {
    for (block, x) in out.iter_mut().zip(bytes.chunks_exact(B::BYTES)) {
        *block = B::from_bytes(x);
    }
}

/// Every value of `blocks` into `out` (at most `out.len()` values).
pub(crate) fn dequantize_into<B: KvBlock>(blocks: &[B], out: &mut [f32]) {
    let mut block = vec![0f32; B::VALUES];
    for (o, b) in out.chunks_mut(B::VALUES).zip(blocks) {
        b.dequantize(&mut block);
        o.copy_from_slice(&block[..o.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Q4Block, Q8Block};

    fn lcg(s: &mut u64) -> f32 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
    }

    /// Quantizing a block's own values changes nothing, and the wire form round-trips.
    fn round_trips<B: KvBlock>(mut seed: u64) {
        for _ in 0..2000 {
            let x: Vec<f32> = (0..B::VALUES).map(|_| lcg(&mut seed)).collect();
            let b = B::quantize(&x);
            let mut y = vec![0f32; B::VALUES];
            b.dequantize(&mut y);
            assert_eq!(B::quantize(&y), b);
            let mut bytes = Vec::new();
            b.push_bytes(&mut bytes);
            assert_eq!(bytes.len(), B::BYTES);
            assert_eq!(B::from_bytes(&bytes), b);
        }
    }

    #[test]
    fn dequantized_values_quantize_to_the_same_block() {
        round_trips::<Q8Block>(7);
        round_trips::<Q4Block>(11);
    }
}
