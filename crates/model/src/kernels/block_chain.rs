//! The arithmetic of Q8_0, Q5_0 and Q4_0 products: one float step per 32-element block.
//!
//! For a weight row of blocks `b` (scale `d_b`, signed values `q_b`) against an activation
//! row of Q8_1 blocks (scale `da_b`, quants `a_b`):
//!
//! ```text
//! acc = 0;  for each block b in order:  acc = fma(d_b · da_b, f32(Σ_e q_b[e] · a_b[e]), acc)
//! ```
//!
//! The block's sum is an exact `i32` (at most 32 · 128 · 127 in magnitude, so its `f32` is
//! exact too), and `d_b · da_b` one rounded product: a value depends only on the two rows,
//! never on how many rows or tokens are computed together or which instruction set runs.
//! [`chain_dot_portable`] is the definition; the 256-bit rows here (with VNNI where the CPU
//! has it) and the 512-bit tokens-in-lanes kernel (`x86_512_block_lanes.rs`) give its bits
//! (`quant/tests.rs`).
//!
//! This is not llama.cpp's order, whose AVX2 kernels keep eight float lanes per token, each
//! taking four products of every block through its own multiply-add: a tokens-in-lanes
//! kernel would then need a conversion and a multiply-add per four products and token,
//! where this arithmetic needs one per 32 (Gemma 3 270M, whose 640-wide matrices are Q5_0,
//! spent 31% of a 16,384-token prefill in those lanes). One rounding per block instead of
//! one per lane is also the nearer to the exact product.

use crate::blocks::{f16_at, BlockQ4_0, BlockQ8_0, BlockQ8_1, LanesQ8_1, QK};

/// A weight block of a format whose product is [`chain_dot`].
pub(crate) trait ChainBlock: Copy + Send + Sync + 'static {
    /// The block's scale.
    fn scale(&self) -> f32;
    /// The 32 values as signed bytes, in element order.
    fn values(&self) -> [i8; QK];
    /// What [`Self::unsigned_256`] adds to each value.
    const OFFSET: i32;
    /// The values plus [`Self::OFFSET`], as unsigned bytes in a 256-bit register.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn unsigned_256(&self) -> std::arch::x86_64::__m256i;
    /// [`Self::values`] in a 256-bit register.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_256(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees AVX2. Bytes wrap: for an offset of 128 this is the
        // sign bit flipped back.
        unsafe {
            _mm256_sub_epi8(
                self.unsigned_256(),
                _mm256_set1_epi8(Self::OFFSET as u8 as i8),
            )
        }
    }
}

/// Nibble `e` of a block's 16 bytes: elements 0..16 the low nibbles, 16..32 the high.
#[inline(always)]
fn nibble(qs: &[u8], e: usize) -> u8 {
    if e < 16 {
        qs[e] & 0x0f
    } else {
        qs[e - 16] >> 4
    }
}

impl ChainBlock for BlockQ8_0 {
    #[inline(always)]
    fn scale(&self) -> f32 {
        self.d
    }

    #[inline(always)]
    fn values(&self) -> [i8; QK] {
        self.qs
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_256(&self) -> std::arch::x86_64::__m256i {
        // The bytes as stored, not the default's flip and flip back.
        // SAFETY: `qs` is 32 readable bytes; the load is unaligned; the caller guarantees
        // AVX2.
        unsafe { std::arch::x86_64::_mm256_loadu_si256(self.qs.as_ptr().cast()) }
    }

    const OFFSET: i32 = 128;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned_256(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: as `values_256`.
        unsafe { _mm256_xor_si256(self.values_256(), _mm256_set1_epi8(-128)) }
    }
}

/// Q4_0 with its scale widened at load: 16 bytes of nibbles (elements 0..16 low, 16..32
/// high); the values are `q − 8`.
impl ChainBlock for BlockQ4_0 {
    #[inline(always)]
    fn scale(&self) -> f32 {
        self.d
    }

    #[inline(always)]
    fn values(&self) -> [i8; QK] {
        std::array::from_fn(|e| nibble(&self.qs, e) as i8 - 8)
    }

    const OFFSET: i32 = 8;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned_256(&self) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller guarantees AVX2, and FMA comes with it on every CPU here
        // (`cpu::features`).
        unsafe { super::x86::unpack_nibbles(&self.qs) }
    }
}

/// Q5_0 as ggml stores it: the f16 scale, 4 bytes of fifth bits, 16 bytes of nibbles
/// (elements 0..16 low, 16..32 high); the values are `q − 16`.
impl ChainBlock for [u8; 22] {
    #[inline(always)]
    fn scale(&self) -> f32 {
        f16_at(self, 0)
    }

