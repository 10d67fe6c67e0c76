//! Q4_K and Q6_K products with the tokens as lanes, for CPUs with AVX-512 VNNI: sixteen
//! tokens per 512-bit register (`LanesQ8K`, built once per product), each weight quad
//! broadcast from a row's unpacked super-block, so one `vpdpbusd` does 64 multiply-adds
//! where the `maddubs` and `vpdpwssd` pair of lane-for-lane kernels did 32 each, and the
//! float part is one multiply-add (two with Q4_K's mins) per row, token and super-block.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes, so the activations enter offset by 128
//! (`a + 128`, unsigned) and the weights as signed bytes (Q4_K's 0..15, Q6_K's `q − 32`);
//! the offset's share, `128 · Σ_g sc_g Σ w`, is one exact integer per row and super-block,
//! taken off before the float part. Every sum is an exact `i32` (at most about 2.7·10^8),
//! so the result is the format's float chain on its definition's integers
//! (`Q4K::dot_scalar`, `Q6K::dot_scalar`): their bits, as `quant/tests.rs` checks.
//!
//! Four rows × two groups of sixteen tokens per pass: the activation register of a quad
//! serves four rows, the broadcast weight quad two groups (24 accumulators). Each row's
//! super-blocks are unpacked once per call for every token group.
//!
//! Measured (2-core Zen 4 at 3.65 GHz, `vpdpbusd` one per cycle and core): Q4_K, 8,192 ×
//! 2,048 × 256 tokens on one thread, 0.41 ns per token-pair block, 67% of the `vpdpbusd`
//! peak. Leaving out the float part made it 7% faster, the unpacking 4%, and the group
//! scale's `vpmulld` (an add in its place) 8–10%: it shares the multiply pipes with
//! `vpdpbusd`, as does an exact float multiply in its place (slower still). The group
//! loop's own pattern (two activation loads, four broadcasts, eight `vpdpbusd`) runs at
//! the peak in a microbenchmark with its data in L1, L2 or L3.
//!
//! Where the rest goes, from the whole op mix written out in assembly (same machine, ns per
//! `vpdpbusd`; the peak is 0.273): the group loop alone 0.273 (the weight broadcasts cost
//! nothing, as instructions or embedded in `vpdpbusd`); with the scales' `vpmulld` 0.307;
//! with the super-block's float part and mins as well 0.343; the kernel itself 0.41, the
//! difference being the unpacking, the output's transposition and the loop around them.
//! Every multiply tried in `vpmulld`'s place (`vpmullw`, `vpmaddwd`, `vpdpwssd`, `vpmuludq`,
//! a conversion and an FMA) costs one `vpdpbusd` slot; shifts do not, one per group, but
//! the four a 6-bit scale needs as `2^a + 2^b − 2^c − 2^d` (exact for all 64) made it
//! 0.369. So 16 multiplies beside Q4_K's 64 `vpdpbusd` per row, token group and super-block
//! (8 for the scales, 4 for the mins, 4 for the float chain) are this arithmetic's floor,
//! 80% of the peak. Pairing two groups' scales in one `vpdpwssd` would halve the first
//! eight, but needs each group's sum in 16 bits: Q4_K's 32-weight sums reach ±61,440 and
//! Q6_K's 16-weight ones ±129,024. Walking a tile's four row blocks over each token group
//! in turn (activations read once per tile, each output line written by four passes in a
//! row) measured the same as row block by row block: 0.406–0.416 against 0.412–0.419.

use std::arch::x86_64::*;

use super::avx2_kquants::k4_scales_mins;
use super::tile_out::{Out, ROWS};
use super::x86::prefetch_ahead;
use super::x86_512_rows_lanes::{transpose_words, Q4_K_TILE, Q6_K_TILE, TILE_ROWS};
use crate::blocks::{f16_at, LanesQ8K, LANE_TOKENS};

/// The super-block formats this kernel takes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Q4K,
    Q6K,
}

impl Format {
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            Format::Q4K => 144,
            Format::Q6K => 210,
        }
    }

    pub(crate) const fn tile_bytes(self) -> usize {
        match self {
            Format::Q4K => Q4_K_TILE,
            Format::Q6K => Q6_K_TILE,
        }
    }
}

