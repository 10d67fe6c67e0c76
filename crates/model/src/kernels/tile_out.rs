//! Where the 512-bit tiles write their results: a row-major block (`out[r * n + t]`) or the
//! layer's token-major output (`out[t * ld + r]`), a row at a time or four rows transposed
//! in registers.

use std::arch::x86_64::*;

use crate::blocks::TILE;

/// Weight rows per micro-tile: 4 rows × 4 token pairs = 16 accumulators, with the pairs'
/// activations (and offsets) still within the 32 vector registers. Measured on Zen 5 for
/// Q4_1: 3, 5 and 6 rows were 3-7% slower.
pub(super) const ROWS: usize = 4;

/// Where the tiles' results go: `out[r * n + t]`, or `out[t * ld + r]`.
pub(crate) enum Out<'a> {
    RowMajor { out: &'a mut [f32], n: usize },
    TokenMajor { out: &'a mut [f32], ld: usize },
}

impl Out<'_> {
    /// Row `r`'s results for tokens `t0..t0 + vals.len()`.
    #[inline]
    pub(crate) fn put_slice(&mut self, r: usize, t0: usize, vals: &[f32]) {
        match self {
            Out::RowMajor { out, n } => {
                out[r * *n + t0..r * *n + t0 + vals.len()].copy_from_slice(vals);
            }
            Out::TokenMajor { out, ld } => {
                for (t, &x) in vals.iter().enumerate() {
                    out[(t0 + t) * *ld + r] = x;
                }
            }
        }
    }

    /// Token `t`'s results for rows `r0..r0 + vals.len()`.
    #[inline]
    pub(crate) fn put_rows_of_token(&mut self, r0: usize, t: usize, vals: &[f32]) {
        match self {
            Out::RowMajor { out, n } => {
                for (r, &x) in vals.iter().enumerate() {
                    out[(r0 + r) * *n + t] = x;
                }
            }
            Out::TokenMajor { out, ld } => {
                out[t * *ld + r0..t * *ld + r0 + vals.len()].copy_from_slice(vals);
            }
        }
    }

    /// Token `t`'s results for rows `r0..r0 + 16`. Token-major, a whole aligned line is
    /// written with a streaming store: a prefill product's output (megabytes, each token's
    /// line of it written once per row tile) otherwise cost a read of every line it wrote, a
    /// tenth of the AMX kernel's time. The caller fences before the output is read.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn put_16_rows_of_token(&mut self, r0: usize, t: usize, v: __m512) {
        let mut vals = [0f32; 16];
        match self {
            Out::TokenMajor { out, ld } => {
                let dst = &mut out[t * *ld + r0..t * *ld + r0 + 16];
                if dst.as_ptr().addr().is_multiple_of(64) {
                    // SAFETY: `dst` is 16 writable f32 (sliced above), 64-byte aligned.
                    unsafe { _mm512_stream_ps(dst.as_mut_ptr(), v) };
                    return;
                }
                // SAFETY: as above; the store is unaligned.
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) };
            }
            Out::RowMajor { .. } => {
                // SAFETY: `vals` is 16 writable f32; the store is unaligned.
                unsafe { _mm512_storeu_ps(vals.as_mut_ptr(), v) };
                self.put_rows_of_token(r0, t, &vals);
            }
        }
    }

    /// Row `r`'s results for tokens `t0..t0 + tokens` (`tokens` ≤ 8), lanes in token order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn put_row(&mut self, r: usize, t0: usize, tokens: usize, v: __m256) {
        let mut lanes = [0f32; 2 * TILE];
        // SAFETY: `lanes` is 8 writable f32; unaligned stores are allowed.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        match self {
            Out::RowMajor { out, n } => {
                out[r * *n + t0..r * *n + t0 + tokens].copy_from_slice(&lanes[..tokens]);
            }
            Out::TokenMajor { out, ld } => {
                for (t, &x) in lanes.iter().enumerate().take(tokens) {
                    out[(t0 + t) * *ld + r] = x;
                }
            }
        }
    }

    /// Rows `r..r + ROWS`' results (as [`Self::put_row`]); token-major, the four rows are
    /// transposed in registers into one 4-value store per token.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn put_rows(&mut self, r: usize, t0: usize, tokens: usize, v: [__m256; ROWS]) {
        let Out::TokenMajor { out, ld } = self else {
            for (i, v) in v.into_iter().enumerate() {
                self.put_row(r + i, t0, tokens, v);
            }
            return;
        };
        // [a0 b0 a1 b1 | a4 b4 a5 b5] and so on, then [a0 b0 c0 d0 | a4 b4 c4 d4] ...
        let ab_lo = _mm256_unpacklo_ps(v[0], v[1]);
        let ab_hi = _mm256_unpackhi_ps(v[0], v[1]);
        let cd_lo = _mm256_unpacklo_ps(v[2], v[3]);
        let cd_hi = _mm256_unpackhi_ps(v[2], v[3]);
        let by_token = [
            _mm256_shuffle_ps::<0x44>(ab_lo, cd_lo),
            _mm256_shuffle_ps::<0xEE>(ab_lo, cd_lo),
            _mm256_shuffle_ps::<0x44>(ab_hi, cd_hi),
            _mm256_shuffle_ps::<0xEE>(ab_hi, cd_hi),
        ];
        for t in 0..tokens {
            let quad = &by_token[t % 4];
            let four = if t < 4 {
                _mm256_castps256_ps128(*quad)
            } else {
                _mm256_extractf128_ps::<1>(*quad)
            };
            let at = (t0 + t) * *ld + r;
            let dst = &mut out[at..at + ROWS];
            // SAFETY: `dst` is 4 writable f32 (sliced just above); unaligned is allowed.
            unsafe { _mm_storeu_ps(dst.as_mut_ptr(), four) };
        }
    }

    /// Rows `r..r + ROWS` for tokens `t0..t0 + tokens` (`tokens` ≤ 16), one register of
    /// sixteen tokens a row; token-major, transposed in registers into one 4-value store per
    /// token, where sixteen scalar stores a row to as many lines were a tenth of a prefill's
    /// tokens-in-lanes kernel.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn put_rows_of_16(&mut self, r: usize, t0: usize, tokens: usize, v: [__m512; ROWS]) {
        let Out::TokenMajor { out, ld } = self else {
            for (i, v) in v.into_iter().enumerate() {
                let mut vals = [0f32; 4 * TILE];
                // SAFETY: `vals` is 16 writable f32; the store is unaligned.
                unsafe { _mm512_storeu_ps(vals.as_mut_ptr(), v) };
                self.put_slice(r + i, t0, &vals[..tokens]);
            }
            return;
        };
        // Within each 128-bit quarter k: [a b c d] of tokens 4k + j, j by register.
        let ab_lo = _mm512_unpacklo_ps(v[0], v[1]);
        let ab_hi = _mm512_unpackhi_ps(v[0], v[1]);
        let cd_lo = _mm512_unpacklo_ps(v[2], v[3]);
        let cd_hi = _mm512_unpackhi_ps(v[2], v[3]);
        let by_token = [
            _mm512_shuffle_ps::<0x44>(ab_lo, cd_lo),
            _mm512_shuffle_ps::<0xEE>(ab_lo, cd_lo),
            _mm512_shuffle_ps::<0x44>(ab_hi, cd_hi),
            _mm512_shuffle_ps::<0xEE>(ab_hi, cd_hi),
        ];
        for (j, &q) in by_token.iter().enumerate() {
            for k in 0..4 {
                let t = 4 * k + j;
                if t >= tokens {
                    break;
                }
                let four = match k {
                    0 => _mm512_extractf32x4_ps::<0>(q),
                    1 => _mm512_extractf32x4_ps::<1>(q),
                    2 => _mm512_extractf32x4_ps::<2>(q),
                    _ => _mm512_extractf32x4_ps::<3>(q),
                };
                let at = (t0 + t) * *ld + r;
                let dst = &mut out[at..at + ROWS];
                // SAFETY: `dst` is 4 writable f32 (sliced just above); unaligned is allowed.
                unsafe { _mm_storeu_ps(dst.as_mut_ptr(), four) };
            }
        }
    }
}
