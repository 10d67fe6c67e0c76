//! Q4_K products with the tokens as lanes, for CPUs with AVX-512 VNNI: sixteen tokens per
//! 512-bit register (`LanesQ8K`, built once per product), each weight quad broadcast from
//! a row's unpacked super-block, so one `vpdpbusd` does 64 multiply-adds where the
//! `maddubs` and `vpdpwssd` pair of the lane-for-lane kernels did 32 each, and the float
//! part is one multiply-add pair per row, token and super-block.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes, so the activations enter offset by 128
//! (`a + 128`, unsigned) and the weights as they are (0..15, a valid signed byte); the
//! offset's share, `128 · Σ_j sc_j Σ q`, is one exact integer per row and super-block,
//! taken off before the float part. Every sum is an exact `i32` (at most about 6.2·10^7),
//! so the result is `Q4K::dot_with`'s chain on `Q4K::dot_scalar`'s integers: the portable
//! definition's bits, as `quant/tests.rs` checks.
//!
//! Four rows × two groups of sixteen tokens per pass: the activation register of a quad
//! serves four rows, the broadcast weight quad two groups (24 accumulators).

use std::arch::x86_64::*;

use super::tile_out::Out;
use crate::blocks::{f16_at, LanesQ8K, LANE_TOKENS};

/// Bytes of a Q4_K super-block.
const BLOCK: usize = 144;

/// A row's super-block as every token group needs it, prepared once per pass.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct RowBlock {
    /// The 256 quants as bytes, in element order (sub-block `j` at `32j..32j + 32`).
    q: [u8; 256],
    sc: [i32; 8],
    /// `m_2k | m_2k+1 << 16`: the min pairs against the activations' sum pairs.
    m_pairs: [i32; 4],
    d: f32,
    neg_dmin: f32,
    /// `128 · Σ_j sc_j Σ_l q_l`: what the activations' offset added.
    offset: i32,
}

const EMPTY: RowBlock = RowBlock {
    q: [0; 256],
    sc: [0; 8],
    m_pairs: [0; 4],
    d: 0.0,
    neg_dmin: 0.0,
    offset: 0,
};

/// Every row of `w` (Q4_K, `nb` super-blocks a row) against the `n` tokens of `lanes`
/// (`[group * nb + i]`), into `out`.
///
/// # Safety
/// The CPU must support the features `super::cpu::wide_available` checks, and F16C.
/// Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q4_k_lanes(
    w: &[u8],
    nb: usize,
    lanes: &[LanesQ8K],
    n: usize,
    out: &mut Out<'_>,
) {
    let rows = w.len() / (nb * BLOCK);
    let groups = n.div_ceil(LANE_TOKENS);
    assert!(lanes.len() >= groups * nb, "q4_k_lanes: lanes too short");
    // Each row's super-blocks are prepared once for every group: `prep[r * nb + i]`.
    let mut prep = vec![EMPTY; 4 * nb];
    let mut r = 0;
    while r < rows {
        let rr = if r + 4 <= rows { 4 } else { 1 };
        for k in 0..rr {
            for i in 0..nb {
                let at = ((r + k) * nb + i) * BLOCK;
                row_block(&w[at..at + BLOCK], &mut prep[k * nb + i]);
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
            match (rr, t) {
                (4, 2) => pass.run::<4, 2>(&prep, out),
                (4, _) => pass.run::<4, 1>(&prep, out),
                (_, 2) => pass.run::<1, 2>(&prep, out),
                _ => pass.run::<1, 1>(&prep, out),
            }
            g += t;
        }
        r += rr;
    }
}

/// Rows `r0..r0 + R` against token groups `g0..g0 + T`.
struct Pass<'a> {
    nb: usize,
    r0: usize,
    lanes: &'a [LanesQ8K],
    g0: usize,
    n: usize,
}

