//! The formats' products compiled for AVX2, FMA and F16C (the default
//! [`super::QuantFormat::product`] dispatches here where the CPU has them).

/// [`super::QuantFormat::rows`] compiled for AVX2, FMA and F16C. The formats' float parts
/// are written with `mul_add` and `round_ties_even` in portable Rust; compiled for the
/// baseline x86-64 they call the library's `fmaf` and `rintf` (a fifth of a Q4_K_M prefill).
/// Here they become single instructions with the same results, both operations being
/// exactly specified. Everything `rows` reaches is `#[inline(always)]` (and closure-free
/// where it matters) so that it is compiled here rather than called.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_for_avx2<F: super::QuantFormat>(
    w: &[F::Block],
    x: &[F::Act],
    nb: usize,
    n: usize,
    out: &mut [f32],
) {
    F::rows(w, x, nb, n, out);
}
