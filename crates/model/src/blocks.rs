//! The block types every layer above shares (a leaf: it names nothing in this crate): the
//! activation blocks (Q8_1, Q8_K), the widened-scale weight blocks of Q4_0, Q4_1 and Q8_0,
//! the activations of a product in every form, and the small helpers the formats' float
//! parts have in common.

use gguf::QK_K;

/// Elements of a Q8_1 activation block (and of the 32-element weight blocks).
pub const QK: usize = 32;

/// Activation rows a weight row is unpacked once for.
pub const TILE: usize = 4;

/// Q4_0 with its f16 scale widened to f32 at load (exact): the kernels do no per-block
/// conversion.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f32,
    pub qs: [u8; 16],
}

/// Q4_1 with its f16 scale and minimum widened to f32 at load.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f32,
    pub m: f32,
    pub qs: [u8; 16],
}

/// Q8_0 with its f16 scale widened to f32 at load.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f32,
    pub qs: [i8; 32],
}

/// An activation block quantized as ggml's Q8_1: `x ≈ d * q`, and `s = d * Σq` so that
/// the offset term of Q4_1 weights costs one multiply per block.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

impl Default for BlockQ8_1 {
    fn default() -> Self {
        Self {
            d: 0.0,
            s: 0.0,
            qs: [0; 32],
        }
    }
}

/// An activation super-block quantized as ggml's Q8_K: `x ≈ d * q`, with the sum of each
/// 16 quants kept for the k-quants' offset terms.
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// Tokens per [`LanesQ8K`]: one 512-bit register's `i32` lanes.
pub const LANE_TOKENS: usize = 16;

/// One Q8_K super-block of [`LANE_TOKENS`] tokens laid out with the tokens as lanes, for
/// `vpdpbusd` against a broadcast weight quad: `q[g]` holds quants `4g..4g + 4` of every
/// token (token `t` at bytes `4t..4t + 4`) offset by 128 into unsigned bytes. Lanes past the
/// product's last token hold zero activations and are never stored.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct LanesQ8K {
    pub q: [[u8; 64]; QK_K / 4],
    /// Each token's scale.
    pub d: [f32; LANE_TOKENS],
    /// Pair `k` of sub-block sums (32 quants each: within ±4,064, an exact `i16`): sums
    /// `2k` and `2k + 1` of each token as the low and high halves of its `i32` lane.
    pub sum_pairs: [[i32; LANE_TOKENS]; 4],
}

impl LanesQ8K {
    /// Tokens `x[0..]` (at most [`LANE_TOKENS`], each `nb` super-blocks) as `nb` lane
    /// blocks, super-block `i` at `out[i]`.
    pub fn fill(x: &[&[BlockQ8K]], out: &mut [LanesQ8K]) {
        assert!(x.len() <= LANE_TOKENS, "lanes: too many tokens");
        for (i, o) in out.iter_mut().enumerate() {
            *o = LanesQ8K {
                q: [[128; 64]; QK_K / 4],
                d: [0.0; LANE_TOKENS],
                sum_pairs: [[0; LANE_TOKENS]; 4],
            };
            for (t, row) in x.iter().enumerate() {
                let b = &row[i];
                for (g, lane) in o.q.iter_mut().enumerate() {
                    for k in 0..4 {
                        lane[4 * t + k] = (b.qs[4 * g + k] as u8) ^ 0x80;
                    }
                }
                o.d[t] = b.d;
                for (k, pair) in o.sum_pairs.iter_mut().enumerate() {
                    let sum = |j: usize| b.bsums[2 * j] + b.bsums[2 * j + 1];
                    pair[t] =
                        i32::from(sum(2 * k) as u16) | (i32::from(sum(2 * k + 1) as u16) << 16);
                }
            }
        }
    }
}

/// One Q8_K super-block of [`LANE_TOKENS`] tokens as the left operand of AMX tile products
/// (`kernels/x86_amx.rs`): `q[s][t]` holds token `t`'s quants `64s..64s + 64`, so each step
/// of 64 weights is one contiguous, aligned 1 KiB tile (loaded from the blocks themselves,
/// rows 292 bytes apart and across cache lines, the tile loads were most of the kernel's
/// time). Tokens past the product's last hold zeros and are never stored.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct TilesQ8K {
    pub q: [[[i8; 64]; LANE_TOKENS]; QK_K / 64],
    /// Each token's sub-block sums in pairs, as [`LanesQ8K::sum_pairs`], token by token.
    pub sum_pairs: [[i32; 4]; LANE_TOKENS],
}

impl TilesQ8K {
    pub const EMPTY: TilesQ8K = TilesQ8K {
        q: [[[0; 64]; LANE_TOKENS]; QK_K / 64],
        sum_pairs: [[0; 4]; LANE_TOKENS],
    };

