//! Q2_K and Q3_K against Q8_K activations, kept as ggml's bytes: one [`QuantFormat`] each, a
//! portable definition and an AVX2 build of its integer part (`kernels/avx2_low_kquants.rs`),
//! dispatched at run time as the other k-quants are, and for prefill on AVX-512 CPUs the
//! register tiles of `kernels/x86_512_low_kquants.rs`.
//!
//! Both formats have sixteen groups of 16 per super-block. Their dot products are written
//! as exact integer sums per group, scaled by the group's integer scale, then one float
//! expression per super-block; integer sums do not depend on their order, so the SIMD and
//! portable paths give the same bits.

use gguf::{GgmlType, QK_K};

use super::{byte_blocks, byte_view, QuantFormat};
use crate::blocks::{f16_at, hsum8, BlockQ8K};
#[cfg(target_arch = "x86_64")]
use crate::kernels::{avx2_low_kquants as simd, cpu, x86_512_low_kquants};

/// Bytes of one Q2_K super-block.
const Q2_K_BYTES: usize = 84;
/// Bytes of one Q3_K super-block.
const Q3_K_BYTES: usize = 110;

/// The eight lane sums of a super-block as llama.cpp's AVX2 kernels form them: lane `i` holds
/// elements `4i..4i+4` (mod 32) of every 32-element chunk `c` (element `32c + 4i + ...`),
/// each chunk's share multiplied by the scale of its group (`2c + (i >= 4)`). `value(e)` is
/// element `e`'s quant, `scale(g)` group `g`'s integer scale.
fn lanes(value: impl Fn(usize) -> i32, scale: impl Fn(usize) -> i32, a: &[i8; QK_K]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for c in 0..8 {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let s: i32 = (32 * c + 4 * i..32 * c + 4 * i + 4)
                .map(|e| value(e) * i32::from(a[e]))
                .sum();
            *lane += scale(2 * c + usize::from(i >= 4)) * s;
        }
    }
    lanes
}

/// Q2_K: `x = d·(sc_g & 15)·q − dmin·(sc_g >> 4)` with `q` in 0..4, so
/// `Σ x·a = d·da·Σ_g sc_g Σ q·a − dmin·da·Σ_g m_g Σ a`, in llama.cpp's AVX2 float order
/// (`ggml_vec_dot_q2_K_q8_K`): per super-block, eight lanes of the min term (groups `2i`,
/// `2i + 1` from `bsums`) and eight of the scaled sums, each added to its lane accumulator by
/// a fused multiply-add, then [`hsum8`]. So the logits are llama.cpp's bit for bit.
pub struct Q2K;

impl Q2K {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        Self::dot_with(w, a, |wb, ab, sc| {
            let qs = &wb[16..80];
            lanes(
                |e| i32::from(gguf::q2_bits(qs, e)),
                |g| i32::from(sc[g]),
                &ab.qs,
            )
        })
    }

    /// The float part shared by both paths; `lanes` gives a super-block's scaled sums.
    #[inline(always)]
    fn dot_with(
        w: &[u8],
        a: &[BlockQ8K],
        lanes: impl Fn(&[u8], &BlockQ8K, &[u8; 16]) -> [i32; 8],
    ) -> f32 {
        let mut acc = [0f32; 8];
        for (wb, ab) in w.chunks_exact(Q2_K_BYTES).zip(a) {
            let d = ab.d * f16_at(wb, 80);
            let dmin = -ab.d * f16_at(wb, 82);
            let sc: [u8; 16] = std::array::from_fn(|g| wb[g] & 0x0f);
            let m = |g: usize| i32::from(wb[g] >> 4);
            for (i, acc) in acc.iter_mut().enumerate() {
                let mins = m(2 * i) * i32::from(ab.bsums[2 * i])
                    + m(2 * i + 1) * i32::from(ab.bsums[2 * i + 1]);
                *acc = dmin.mul_add(mins as f32, *acc);
            }
            for (acc, lane) in acc.iter_mut().zip(lanes(wb, ab, &sc)) {
                *acc = d.mul_add(lane as f32, *acc);
            }
        }
        hsum8(acc)
    }
}

impl QuantFormat for Q2K {
    const TYPE: GgmlType = GgmlType::Q2_K;
    type Block = [u8; 84];
    type Act = BlockQ8K;

    fn load(_: GgmlType, bytes: &[u8]) -> Vec<[u8; 84]> {
        byte_blocks(bytes)
    }

