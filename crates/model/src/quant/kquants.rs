//! Q4_K, Q5_K and Q6_K against Q8_K activations, kept as ggml's bytes: one [`QuantFormat`]
//! each, a portable definition, AVX2 integer lanes (`kernels/avx2_kquants.rs`) dispatched at
//! run time as the other formats are, and for prefill on AVX-512 CPUs the tokens-in-lanes
//! kernel of `kernels/x86_512_lanes.rs` (Q4_K, Q6_K). Q5_K keeps llama.cpp's AVX2 float
//! order; Q4_K and Q6_K have one float chain per output (see [`Q4K::dot_scalar`]).

use gguf::GgmlType;

use super::{byte_blocks, byte_view, QuantFormat};
#[cfg(target_arch = "x86_64")]
use crate::blocks::TILE;
use crate::blocks::{f16_at, hsum8, BlockQ8K, LanesQ8K};
#[cfg(target_arch = "x86_64")]
use crate::kernels::x86_512_lanes::{self, Format, Weights};
#[cfg(target_arch = "x86_64")]
use crate::kernels::{avx2_kquants as simd, cpu, tile_out::Out};

/// From this many tokens on, a Q4_K or Q6_K product takes the activations as lanes (up to
/// sixteen tokens a register, eight in a half-width one): on the 1B shape a decode batch of
/// two ran 26.4 tok/s this way against 24.9 one row at a time, of four 49.8 against 37.6.
/// One token goes one row at a time (`avx2_kquants`), which needs no unpacked copy.
#[cfg(target_arch = "x86_64")]
const LANES_MIN: usize = 2;

/// Rows of at most this many super-blocks (16,384 columns) keep a tile's integer lanes on
/// the stack; longer ones go one token at a time.
#[cfg(target_arch = "x86_64")]
const MAX_TILED_SUPER_BLOCKS: usize = 64;

/// Binds `$lanes` to a zeroed buffer for a tile's integer lanes of `$n` super-blocks (at
/// most [`MAX_TILED_SUPER_BLOCKS`]), on the stack, and runs `$body`. Zeroing the largest size
/// for every row and tile was 5% of a Q4_K_M prefill, so rows of up to 2,048 columns use a
/// short one. A macro rather than a function taking a closure: the body must stay inside
/// the caller to be compiled with its target features (see `simd::compiled_for_avx2`).
#[cfg(target_arch = "x86_64")]
macro_rules! with_tile_lanes {
    ($n:expr, |$lanes:ident| $body:block) => {
        if $n <= 8 {
            let $lanes = &mut [[[0i32; 8]; TILE]; 8][..$n];
            $body
        } else {
            let $lanes = &mut [[[0i32; 8]; TILE]; MAX_TILED_SUPER_BLOCKS][..$n];
            $body
        }
    };
}

/// Whether a product of `n` tokens runs the 512-bit register tiles here.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn wide_tiles(n: usize) -> bool {
    n >= TILE && cpu::wide_available() && cpu::avx2_fma_f16c_detected()
}

/// The tokens-in-lanes kernel for `format`'s rows `w` where a product of `n` tokens takes
/// it ([`Q4K::wants_lanes`]), into `out` row-major, or token-major given `ld`.
#[cfg(target_arch = "x86_64")]
fn lanes_rows(
    format: Format,
    w: &[u8],
    nb: usize,
    lanes: &[LanesQ8K],
    n: usize,
    out: &mut [f32],
    ld: Option<usize>,
) -> bool {
    if !Q4K::wants_lanes(n) {
        return false;
    }
    let mut out = match ld {
        Some(ld) => Out::TokenMajor { out, ld },
        None => Out::RowMajor { out, n },
    };
    // SAFETY: the CPU has the features `wide_available` checks and F16C, the function's
    // only requirement; it bounds-checks its slices.
    unsafe { x86_512_lanes::k_quant_lanes(format, Weights::Blocks(w), nb, lanes, n, &mut out) };
    true
}

pub struct Q4K;