    /// Tokens `x[0..]` (at most [`LANE_TOKENS`], each `nb` super-blocks) as `nb` tile
    /// blocks, super-block `i` at `out[i]`, which must be [`TilesQ8K::EMPTY`] (the tokens
    /// past `x`'s stay zero).
    pub fn fill(x: &[&[BlockQ8K]], out: &mut [TilesQ8K]) {
        assert!(x.len() <= LANE_TOKENS, "tiles: too many tokens");
        for (i, o) in out.iter_mut().enumerate() {
            for (t, row) in x.iter().enumerate() {
                let b = &row[i];
                for (s, step) in o.q.iter_mut().enumerate() {
                    step[t].copy_from_slice(&b.qs[64 * s..64 * s + 64]);
                }
                let sum = |j: usize| b.bsums[2 * j] + b.bsums[2 * j + 1];
                o.sum_pairs[t] = std::array::from_fn(|k| {
                    i32::from(sum(2 * k) as u16) | (i32::from(sum(2 * k + 1) as u16) << 16)
                });
            }
        }
    }
}

/// One Q8_1 block of [`LANE_TOKENS`] tokens with the tokens as lanes, as [`LanesQ8K`] lays
/// out a super-block: `q[g]` holds quants `4g..4g + 4` of every token, offset by 128 into
/// unsigned bytes; `d` each token's scale. Lanes past the product's last token hold zero
/// activations and a zero scale, and are never stored.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct LanesQ8_1 {
    pub q: [[u8; 64]; QK / 4],
    pub d: [f32; LANE_TOKENS],
}

impl LanesQ8_1 {
    /// Tokens `x[0..]` (at most [`LANE_TOKENS`], each `nb` blocks) as `nb` lane blocks,
    /// block `i` at `out[i]`.
    pub fn fill(x: &[&[BlockQ8_1]], out: &mut [LanesQ8_1]) {
        assert!(x.len() <= LANE_TOKENS, "lanes: too many tokens");
        for (i, o) in out.iter_mut().enumerate() {
            *o = LanesQ8_1 {
                q: [[128; 64]; QK / 4],
                d: [0.0; LANE_TOKENS],
            };
            for (t, row) in x.iter().enumerate() {
                let b = &row[i];
                for (g, lane) in o.q.iter_mut().enumerate() {
                    for k in 0..4 {
                        lane[4 * t + k] = (b.qs[4 * g + k] as u8) ^ 0x80;
                    }
                }
                o.d[t] = b.d;
            }
        }
    }
}

/// The activation scales of a whole tile of Q8_1 rows, per block: `[d of its 4 tokens, s
/// of its 4 tokens]` (what the 256-bit Q4_1 kernel reads).
pub type TileScales = [f32; 2 * TILE];

/// The input rows of one product in every form a format may take; a format picks the one
/// its dot product is defined on. Forms the product's matrices do not use are empty.
#[derive(Clone, Copy)]
pub struct Acts<'a> {
    pub f32: &'a [f32],
    pub q8_1: &'a [BlockQ8_1],
    pub q8_k: &'a [BlockQ8K],
    /// Every whole tile's Q8_1 scales, `[tile * nb + block]`, where a matrix of the
    /// product asks for them (else empty).
    pub tile_scales: &'a [TileScales],
    /// The Q8_K rows as lanes (`[group * nb + super-block]`, groups of [`LANE_TOKENS`]
    /// tokens), where a matrix of the product asks for them (else empty).
    pub q8_k_lanes: &'a [LanesQ8K],
    /// The Q8_K rows as AMX's tiles (`[group * nb + super-block]`), likewise.
    pub q8_k_tiles: &'a [TilesQ8K],
    /// The Q8_1 rows as lanes (`[group * nb + block]`), likewise.
    pub q8_1_lanes: &'a [LanesQ8_1],
}

/// llama.cpp's `hsum_float_8`: the order in which its AVX2 kernels add their eight lanes.
pub fn hsum8(acc: [f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|j| acc[4 + j] + acc[j]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// The f16 at `b[i..i + 2]`, as f32. Converted with integer operations (exact, as every
/// f16 is an f32) so that it inlines into the callers' SIMD-compiled code; the `half` crate
/// tests the CPU and calls out for each value.
#[inline(always)]
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exponent = u32::from((h >> 10) & 0x1f);
    let mantissa = u32::from(h & 0x3ff);
    match exponent {
        // Zero and subnormals: mantissa × 2^-24, exact in f32.
        0 => f32::from_bits((mantissa as f32 * f32::from_bits(0x3380_0000)).to_bits() | sign),
        0x1f => f32::from_bits(sign | 0x7f80_0000 | (mantissa << 13)),
        _ => f32::from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13)),
    }
}