    #[inline(always)]
    fn values(&self) -> [i8; QK] {
        let qh = u32::from_le_bytes([self[2], self[3], self[4], self[5]]);
        std::array::from_fn(|e| (nibble(&self[6..], e) | (((qh >> e) & 1) << 4) as u8) as i8 - 16)
    }

    const OFFSET: i32 = 16;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned_256(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let qs: &[u8; 16] = self[6..].try_into().expect("16 bytes of nibbles");
        // SAFETY: the caller guarantees AVX2 (with FMA, as `cpu::features` pairs them).
        unsafe {
            let nibbles = super::x86::unpack_nibbles(qs);
            // Byte e tests bit e of `qh`: byte e / 8 broadcast to its eight, bit e % 8 masked.
            let bits = i32::from_le_bytes([self[2], self[3], self[4], self[5]]);
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(bits),
                _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                    3, 3, 3, 3, 3, 3,
                ),
            );
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
            _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
        }
    }
}

/// The definition: one weight row against one activation row.
pub(crate) fn chain_dot_portable<B: ChainBlock>(w: &[B], a: &[BlockQ8_1]) -> f32 {
    let mut acc = 0f32;
    for (b, x) in w.iter().zip(a) {
        let q = b.values();
        let sum: i32 = q
            .iter()
            .zip(&x.qs)
            .map(|(&w, &a)| i32::from(w) * i32::from(a))
            .sum();
        acc = (b.scale() * x.d).mul_add(sum as f32, acc);
    }
    acc
}

/// [`chain_dot_portable`]'s value on the widest instruction set this CPU runs.
#[inline]
pub(crate) fn chain_dot<B: ChainBlock>(w: &[B], a: &[BlockQ8_1]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::avx2_fma_f16c_detected() {
        // SAFETY: AVX2, FMA and F16C are present (checked), the function's requirement.
        return unsafe { x86::chain_dot_256(w, a) };
    }
    chain_dot_portable(w, a)
}

