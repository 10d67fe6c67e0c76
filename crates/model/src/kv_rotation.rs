//! The Walsh–Hadamard rotation of K and V stored in a block format (`--kv-dtype q8_0`,
//! `q4_0`), as llama.cpp 0.3.36 applies it to a quantized cache (`attn_rot_k`,
//! `attn_rot_v` in its `llama-kv-cache.cpp`).
//!
//! A block format spends one scale on 32 values, so one outlier coordinate of a head
//! (RoPE'd K rows have several) takes the whole block's resolution. An orthonormal
//! rotation `H` spreads every coordinate over all of them; attention is unchanged because
//! `(Hq)·(Hk) = q·k` and `Σ w (Hv) = H (Σ w v)`, so: rotate the query and the K row by
//! `H_nk` (per head, in chunks of `nk`: the largest power of two from 64 dividing the head
//! size), the V row by `H_64` (llama.cpp found the small rotation better for V), store
//! the rotated rows, and rotate each head's output back by `H_64` (`H` is its own
//! inverse). On the default model this took Q4_0's mean KL divergence against llama.cpp's
//! own Q4_0 path from 0.20 to the f16 files' spread (the README gives the figures).
//!
//! The arithmetic is defined here once, in plain f32 operations that no CPU path
//! changes: the butterflies of the fast transform in a fixed order, then one multiply by
//! `1/√n`. Rows are rotated one at a time, so a row's stored bytes do not depend on what
//! it was batched or chunked with, and a prefill node and a decode node (which hold the
//! same element type, or the router refuses them) store and read the same rotation.

use kv::KvDtype;

/// Which rotations a cache of this element type and head size takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KvRotation {
    /// Chunk of each query and K head rotated as one.
    pub k: usize,
    /// Chunk of each V head (and each head's output).
    pub v: usize,
}

impl KvRotation {
    /// The rotation of a cache storing `dtype` with heads of `head_dim` values: only the
    /// block formats, and only heads of a multiple of 64 values (as llama.cpp).
    pub(crate) fn of(dtype: KvDtype, head_dim: usize) -> Option<KvRotation> {
        let blocks = matches!(dtype, KvDtype::Q8_0 | KvDtype::Q4_0);
        if !blocks || head_dim == 0 || !head_dim.is_multiple_of(64) {
            return None;
        }
        let mut k = 64;
        while head_dim.is_multiple_of(2 * k) {
            k *= 2;
        }
        Some(KvRotation { k, v: 64 })
    }
}

/// Every consecutive `n` values of `x` (a multiple of `n`, a power of two) replaced by
/// `H_n` times them, `H_n[i][j] = (−1)^popcount(i & j) / √n`.
pub(crate) fn rotate_chunks(x: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two() && x.len().is_multiple_of(n));
    let scale = (1.0 / (n as f64).sqrt()) as f32;
    for chunk in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for block in chunk.chunks_exact_mut(2 * h) {
                let (a, b) = block.split_at_mut(h);
                for (x, y) in a.iter_mut().zip(b) {
                    let (s, d) = (*x + *y, *x - *y);
                    *x = s;
                    *y = d;
                }
            }
            h *= 2;
        }
        for v in chunk.iter_mut() {
            *v *= scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(s: &mut u64) -> f32 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
    }

    #[test]
    fn the_rotation_is_the_hadamard_matrix_and_its_own_inverse() {
        let mut s = 5;
        for n in [64, 128, 256] {
            let x: Vec<f32> = (0..2 * n).map(|_| lcg(&mut s)).collect();
            let mut y = x.clone();
            rotate_chunks(&mut y, n);
            for (c, (xc, yc)) in x.chunks(n).zip(y.chunks(n)).enumerate() {
                for (i, &got) in yc.iter().enumerate() {
                    let want: f64 = xc
                        .iter()
                        .enumerate()
                        .map(|(j, &v)| {
                            let sign = if (i & j).count_ones() % 2 == 0 {
                                1.0
                            } else {
                                -1.0
                            };
                            sign * f64::from(v)
                        })
                        .sum::<f64>()
                        / (n as f64).sqrt();
                    assert!(
                        (f64::from(got) - want).abs() < 1e-5,
                        "n {n} chunk {c} row {i}"
                    );
                }
            }
            rotate_chunks(&mut y, n);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5, "n {n}: {a} {b}");
            }
        }
    }

    #[test]
    fn only_block_formats_with_heads_of_64s_rotate() {
        let rot = |d, hd| KvRotation::of(d, hd);
        assert_eq!(rot(KvDtype::F16, 64), None);
        assert_eq!(rot(KvDtype::F32, 128), None);
        assert_eq!(rot(KvDtype::Q8_0, 96), None);
        assert_eq!(rot(KvDtype::Q4_0, 64), Some(KvRotation { k: 64, v: 64 }));
        assert_eq!(rot(KvDtype::Q8_0, 128), Some(KvRotation { k: 128, v: 64 }));
        assert_eq!(rot(KvDtype::Q4_0, 192), Some(KvRotation { k: 64, v: 64 }));
        assert_eq!(rot(KvDtype::Q4_0, 256), Some(KvRotation { k: 256, v: 64 }));
    }

    #[test]
    fn a_rotated_row_with_an_outlier_loses_less_to_q4_0() {
        use kv::{KvBlock, Q4Block};
        let mut s = 9;
        let (mut plain, mut rotated) = (0f64, 0f64);
        for _ in 0..200 {
            let mut x: Vec<f32> = (0..64).map(|_| lcg(&mut s)).collect();
            x[3] = 40.0;
            let roundtrip = |x: &[f32]| -> Vec<f32> {
                let mut out = vec![0f32; x.len()];
                for (o, c) in out.chunks_mut(32).zip(x.chunks(32)) {
                    Q4Block::quantize(c).dequantize(o);
                }
                out
            };
            let err = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(p, q)| f64::from(p - q).powi(2)).sum()
            };
            plain += err(&x, &roundtrip(&x));
            let mut r = x.clone();
            rotate_chunks(&mut r, 64);
            let mut back = roundtrip(&r);
            rotate_chunks(&mut back, 64);
            rotated += err(&x, &back);
        }
        assert!(rotated < 0.5 * plain, "rotated {rotated}, plain {plain}");
    }
}
