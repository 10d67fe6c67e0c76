//! Q8_0, Q5_0 and Q4_0 products with the tokens as lanes, for CPUs with AVX-512 VNNI: sixteen
//! tokens per 512-bit register (`LanesQ8_1`, built once per product), each weight quad
//! broadcast from a row's prepared block, so one `vpdpbusd` does 64 multiply-adds and the
//! float part is one conversion and one multiply-add per row, block and sixteen tokens.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes: the activations enter offset by 128
//! (`a + 128`) and the weights as their signed values, and each row block's sum starts from
//! `−128 · Σ q`, so it ends on the exact `Σ q·a` of the definition
//! (`super::block_chain::chain_dot_portable`), whose float step follows lane for lane: its
//! bits (`quant/tests.rs`).
//!
//! Four rows × two groups of sixteen tokens per pass, as the k-quants' tokens-in-lanes
//! kernel (`x86_512_lanes.rs`): the activation register of a quad serves four rows, the
//! broadcast weight quad two groups. Each row's blocks are prepared once per call for every
//! token group.

use std::arch::x86_64::*;

use super::block_chain::ChainBlock;
use super::tile_out::{Out, ROWS};
use crate::blocks::{LanesQ8_1, LANE_TOKENS, QK};

/// A row's block as every token group needs it.
#[derive(Clone, Copy)]
struct Prepared {
    /// The values as signed bytes.
    q: [i8; QK],
    /// `−128 · Σ q`: takes off what the activations' offset added.
    start: i32,
    d: f32,
}

const EMPTY: Prepared = Prepared {
    q: [0; QK],
    start: 0,
    d: 0.0,
};

/// Every row of `w` (`nb` blocks a row) against the `n` tokens of `lanes`
/// (`[group * nb + i]`), into `out`.
///
/// # Safety
/// The CPU must support the features `super::cpu::wide_available` checks, and F16C.
/// Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn block_lanes<B: ChainBlock>(
    w: &[B],
    nb: usize,
    lanes: &[LanesQ8_1],
    n: usize,
    out: &mut Out<'_>,
) {
    let rows = w.len() / nb;
    let groups = n.div_ceil(LANE_TOKENS);
    assert!(lanes.len() >= groups * nb, "block_lanes: lanes too short");
    let mut prep = vec![EMPTY; ROWS * nb];
    let mut r = 0;
    while r < rows {
        let rr = if r + ROWS <= rows { ROWS } else { 1 };
        for k in 0..rr {
            for i in 0..nb {
                prepare(&w[(r + k) * nb + i], &mut prep[k * nb + i]);
            }
        }
        let mut g = 0;
        while g < groups {
            let t = if g + 2 <= groups { 2 } else { 1 };
            let pass = Pass {
                nb,
                r0: r,
                lanes,
                g0: g,
                n,
            };
            // A last group of at most eight tokens (a decode batch) fills half the lanes:
            // 256-bit registers then do the same work in half the instructions.
            if t == 1 && n - g * LANE_TOKENS <= LANE_TOKENS / 2 {
                match rr {
                    ROWS => pass.run_narrow::<ROWS>(&prep, out),
                    _ => pass.run_narrow::<1>(&prep, out),
                }
                g += t;
                continue;
            }
            match (rr, t) {
                (ROWS, 2) => pass.run::<ROWS, 2>(&prep, out),
                (ROWS, _) => pass.run::<ROWS, 1>(&prep, out),
                (_, 2) => pass.run::<1, 2>(&prep, out),
                _ => pass.run::<1, 1>(&prep, out),
            }
            g += t;
        }
        r += rr;
    }
}

/// A row's block as [`Prepared`]: the values unpacked and summed in registers (a scalar
/// sum took most of a 64-token prefill's product time).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn prepare<B: ChainBlock>(b: &B, p: &mut Prepared) {
    // SAFETY: the CPU has AVX2 (the function's features); `p.q` is 32 writable bytes, the
    // store unaligned.
    unsafe {
        let v = b.values_256();
        _mm256_storeu_si256(p.q.as_mut_ptr().cast(), v);
        // Σ (v + 128) over unsigned bytes, four partial sums, then less 32 · 128.
        let unsigned = _mm256_xor_si256(v, _mm256_set1_epi8(-128));
        let partial = _mm256_sad_epu8(unsigned, _mm256_setzero_si256());
        let two = _mm_add_epi64(
            _mm256_castsi256_si128(partial),
            _mm256_extracti128_si256::<1>(partial),
        );
        let sum = _mm_cvtsi128_si64(_mm_add_epi64(two, _mm_unpackhi_epi64(two, two))) as i32;
        p.start = -128 * (sum - 128 * QK as i32);
    }
    p.d = b.scale();
}

/// Rows `r0..r0 + R` against token groups `g0..g0 + T`.
struct Pass<'a> {
    nb: usize,
    r0: usize,
    lanes: &'a [LanesQ8_1],
    g0: usize,
    n: usize,
}