impl Q4K {
    /// Eight sub-blocks of 32 with 6-bit scales and mins, one float chain per output: per
    /// super-block the exact integers `S = Σ_j sc_j Σ_l q·a` and `M = Σ_j m_j Σ a`, then
    /// `acc = fma(d_a·d_w, S, acc)` and `acc = fma(−d_a·dmin_w, M, acc)`, super-block after
    /// super-block. Exact integers do not depend on how they are formed, so every path (one
    /// row, a tile, the 512-bit kernels' tokens-in-lanes `vpdpbusd`) gives these bits
    /// whatever its lanes. This is not llama.cpp's order (eight float lanes, four min lanes,
    /// its lane sum): issue 20 gave that up for the products' speed, and `kvwarden eval`
    /// holds the difference to llama.cpp's own spread. The portable definition.
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        Self::dot_with(w, a, |_, wb, ab, sc| {
            let mut sum = 0i32;
            for (j, &s) in sc.iter().enumerate() {
                let qs = &wb[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
                let sub: i32 = (0..32)
                    .map(|l| {
                        let v = if j % 2 == 0 { qs[l] & 0x0f } else { qs[l] >> 4 };
                        i32::from(v) * i32::from(ab.qs[32 * j + l])
                    })
                    .sum();
                sum += i32::from(s) * sub;
            }
            sum
        })
    }

    /// The float chain shared by every path; `scaled_sum` gives a super-block's exact `S`.
    #[inline(always)]
    pub(crate) fn dot_with(
        w: &[u8],
        a: &[BlockQ8K],
        scaled_sum: impl Fn(usize, &[u8], &BlockQ8K, &[u8; 8]) -> i32,
    ) -> f32 {
        let mut acc = 0f32;
        for (i, (wb, ab)) in w.chunks_exact(144).zip(a).enumerate() {
            let (d, dmin) = Self::block_scales(wb, ab.d);
            let (sc, m) = scales_mins(wb);
            let s = scaled_sum(i, wb, ab, &sc);
            acc = d.mul_add(s as f32, acc);
            acc = dmin.mul_add(Self::min_sum(&m, &ab.bsums) as f32, acc);
        }
        acc
    }

    /// A super-block's two float factors against activations of scale `d_a`: `d_a·d_w` and
    /// `−d_a·dmin_w`.
    #[inline(always)]
    pub(crate) fn block_scales(wb: &[u8], d_a: f32) -> (f32, f32) {
        (d_a * f16_at(wb, 0), -d_a * f16_at(wb, 2))
    }

    /// `M = Σ_j m_j · Σ a` over sub-block `j` (from the activations' sums of 16), exact.
    #[inline(always)]
    pub(crate) fn min_sum(m: &[u8; 8], bsums: &[i16; 16]) -> i32 {
        (0..8)
            .map(|j| i32::from(m[j]) * (i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1])))
            .sum()
    }
}

/// A Q4_K super-block's eight 6-bit sub-block scales and mins.
#[inline(always)]
pub(crate) fn scales_mins(wb: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        (sc[j], m[j]) = gguf::k4_scale_min(j, &wb[4..16]);
    }
    (sc, m)
}

impl QuantFormat for Q4K {
    const TYPE: GgmlType = GgmlType::Q4_K;
    type Block = [u8; 144];
    type Act = BlockQ8K;

    fn load(_: GgmlType, bytes: &[u8]) -> Vec<[u8; 144]> {
        byte_blocks(bytes)
    }

    fn view(bytes: &[u8]) -> Option<&[[u8; 144]]> {
        Some(byte_view(bytes))
    }

    fn dequantize(w: &[[u8; 144]], out: &mut [f32]) {
        Self::TYPE.dequantize(w.as_flattened(), out);
    }

