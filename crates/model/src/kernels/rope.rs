//! Rotary position embedding of one row, as ggml's CPU kernel rounds it.

#[cfg(target_arch = "x86_64")]
use super::cpu::has_avx2;

/// Rotates each head of `x` (heads of `hd` values) by the angles whose `cos` and `sin` are
/// given per pair: pair `i` is elements `2i, 2i + 1` (llama's NORMAL mode) or `i, i + half`
/// (`neox`, the Qwen families), `half = cos.len()`.
pub fn rope_row(x: &mut [f32], hd: usize, cos: &[f32], sin: &[f32], neox: bool) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA are present (checked); the function is safe code compiled
        // for them.
        unsafe { rope_row_fma(x, hd, cos, sin, neox) };
        return;
    }
    rope_row_portable(x, hd, cos, sin, neox);
}

/// [`rope_row_portable`] compiled with FMA: `mul_add` becomes one instruction instead of a
/// call to the C library's `fmaf` (the same correctly rounded result either way).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rope_row_fma(x: &mut [f32], hd: usize, cos: &[f32], sin: &[f32], neox: bool) {
    rope_row_portable(x, hd, cos, sin, neox);
}

#[inline(always)]
fn rope_row_portable(x: &mut [f32], hd: usize, cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len().min(sin.len());
    // Index of the second element of pair `i`, relative to the first.
    let (stride, offset) = if neox { (1, half) } else { (2, 1) };
    for head in x.chunks_exact_mut(hd) {
        for i in 0..half {
            let j = stride * i;
            let (a, b) = (head[j], head[j + offset]);
            // The contractions GCC makes of ggml's `x0*cos - x1*sin` and
            // `x0*sin + x1*cos`: the first product fused, the second rounded.
            head[j] = a.mul_add(cos[i], -(b * sin[i]));
            head[j + offset] = a.mul_add(sin[i], b * cos[i]);
        }
    }
}
