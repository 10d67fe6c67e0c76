//! Weight formats added after the original three (Q5_0 and Q5_1 here; Q4_K, Q5_K and Q6_K in
//! `kquants.rs`; Q2_K and Q3_K in `low_kquants.rs`): one [`QuantFormat`] implementation per ggml type, each
//! defining its dot product against the activation quantization ggml pairs it with (Q8_1
//! blocks of 32, or Q8_K super-blocks of 256). Matrices keep ggml's bytes as in the file.
//!
//! The kernels compute exact integer sums, then apply the blocks' float scales in
//! llama.cpp's AVX2 float order (its `ggml_vec_dot_*` kernels): eight integer lanes (lane `i`
//! holding elements `4i..4i+4` of each 32-element chunk), one fused multiply-add per lane and
//! block, the min/offset terms as llama.cpp accumulates them, and its final lane sum. So the
//! logits on these types equal llama.cpp's bit for bit (`tests/llama_references.rs`); with
//! the same products in another order this small model moved by tenths of a nat. The
//! k-quants have AVX2 builds of the integer lanes (run-time dispatch, as in `kernels/`);
//! integer lanes do not depend on how they are summed, so both paths give the same bits.

use std::marker::PhantomData;

use gguf::{GgmlType, QK_K};

use crate::weights::{BlockQ8_1, QK};

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

/// Quantizes one activation row (length a multiple of 256) as ggml's reference Q8_K does:
/// the scale comes from the signed value of largest magnitude (`-127 / max`), values round
/// to nearest even and are capped at 127.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    let done = crate::kernels::quantize_blocks_q8_k(x, out);
    let (x, out) = (&x[done * QK_K..], &mut out[done..]);
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx2_fma_f16c() {
        // SAFETY: AVX2, FMA and F16C are present (checked), the function's requirement.
        // (Compiled there, the rounding is one instruction instead of a `rintf` call.)
        unsafe { simd::quantize_row_q8_k_for_avx2(x, out) };
        return;
    }
    quantize_row_q8_k_portable(x, out);
}

#[inline(always)]
fn quantize_row_q8_k_portable(x: &[f32], out: &mut [BlockQ8K]) {
    for (blk, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut max = 0f32;
        let mut amax = 0f32;
        for &v in blk {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *o = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in o.qs.iter_mut().zip(blk) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, group) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = group.iter().map(|&q| i16::from(q)).sum();
        }
        o.d = 1.0 / iscale;
    }
}

/// Every activation quantization of the same input rows; a format takes the one it needs.
pub struct Acts<'a> {
    pub q8_1: &'a [BlockQ8_1],
    pub q8_k: &'a [BlockQ8K],
}

/// An activation block type: how many elements a block covers, and where to find it.
pub trait ActBlock: Sized + 'static {
    const ELEMS: usize;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self];
    /// Rows of format `ty` (ggml's bytes, `nb` blocks of these activations a row) against
    /// the `n` tokens of `x` into token-major `out[t * ld + r]`, where a 512-bit tile takes
    /// the format and the CPU has it; false, nothing done, where not.
    fn token_major(
        ty: GgmlType,
        w: &[u8],
        x: &[Self],
        nb: usize,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool;
}

impl ActBlock for BlockQ8_1 {
    const ELEMS: usize = QK;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self] {
        acts.q8_1
    }
    fn token_major(
        ty: GgmlType,
        w: &[u8],
        x: &[Self],
        nb: usize,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let GgmlType::Q5_0 | GgmlType::Q5_1 = ty {
            let with_min = ty == GgmlType::Q5_1;
            return crate::kernels::five_bit_token_major(w, nb, x, n, with_min, out, ld);
        }
        let _ = (ty, w, x, nb, n, out, ld);
        false
    }
}

impl ActBlock for BlockQ8K {
    const ELEMS: usize = QK_K;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self] {
        acts.q8_k
    }
    fn token_major(
        ty: GgmlType,
        w: &[u8],
        x: &[Self],
        nb: usize,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        return crate::kernels::k_quant_token_major(w, nb, x, n, ty, out, ld);
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (ty, w, x, nb, n, out, ld);
            false
        }
    }
}