    /// The tile's integer lanes first (each super-block unpacked once for every token),
    /// then each token through `Q4K::dot_with`, the same float part as `dot`.
    #[inline(always)]
    fn dot_tile(w: &[Self::Block], acts: &[&[BlockQ8K]], out: &mut [f32]) {
        let (blocks, w) = (w, w.as_flattened());
        #[cfg(target_arch = "x86_64")]
        if cpu::avx2_detected() && acts.len() > 1 && w.len() / 144 <= MAX_TILED_SUPER_BLOCKS {
            with_tile_lanes!(w.len() / 144, |lanes| {
                for (i, wb) in w.chunks_exact(144).enumerate() {
                    let sc: [u8; 8] = std::array::from_fn(|j| gguf::k4_scale_min(j, &wb[4..16]).0);
                    let a = std::array::from_fn(|t| &acts[t.min(acts.len() - 1)][i].qs);
                    // SAFETY: AVX2 is present (checked above); the function checks the slice
                    // lengths it reads.
                    lanes[i] = unsafe { simd::q4_k_lanes_n(&wb[16..144], a, &sc) };
                }
                for (t, (a, o)) in acts.iter().zip(out.iter_mut()).enumerate() {
                    *o = Self::dot_with(w, a, |i, _, _, _| lanes[i][t].iter().sum());
                }
            });
            return;
        }
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot(blocks, a);
        }
    }

    #[inline(always)]
    fn wants_lanes(n: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        return n >= LANES_MIN && cpu::wide_available() && cpu::avx2_fma_f16c_detected();
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = n;
            false
        }
    }

    #[inline(always)]
    fn lanes_rows(
        w: &[[u8; 144]],
        nb: usize,
        lanes: &[LanesQ8K],
        n: usize,
        out: &mut [f32],
        ld: Option<usize>,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        return lanes_rows(Format::Q4K, w.as_flattened(), nb, lanes, n, out, ld);
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w, nb, lanes, n, out, ld);
            false
        }
    }

    #[inline(always)]
    fn dot(w: &[Self::Block], a: &[BlockQ8K]) -> f32 {
        let w = w.as_flattened();
        #[cfg(target_arch = "x86_64")]
        if cpu::avx2_fma_f16c_detected() {
            // SAFETY: AVX2 and FMA are present (checked above), the only requirements of
            // the target-feature function; it checks the slice lengths it reads.
            return unsafe { simd::q4_k_dot(w, a) };
        }
        Self::dot_scalar(w, a)
    }
}

/// The eight 6-bit sub-block scales of a Q4_K/Q5_K block, and `Σ_j m_j Σ a` over its
/// sub-blocks (the offset term, from the activations' `bsums`).
fn k4_scales(wb: &[u8], ab: &BlockQ8K) -> ([u8; 8], i32) {
    let mut sc = [0u8; 8];
    let mut summ = 0i32;
    for (j, s) in sc.iter_mut().enumerate() {
        let (scale, m) = gguf::k4_scale_min(j, &wb[4..16]);
        *s = scale;
        summ += i32::from(m) * (i32::from(ab.bsums[2 * j]) + i32::from(ab.bsums[2 * j + 1]));
    }
    (sc, summ)
}

pub struct Q5K;

impl QuantFormat for Q5K {
    const TYPE: GgmlType = GgmlType::Q5_K;
    type Block = [u8; 176];
    type Act = BlockQ8K;

    fn load(_: GgmlType, bytes: &[u8]) -> Vec<[u8; 176]> {
        byte_blocks(bytes)
    }

    fn view(bytes: &[u8]) -> Option<&[[u8; 176]]> {
        Some(byte_view(bytes))
    }

    fn dequantize(w: &[[u8; 176]], out: &mut [f32]) {
        Self::TYPE.dequantize(w.as_flattened(), out);
    }

    #[inline(always)]
    fn dot(w: &[Self::Block], a: &[BlockQ8K]) -> f32 {
        let w = w.as_flattened();
        #[cfg(target_arch = "x86_64")]
        if cpu::avx2_detected() {
            // SAFETY: AVX2 is present (checked above), the only requirement of the
            // target-feature function; it checks the slice lengths it reads.
            return Self::dot_with(w, a, |wb, ab, sc| unsafe {
                simd::q5_k_lanes(&wb[16..48], &wb[48..176], &ab.qs, sc)
            });
        }
        Self::dot_scalar(w, a)
    }
}