/// A row's super-block as every token group needs it, prepared once per call.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct RowBlock {
    /// The 256 weights as signed bytes, in element order.
    q: [u8; 256],
    /// The group scales: Q4_K's eight (32 weights each), Q6_K's sixteen (16 each).
    sc: [i32; 16],
    /// Q4_K: `m_2k | m_2k+1 << 16`, the min pairs against the activations' sum pairs.
    m_pairs: [i32; 4],
    d: f32,
    /// Q4_K: `−dmin`.
    neg_dmin: f32,
    /// `128 · Σ_g sc_g Σ w`: what the activations' offset added.
    offset: i32,
}

const EMPTY: RowBlock = RowBlock {
    q: [0; 256],
    sc: [0; 16],
    m_pairs: [0; 4],
    d: 0.0,
    neg_dmin: 0.0,
    offset: 0,
};

/// Where the weight rows are: ggml's super-blocks, `nb` a row, or the tiles of sixteen
/// rows of `quant/interleaved.rs`, `[group * nb + i]`.
#[derive(Clone, Copy)]
pub(crate) enum Weights<'a> {
    Blocks(&'a [u8]),
    Tiles(&'a [u8]),
}

/// Every row of `w` (`format`'s super-blocks, `nb` a row) against the `n` tokens of `lanes`
/// (`[group * nb + i]`), into `out`.
///
/// # Safety
/// The CPU must support the features `super::cpu::wide_available` checks, and F16C.
/// Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn k_quant_lanes(
    format: Format,
    w: Weights<'_>,
    nb: usize,
    lanes: &[LanesQ8K],
    n: usize,
    out: &mut Out<'_>,
) {
    let block = format.block_bytes();
    let rows = match w {
        Weights::Blocks(w) => w.len() / (nb * block),
        Weights::Tiles(t) => t.len() / (nb * format.tile_bytes()) * TILE_ROWS,
    };
    let groups = n.div_ceil(LANE_TOKENS);
    assert!(lanes.len() >= groups * nb, "k_quant_lanes: lanes too short");
    // Each row's super-blocks are prepared once for every group: `prep[r * nb + i]`, four
    // rows at a time from blocks, a tile's sixteen from tiles.
    let per_prep = match w {
        Weights::Blocks(_) => 4,
        Weights::Tiles(_) => TILE_ROWS,
    };
    let mut prep = vec![EMPTY; per_prep * nb];
    let mut r = 0;
    while r < rows {
        let rr = if r + 4 <= rows { 4 } else { 1 };
        let base = match w {
            Weights::Blocks(w) => {
                for k in 0..rr {
                    for i in 0..nb {
                        let at = ((r + k) * nb + i) * block;
                        let (wb, rb) = (&w[at..at + block], &mut prep[k * nb + i]);
                        match format {
                            Format::Q4K => q4_k_block(wb, rb),
                            Format::Q6K => q6_k_block(wb, rb),
                        }
                    }
                }
                0
            }
            Weights::Tiles(t) => {
                if r % TILE_ROWS == 0 {
                    let g = r / TILE_ROWS;
                    let tile = format.tile_bytes();
                    for i in 0..nb {
                        let at = (g * nb + i) * tile;
                        match format {
                            Format::Q4K => q4_k_tile_blocks(&t[at..at + tile], &mut prep, nb, i),
                            Format::Q6K => q6_k_tile_blocks(&t[at..at + tile], &mut prep, nb, i),
                        }
                    }
                }
                r % TILE_ROWS * nb
            }
        };
        let prep = &prep[base..];
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
            // A last group of at most eight tokens (a small decode batch) fills half the
            // lanes: 256-bit registers then do the same work in half the instructions.
            if t == 1 && n - g * LANE_TOKENS <= LANE_TOKENS / 2 {
                match (format, rr) {
                    (Format::Q4K, 4) => pass.run_narrow::<4, 8, true>(prep, out),
                    (Format::Q4K, _) => pass.run_narrow::<1, 8, true>(prep, out),
                    (Format::Q6K, 4) => pass.run_narrow::<4, 16, false>(prep, out),
                    (Format::Q6K, _) => pass.run_narrow::<1, 16, false>(prep, out),
                }
                g += t;
                continue;
            }
            match (format, rr, t) {
                (Format::Q4K, 4, 2) => pass.run::<4, 2, 8, true>(prep, out),
                (Format::Q4K, 4, _) => pass.run::<4, 1, 8, true>(prep, out),
                (Format::Q4K, _, 2) => pass.run::<1, 2, 8, true>(prep, out),
                (Format::Q4K, _, _) => pass.run::<1, 1, 8, true>(prep, out),
                (Format::Q6K, 4, 2) => pass.run::<4, 2, 16, false>(prep, out),
                (Format::Q6K, 4, _) => pass.run::<4, 1, 16, false>(prep, out),
                (Format::Q6K, _, 2) => pass.run::<1, 2, 16, false>(prep, out),
                (Format::Q6K, _, _) => pass.run::<1, 1, 16, false>(prep, out),
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
    /// `G` groups of `256 / G` weights a super-block, each with its scale; `MINS`: Q4_K's
    /// min term.
    fn run<const R: usize, const T: usize, const G: usize, const MINS: bool>(
        &self,
        prep: &[RowBlock],
        out: &mut Out<'_>,
    ) {
        let quads = 64 / G;
        let nb = self.nb;
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for i in 0..nb {
            let rb: [&RowBlock; R] = std::array::from_fn(|r| &prep[r * nb + i]);
            let la: [&LanesQ8K; T] = std::array::from_fn(|t| &self.lanes[(self.g0 + t) * nb + i]);
            let mut isum = [[zero; T]; R];
            for j in 0..G {
                let mut s = [[zero; T]; R];
                for g in quads * j..quads * (j + 1) {
                    let a: [__m512i; T] = std::array::from_fn(|t| {
                        // SAFETY: `q[g]` is 64 readable bytes, 64-byte aligned.
                        unsafe { _mm512_load_si512(la[t].q[g].as_ptr().cast()) }
                    });
                    for r in 0..R {
                        let at = 4 * g;
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
                    let d = _mm512_mul_ps(d_a, _mm512_set1_ps(b.d));
                    acc[r][t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), acc[r][t]);
                    if MINS {
                        let mut mins = zero;
                        for (k, &p) in pairs.iter().enumerate() {
                            let m = _mm512_set1_epi32(b.m_pairs[k]);
                            mins = _mm512_dpwssd_epi32(mins, p, m);
                        }
                        let dmin = _mm512_mul_ps(d_a, _mm512_set1_ps(b.neg_dmin));
                        acc[r][t] = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(mins), acc[r][t]);
                    }
                }
            }
        }
        for t in 0..T {
            let t0 = (self.g0 + t) * LANE_TOKENS;
            if R == ROWS && t0 < self.n {
                let v = std::array::from_fn(|r| acc[r][t]);
                out.put_rows_of_16(self.r0, t0, LANE_TOKENS.min(self.n - t0), v);
            }
        }
        for r in 0..R {
            for t in 0..T {
                let t0 = (self.g0 + t) * LANE_TOKENS;
                if R == ROWS || t0 >= self.n {
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

    /// [`Self::run`] for one group of at most eight tokens, in 256-bit registers: the low
    /// half of each lane block, the same integers and float chain lane for lane.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn run_narrow<const R: usize, const G: usize, const MINS: bool>(
        &self,
        prep: &[RowBlock],
        out: &mut Out<'_>,
    ) {
        let quads = 64 / G;
        let nb = self.nb;
        let zero = _mm256_setzero_si256();
        let mut acc = [_mm256_setzero_ps(); R];
        for i in 0..nb {
            let rb: [&RowBlock; R] = std::array::from_fn(|r| &prep[r * nb + i]);
            let la = &self.lanes[self.g0 * nb + i];
            let mut isum = [zero; R];
            for j in 0..G {
                let mut s = [zero; R];
                for g in quads * j..quads * (j + 1) {
                    // SAFETY: `q[g]` is 64 readable bytes, 64-byte aligned; this reads its
                    // first 32 (tokens 0..8).
                    let a = unsafe { _mm256_load_si256(la.q[g].as_ptr().cast()) };
                    for r in 0..R {
                        let quad = &rb[r].q[4 * g..4 * g + 4];
                        let wq = _mm256_set1_epi32(i32::from_le_bytes([
                            quad[0], quad[1], quad[2], quad[3],
                        ]));
                        s[r] = _mm256_dpbusd_epi32(s[r], a, wq);
                    }
                }
                for r in 0..R {
                    let sc = _mm256_set1_epi32(rb[r].sc[j]);
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(s[r], sc));
                }
            }
            // SAFETY: `d` and `sum_pairs[k]` are 16 readable values, 64-byte aligned within
            // the aligned block; these read their first eight.
            let d_a = unsafe { _mm256_load_ps(la.d.as_ptr()) };
            let pairs: [__m256i; 4] = std::array::from_fn(|k| unsafe {
                _mm256_load_si256(la.sum_pairs[k].as_ptr().cast())
            });
            for r in 0..R {
                let b = rb[r];
                let sum = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(b.offset));
                let d = _mm256_mul_ps(d_a, _mm256_set1_ps(b.d));
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sum), acc[r]);
                if MINS {
                    let mut mins = zero;
                    for (k, &p) in pairs.iter().enumerate() {
                        mins = _mm256_dpwssd_epi32(mins, p, _mm256_set1_epi32(b.m_pairs[k]));
                    }
                    let dmin = _mm256_mul_ps(d_a, _mm256_set1_ps(b.neg_dmin));
                    acc[r] = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(mins), acc[r]);
                }
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

/// Unpacks one Q4_K super-block into `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_k_block(wb: &[u8], b: &mut RowBlock) {
    // A decode step's weights come from memory: the next blocks are on their way while this
    // one is unpacked.
    prefetch_ahead(&wb[0]);
    let mask = _mm256_set1_epi8(0x0f);
    let qs = &wb[16..144];
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
    q4_k_scales(&wb[4..16], f16_at(wb, 0), f16_at(wb, 2), b);
}

/// The sixteen rows' super-blocks of a Q4_K tile into `prep[lane * nb + i]`: the quants
/// transposed back into rows in registers, then unpacked as [`q4_k_block`] does.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_k_tile_blocks(tile: &[u8], prep: &mut [RowBlock], nb: usize, i: usize) {
    let mask = _mm256_set1_epi8(0x0f);
    // The quants are words 3..35 after the two fields of halves.
    let quants: [[__m512i; 16]; 2] = std::array::from_fn(|h| transpose_words(tile, 2, 3 + 16 * h));
    for lane in 0..TILE_ROWS {
        let b = &mut prep[lane * nb + i];
        for (h, words) in quants.iter().enumerate() {
            for part in 0..2 {
                let q = if part == 0 {
                    _mm512_castsi512_si256(words[lane])
                } else {
                    _mm512_extracti64x4_epi64::<1>(words[lane])
                };
                let c = 2 * h + part;
                let (lo, hi) = b.q[64 * c..64 * c + 64].split_at_mut(32);
                // SAFETY: `lo` and `hi` are 32 writable bytes each (sliced above); unaligned.
                unsafe {
                    _mm256_storeu_si256(lo.as_mut_ptr().cast(), _mm256_and_si256(q, mask));
                    let high = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
                    _mm256_storeu_si256(hi.as_mut_ptr().cast(), high);
                }
            }
        }
        let word = |w: usize| &tile[64 + 64 * w + 4 * lane..64 + 64 * w + 4 * lane + 4];
        let mut scales = [0u8; 12];
        for w in 0..3 {
            scales[4 * w..4 * w + 4].copy_from_slice(word(w));
        }
        let (d, dmin) = (f16_at(tile, 2 * lane), f16_at(tile, 32 + 2 * lane));
        q4_k_scales(&scales, d, dmin, b);
    }
}

/// The rest of a Q4_K row block once its quants are in `b.q`: from the 12 scale bytes and
/// the two factors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_k_scales(packed: &[u8], d: f32, dmin: f32, b: &mut RowBlock) {
    let (sc, m) = k4_scales_mins(packed);
    // SAFETY: `sc` and `m` are 8 readable bytes, `b.sc` 8 writable i32 (of 16) and
    // `b.m_pairs` 4 writable i32; the accesses are unaligned.
    unsafe {
        let sc8 = _mm_loadl_epi64(sc.as_ptr().cast());
        _mm256_storeu_si256(b.sc.as_mut_ptr().cast(), _mm256_cvtepu8_epi32(sc8));
        // Widened to 16 bits, the mins are already `m_2k | m_2k+1 << 16` as `i32`s.
        let m8 = _mm_loadl_epi64(m.as_ptr().cast());
        _mm_storeu_si128(b.m_pairs.as_mut_ptr().cast(), _mm_cvtepu8_epi16(m8));
    }
    b.d = d;
    b.neg_dmin = -dmin;
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

/// Unpacks one Q6_K super-block into `b`: each weight `q − 32` (ggml's order: in each half
/// of 128, `ql`'s low nibbles then high nibbles of its two 32-byte rows, `qh`'s bit pairs
/// above them), the sixteen signed scales.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q6_k_block(wb: &[u8], b: &mut RowBlock) {
    prefetch_ahead(&wb[0]);
    let load = |at: usize| {
        let src = &wb[at..at + 32];
        // SAFETY: `src` is 32 readable bytes (sliced above); the load is unaligned.
        unsafe { _mm256_loadu_si256(src.as_ptr().cast()) }
    };
    let halves =
        std::array::from_fn(|half| [load(64 * half), load(64 * half + 32), load(128 + 32 * half)]);
    let mut sc = [0u8; 16];
    sc.copy_from_slice(&wb[192..208]);
    q6_k_unpack(halves, sc, f16_at(wb, 208), b);
}