/// `out[r * n + t] = dot(w[r], x[t])` for the rows of `w` (`nb` blocks each) and the `n`
/// tokens of `x` (`nb` blocks each), one value at a time.
pub(crate) fn chain_rows<B: ChainBlock>(
    w: &[B],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::wide_available() && super::cpu::avx2_fma_f16c_detected() {
        // SAFETY: the CPU has the features `wide_available` checks, and F16C: the
        // function's requirement.
        unsafe { x86::chain_rows_vnni(w, nb, x, n, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::cpu::avx2_fma_f16c_detected() {
        // SAFETY: AVX2, FMA and F16C are present (checked), the function's requirement.
        unsafe { x86::chain_rows_256(w, nb, x, n, out) };
        return;
    }
    for (r, row) in w.chunks_exact(nb).enumerate() {
        for t in 0..n {
            out[r * n + t] = chain_dot_portable(row, &x[t * nb..(t + 1) * nb]);
        }
    }
}

/// From this many tokens a product takes the tokens-in-lanes kernel where the CPU has it;
/// fewer go through the rows, eight rows in the lanes of a 256-bit register.
#[cfg(target_arch = "x86_64")]
const LANES_MIN: usize = 8;

/// Whether a product of `n` tokens runs the tokens-in-lanes kernel here.
pub(crate) fn wants_lanes(n: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        n >= LANES_MIN && super::cpu::wide_available() && super::cpu::avx2_fma_f16c_detected()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = n;
        false
    }
}

/// The rows of `w` (`nb` blocks each) against the `n` tokens of `lanes` with the
/// tokens-in-lanes kernel, into `out[r * n + t]`, or token-major `out[t * ld + r]` given
/// `ld`; false (nothing done) where [`wants_lanes`] is false.
pub(crate) fn lanes_rows<B: ChainBlock>(
    w: &[B],
    nb: usize,
    lanes: &[LanesQ8_1],
    n: usize,
    out: &mut [f32],
    ld: Option<usize>,
) -> bool {
    if !wants_lanes(n) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let mut out = match ld {
            None => super::tile_out::Out::RowMajor { out, n },
            Some(ld) => super::tile_out::Out::TokenMajor { out, ld },
        };
        // SAFETY: `wants_lanes` found the CPU's features, the function's requirement.
        unsafe { super::x86_512_block_lanes::block_lanes(w, nb, lanes, n, &mut out) };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, nb, lanes, out, ld);
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::ChainBlock;
    use crate::blocks::BlockQ8_1;

    /// Blocks whose sums are reduced together (one register of eight `i32`).
    const GROUP: usize = 8;

    /// The largest group of eight rows (bytes) the rows kernels read side by side for one
    /// token.
    const NEXT_GROUP_MAX: usize = 16 << 10;

    /// [`super::chain_rows`] compiled for AVX2, FMA and F16C.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn chain_rows_256<B: ChainBlock>(
        w: &[B],
        nb: usize,
        x: &[BlockQ8_1],
        n: usize,
        out: &mut [f32],
    ) {
        let rows = w.len() / nb;
        let whole = rows / GROUP * GROUP;
        for r0 in (0..whole).step_by(GROUP) {
            let next = w[(r0 + GROUP) * nb..].as_ptr().cast::<u8>();
            for t in 0..n {
                let group = &w[r0 * nb..(r0 + GROUP) * nb];
                let sums = eight_rows(group, nb, &x[t * nb..(t + 1) * nb], next);
                for (k, &v) in sums.iter().enumerate() {
                    out[(r0 + k) * n + t] = v;
                }
            }
        }
        for r in whole..rows {
            for t in 0..n {
                out[r * n + t] = chain_dot_with(&w[r * nb..(r + 1) * nb], &x[t * nb..(t + 1) * nb]);
            }
        }
    }

    /// Eight rows' chains side by side, row `k` in lane `k`: per block the rows' exact sums
    /// reduced into one register, then one vector step of every chain. One row's chain alone
    /// waits on each multiply-add's latency (a decode step's Q8_0 output layer ran 7% slower
    /// that way than llama.cpp's order). The eight rows are eight streams the hardware
    /// prefetcher did not follow (half the speed): the next group's bytes (`next`, contiguous)
    /// are requested as this group's are read.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn eight_rows<B: ChainBlock>(
        w: &[B],
        nb: usize,
        a: &[BlockQ8_1],
        next: *const u8,
    ) -> [f32; GROUP] {
        // The bytes of one block of each row, requested a line at a time.
        let step = GROUP * std::mem::size_of::<B>();
        let mut acc = _mm256_setzero_ps();
        for (b, ab) in a.iter().enumerate().take(nb) {
            for line in (b * step..(b + 1) * step).step_by(64) {
                // A hint: it never faults, whatever the address (`wrapping_add` forms it
                // without claiming it is in bounds).
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line).cast());
            }
            let mut parts = [_mm256_setzero_si256(); GROUP];
            let mut scales = [0f32; GROUP];
            for k in 0..GROUP {
                let wb = &w[k * nb + b];
                parts[k] = block_lanes(wb, ab);
                scales[k] = wb.scale();
            }
            // SAFETY: `scales` is 8 readable f32; the load is unaligned.
            let d = _mm256_mul_ps(
                unsafe { _mm256_loadu_ps(scales.as_ptr()) },
                _mm256_set1_ps(ab.d),
            );
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(reduce8(parts)), acc);
        }
        let mut sums = [0f32; GROUP];
        // SAFETY: `sums` is 8 writable f32; the store is unaligned.
        unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), acc) };
        sums
    }

    /// [`super::chain_rows`] with 256-bit `vpdpbusd`: per block each row's values are
    /// unpacked once as unsigned bytes (`q + OFFSET`) and every token's sums made by one
    /// instruction a row against its signed quants, less `OFFSET · Σ a` once per token for
    /// all eight rows; so a decode batch of a few tokens costs little more than one.
    ///
    /// # Safety
    /// The CPU must support the features `super::super::cpu::wide_available` checks, and
    /// F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn chain_rows_vnni<B: ChainBlock>(
        w: &[B],
        nb: usize,
        x: &[BlockQ8_1],
        n: usize,
        out: &mut [f32],
    ) {
        let rows = w.len() / nb;
        let whole = rows / GROUP * GROUP;
        // Each token block's `Σ a`, once for every group of rows.
        let ones = _mm256_set1_epi8(1);
        let a_sums: Vec<i32> = x[..n * nb]
            .iter()
            .map(|a| {
                // SAFETY: `qs` is 32 readable bytes; the load is unaligned.
                let q = unsafe { _mm256_loadu_si256(a.qs.as_ptr().cast()) };
                hsum_i32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, q))
            })
            .collect();
        // One token against long rows (a decode step, bound by the reads): a row at a time
        // streams each row in order (eight rows block by block were 10-20% slower on
        // 2,048-wide Q8_0 and Q4_0 rows, with or without requests ahead).
        if n == 1 && nb * std::mem::size_of::<B>() * GROUP > NEXT_GROUP_MAX {
            for (r, row) in w.chunks_exact(nb).enumerate() {
                out[r] = chain_dot_with(row, &x[..nb]);
            }
            return;
        }
        for r0 in (0..whole).step_by(GROUP) {
            let next = w[(r0 + GROUP) * nb..].as_ptr().cast::<u8>();
            let group = &w[r0 * nb..(r0 + GROUP) * nb];
            let mut t0 = 0;
            while t0 < n {
                let tokens = (n - t0).min(VNNI_TOKENS);
                let x = &x[t0 * nb..(t0 + tokens) * nb];
                let a_sums = &a_sums[t0 * nb..(t0 + tokens) * nb];
                let mut put = |t: usize, sums: [f32; GROUP]| {
                    for (k, &v) in sums.iter().enumerate() {
                        out[(r0 + k) * n + t0 + t] = v;
                    }
                };
                match tokens {
                    1 => vnni_rows::<B, 1>(group, nb, x, a_sums, next, &mut put),
                    2 => vnni_rows::<B, 2>(group, nb, x, a_sums, next, &mut put),
                    3 => vnni_rows::<B, 3>(group, nb, x, a_sums, next, &mut put),
                    _ => vnni_rows::<B, VNNI_TOKENS>(group, nb, x, a_sums, next, &mut put),
                }
                t0 += tokens;
            }
        }
        for r in whole..rows {
            for t in 0..n {
                out[r * n + t] = chain_dot_with(&w[r * nb..(r + 1) * nb], &x[t * nb..(t + 1) * nb]);
            }
        }
    }

    /// Tokens whose chains share one pass of [`vnni_rows`] over eight rows' blocks.
    const VNNI_TOKENS: usize = 4;

    /// Eight rows (`w`, `nb` blocks each) against the `T` tokens of `x` (`a_sums`: their
    /// blocks' `Σ a`): row `k` of token `t` in lane `k` of `acc[t]`, given to `put(t, ..)` at
    /// the end.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn vnni_rows<B: ChainBlock, const T: usize>(
        w: &[B],
        nb: usize,
        x: &[BlockQ8_1],
        a_sums: &[i32],
        next: *const u8,
        put: &mut impl FnMut(usize, [f32; GROUP]),
    ) {
        let step = GROUP * std::mem::size_of::<B>();
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..nb {
            for line in (b * step..(b + 1) * step).step_by(64) {
                // A hint: it never faults, whatever the address.
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line).cast());
            }
            let mut values = [_mm256_setzero_si256(); GROUP];
            let mut scales = [0f32; GROUP];
            for k in 0..GROUP {
                let wb = &w[k * nb + b];
                // SAFETY: the CPU has AVX2 (this function's features).
                values[k] = unsafe { wb.unsigned_256() };
                scales[k] = wb.scale();
            }
            // From registers, not an array's eight stores read back as one load (a
            // store-forwarding stall).
            let [s0, s1, s2, s3, s4, s5, s6, s7] = scales;
            let d_w = _mm256_setr_ps(s0, s1, s2, s3, s4, s5, s6, s7);
            for (t, acc) in acc.iter_mut().enumerate() {
                let a = &x[t * nb + b];
                // SAFETY: `qs` is 32 readable bytes; the load is unaligned.
                let q = unsafe { _mm256_loadu_si256(a.qs.as_ptr().cast()) };
                let mut parts = [_mm256_setzero_si256(); GROUP];
                for k in 0..GROUP {
                    parts[k] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), values[k], q);
                }
                let correction = B::OFFSET * a_sums[t * nb + b];
                let sums = _mm256_sub_epi32(reduce8(parts), _mm256_set1_epi32(correction));
                let d = _mm256_mul_ps(d_w, _mm256_set1_ps(a.d));
                *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), *acc);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            let mut sums = [0f32; GROUP];
            // SAFETY: `sums` is 8 writable f32; the store is unaligned.
            unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), *acc) };
            put(t, sums);
        }
    }

    /// [`super::chain_dot_portable`] compiled for AVX2, FMA and F16C.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn chain_dot_256<B: ChainBlock>(w: &[B], a: &[BlockQ8_1]) -> f32 {
        chain_dot_with(w, a)
    }

    /// Eight blocks' exact sums at a time, reduced across registers into one (block `k` in
    /// lane `k`), then the chain's steps in block order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn chain_dot_with<B: ChainBlock>(w: &[B], a: &[BlockQ8_1]) -> f32 {
        let nb = w.len().min(a.len());
        let mut acc = 0f32;
        let whole = nb / GROUP * GROUP;
        for b0 in (0..whole).step_by(GROUP) {
            let mut parts = [_mm256_setzero_si256(); GROUP];
            for (k, p) in parts.iter_mut().enumerate() {
                if k % 2 == 0 {
                    super::super::x86::prefetch_ahead(&w[b0 + k]);
                }
                *p = block_lanes(&w[b0 + k], &a[b0 + k]);
            }
            let mut sums = [0f32; GROUP];
            // SAFETY: `sums` is 8 writable f32; the store is unaligned.
            unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), _mm256_cvtepi32_ps(reduce8(parts))) };
            for (k, &s) in sums.iter().enumerate() {
                acc = (w[b0 + k].scale() * a[b0 + k].d).mul_add(s, acc);
            }
        }
        for b in whole..nb {
            let sum = hsum_i32(block_lanes(&w[b], &a[b]));
            acc = (w[b].scale() * a[b].d).mul_add(sum as f32, acc);
        }
        acc
    }

    /// One block's `Σ q·a` as eight partial `i32` lanes (four products each; `|q| ≤ 128`
    /// and `|a| ≤ 127`, so `maddubs` never saturates).
    #[inline(always)]
    fn block_lanes<B: ChainBlock>(w: &B, a: &BlockQ8_1) -> __m256i {
        // SAFETY: the callers are compiled with AVX2; `qs` is 32 readable bytes (unaligned
        // load).
        unsafe {
            let v = w.values_256();
            let x = _mm256_loadu_si256(a.qs.as_ptr().cast());
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v));
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        }
    }

    /// Lane `k` = the sum of `p[k]`'s eight lanes (exact: integers).
    #[inline(always)]
    fn reduce8(p: [__m256i; 8]) -> __m256i {
        // SAFETY: the callers are compiled with AVX2.
        unsafe {
            let h01 = _mm256_hadd_epi32(p[0], p[1]);
            let h23 = _mm256_hadd_epi32(p[2], p[3]);
            let h45 = _mm256_hadd_epi32(p[4], p[5]);
            let h67 = _mm256_hadd_epi32(p[6], p[7]);
            // Per 128-bit half: [p0, p1, p2, p3] of that half's four lanes.
            let h0123 = _mm256_hadd_epi32(h01, h23);
            let h4567 = _mm256_hadd_epi32(h45, h67);
            let low = _mm256_permute2x128_si256::<0x20>(h0123, h4567);
            let high = _mm256_permute2x128_si256::<0x31>(h0123, h4567);
            _mm256_add_epi32(low, high)
        }
    }

    #[inline(always)]
    fn hsum_i32(v: __m256i) -> i32 {
        // SAFETY: the callers are compiled with AVX2.
        unsafe {
            let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            _mm_cvtsi128_si32(s)
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::kernels::quantize_row_q8_1;

    /// The 256-bit rows (eight rows in lanes, the path of CPUs without AVX-512, which the
    /// formats' test does not reach on a CPU with it) against the definition, bit for bit:
    /// Q8_0's whole signed range, a group and a leftover row, one to five tokens.
    #[test]
    fn avx2_rows_give_the_definitions_bits() {
        assert!(
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            "this CPU lacks AVX2 and FMA: the 256-bit rows cannot run here"
        );
        let (rows, nb) = (9, 11);
        let mut s = 5u32;
        let mut next = || {
            s = s.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            s >> 8
        };
        let w: Vec<BlockQ8_0> = (0..rows * nb)
            .map(|_| BlockQ8_0 {
                d: (next() % 1000) as f32 / 997.0 - 0.3,
                qs: std::array::from_fn(|_| next() as u8 as i8),
            })
            .collect();
        for n in 1..=5 {
            let x: Vec<f32> = (0..n * nb * QK)
                .map(|_| (next() % 2001) as f32 / 100.0 - 10.0)
                .collect();
            let mut xq = vec![BlockQ8_1::default(); n * nb];
            for (row, o) in x.chunks_exact(nb * QK).zip(xq.chunks_exact_mut(nb)) {
                quantize_row_q8_1(row, o);
            }
            let mut out = vec![f32::NAN; rows * n];
            // SAFETY: AVX2 and FMA are present (asserted), with F16C on every such CPU.
            unsafe { x86::chain_rows_256(&w, nb, &xq, n, &mut out) };
            for r in 0..rows {
                for t in 0..n {
                    let want =
                        chain_dot_portable(&w[r * nb..(r + 1) * nb], &xq[t * nb..(t + 1) * nb]);
                    assert_eq!(
                        out[r * n + t].to_bits(),
                        want.to_bits(),
                        "row {r} token {t}"
                    );
                }
            }
        }
    }
}