impl Q5K {
    /// Q4_K's lanes with the fifth bit, in llama.cpp's AVX2 float order
    /// (`ggml_vec_dot_q5_K_q8_K`, built with contracted multiply-adds): the min term is one
    /// exact integer per super-block, added as `dmin·Σ` by a fused multiply-add to a scalar
    /// that joins the lane sum last. The portable definition (the SIMD path is tested
    /// against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        Self::dot_with(w, a, |wb, ab, sc| {
            let mut lanes = [0i32; 8];
            for (j, &s) in sc.iter().enumerate() {
                let qs = &wb[48 + 32 * (j / 2)..48 + 32 * (j / 2) + 32];
                for (i, lane) in lanes.iter_mut().enumerate() {
                    let sum: i32 = (4 * i..4 * i + 4)
                        .map(|l| {
                            let lo = if j % 2 == 0 { qs[l] & 0x0f } else { qs[l] >> 4 };
                            let v = lo | (((wb[16 + l] >> j) & 1) << 4);
                            i32::from(v) * i32::from(ab.qs[32 * j + l])
                        })
                        .sum();
                    *lane += i32::from(s) * sum;
                }
            }
            lanes
        })
    }

    /// The float part shared by both paths; `lanes` gives a super-block's scaled sums.
    #[inline(always)]
    fn dot_with(
        w: &[u8],
        a: &[BlockQ8K],
        lanes: impl Fn(&[u8], &BlockQ8K, &[u8; 8]) -> [i32; 8],
    ) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (wb, ab) in w.chunks_exact(176).zip(a) {
            let d = ab.d * f16_at(wb, 0);
            let dmin = -ab.d * f16_at(wb, 2);
            let (sc, summ) = k4_scales(wb, ab);
            summs = dmin.mul_add(summ as f32, summs);
            for (acc, lane) in acc.iter_mut().zip(lanes(wb, ab, &sc)) {
                *acc = d.mul_add(lane as f32, *acc);
            }
        }
        hsum8(acc) + summs
    }
}

pub struct Q6K;

impl QuantFormat for Q6K {
    const TYPE: GgmlType = GgmlType::Q6_K;
    type Block = [u8; 210];
    type Act = BlockQ8K;

    fn load(_: GgmlType, bytes: &[u8]) -> Vec<[u8; 210]> {
        byte_blocks(bytes)
    }

    fn view(bytes: &[u8]) -> Option<&[[u8; 210]]> {
        Some(byte_view(bytes))
    }

    fn dequantize(w: &[[u8; 210]], out: &mut [f32]) {
        Self::TYPE.dequantize(w.as_flattened(), out);
    }

    /// As [`Q4K`]'s: the tile's lanes first, then each token through `Q6K::dot_with`.
    #[inline(always)]
    fn dot_tile(w: &[Self::Block], acts: &[&[BlockQ8K]], out: &mut [f32]) {
        let (blocks, w) = (w, w.as_flattened());
        #[cfg(target_arch = "x86_64")]
        if cpu::avx2_detected() && acts.len() > 1 && w.len() / 210 <= MAX_TILED_SUPER_BLOCKS {
            with_tile_lanes!(w.len() / 210, |lanes| {
                for (i, wb) in w.chunks_exact(210).enumerate() {
                    let sc: [i8; 16] = std::array::from_fn(|g| wb[192 + g] as i8);
                    let a = std::array::from_fn(|t| &acts[t.min(acts.len() - 1)][i].qs);
                    // SAFETY: AVX2 is present (checked above); the function checks the slice
                    // lengths it reads.
                    lanes[i] = unsafe { simd::q6_k_lanes_n(&wb[..128], &wb[128..192], a, &sc) };
                }
                for (t, (a, o)) in acts.iter().zip(out.iter_mut()).enumerate() {
                    *o = Self::dot_with(w, a, |b, _, _, _| lanes[b][t]);
                }
            });
            return;
        }
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot(blocks, a);
        }
    }

    #[inline(always)]
    fn wants_lanes(n: usize) -> bool {
        Q4K::wants_lanes(n)
    }

    #[inline(always)]
    fn lanes_rows(
        w: &[[u8; 210]],
        nb: usize,
        lanes: &[LanesQ8K],
        n: usize,
        out: &mut [f32],
        ld: Option<usize>,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        return lanes_rows(Format::Q6K, w.as_flattened(), nb, lanes, n, out, ld);
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w, nb, lanes, n, out, ld);
            false
        }
    }

    #[inline(always)]
    fn dot(w: &[Self::Block], a: &[BlockQ8K]) -> f32 {
        let w = w.as_flattened();
        #[cfg(target_arch = "x86_64")]
        if cpu::avx2_fma_f16c_detected() {
            // SAFETY: AVX2 and FMA are present (checked above), the only requirements of
            // the target-feature function; it checks the slice lengths it reads.
            return unsafe { simd::q6_k_dot(w, a) };
        }
        Self::dot_scalar(w, a)
    }
}