/// The sixteen rows' super-blocks of a Q6_K tile into `prep[lane * nb + i]`: the tile's
/// slots transposed back into rows in registers, each row's words put back in ggml's order
/// by two permutations per half (`quant/interleaved.rs` says the slots' order), then
/// unpacked as [`q6_k_block`] does.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q6_k_tile_blocks(tile: &[u8], prep: &mut [RowBlock], nb: usize, i: usize) {
    let slots: [[__m512i; 16]; 3] = std::array::from_fn(|k| transpose_words(tile, 1, 16 * k));
    // Half h's quad q is in slots 24h + 3q (`ql`'s first word), + 1 (its second), + 2
    // (`qh`'s): indices into the two slot registers that hold the half.
    let index = |first: i32| {
        let ql: [i32; 16] = std::array::from_fn(|k| first + 3 * (k as i32 % 8) + k as i32 / 8);
        let qh: [i32; 16] = std::array::from_fn(|k| first + 3 * (k as i32 % 8) + 2);
        // SAFETY: each array is 64 readable bytes; the loads are unaligned.
        unsafe {
            (
                _mm512_loadu_si512(ql.as_ptr().cast()),
                _mm512_loadu_si512(qh.as_ptr().cast()),
            )
        }
    };
    let (ql0, qh0) = index(0);
    let (ql1, qh1) = index(8);
    for lane in 0..TILE_ROWS {
        let (a, b, c) = (slots[0][lane], slots[1][lane], slots[2][lane]);
        let parts = |ql: __m512i, qh: __m512i| {
            [
                _mm512_castsi512_si256(ql),
                _mm512_extracti64x4_epi64::<1>(ql),
                _mm512_castsi512_si256(qh),
            ]
        };
        let halves = [
            parts(
                _mm512_permutex2var_epi32(a, ql0, b),
                _mm512_permutex2var_epi32(a, qh0, b),
            ),
            parts(
                _mm512_permutex2var_epi32(b, ql1, c),
                _mm512_permutex2var_epi32(b, qh1, c),
            ),
        ];
        let mut sc = [0u8; 16];
        for w in 0..4 {
            let at = 32 + 64 * (48 + w) + 4 * lane;
            sc[4 * w..4 * w + 4].copy_from_slice(&tile[at..at + 4]);
        }
        q6_k_unpack(halves, sc, f16_at(tile, 2 * lane), &mut prep[lane * nb + i]);
    }
}