/// One ggml weight format the kernels can multiply.
pub trait QuantFormat: Send + Sync + 'static {
    const TYPE: GgmlType;
    /// The activation blocks the dot product takes.
    type Act: ActBlock;
    /// One weight row (ggml's blocks, as bytes) against one activation row.
    fn dot(w: &[u8], a: &[Self::Act]) -> f32;
    /// One weight row against up to [`TILE`] activation rows, `out[t]` exactly
    /// `dot(w, acts[t])`; formats whose unpacking dominates share it across the tile.
    #[inline(always)]
    fn dot_tile(w: &[u8], acts: &[&[Self::Act]], out: &mut [f32]) {
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot(w, a);
        }
    }
    /// `out[r * n + t] = dot(w[r], x[t])` for the rows of `w` (`row_bytes` each, `nb`
    /// activation blocks) and the `n` tokens of `x`; formats with a kernel over several
    /// rows at once override it.
    #[inline(always)]
    fn rows(w: &[u8], row_bytes: usize, x: &[Self::Act], nb: usize, n: usize, out: &mut [f32]) {
        tokens_by_tiles::<Self>(w, row_bytes, x, nb, n, 0, out);
    }
    /// As [`Self::rows`] but token-major, `out[t * ld + r]`, for formats with a kernel that
    /// writes that layout (a prefill then needs no transposition); false, nothing done, for
    /// the others or where the CPU lacks the kernel.
    #[inline(always)]
    fn rows_token_major(
        w: &[u8],
        x: &[Self::Act],
        nb: usize,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        Self::Act::token_major(Self::TYPE, w, x, nb, n, out, ld)
    }
}

/// [`QuantFormat::rows`] for tokens `t0..n`, one row and up to [`TILE`] tokens at a time
/// through [`QuantFormat::dot_tile`].
#[inline(always)]
pub(crate) fn tokens_by_tiles<F: QuantFormat + ?Sized>(
    w: &[u8],
    row_bytes: usize,
    x: &[F::Act],
    nb: usize,
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let mut acts: [&[F::Act]; TILE] = [&[]; TILE];
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let mut t = t0;
        while t < n {
            let k = (n - t).min(TILE);
            for (j, a) in acts.iter_mut().enumerate().take(k) {
                *a = &x[(t + j) * nb..(t + j + 1) * nb];
            }
            F::dot_tile(row, &acts[..k], &mut out[r * n + t..r * n + t + k]);
            t += k;
        }
    }
}

/// Q5_0's or Q5_1's (`with_min`) rows: whole tiles of tokens through the 512-bit register
/// tile where the CPU has it, the rest through [`QuantFormat::dot_tile`].
#[inline(always)]
fn five_bit_matrix_rows<F: QuantFormat<Act = BlockQ8_1>>(
    w: &[u8],
    row_bytes: usize,
    x: &[BlockQ8_1],
    nb: usize,
    n: usize,
    with_min: bool,
    out: &mut [f32],
) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if n >= TILE && crate::kernels::wide_available() && simd::has_avx2_fma_f16c() {
        // SAFETY: the CPU has the features `wide_available` checks (AVX-512 F, BW, DQ, VL,
        // VNNI, with AVX2 and FMA) and F16C, the function's only requirement; it
        // bounds-checks its slices.
        done = unsafe { crate::kernels::five_bit_tiles(w, nb, x, n, with_min, out) };
    }
    let _ = with_min;
    tokens_by_tiles::<F>(w, row_bytes, x, nb, n, done, out);
}

/// Activation rows a weight row is unpacked once for.
pub const TILE: usize = 4;

/// The f16 at `b[i..i + 2]`, as f32. Converted with integer operations (exact, as every
/// f16 is an f32) so that it inlines into the callers' SIMD-compiled code; the `half` crate
/// tests the CPU and calls out for each value.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
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

/// The 32 five-bit values of a Q5_0/Q5_1 block from its `qh` (4 bytes) and `qs` (16).
fn five_bit(qh: &[u8], qs: &[u8]) -> [i32; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0i32; 32];
    for j in 0..16 {
        q[j] = i32::from(qs[j] & 0x0f) | (((qh >> j) & 1) << 4) as i32;
        q[j + 16] = i32::from(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as i32;
    }
    q
}

fn isum(q: &[i32], a: &[i8]) -> i32 {
    q.iter().zip(a).map(|(&x, &y)| x * i32::from(y)).sum()
}

#[allow(non_camel_case_types)]
pub struct Q5_0;