    fn view(bytes: &[u8]) -> Option<&[[u8; 84]]> {
        Some(byte_view(bytes))
    }

    fn dequantize(w: &[[u8; 84]], out: &mut [f32]) {
        Self::TYPE.dequantize(w.as_flattened(), out);
    }

    #[inline(always)]
    fn wide_rows(w: &[[u8; 84]], nb: usize, x: &[BlockQ8K], n: usize, out: &mut [f32]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if super::kquants::wide_tiles(n) {
            let w = w.as_flattened();
            // SAFETY: the CPU has the features `wide_available` checks (AVX-512 F, BW, DQ, VL,
            // VNNI, with AVX2 and FMA) and F16C, the function's only requirement; it
            // bounds-checks its slices.
            return unsafe { x86_512_low_kquants::low_k_quant_rows(w, nb, x, n, true, out) };
        }
        let _ = (w, nb, x, n, out);
        0
    }

    #[inline(always)]
    fn rows_token_major(
        w: &[[u8; 84]],
        nb: usize,
        x: &[BlockQ8K],
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if cpu::wide_available() {
            let w = w.as_flattened();
            // SAFETY: the CPU has the features `wide_available` checks, the function's
            // only requirement; it bounds-checks its slices.
            return unsafe {
                x86_512_low_kquants::low_k_quant_token_major(w, nb, x, n, true, out, ld)
            };
        }
        let _ = (w, nb, x, n, out, ld);
        false
    }

    #[inline(always)]
    fn dot(w: &[Self::Block], a: &[BlockQ8K]) -> f32 {
        let w = w.as_flattened();
        #[cfg(target_arch = "x86_64")]
        if cpu::avx2_detected() {
            // SAFETY: AVX2 is present (checked above), the only requirement of the
            // target-feature function; it checks the slice lengths it reads.
            return Self::dot_with(w, a, |wb, ab, sc| unsafe {
                simd::q2_k_lanes(&wb[16..80], &ab.qs, sc)
            });
        }
        Self::dot_scalar(w, a)
    }
}

/// Q3_K: `x = d·sc_g·(q − 4)` with `q` in 0..8 (two low bits and a high bit) and signed
/// 6-bit `sc_g`, so `Σ x·a = d·da·Σ_g sc_g Σ (q − 4)·a`, in llama.cpp's AVX2 float order
/// (`ggml_vec_dot_q3_K_q8_K`): eight lanes of scaled signed sums per super-block, each
/// added to its lane accumulator by a fused multiply-add, then [`hsum8`].
pub struct Q3K;

impl Q3K {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        Self::dot_with(w, a, |wb, ab| {
            let (hmask, qs) = (&wb[..32], &wb[32..96]);
            let sc = gguf::q3_k_scales(&wb[96..108]);
            lanes(
                |e| i32::from(gguf::q2_bits(qs, e) | (gguf::q3_high_bit(hmask, e) << 2)) - 4,
                |g| i32::from(sc[g]),
                &ab.qs,
            )
        })
    }

    /// The float part shared by both paths; `lanes` gives a super-block's scaled sums (each
    /// path decodes the packed group scales its own way: the scalar decode was a sixth of a
    /// Q3_K file's decode step).
    #[inline(always)]
    fn dot_with(w: &[u8], a: &[BlockQ8K], lanes: impl Fn(&[u8], &BlockQ8K) -> [i32; 8]) -> f32 {
        let mut acc = [0f32; 8];
        for (wb, ab) in w.chunks_exact(Q3_K_BYTES).zip(a) {
            let d = ab.d * f16_at(wb, 108);
            for (acc, lane) in acc.iter_mut().zip(lanes(wb, ab)) {
                *acc = d.mul_add(lane as f32, *acc);
            }
        }
        hsum8(acc)
    }
}

impl QuantFormat for Q3K {
    const TYPE: GgmlType = GgmlType::Q3_K;
    type Block = [u8; 110];
    type Act = BlockQ8K;

    fn load(_: GgmlType, bytes: &[u8]) -> Vec<[u8; 110]> {
        byte_blocks(bytes)
    }

    fn view(bytes: &[u8]) -> Option<&[[u8; 110]]> {
        Some(byte_view(bytes))
    }

    fn dequantize(w: &[[u8; 110]], out: &mut [f32]) {
        Self::TYPE.dequantize(w.as_flattened(), out);
    }