/// A Q6_K row block from its halves' `ql` and `qh` registers (`[ql 0..32, ql 32..64, qh]`
/// of each half of 128 elements), its scale bytes and `d`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q6_k_unpack(halves: [[__m256i; 3]; 2], sc: [u8; 16], d: f32, b: &mut RowBlock) {
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(0x03);
    // The unsigned values 0..63 first: the offset sum takes them unsigned.
    let mut unsigned = [_mm256_setzero_si256(); 8];
    for (half, &[l0, l1, h]) in halves.iter().enumerate() {
        let high = |shift: i32| {
            let bits = match shift {
                0 => h,
                2 => _mm256_srli_epi16::<2>(h),
                4 => _mm256_srli_epi16::<4>(h),
                _ => _mm256_srli_epi16::<6>(h),
            };
            _mm256_slli_epi16::<4>(_mm256_and_si256(bits, m2))
        };
        unsigned[4 * half] = _mm256_or_si256(_mm256_and_si256(l0, m4), high(0));
        unsigned[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), high(2));
        let l0h = _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4);
        let l1h = _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4);
        unsigned[4 * half + 2] = _mm256_or_si256(l0h, high(4));
        unsigned[4 * half + 3] = _mm256_or_si256(l1h, high(6));
    }
    for (s, &v) in b.sc.iter_mut().zip(&sc) {
        *s = i32::from(v as i8);
    }
    b.d = d;
    b.neg_dmin = 0.0;
    b.m_pairs = [0; 4];
    // `Σ_g sc_g Σ q` over the unsigned values, each 128-bit quarter of a register one group
    // against its scale as bytes.
    let scales = _mm512_broadcast_i32x4(
        // SAFETY: `sc` is 16 readable bytes; the load is unaligned.
        unsafe { _mm_loadu_si128(sc.as_ptr().cast()) },
    );
    let mut sum = _mm512_setzero_si512();
    let thirty_two = _mm256_set1_epi8(32);
    for k in 0..4 {
        let v =
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(unsigned[2 * k]), unsigned[2 * k + 1]);
        let first = (4 * k) as i8;
        let pick = _mm512_set_epi32(
            i32::from_le_bytes([first as u8 + 3; 4]),
            i32::from_le_bytes([first as u8 + 3; 4]),
            i32::from_le_bytes([first as u8 + 3; 4]),
            i32::from_le_bytes([first as u8 + 3; 4]),
            i32::from_le_bytes([first as u8 + 2; 4]),
            i32::from_le_bytes([first as u8 + 2; 4]),
            i32::from_le_bytes([first as u8 + 2; 4]),
            i32::from_le_bytes([first as u8 + 2; 4]),
            i32::from_le_bytes([first as u8 + 1; 4]),
            i32::from_le_bytes([first as u8 + 1; 4]),
            i32::from_le_bytes([first as u8 + 1; 4]),
            i32::from_le_bytes([first as u8 + 1; 4]),
            i32::from_le_bytes([first as u8; 4]),
            i32::from_le_bytes([first as u8; 4]),
            i32::from_le_bytes([first as u8; 4]),
            i32::from_le_bytes([first as u8; 4]),
        );
        sum = _mm512_dpbusd_epi32(sum, v, _mm512_shuffle_epi8(scales, pick));
        for (h, &u) in [unsigned[2 * k], unsigned[2 * k + 1]].iter().enumerate() {
            let dst = &mut b.q[64 * k + 32 * h..64 * k + 32 * h + 32];
            // SAFETY: `dst` is 32 writable bytes (sliced above); the store is unaligned.
            unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), _mm256_sub_epi8(u, thirty_two)) };
        }
    }
    // Σ_g sc_g Σ (q − 32) = Σ_g sc_g Σ q − 32 · 16 · Σ_g sc_g.
    let sc_sum: i32 = b.sc.iter().sum();
    b.offset = 128 * (_mm512_reduce_add_epi32(sum) - 512 * sc_sum);
}