impl Q5_0 {
    /// In llama.cpp's AVX2 float order (`ggml_vec_dot_q5_0_q8_0`): per block, eight lanes of
    /// four consecutive products, each added to its lane accumulator by a fused multiply-add
    /// with the block's `d·da`, then its final lane sum; so the logits are llama.cpp's.
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        for (wb, ab) in w.chunks_exact(22).zip(a) {
            let q = five_bit(&wb[2..6], &wb[6..22]);
            let d = f16_at(wb, 0) * ab.d;
            for (i, acc) in acc.iter_mut().enumerate() {
                let lane = isum(&q[4 * i..4 * i + 4], &ab.qs[4 * i..4 * i + 4])
                    - 16 * ab.qs[4 * i..4 * i + 4]
                        .iter()
                        .map(|&v| i32::from(v))
                        .sum::<i32>();
                *acc = d.mul_add(lane as f32, *acc);
            }
        }
        crate::low_kquants::hsum8(acc)
    }
}

impl QuantFormat for Q5_0 {
    const TYPE: GgmlType = GgmlType::Q5_0;
    type Act = BlockQ8_1;

    #[inline(always)]
    fn dot(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut out = [0f32];
        Self::dot_tile(w, &[a], &mut out);
        out[0]
    }

    /// Per block the five-bit values are unpacked once for the tile; each token's lanes
    /// then follow [`Q5_0::dot_scalar`] exactly.
    #[inline(always)]
    fn dot_tile(w: &[u8], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
        five_bit_tile(w, acts, out, false, Self::dot_scalar);
    }

    #[inline(always)]
    fn rows(w: &[u8], row_bytes: usize, x: &[BlockQ8_1], nb: usize, n: usize, out: &mut [f32]) {
        five_bit_matrix_rows::<Self>(w, row_bytes, x, nb, n, false, out);
    }
}

/// Q5_0's or Q5_1's (`with_min`) tile: the SIMD rows where the CPU has them, else the
/// portable definition token by token.
#[inline(always)]
fn five_bit_tile(
    w: &[u8],
    acts: &[&[BlockQ8_1]],
    out: &mut [f32],
    with_min: bool,
    scalar: fn(&[u8], &[BlockQ8_1]) -> f32,
) {
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx2_fma_f16c() && !acts.is_empty() {
        // SAFETY: AVX2, FMA and F16C are present (checked above); the function checks the
        // slice lengths it reads.
        unsafe { simd::five_bit_rows(w, acts, with_min, out) };
        return;
    }
    let _ = with_min;
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        *o = scalar(w, a);
    }
}

#[allow(non_camel_case_types)]
pub struct Q5_1;

impl Q5_1 {
    /// In llama.cpp's AVX2 float order (`ggml_vec_dot_q5_1_q8_1`, built with contracted
    /// multiply-adds): eight lanes of four products per block, each added by a fused
    /// multiply-add with `d·da`; the offsets `m·s` summed apart and added last.
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (wb, ab) in w.chunks_exact(24).zip(a) {
            summs = f16_at(wb, 2).mul_add(ab.s, summs);
            let q = five_bit(&wb[4..8], &wb[8..24]);
            let d = f16_at(wb, 0) * ab.d;
            for (i, acc) in acc.iter_mut().enumerate() {
                let lane = isum(&q[4 * i..4 * i + 4], &ab.qs[4 * i..4 * i + 4]);
                *acc = (lane as f32).mul_add(d, *acc);
            }
        }
        crate::low_kquants::hsum8(acc) + summs
    }
}

impl QuantFormat for Q5_1 {
    const TYPE: GgmlType = GgmlType::Q5_1;
    type Act = BlockQ8_1;

    #[inline(always)]
    fn dot(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut out = [0f32];
        Self::dot_tile(w, &[a], &mut out);
        out[0]
    }

    /// As [`Q5_0`]'s, following [`Q5_1::dot_scalar`].
    #[inline(always)]
    fn dot_tile(w: &[u8], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
        five_bit_tile(w, acts, out, true, Self::dot_scalar);
    }

    #[inline(always)]
    fn rows(w: &[u8], row_bytes: usize, x: &[BlockQ8_1], nb: usize, n: usize, out: &mut [f32]) {
        five_bit_matrix_rows::<Self>(w, row_bytes, x, nb, n, true, out);
    }
}

#[cfg(target_arch = "x86_64")]
#[path = "quant_simd.rs"]
pub(crate) mod simd;