    #[inline(always)]
    fn wide_rows(w: &[[u8; 110]], nb: usize, x: &[BlockQ8K], n: usize, out: &mut [f32]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if super::kquants::wide_tiles(n) {
            let w = w.as_flattened();
            // SAFETY: the CPU has the features `wide_available` checks (AVX-512 F, BW, DQ, VL,
            // VNNI, with AVX2 and FMA) and F16C, the function's only requirement; it
            // bounds-checks its slices.
            return unsafe { x86_512_low_kquants::low_k_quant_rows(w, nb, x, n, false, out) };
        }
        let _ = (w, nb, x, n, out);
        0
    }

    #[inline(always)]
    fn rows_token_major(
        w: &[[u8; 110]],
        nb: usize,
        x: &[BlockQ8K],
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if cpu::wide_available() {
            let w = w.as_flattened();
            // SAFETY: the CPU has the features `wide_available` checks, the function's
            // only requirement; it bounds-checks its slices.
            return unsafe {
                x86_512_low_kquants::low_k_quant_token_major(w, nb, x, n, false, out, ld)
            };
        }
        let _ = (w, nb, x, n, out, ld);
        false
    }

    #[inline(always)]
    fn dot(w: &[Self::Block], a: &[BlockQ8K]) -> f32 {
        let w = w.as_flattened();
        #[cfg(target_arch = "x86_64")]
        if cpu::avx2_detected() {
            // SAFETY: AVX2 is present (checked above), the only requirement of the
            // target-feature function; it checks the slice lengths it reads.
            return Self::dot_with(w, a, |wb, ab| unsafe { simd::q3_k_lanes(wb, &ab.qs) });
        }
        Self::dot_scalar(w, a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quantize_row_q8_k;
    use half::f16;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    fn random_bytes(n: usize, seed: &mut u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                lcg(seed);
                (*seed >> 56) as u8
            })
            .collect()
    }

    fn acts(cols: usize, amp: f32, seed: &mut u64) -> Vec<BlockQ8K> {
        let x: Vec<f32> = (0..cols).map(|_| lcg(seed) * amp).collect();
        let mut xk = vec![BlockQ8K::default(); cols / QK_K];
        quantize_row_q8_k(&x, &mut xk);
        xk
    }

    /// Weight rows of quantized values and of raw random bytes (every bit pattern of the
    /// quants, scales and masks reached), each scale field set to a finite f16.
    fn weights(ty: GgmlType, blocks: usize, trial: usize, seed: &mut u64) -> Vec<u8> {
        let cols = blocks * QK_K;
        if trial.is_multiple_of(2) {
            let amp = 1.0 + trial as f32;
            let vals: Vec<f32> = (0..cols).map(|_| lcg(seed) * amp).collect();
            return ty.quantize(&vals);
        }
        let mut w = random_bytes(blocks * ty.block_bytes(), seed);
        for b in w.chunks_exact_mut(ty.block_bytes()) {
            let d = f16::from_f32(0.01 * (1.0 + lcg(seed).abs())).to_le_bytes();
            match ty {
                GgmlType::Q2_K => {
                    b[80..82].copy_from_slice(&d);
                    b[82..84].copy_from_slice(&f16::from_f32(0.02).to_le_bytes());
                }
                _ => b[108..110].copy_from_slice(&d),
            }
        }
        w
    }

    fn dots(ty: GgmlType, w: &[u8], a: &[BlockQ8K]) -> (f32, f32) {
        match ty {
            GgmlType::Q2_K => (Q2K::dot(w.as_chunks().0, a), Q2K::dot_scalar(w, a)),
            _ => (Q3K::dot(w.as_chunks().0, a), Q3K::dot_scalar(w, a)),
        }
    }