impl Pass<'_> {
    // Indexed loops: the register arrays are indexed by row and group together.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn run<const R: usize, const T: usize>(&self, prep: &[RowBlock], out: &mut Out<'_>) {
        let nb = self.nb;
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for i in 0..nb {
            let rb: [&RowBlock; R] = std::array::from_fn(|r| &prep[r * nb + i]);
            let la: [&LanesQ8K; T] = std::array::from_fn(|t| &self.lanes[(self.g0 + t) * nb + i]);
            let mut isum = [[zero; T]; R];
            for j in 0..8 {
                let mut s = [[zero; T]; R];
                for g in 0..8 {
                    let a: [__m512i; T] = std::array::from_fn(|t| {
                        // SAFETY: `q[8j + g]` is 64 readable bytes, 64-byte aligned.
                        unsafe { _mm512_load_si512(la[t].q[8 * j + g].as_ptr().cast()) }
                    });
                    for r in 0..R {
                        let at = 32 * j + 4 * g;
                        let quad = &rb[r].q[at..at + 4];
                        let wq = _mm512_set1_epi32(i32::from_le_bytes([
                            quad[0], quad[1], quad[2], quad[3],
                        ]));
                        for t in 0..T {
                            s[r][t] = _mm512_dpbusd_epi32(s[r][t], a[t], wq);
                        }
                    }
                }
                for r in 0..R {
                    let sc = _mm512_set1_epi32(rb[r].sc[j]);
                    for t in 0..T {
                        isum[r][t] = _mm512_add_epi32(isum[r][t], _mm512_mullo_epi32(s[r][t], sc));
                    }
                }
            }
            for t in 0..T {
                // SAFETY: `d` is 16 readable f32 and `sum_pairs[k]` 16 readable i32, each
                // 64-byte aligned within the aligned block.
                let d_a = unsafe { _mm512_load_ps(la[t].d.as_ptr()) };
                let pairs: [__m512i; 4] = std::array::from_fn(|k| unsafe {
                    _mm512_load_si512(la[t].sum_pairs[k].as_ptr().cast())
                });
                for r in 0..R {
                    let b = rb[r];
                    let sum = _mm512_sub_epi32(isum[r][t], _mm512_set1_epi32(b.offset));
                    let mut mins = zero;
                    for (k, &p) in pairs.iter().enumerate() {
                        mins = _mm512_dpwssd_epi32(mins, p, _mm512_set1_epi32(b.m_pairs[k]));
                    }
                    let d = _mm512_mul_ps(d_a, _mm512_set1_ps(b.d));
                    let dmin = _mm512_mul_ps(d_a, _mm512_set1_ps(b.neg_dmin));
                    acc[r][t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), acc[r][t]);
                    acc[r][t] = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(mins), acc[r][t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                let t0 = (self.g0 + t) * LANE_TOKENS;
                if t0 >= self.n {
                    continue;
                }
                let mut vals = [0f32; LANE_TOKENS];
                // SAFETY: `vals` is 16 writable f32; the store is unaligned.
                unsafe { _mm512_storeu_ps(vals.as_mut_ptr(), acc[r][t]) };
                let k = LANE_TOKENS.min(self.n - t0);
                out.put_slice(self.r0 + r, t0, &vals[..k]);
            }
        }
    }
}

/// Unpacks one Q4_K super-block into `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn row_block(wb: &[u8], b: &mut RowBlock) {
    let mask = _mm256_set1_epi8(0x0f);
    let qs = &wb[16..BLOCK];
    for c in 0..4 {
        let src = &qs[32 * c..32 * c + 32];
        let (lo, hi) = b.q[64 * c..64 * c + 64].split_at_mut(32);
        // SAFETY: `src`, `lo` and `hi` are 32 bytes each (sliced above); unaligned access.
        unsafe {
            let q = _mm256_loadu_si256(src.as_ptr().cast());
            _mm256_storeu_si256(lo.as_mut_ptr().cast(), _mm256_and_si256(q, mask));
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
            _mm256_storeu_si256(hi.as_mut_ptr().cast(), high);
        }
    }
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        (sc[j], m[j]) = gguf::k4_scale_min(j, &wb[4..16]);
        b.sc[j] = i32::from(sc[j]);
    }
    for k in 0..4 {
        b.m_pairs[k] = i32::from(m[2 * k]) | (i32::from(m[2 * k + 1]) << 16);
    }
    b.d = f16_at(wb, 0);
    b.neg_dmin = -f16_at(wb, 2);
    // `Σ_j sc_j Σ q` with each register's two sub-blocks against their scales as bytes.
    let scales = _mm512_set1_epi64(i64::from_le_bytes(sc));
    let mut sum = _mm512_setzero_si512();
    for k in 0..4 {
        let lo = (2 * k) as i8;
        let pick = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi8(lo)),
            _mm256_set1_epi8(lo + 1),
        );
        // SAFETY: `q[64k..64k + 64]` is 64 readable bytes; the load is aligned (64k of an
        // aligned array).
        let q = unsafe { _mm512_load_si512(b.q[64 * k..].as_ptr().cast()) };
        sum = _mm512_dpbusd_epi32(sum, q, _mm512_shuffle_epi8(scales, pick));
    }
    b.offset = 128 * _mm512_reduce_add_epi32(sum);
}