/// What [`crate::weights::Matrix`] needs of a matrix in any of these formats.
pub trait BlockMatrix: Send + Sync {
    fn ty(&self) -> GgmlType;
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Whether the product takes Q8_K activations (else Q8_1).
    fn wants_q8_k(&self) -> bool;
    /// `out[r * n + t] = dot(W[r0 + r], x[t])` for `nr` rows and `n` tokens.
    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]);
    /// Rows `r0..r0 + nr` against the `n` tokens into token-major `out[t * ld + r]`, where
    /// the format has a kernel for that layout; false (nothing done) where not.
    fn rows_token_major(
        &self,
        r0: usize,
        nr: usize,
        acts: &Acts<'_>,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool;
    /// Row `r` dequantized (embedding lookups).
    fn row_f32(&self, r: usize, out: &mut [f32]);
}

/// A matrix of format `F`, as ggml's bytes, row after row.
pub struct QuantMatrix<F> {
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    format: PhantomData<F>,
}

impl<F: QuantFormat> QuantMatrix<F> {
    /// `data` must hold `rows` rows of `cols` elements (the GGUF reader checked the size;
    /// `cols` is a whole number of blocks).
    pub fn new(rows: usize, cols: usize, data: Vec<u8>) -> Self {
        debug_assert_eq!(cols % F::TYPE.block_elems(), 0);
        debug_assert_eq!(data.len(), rows * Self::row_bytes(cols));
        QuantMatrix {
            rows,
            cols,
            data,
            format: PhantomData,
        }
    }

    fn row_bytes(cols: usize) -> usize {
        cols / F::TYPE.block_elems() * F::TYPE.block_bytes()
    }

    fn row(&self, r: usize) -> &[u8] {
        let rb = Self::row_bytes(self.cols);
        &self.data[r * rb..(r + 1) * rb]
    }
}

impl<F: QuantFormat> BlockMatrix for QuantMatrix<F> {
    fn ty(&self) -> GgmlType {
        F::TYPE
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn wants_q8_k(&self) -> bool {
        F::Act::ELEMS == QK_K
    }

    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        let rb = Self::row_bytes(self.cols);
        let w = &self.data[r0 * rb..(r0 + nr) * rb];
        let (x, nb) = (F::Act::pick(acts), self.cols / F::Act::ELEMS);
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2_fma_f16c() {
            // SAFETY: AVX2, FMA and F16C are present (checked), the function's requirement.
            unsafe { simd::rows_for_avx2::<F>(w, rb, x, nb, n, out) };
            return;
        }
        F::rows(w, rb, x, nb, n, out);
    }

    fn rows_token_major(
        &self,
        r0: usize,
        nr: usize,
        acts: &Acts<'_>,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        let rb = Self::row_bytes(self.cols);
        let w = &self.data[r0 * rb..(r0 + nr) * rb];
        F::rows_token_major(w, F::Act::pick(acts), self.cols / F::Act::ELEMS, n, out, ld)
    }

    fn row_f32(&self, r: usize, out: &mut [f32]) {
        F::TYPE.dequantize(self.row(r), out);
    }
}

/// A boxed matrix for ggml type `ty`, or `None` if no format here implements it.
pub fn block_matrix(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
) -> Option<Box<dyn BlockMatrix>> {
    fn boxed<F: QuantFormat>(rows: usize, cols: usize, data: Vec<u8>) -> Box<dyn BlockMatrix> {
        Box::new(QuantMatrix::<F>::new(rows, cols, data))
    }
    Some(match ty {
        GgmlType::Q5_0 => boxed::<Q5_0>(rows, cols, data),
        GgmlType::Q5_1 => boxed::<Q5_1>(rows, cols, data),
        GgmlType::Q2_K => boxed::<crate::low_kquants::Q2K>(rows, cols, data),
        GgmlType::Q3_K => boxed::<crate::low_kquants::Q3K>(rows, cols, data),
        GgmlType::Q4_K => boxed::<crate::kquants::Q4K>(rows, cols, data),
        GgmlType::Q5_K => boxed::<crate::kquants::Q5K>(rows, cols, data),
        GgmlType::Q6_K => boxed::<crate::kquants::Q6K>(rows, cols, data),
        _ => return None,
    })
}
#[cfg(test)]
#[path = "quant_tests.rs"]
mod tests;