    /// The dispatched product (AVX2 where the CPU has it) gives the portable definition's
    /// bits: the same integers, then the same float expression.
    #[test]
    fn simd_equals_the_scalar_definition_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        eprintln!("AVX2 present: {}", cpu::avx2_detected());
        let mut s = 5u64;
        for ty in [GgmlType::Q2_K, GgmlType::Q3_K] {
            for trial in 0..40 {
                let blocks = 1 + trial % 4;
                let w = weights(ty, blocks, trial, &mut s);
                let a = acts(blocks * QK_K, 1.0 + trial as f32, &mut s);
                let (fast, slow) = dots(ty, &w, &a);
                assert_eq!(fast.to_bits(), slow.to_bits(), "{ty:?} trial {trial}");
            }
        }
    }

    /// The AVX2 lanes equal the portable ones, and the lanes add up to a plain loop over
    /// gguf's dequantization layout (so a wrong lane, element or scale fails here even if the
    /// scalar code shared it).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_lanes_follow_the_layout() {
        if !cpu::avx2_detected() {
            eprintln!("avx2_lanes_follow_the_layout: NOT RUN (no AVX2 on this CPU)");
            return;
        }
        let mut s = 17u64;
        for trial in 0..30 {
            let a = acts(QK_K, 3.0, &mut s)[0];
            let w2 = random_bytes(84, &mut s);
            let sc2: [u8; 16] = std::array::from_fn(|g| w2[g] & 0x0f);
            let q2 = |e: usize| i32::from(gguf::q2_bits(&w2[16..80], e));
            let want: i32 = (0..QK_K)
                .map(|e| i32::from(sc2[e / 16]) * q2(e) * i32::from(a.qs[e]))
                .sum();
            let portable = lanes(q2, |g| i32::from(sc2[g]), &a.qs);
            // SAFETY: AVX2 is present (checked above).
            let got = unsafe { simd::q2_k_lanes(&w2[16..80], &a.qs, &sc2) };
            assert_eq!(got, portable, "Q2_K trial {trial}");
            assert_eq!(got.iter().sum::<i32>(), want, "Q2_K trial {trial}");

            let w3 = random_bytes(110, &mut s);
            let sc3 = gguf::q3_k_scales(&w3[96..108]);
            let q3 = |e: usize| {
                i32::from(gguf::q2_bits(&w3[32..96], e) | (gguf::q3_high_bit(&w3, e) << 2)) - 4
            };
            let want: i32 = (0..QK_K)
                .map(|e| i32::from(sc3[e / 16]) * q3(e) * i32::from(a.qs[e]))
                .sum();
            let portable = lanes(q3, |g| i32::from(sc3[g]), &a.qs);
            // SAFETY: AVX2 is present (checked above).
            let got = unsafe { simd::q3_k_lanes(&w3, &a.qs) };
            assert_eq!(got, portable, "Q3_K trial {trial}");
            assert_eq!(got.iter().sum::<i32>(), want, "Q3_K trial {trial}");
        }
    }

    /// The vector decode of Q3_K's group scales equals gguf's scalar one on every packed
    /// pattern reached by random bytes (and on the all-zero and all-one bytes).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q3_k_scales_match_gguf() {
        if !cpu::avx2_detected() {
            eprintln!("q3_k_scales_match_gguf: NOT RUN (no AVX2 on this CPU)");
            return;
        }
        let mut s = 3u64;
        let mut cases = vec![vec![0u8; 12], vec![0xff; 12]];
        cases.extend((0..10_000).map(|_| random_bytes(12, &mut s)));
        for bytes in cases {
            let mut got = [0i16; 16];
            // SAFETY: AVX2 is present (checked above); `got` is 32 writable bytes and the
            // store is unaligned.
            unsafe {
                let v = simd::q3_k_scales_i16(&bytes);
                std::arch::x86_64::_mm256_storeu_si256(got.as_mut_ptr().cast(), v);
            }
            let want = gguf::q3_k_scales(&bytes).map(i16::from);
            assert_eq!(got, want, "{bytes:?}");
        }
    }

    /// Each product equals the f64 product of gguf's dequantized weights with the
    /// dequantized activations, up to float rounding: the kernels read the layout as the
    /// reference dequantization does.
    #[test]
    fn products_match_the_reference_dequantization() {
        let mut s = 23u64;
        for ty in [GgmlType::Q2_K, GgmlType::Q3_K] {
            for trial in 0..20 {
                let blocks = 2;
                let w = weights(ty, blocks, trial, &mut s);
                let a = acts(blocks * QK_K, 2.0, &mut s);
                let mut deq = vec![0f32; blocks * QK_K];
                ty.dequantize(&w, &mut deq);
                let xa: Vec<f32> = a
                    .iter()
                    .flat_map(|b| b.qs.iter().map(move |&q| f32::from(q) * b.d))
                    .collect();
                let want: f64 = deq
                    .iter()
                    .zip(&xa)
                    .map(|(&x, &y)| f64::from(x) * f64::from(y))
                    .sum();
                let scale: f64 = deq
                    .iter()
                    .zip(&xa)
                    .map(|(&x, &y)| (f64::from(x) * f64::from(y)).abs())
                    .sum();
                let (fast, slow) = dots(ty, &w, &a);
                for got in [fast, slow] {
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (1.0 + scale),
                        "{ty:?} trial {trial}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