impl Q6K {
    /// Sixteen groups of 16 with signed 8-bit scales: `d·da·Σ_g sc_g Σ (q − 32)·a`, one
    /// float chain per output as Q4_K's: per super-block the exact `S` (formed here as
    /// llama.cpp's eight lanes, lane `i` holding elements `4i..4i+4` (mod 32) of every
    /// 32-element chunk scaled by its group, minus `32·Σ sc·bsums` of groups `2i` and
    /// `2i + 1`; exact integers, so any grouping gives the same `S`), then one fused
    /// multiply-add. Not llama.cpp's float order (eight float lanes and its `hsum_float_8`),
    /// which the tokens-in-lanes kernel could not keep. The portable definition.
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        Self::dot_with(w, a, |_, wb, ab, sc| {
            let mut lanes = [0i32; 8];
            for half in 0..2 {
                let ql = &wb[64 * half..64 * half + 64];
                let qh = &wb[128 + 32 * half..128 + 32 * half + 32];
                for k in 0..4 {
                    for (i, lane) in lanes.iter_mut().enumerate() {
                        let s: i32 = (4 * i..4 * i + 4)
                            .map(|l| {
                                let q = i32::from(gguf::q6_at(ql, qh, l, k)) + 32;
                                q * i32::from(ab.qs[128 * half + 32 * k + l])
                            })
                            .sum();
                        *lane += i32::from(sc[8 * half + 2 * k + usize::from(i >= 4)]) * s;
                    }
                }
            }
            lanes
        })
    }

    /// The float chain shared by every path: `lanes` gives a super-block's eight unsigned
    /// lane sums (values taken as 0..63), from which its exact `S = Σ_g sc_g Σ (q − 32)·a`;
    /// then `acc = fma(d_a·d_w, S, acc)`, super-block after super-block.
    #[inline(always)]
    pub(crate) fn dot_with(
        w: &[u8],
        a: &[BlockQ8K],
        lanes: impl Fn(usize, &[u8], &BlockQ8K, &[i8; 16]) -> [i32; 8],
    ) -> f32 {
        let mut acc = 0f32;
        for (b, (wb, ab)) in w.chunks_exact(210).zip(a).enumerate() {
            let mut sc = [0i8; 16];
            for (s, &b) in sc.iter_mut().zip(&wb[192..208]) {
                *s = b as i8;
            }
            let d = ab.d * f16_at(wb, 208);
            let mut sum = 0i32;
            for (i, lane) in lanes(b, wb, ab, &sc).into_iter().enumerate() {
                // Σ (q − 32)·a = Σ q·a − 32·Σ a, the last sums per group from `bsums`.
                let offset = i32::from(ab.bsums[2 * i]) * i32::from(sc[2 * i])
                    + i32::from(ab.bsums[2 * i + 1]) * i32::from(sc[2 * i + 1]);
                sum += lane - (offset << 5);
            }
            acc = d.mul_add(sum as f32, acc);
        }
        acc
    }
}