impl Pass<'_> {
    // The register arrays are indexed by row and group together.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn run<const R: usize, const T: usize>(&self, prep: &[Prepared], out: &mut Out<'_>) {
        let nb = self.nb;
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for i in 0..nb {
            let pb: [&Prepared; R] = std::array::from_fn(|r| &prep[r * nb + i]);
            let la: [&LanesQ8_1; T] = std::array::from_fn(|t| &self.lanes[(self.g0 + t) * nb + i]);
            let mut s: [[__m512i; T]; R] =
                std::array::from_fn(|r| [_mm512_set1_epi32(pb[r].start); T]);
            for g in 0..QK / 4 {
                let a: [__m512i; T] = std::array::from_fn(|t| {
                    // SAFETY: `q[g]` is 64 readable bytes, 64-byte aligned.
                    unsafe { _mm512_load_si512(la[t].q[g].as_ptr().cast()) }
                });
                for r in 0..R {
                    let quad = &pb[r].q[4 * g..4 * g + 4];
                    let wq = _mm512_set1_epi32(i32::from_le_bytes([
                        quad[0] as u8,
                        quad[1] as u8,
                        quad[2] as u8,
                        quad[3] as u8,
                    ]));
                    for t in 0..T {
                        s[r][t] = _mm512_dpbusd_epi32(s[r][t], a[t], wq);
                    }
                }
            }
            for t in 0..T {
                // SAFETY: `d` is 16 readable f32, 64-byte aligned within the aligned block.
                let d_a = unsafe { _mm512_load_ps(la[t].d.as_ptr()) };
                for r in 0..R {
                    let d = _mm512_mul_ps(_mm512_set1_ps(pb[r].d), d_a);
                    acc[r][t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[r][t]), acc[r][t]);
                }
            }
        }
        for t in 0..T {
            let t0 = (self.g0 + t) * LANE_TOKENS;
            if t0 >= self.n {
                continue;
            }
            let tokens = LANE_TOKENS.min(self.n - t0);
            if R == ROWS {
                out.put_rows_of_16(self.r0, t0, tokens, std::array::from_fn(|r| acc[r][t]));
                continue;
            }
            for r in 0..R {
                let mut vals = [0f32; LANE_TOKENS];
                // SAFETY: `vals` is 16 writable f32; the store is unaligned.
                unsafe { _mm512_storeu_ps(vals.as_mut_ptr(), acc[r][t]) };
                out.put_slice(self.r0 + r, t0, &vals[..tokens]);
            }
        }
    }

    /// [`Self::run`] for one group of at most eight tokens, in 256-bit registers: the low
    /// half of each lane block, the same integers and float steps lane for lane.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn run_narrow<const R: usize>(&self, prep: &[Prepared], out: &mut Out<'_>) {
        let nb = self.nb;
        let mut acc = [_mm256_setzero_ps(); R];
        for i in 0..nb {
            let pb: [&Prepared; R] = std::array::from_fn(|r| &prep[r * nb + i]);
            let la = &self.lanes[self.g0 * nb + i];
            let mut s: [__m256i; R] = std::array::from_fn(|r| _mm256_set1_epi32(pb[r].start));
            for g in 0..QK / 4 {
                // SAFETY: `q[g]` is 64 readable bytes, 64-byte aligned; this reads its first
                // 32 (tokens 0..8).
                let a = unsafe { _mm256_load_si256(la.q[g].as_ptr().cast()) };
                for r in 0..R {
                    let quad = &pb[r].q[4 * g..4 * g + 4];
                    let wq = _mm256_set1_epi32(i32::from_le_bytes([
                        quad[0] as u8,
                        quad[1] as u8,
                        quad[2] as u8,
                        quad[3] as u8,
                    ]));
                    s[r] = _mm256_dpbusd_epi32(s[r], a, wq);
                }
            }
            // SAFETY: `d` is 16 readable f32, 64-byte aligned; this reads its first eight.
            let d_a = unsafe { _mm256_load_ps(la.d.as_ptr()) };
            for r in 0..R {
                let d = _mm256_mul_ps(_mm256_set1_ps(pb[r].d), d_a);
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s[r]), acc[r]);
            }
        }
        let t0 = self.g0 * LANE_TOKENS;
        if R == ROWS {
            out.put_rows(self.r0, t0, self.n - t0, std::array::from_fn(|r| acc[r]));
            return;
        }
        for r in 0..R {
            let mut vals = [0f32; LANE_TOKENS / 2];
            // SAFETY: `vals` is 8 writable f32; the store is unaligned.
            unsafe { _mm256_storeu_ps(vals.as_mut_ptr(), acc[r]) };
            out.put_slice(self.r0 + r, t0, &vals[..self.n - t0]);
        }
    }
}
