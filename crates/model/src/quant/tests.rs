//! Tests of the formats: each against the reference dequantization, SIMD against the
//! portable definitions.

use gguf::{TensorData, QK_K};

use super::kquants::{Q4K, Q5K, Q6K};
use super::low_kquants::{Q2K, Q3K};
use super::q5::{Q5_0, Q5_1};
use super::*;
use crate::blocks::QK;
use crate::kernels::{matmul, quantize_row_q8_k, quantize_row_q8_k_portable};
use crate::weights::{quantize_row_q8_1, Matrix};

/// ggml's bytes as a format's blocks.
fn as_blocks<const N: usize>(bytes: &[u8]) -> &[[u8; N]] {
    let (blocks, rest) = bytes.as_chunks::<N>();
    assert!(rest.is_empty());
    blocks
}

/// A matrix of `ty` made from `bytes` in memory (no file), built at once.
fn in_memory(ty: GgmlType, rows: usize, cols: usize, bytes: Vec<u8>) -> Box<dyn WeightMatrix> {
    table::matrix(
        ty,
        rows,
        cols,
        &TensorData::from_vec(bytes),
        &Repack::AtLoad,
    )
    .unwrap_or_else(|| panic!("{ty:?} has no matrix"))
}

/// `n` rows of `x` (`nb` super-blocks each) quantized to Q8_K, and laid out as lanes where
/// a product of `m` takes them.
fn q8_k_inputs(m: &dyn WeightRows, x: &[f32], n: usize, nb: usize) -> Q8KInputs {
    let mut xk = vec![BlockQ8K::default(); n * nb];
    for (row, o) in x.chunks_exact(nb * QK_K).zip(xk.chunks_exact_mut(nb)) {
        quantize_row_q8_k(row, o);
    }
    let lanes = if m.wants_q8_k_lanes(n) {
        crate::kernels::q8_k_lanes(&xk, n, nb)
    } else {
        Vec::new()
    };
    let tiles = if m.wants_q8_k_tiles(n) {
        crate::kernels::q8_k_tiles(&xk, n, nb)
    } else {
        Vec::new()
    };
    Q8KInputs { xk, lanes, tiles }
}

/// A product's Q8_K inputs in the forms the matrix asked for.
struct Q8KInputs {
    xk: Vec<BlockQ8K>,
    lanes: Vec<crate::blocks::LanesQ8K>,
    tiles: Vec<crate::blocks::TilesQ8K>,
}

impl Q8KInputs {
    fn acts(&self) -> Acts<'_> {
        Acts {
            f32: &[],
            q8_1: &[],
            q8_k: &self.xk,
            tile_scales: &[],
            q8_k_lanes: &self.lanes,
            q8_k_tiles: &self.tiles,
            q8_1_lanes: &[],
        }
    }
}

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

/// Each format's kernel against the f32 product of the scalar reference dequantization
/// of the weights (gguf's, written from ggml's definitions) and of the activations the
/// kernel was given: the integer sums are exact, so only float rounding may differ. Rows
/// are also identical alone and batched.
#[test]
fn kernels_match_the_reference_dequantization() {
    let (rows, cols, n) = (11, 512, 5);
    let mut s = 7u64;
    let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 3.0).collect();
    let mut xq = vec![BlockQ8_1::default(); n * cols / QK];
    for (row, o) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(cols / QK)) {
        quantize_row_q8_1(row, o);
    }
    let mut xk = vec![BlockQ8K::default(); n * cols / QK_K];
    for (row, o) in x.chunks_exact(cols).zip(xk.chunks_exact_mut(cols / QK_K)) {
        quantize_row_q8_k(row, o);
    }
    let deq_q8_1: Vec<f32> = xq
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
        .collect();
    let deq_q8_k: Vec<f32> = xk
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
        .collect();
    for (i, b) in xk.iter().enumerate() {
        for (g, &sum) in b.bsums.iter().enumerate() {
            let want: i32 = b.qs[16 * g..16 * g + 16]
                .iter()
                .map(|&q| i32::from(q))
                .sum();
            assert_eq!(i32::from(sum), want, "block {i} group {g}");
        }
    }
    // Q8_K is within half a step of its input.
    for (a, b) in x.iter().zip(&deq_q8_k) {
        assert!((a - b).abs() <= 3.0 / 127.0 * 0.5 + 1e-5, "{a} vs {b}");
    }

    for ty in [
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
    ] {
        let vals: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
        let mut w = gguf::GgufWriter::new();
        w.tensor_f32("w", &[cols as u64, rows as u64], ty, &vals);
        let f = gguf::GgufFile::parse(w.to_bytes()).expect("parses");
        let info = f.tensor("w").expect("tensor");
        let deq = f.tensor_f32(info);
        let m = Matrix::load(&f, info, rows, cols).expect("loads");
        assert_eq!(m.ty(), ty);
        let mut out = vec![0f32; n * rows];
        matmul(&m, &x, &xq, n, &mut out);
        let xin = if m.wants_q8_k() { &deq_q8_k } else { &deq_q8_1 };
        for t in 0..n {
            for r in 0..rows {
                let want: f64 = (0..cols)
                    .map(|c| deq[r * cols + c] as f64 * xin[t * cols + c] as f64)
                    .sum();
                let got = out[t * rows + r] as f64;
                // Q5_1's offset term uses the f16-rounded activation sum, as ggml's.
                let tol = if ty == GgmlType::Q5_1 { 2e-2 } else { 1e-4 };
                assert!(
                    (want - got).abs() < tol * (1.0 + want.abs()),
                    "{ty:?} t{t} r{r}: {want} vs {got}"
                );
            }
            let mut one = vec![0f32; rows];
            let nb = cols / QK;
            matmul(
                &m,
                &x[t * cols..(t + 1) * cols],
                &xq[t * nb..(t + 1) * nb],
                1,
                &mut one,
            );
            assert_eq!(one, out[t * rows..(t + 1) * rows], "{ty:?} token {t}");
        }
        // Embedding lookups dequantize the row.
        let mut row = vec![0f32; cols];
        m.row_f32(3, &mut row);
        assert_eq!(row, deq[3 * cols..4 * cols]);
    }
}

/// The dispatched Q4_K, Q5_K and Q6_K products (AVX2 where the CPU has it) give the portable
/// definition's bits: the same integers, then the same float expression.
#[test]
fn simd_k_quants_equal_the_scalar_definition_bit_for_bit() {
    let mut s = 11u64;
    for (ty, blocks) in [
        (GgmlType::Q4_K, 3),
        (GgmlType::Q5_K, 3),
        (GgmlType::Q6_K, 3),
    ] {
        for trial in 0..20 {
            let cols = blocks * QK_K;
            // Wide value ranges, so quants reach their extremes (0 and 15 or 63).
            let amp = 1.0 + trial as f32;
            let vals: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * amp).collect();
            let w = ty.quantize(&vals);
            let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * amp).collect();
            let mut xk = vec![BlockQ8K::default(); blocks];
            quantize_row_q8_k(&x, &mut xk);
            let (fast, slow) = match ty {
                GgmlType::Q4_K => (Q4K::dot(as_blocks(&w), &xk), Q4K::dot_scalar(&w, &xk)),
                GgmlType::Q5_K => (Q5K::dot(as_blocks(&w), &xk), Q5K::dot_scalar(&w, &xk)),
                _ => (Q6K::dot(as_blocks(&w), &xk), Q6K::dot_scalar(&w, &xk)),
            };
            assert_eq!(fast.to_bits(), slow.to_bits(), "{ty:?} trial {trial}");
        }
    }
}

#[test]
fn unsupported_types_are_refused_by_name() {
    let e = gguf::GgufError::UnknownTensorType {
        name: "blk.0.ffn_down.weight".into(),
        ty: 16,
    };
    let msg = e.to_string();
    assert!(
        msg.contains("IQ2_XXS") && msg.contains("blk.0.ffn_down.weight"),
        "{msg}"
    );
    let e = gguf::GgufError::UnknownTensorType {
        name: "w".into(),
        ty: 23,
    };
    assert!(e.to_string().contains("IQ4_XS"), "{e}");
}

/// Q5_0 and Q5_1 through the SIMD tile (one token and tiles of 2 to 4) against the
/// portable definition, bit for bit, with values at both ends of the five-bit range.
#[test]
fn five_bit_simd_equals_the_scalar_definition_bit_for_bit() {
    let mut s = 17u64;
    for ty in [GgmlType::Q5_0, GgmlType::Q5_1] {
        for trial in 0..10 {
            let cols = 4 * QK;
            let amp = 1.0 + trial as f32;
            let vals: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * amp).collect();
            let w = ty.quantize(&vals);
            let xs: Vec<Vec<BlockQ8_1>> = (0..4)
                .map(|_| {
                    let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * amp).collect();
                    let mut xq = vec![BlockQ8_1::default(); 4];
                    quantize_row_q8_1(&x, &mut xq);
                    xq
                })
                .collect();
            for k in 1..=4 {
                let acts: Vec<&[BlockQ8_1]> = xs[..k].iter().map(|x| x.as_slice()).collect();
                let mut tile = [0f32; 4];
                let slow: Vec<f32> = if ty == GgmlType::Q5_0 {
                    Q5_0::dot_tile(as_blocks(&w), &acts, &mut tile);
                    acts.iter().map(|a| Q5_0::dot_scalar(&w, a)).collect()
                } else {
                    Q5_1::dot_tile(as_blocks(&w), &acts, &mut tile);
                    acts.iter().map(|a| Q5_1::dot_scalar(&w, a)).collect()
                };
                for (t, v) in slow.iter().enumerate() {
                    assert_eq!(
                        tile[t].to_bits(),
                        v.to_bits(),
                        "{ty:?} trial {trial} tile {k} token {t}"
                    );
                }
            }
        }
    }
}

/// A tile of 2, 3 or 4 tokens gives each token exactly `dot`'s bits (the tile kernels
/// share unpacking, never arithmetic).
#[test]
fn k_quant_tiles_equal_one_token_at_a_time() {
    let mut s = 13u64;
    for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        let cols = 2 * QK_K;
        let vals: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * 3.0).collect();
        let w = ty.quantize(&vals);
        let xs: Vec<Vec<BlockQ8K>> = (0..4)
            .map(|_| {
                let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * 5.0).collect();
                let mut xk = vec![BlockQ8K::default(); 2];
                quantize_row_q8_k(&x, &mut xk);
                xk
            })
            .collect();
        for k in 2..=4 {
            let acts: Vec<&[BlockQ8K]> = xs[..k].iter().map(|x| x.as_slice()).collect();
            let mut tile = [0f32; 4];
            let single: Vec<f32> = match ty {
                GgmlType::Q4_K => {
                    Q4K::dot_tile(as_blocks(&w), &acts, &mut tile);
                    acts.iter().map(|a| Q4K::dot(as_blocks(&w), a)).collect()
                }
                GgmlType::Q5_K => {
                    Q5K::dot_tile(as_blocks(&w), &acts, &mut tile);
                    acts.iter().map(|a| Q5K::dot(as_blocks(&w), a)).collect()
                }
                _ => {
                    Q6K::dot_tile(as_blocks(&w), &acts, &mut tile);
                    acts.iter().map(|a| Q6K::dot(as_blocks(&w), a)).collect()
                }
            };
            for (t, v) in single.iter().enumerate() {
                assert_eq!(
                    tile[t].to_bits(),
                    v.to_bits(),
                    "{ty:?} tile of {k}, token {t}"
                );
            }
        }
    }
}

/// The register-tiled 512-bit Q5_1 product against the 256-bit tile kernel
/// (`dot_tile`) one token at a time, bit for bit: row counts not a multiple of the
/// micro-tile's rows, token counts not a multiple of the tile (the wide kernel does the
/// whole tiles, `QuantFormat::rows` the rest), the whole five-bit range, tokens of very
/// different magnitudes. It needs AVX-512 VNNI, so it is ignored by default like the other
/// wide-kernel tests (`kernels/tests.rs`), and run by `scripts/test.sh` where the CPU has it.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
fn wide_five_bit_tiles_match_the_256_bit_kernel_bit_for_bit() {
    assert!(
        crate::kernels::wide_available(),
        "this CPU lacks AVX-512 (F, BW, DQ, VL, VNNI): the wide kernel cannot run here"
    );
    let mut s = 31u64;
    // (Q5_0: `block_chain_formats_give_the_definitions_bits`.)
    for ty in [GgmlType::Q5_1] {
        // The micro-tile has 8 rows: two and some left over, fewer than one, one and one.
        for (rows, n) in [(19, 15), (4, 4), (9, 66), (11, 7)] {
            let cols = 8 * QK;
            let nb = cols / QK;
            let rb = nb * ty.block_bytes();
            let vals: Vec<f32> = (0..rows * cols)
                .map(|i| lcg(&mut s) * (0.5 + 9.0 * (i / cols % 3) as f32))
                .collect();
            let w = ty.quantize(&vals);
            assert_eq!(w.len(), rows * rb);
            let x: Vec<f32> = (0..n * cols)
                .map(|i| lcg(&mut s) * (1.0 + 37.0 * (i / cols % 5) as f32))
                .collect();
            let mut xq = vec![BlockQ8_1::default(); n * nb];
            for (row, o) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(nb)) {
                quantize_row_q8_1(row, o);
            }
            let mut wide = vec![f32::NAN; rows * n];
            // SAFETY: the features are present (checked above, F16C with them on every
            // AVX-512 CPU, and checked again here).
            let done = unsafe {
                assert!(is_x86_feature_detected!("f16c"));
                crate::kernels::x86_512::row_major_tiles::<[u8; 24]>(
                    as_blocks(&w),
                    nb,
                    &xq,
                    n,
                    &mut wide,
                )
            };
            assert_eq!(done, crate::kernels::x86_512::tiled_tokens(n));
            let mut all = vec![f32::NAN; rows * n];
            Q5_1::rows(as_blocks(&w), &xq, nb, n, &mut all);
            for r in 0..rows {
                for t in 0..n {
                    let mut one = [0f32; 1];
                    let a: &[&[BlockQ8_1]] = &[&xq[t * nb..(t + 1) * nb]];
                    Q5_1::dot_tile(as_blocks(&w[r * rb..(r + 1) * rb]), a, &mut one);
                    let at = format!("{ty:?} {rows}x{n} row {r} token {t}");
                    if t < done {
                        assert_eq!(wide[r * n + t].to_bits(), one[0].to_bits(), "{at}");
                    }
                    assert_eq!(all[r * n + t].to_bits(), one[0].to_bits(), "{at}");
                }
            }
        }
    }
}

/// The integer f16 conversion the formats' float parts use, on every f16 against `half`'s.
#[test]
fn f16_conversion_matches_half_on_every_value() {
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        let got = crate::blocks::f16_bits_to_f32(h);
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#06x}");
        } else {
            assert_eq!(want.to_bits(), got.to_bits(), "{h:#06x}");
        }
    }
}

/// The 512-bit Q2_K and Q3_K register tiles against `dot_tile` and `dot` one token at a
/// time, bit for bit: row and token counts not multiples of the tile, 1-6 super-blocks,
/// quantized weights and raw random bytes (every quant, scale and high-bit pattern), tokens
/// of very different magnitudes. It needs AVX-512 VNNI, so it is ignored by default like
/// the other wide-kernel tests, and run by `scripts/test.sh` where the CPU has it.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
fn wide_low_k_quant_tiles_match_the_256_bit_kernel_bit_for_bit() {
    assert!(
        crate::kernels::wide_available(),
        "this CPU lacks AVX-512 (F, BW, DQ, VL, VNNI): the wide kernel cannot run here"
    );
    let mut s = 43u64;
    for ty in [GgmlType::Q3_K, GgmlType::Q2_K] {
        let cases = [
            (5, 15, 6),
            (1, 4, 1),
            (3, 66, 2),
            (2, 7, 3),
            (4, 13, 6),
            (3, 8, 4),
            (2, 12, 5),
            // More rows than the 512-bit tile unpacks at a time (1,024 / nb), odd.
            (173, 12, 6),
            // The extremes of every scaled weight (Q3_K: the table entries 255 and 3, from
            // scale -32 or 31 with quant 0) against activations of -127 and 127.
            (4, 8, 1),
            (4, 16, 2),
        ];
        for (case, (rows, n, nb)) in cases.into_iter().enumerate() {
            let cols = nb * QK_K;
            let rb = nb * ty.block_bytes();
            let extreme = case >= 8;
            let w: Vec<u8> = if extreme {
                // Row r: packed scale bytes all 0 (Q3_K -32, Q2_K 0) or all 0xff (31 and
                // min 15, Q2_K 15), quant and high-bit bytes all 0 or all 0xff.
                let mut w = Vec::with_capacity(rows * rb);
                for r in 0..rows {
                    let (sc, q) = (
                        if r % 2 == 0 { 0 } else { 0xff },
                        if r < 2 { 0 } else { 0xff },
                    );
                    for _ in 0..nb {
                        let start = w.len();
                        w.resize(start + ty.block_bytes(), q);
                        let b = &mut w[start..];
                        let d = half::f16::from_f32(0.01).to_le_bytes();
                        if ty == GgmlType::Q2_K {
                            b[..16].fill(sc);
                            b[80..82].copy_from_slice(&d);
                            b[82..84].copy_from_slice(&d);
                        } else {
                            b[96..108].fill(sc);
                            b[108..110].copy_from_slice(&d);
                        }
                    }
                }
                w
            } else if case % 2 == 0 {
                let vals: Vec<f32> = (0..rows * cols)
                    .map(|i| lcg(&mut s) * (0.5 + 9.0 * (i / cols % 3) as f32))
                    .collect();
                ty.quantize(&vals)
            } else {
                let mut w: Vec<u8> = (0..rows * rb)
                    .map(|_| (lcg(&mut s) * 128.0 + 128.0) as u8)
                    .collect();
                for b in w.chunks_exact_mut(ty.block_bytes()) {
                    let d = half::f16::from_f32(0.01 * (1.0 + lcg(&mut s).abs())).to_le_bytes();
                    if ty == GgmlType::Q2_K {
                        b[80..82].copy_from_slice(&d);
                        b[82..84].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
                    } else {
                        b[108..110].copy_from_slice(&d);
                    }
                }
                w
            };
            assert_eq!(w.len(), rows * rb);
            let x: Vec<f32> = if extreme {
                // +1 first: Q8_K scales by -127 / +1, so every +1 is -127 and every -1 127, the
                // ends of its range.
                (0..n * cols)
                    .map(|i| {
                        if (i + i / cols).is_multiple_of(2) {
                            1.0
                        } else {
                            -1.0
                        }
                    })
                    .collect()
            } else {
                (0..n * cols)
                    .map(|i| lcg(&mut s) * (1.0 + 37.0 * (i / cols % 5) as f32))
                    .collect()
            };
            let mut xk = vec![BlockQ8K::default(); n * nb];
            for (row, o) in x.chunks_exact(cols).zip(xk.chunks_exact_mut(nb)) {
                quantize_row_q8_k(row, o);
            }
            let two = ty == GgmlType::Q2_K;
            let mut wide = vec![f32::NAN; rows * n];
            // SAFETY: the features are present (checked above, F16C with them on every
            // AVX-512 CPU, and checked again here).
            let done = unsafe {
                assert!(is_x86_feature_detected!("f16c"));
                crate::kernels::x86_512_low_kquants::low_k_quant_rows(
                    &w, nb, &xk, n, two, &mut wide,
                )
            };
            assert_eq!(done, crate::kernels::x86_512::tiled_tokens(n));
            let mut all = vec![f32::NAN; rows * n];
            if two {
                Q2K::rows(as_blocks(&w), &xk, nb, n, &mut all);
            } else {
                Q3K::rows(as_blocks(&w), &xk, nb, n, &mut all);
            }
            for r in 0..rows {
                let row = &w[r * rb..(r + 1) * rb];
                for t in 0..n {
                    let a = &xk[t * nb..(t + 1) * nb];
                    let mut one = [0f32; 1];
                    let (single, scalar) = if two {
                        Q2K::dot_tile(as_blocks(row), &[a], &mut one);
                        (Q2K::dot(as_blocks(row), a), Q2K::dot_scalar(row, a))
                    } else {
                        Q3K::dot_tile(as_blocks(row), &[a], &mut one);
                        (Q3K::dot(as_blocks(row), a), Q3K::dot_scalar(row, a))
                    };
                    let at = format!("{ty:?} {rows}x{n}x{nb} row {r} token {t}");
                    assert_eq!(one[0].to_bits(), single.to_bits(), "{at}");
                    assert_eq!(scalar.to_bits(), single.to_bits(), "{at}");
                    if t < done {
                        assert_eq!(wide[r * n + t].to_bits(), one[0].to_bits(), "{at}");
                    }
                    assert_eq!(all[r * n + t].to_bits(), one[0].to_bits(), "{at}");
                }
            }
        }
    }
}

/// The tokens-in-lanes Q4_K and Q6_K kernel against the portable definitions and the
/// 256-bit row kernels, bit for bit: row counts around its four-row pass, token counts around its groups
/// of sixteen and pairs of groups (padding lanes never stored), wide value ranges, tokens of
/// very different magnitudes, extreme quants (every nibble 15 and the largest activations,
/// the sums' bound), row-major and token-major.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
fn k_quant_lanes_give_the_definitions_bits() {
    assert!(
        crate::kernels::wide_available(),
        "this CPU lacks AVX-512 (F, BW, DQ, VL, VNNI): the wide kernel cannot run here"
    );
    use crate::kernels::tile_out::Out;
    use crate::kernels::x86_512_lanes::{k_quant_lanes, Format, Weights};
    let mut s = 47u64;
    for (ty, format) in [(GgmlType::Q4_K, Format::Q4K), (GgmlType::Q6_K, Format::Q6K)] {
        for (rows, n, nb, extreme) in [
            (5, 15, 6, false),
            (4, 16, 1, false),
            (9, 66, 2, false),
            (1, 8, 3, false),
            (6, 33, 8, false),
            (4, 40, 2, true),
            (5, 5, 2, false),
            (6, 24, 3, false),
            (4, 8, 2, true),
            // Longer rows, with a narrow last group.
            (5, 40, 19, false),
            (6, 33, 17, true),
            // Several four-row passes, then one-row passes.
            (8, 40, 2, false),
            (12, 33, 3, false),
            (13, 8, 2, true),
            (17, 17, 2, true),
        ] {
            let cols = nb * QK_K;
            let vals: Vec<f32> = (0..rows * cols)
                .map(|i| lcg(&mut s) * (0.5 + 9.0 * (i / cols % 3) as f32))
                .collect();
            let mut w = ty.quantize(&vals);
            let x: Vec<f32> = (0..n * cols)
                .map(|i| {
                    if extreme {
                        if i % 7 == 0 {
                            -100.0
                        } else {
                            100.0
                        }
                    } else {
                        lcg(&mut s) * (1.0 + 37.0 * (i / cols % 5) as f32)
                    }
                })
                .collect();
            if extreme {
                // The integer sums' bounds. Q4_K: every nibble 15, every 6-bit scale and min 63.
                // Q6_K: every value 63 (or, in odd super-blocks, 0: `q − 32` at both ends) and
                // every scale −128.
                for (i, b) in w.chunks_exact_mut(ty.block_bytes()).enumerate() {
                    if ty == GgmlType::Q4_K {
                        b[4..16].fill(0xff);
                        b[16..].fill(0xff);
                    } else {
                        b[..192].fill(if i % 2 == 0 { 0xff } else { 0 });
                        b[192..208].fill(0x80);
                    }
                }
            }
            let mut xk = vec![BlockQ8K::default(); n * nb];
            for (row, o) in x.chunks_exact(cols).zip(xk.chunks_exact_mut(nb)) {
                quantize_row_q8_k(row, o);
            }
            let lanes = crate::kernels::q8_k_lanes(&xk, n, nb);
            let mut by_row = vec![f32::NAN; rows * n];
            let ld = rows + 2;
            let mut by_token = vec![f32::NAN; n * ld];
            // SAFETY: the features are present (checked above, F16C with them on every AVX-512
            // CPU, and checked again here).
            unsafe {
                assert!(is_x86_feature_detected!("f16c"));
                k_quant_lanes(
                    format,
                    Weights::Blocks(&w),
                    nb,
                    &lanes,
                    n,
                    &mut Out::RowMajor {
                        out: &mut by_row,
                        n,
                    },
                );
                k_quant_lanes(
                    format,
                    Weights::Blocks(&w),
                    nb,
                    &lanes,
                    n,
                    &mut Out::TokenMajor {
                        out: &mut by_token,
                        ld,
                    },
                );
            }
            let rb = nb * ty.block_bytes();
            for r in 0..rows {
                let row = &w[r * rb..(r + 1) * rb];
                for t in 0..n {
                    let a = &xk[t * nb..(t + 1) * nb];
                    let (want, dot) = if ty == GgmlType::Q4_K {
                        (Q4K::dot_scalar(row, a), Q4K::dot(as_blocks(row), a))
                    } else {
                        (Q6K::dot_scalar(row, a), Q6K::dot(as_blocks(row), a))
                    };
                    let at = format!("{ty:?} {rows}x{n}x{nb} row {r} token {t}");
                    assert!(want.is_finite() && want != 0.0, "{at}: {want}");
                    assert_eq!(dot.to_bits(), want.to_bits(), "{at}");
                    assert_eq!(by_row[r * n + t].to_bits(), want.to_bits(), "{at}");
                    assert_eq!(by_token[t * ld + r].to_bits(), want.to_bits(), "{at}");
                }
            }
            for t in 0..n {
                assert!(by_token[t * ld + rows..(t + 1) * ld]
                    .iter()
                    .all(|v| v.is_nan()));
            }
        }
    }
}

/// The super-block formats' 512-bit tiles writing token-major (a prefill's layer output)
/// against their row-major result, bit for bit, through `WeightRows` as the product driver
/// calls them: one- and two-tile passes, several rows; a token count that is not whole tiles
/// is refused with nothing written.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
fn wide_k_quant_token_major_matches_row_major_bit_for_bit() {
    assert!(
        crate::kernels::wide_available(),
        "this CPU lacks AVX-512 (F, BW, DQ, VL, VNNI): the wide kernel cannot run here"
    );
    let mut s = 53u64;
    for ty in [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let (rows, nb) = (5, 2);
        let cols = nb * QK_K;
        let vals: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s) * 3.0).collect();
        let m = in_memory(ty, rows, cols, ty.quantize(&vals));
        for n in [12, 4, 6, 37] {
            let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 5.0).collect();
            let inputs = q8_k_inputs(&*m, &x, n, nb);
            let acts = inputs.acts();
            let mut by_row = vec![0f32; rows * n];
            m.rows_kernel(0, rows, &acts, n, &mut by_row);
            let ld = rows + 3;
            let mut by_token = vec![f32::NAN; n * ld];
            let wrote = m.rows_token_major(0, rows, &acts, n, &mut by_token[2..], ld);
            // Q4_K and Q6_K write token-major with their lanes kernel (any count from 2), the
            // others whole tiles only.
            let expected = if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) {
                n >= 2
            } else {
                n % TILE == 0
            };
            assert_eq!(wrote, expected, "{ty:?}: {n} tokens");
            if !wrote {
                assert!(
                    by_token.iter().all(|v| v.is_nan()),
                    "{ty:?}: nothing written"
                );
                continue;
            }
            for r in 0..rows {
                for t in 0..n {
                    assert_eq!(
                        by_token[t * ld + 2 + r].to_bits(),
                        by_row[r * n + t].to_bits(),
                        "{ty:?} n {n} row {r} token {t}"
                    );
                }
            }
        }
    }
}

/// The vector Q8_K quantization gives the definition's blocks exactly: random magnitudes,
/// ties after scaling, the largest magnitude with both signs (the first sets the sign),
/// zeros, NaNs, infinities and subnormals (those blocks go to the definition).
#[test]
fn q8_k_quantization_equals_the_definition() {
    let mut s = 61u64;
    let mut blocks: Vec<[f32; QK_K]> = Vec::new();
    for trial in 0..400usize {
        let amp = 10f32.powi((trial % 9) as i32 - 4);
        let mut b: [f32; QK_K] = std::array::from_fn(|_| lcg(&mut s) * amp);
        match trial % 8 {
            // Ties: max 127 makes the scale -1, so halves stay halves.
            1 => {
                b = std::array::from_fn(|i| (i % 255) as f32 * 0.5 - 63.5);
                b[(trial * 7) % QK_K] = 127.0;
            }
            2 => {
                let (i, j) = ((trial * 13) % QK_K, (trial * 29 + 5) % QK_K);
                b[i] = -2.0 * amp;
                b[j] = 2.0 * amp;
            }
            3 => b[(trial * 3) % QK_K] = f32::NAN,
            4 => b = [0.0; QK_K],
            5 => b[(trial * 11) % QK_K] = if trial % 16 == 5 { f32::INFINITY } else { -0.0 },
            6 => b = std::array::from_fn(|i| (i as f32 - 128.0) * 1e-42),
            7 => b = std::array::from_fn(|i| if i % 3 == 0 { f32::NAN } else { 0.0 }),
            _ => {}
        }
        blocks.push(b);
    }
    let x: Vec<f32> = blocks.iter().flatten().copied().collect();
    let mut fast = vec![BlockQ8K::default(); blocks.len()];
    quantize_row_q8_k(&x, &mut fast);
    for (i, (blk, got)) in x.chunks_exact(QK_K).zip(&fast).enumerate() {
        let mut want = [BlockQ8K::default()];
        quantize_row_q8_k_portable(blk, &mut want);
        assert_eq!(got.d.to_bits(), want[0].d.to_bits(), "block {i}");
        assert_eq!(got.qs, want[0].qs, "block {i}");
        assert_eq!(got.bsums, want[0].bsums, "block {i}");
    }
    // Each block alone through the vector path (not just after an earlier fallback).
    #[cfg(target_arch = "x86_64")]
    {
        let mut vector_blocks = 0;
        for blk in x.chunks_exact(QK_K) {
            let mut one = [BlockQ8K::default()];
            let did = crate::kernels::quantize_blocks_q8_k(blk, &mut one);
            vector_blocks += did;
            if did == 1 {
                let mut want = [BlockQ8K::default()];
                quantize_row_q8_k_portable(blk, &mut want);
                assert_eq!(one[0].d.to_bits(), want[0].d.to_bits());
                assert_eq!((one[0].qs, one[0].bsums), (want[0].qs, want[0].bsums));
            }
        }
        eprintln!(
            "{vector_blocks} of {} blocks went through the vector path",
            blocks.len()
        );
        assert!(!is_x86_feature_detected!("avx2") || vector_blocks >= 300);
    }
}

/// IQ4_NL on rows of one to five blocks (so with and without the odd last block llama.cpp
/// adds apart): the product as the driver runs it (compiled for AVX2 and FMA where the CPU
/// has them, alone and batched) equals the portable definition bit for bit, and both the
/// f64 product of the dequantized weights and activations up to float rounding.
#[test]
fn iq4_nl_products_match_the_definition_and_the_reference() {
    use super::iq4_nl::IQ4NL;
    let ty = GgmlType::IQ4_NL;
    let mut s = 71u64;
    for nb in 1..=5 {
        let (rows, cols, n) = (3, nb * QK, 6);
        let vals: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s) * 2.0).collect();
        let w = ty.quantize(&vals);
        let mut deq = vec![0f32; rows * cols];
        ty.dequantize(&w, &mut deq);
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 3.0).collect();
        let mut xq = vec![BlockQ8_1::default(); n * nb];
        for (row, o) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(nb)) {
            quantize_row_q8_1(row, o);
        }
        let m = in_memory(ty, rows, cols, w.clone());
        let acts = Acts {
            f32: &x,
            q8_1: &xq,
            q8_k: &[],
            tile_scales: &[],
            q8_k_lanes: &[],
            q8_k_tiles: &[],
            q8_1_lanes: &[],
        };
        let mut out = vec![0f32; rows * n];
        m.rows_kernel(0, rows, &acts, n, &mut out);
        let rb = nb * ty.block_bytes();
        for r in 0..rows {
            let row = &w[r * rb..(r + 1) * rb];
            for t in 0..n {
                let a = &xq[t * nb..(t + 1) * nb];
                let want = IQ4NL::dot_scalar(row, a);
                let at = format!("{nb} blocks, row {r} token {t}");
                assert_eq!(out[r * n + t].to_bits(), want.to_bits(), "{at}");
                let one = {
                    let one_acts = Acts { q8_1: a, ..acts };
                    let mut one = [0f32];
                    m.rows_kernel(r, 1, &one_acts, 1, &mut one);
                    one[0]
                };
                assert_eq!(one.to_bits(), want.to_bits(), "{at} alone");
                let exact: f64 = (0..cols)
                    .map(|c| {
                        let b = &a[c / QK];
                        f64::from(deq[r * cols + c]) * f64::from(b.qs[c % QK]) * f64::from(b.d)
                    })
                    .sum();
                let scale: f64 = (0..cols)
                    .map(|c| (f64::from(deq[r * cols + c]) * f64::from(x[t * cols + c])).abs())
                    .sum();
                assert!(
                    (f64::from(want) - exact).abs() <= 1e-5 * (1.0 + scale),
                    "{at}: {want} vs {exact}"
                );
            }
        }
        let mut row = vec![0f32; cols];
        m.row_f32(2, &mut row);
        assert_eq!(row, deq[2 * cols..3 * cols]);
    }
}

/// Q4_K and Q6_K repacked into tiles of sixteen rows give their definitions' bits on
/// every path: the rows-in-lanes kernel (whole tiles, up to `ROWS_LANES_MAX` tokens,
/// row-major and token-major), ggml's blocks rebuilt for rows that do not start a tile and
/// for larger products (the tokens-in-lanes kernel), and the dequantized rows; random
/// blocks of very different magnitudes and the integer sums' bounds.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
fn interleaved_k_quants_give_the_definitions_bits() {
    use super::interleaved::{applies, Interleave, InterleavedMatrix, ROWS_LANES_MAX};
    use super::{PendingRepacks, Repack};
    assert!(
        crate::kernels::wide_available(),
        "this CPU lacks AVX-512 (F, BW, DQ, VL, VNNI): the wide kernel cannot run here"
    );
    fn check<F: Interleave>(ty: GgmlType, dot: fn(&[u8], &[BlockQ8K]) -> f32, s: &mut u64) {
        assert!(applies::<F>(32) && !applies::<F>(40 + 1));
        for (nb, extreme) in [(1, false), (3, false), (8, false), (11, false), (2, true)] {
            let rows = 48;
            let cols = nb * QK_K;
            let vals: Vec<f32> = (0..rows * cols)
                .map(|i| lcg(s) * (0.5 + 9.0 * (i / cols % 3) as f32))
                .collect();
            let mut w = ty.quantize(&vals);
            if extreme {
                for (i, b) in w.chunks_exact_mut(ty.block_bytes()).enumerate() {
                    if ty == GgmlType::Q4_K {
                        b[4..].fill(0xff);
                    } else {
                        b[..192].fill(if i % 2 == 0 { 0xff } else { 0 });
                        b[192..208].fill(0x80);
                    }
                }
            }
            let data = TensorData::from_vec(w.clone());
            let at_load = InterleavedMatrix::<F>::new(ty, rows, cols, &data, &Repack::AtLoad);
            let pending = PendingRepacks::default();
            let deferred =
                InterleavedMatrix::<F>::new(ty, rows, cols, &data, &Repack::Deferred(&pending));
            assert_eq!(pending.len(), 1);
            check_matrix::<F>(&at_load, &w, ty, nb, extreme, true, dot, s);
            // The file's rows, before the deferred repack has run; then its tiles.
            check_matrix::<F>(&deferred, &w, ty, nb, extreme, false, dot, s);
            assert_eq!(pending.run(), w.len());
            check_matrix::<F>(&deferred, &w, ty, nb, extreme, true, dot, s);
        }
    }
    /// Every product and dequantized row of `m` (`w`'s rows; `tiled`: built) against the
    /// definition.
    #[allow(clippy::too_many_arguments)]
    fn check_matrix<F: Interleave>(
        m: &InterleavedMatrix<F>,
        w: &[u8],
        ty: GgmlType,
        nb: usize,
        extreme: bool,
        tiled: bool,
        dot: fn(&[u8], &[BlockQ8K]) -> f32,
        s: &mut u64,
    ) {
        let rows = 48;
        let cols = nb * QK_K;
        {
            let rb = nb * ty.block_bytes();
            for r in [0, 17, 47] {
                let (mut got, mut want) = (vec![0f32; cols], vec![0f32; cols]);
                m.row_f32(r, &mut got);
                ty.dequantize(&w[r * rb..(r + 1) * rb], &mut want);
                assert_eq!(got, want, "{ty:?} row {r} dequantized");
            }
            // 33 and 50 tokens: whole groups of sixteen and a partial one (AMX's tiles).
            for n in (1..=ROWS_LANES_MAX + 1).chain([48, 50]) {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| match (extreme, i % 7) {
                        (true, 0) => -100.0,
                        (true, _) => 100.0,
                        _ => lcg(s) * (1.0 + 37.0 * (i / cols % 5) as f32),
                    })
                    .collect();
                let inputs = q8_k_inputs(m, &x, n, nb);
                let (xk, lanes, acts) = (&inputs.xk, &inputs.lanes, inputs.acts());
                // Whole tiles, and a run of rows that starts and ends inside tiles.
                for (r0, nr) in [(0, rows), (16, 16), (3, 30)] {
                    let mut by_row = vec![f32::NAN; nr * n];
                    m.rows_kernel(r0, nr, &acts, n, &mut by_row);
                    let ld = nr + 1;
                    let mut by_token = vec![f32::NAN; n * ld];
                    let wrote = m.rows_token_major(r0, nr, &acts, n, &mut by_token, ld);
                    for r in 0..nr {
                        let row = &w[(r0 + r) * rb..(r0 + r + 1) * rb];
                        for t in 0..n {
                            let want = dot(row, &xk[t * nb..(t + 1) * nb]);
                            let at = format!("{ty:?} nb {nb} n {n} rows {r0}+{nr}: {r}, {t}");
                            assert!(want.is_finite() && want != 0.0, "{at}: {want}");
                            assert_eq!(by_row[r * n + t].to_bits(), want.to_bits(), "{at}");
                            if wrote {
                                assert_eq!(by_token[t * ld + r].to_bits(), want.to_bits(), "{at}");
                            }
                        }
                    }
                    // Whole tiles run a tile kernel; the rest, from `ROWS_LANES_MAX`, the
                    // tokens-in-lanes one where the product asked for its lanes (not on AMX).
                    let on_tiles = tiled && r0 % 16 == 0 && nr % 16 == 0;
                    let in_lanes = n > ROWS_LANES_MAX && !lanes.is_empty();
                    assert_eq!(wrote, on_tiles || in_lanes, "{ty:?} n {n}");
                }
            }
        }
    }
    let mut s = 71u64;
    check::<Q4K>(GgmlType::Q4_K, Q4K::dot_scalar, &mut s);
    check::<Q6K>(GgmlType::Q6_K, Q6K::dot_scalar, &mut s);
}

/// Q8_0, Q5_0 and Q4_0 (one float step per block, `kernels/block_chain.rs`) on every path this CPU
/// has: one value at a time, the rows, and where the CPU runs it the tokens-in-lanes kernel
/// (partial groups, one and two groups a pass, leftover rows), row-major and token-major;
/// each against the portable definition bit for bit, and the definition against the exact
/// product of the dequantized values.
#[test]
fn block_chain_formats_give_the_definitions_bits() {
    use crate::kernels::block_chain::chain_dot_portable;
    let mut s = 71u64;
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_0] {
        // 120 blocks: eight rows over 16 KiB, which one token reads a row at a time.
        for nb in [1, 7, 8, 20, 120] {
            let (rows, cols) = (9, nb * QK);
            let vals: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s) * 2.0).collect();
            let w = ty.quantize(&vals);
            let mut deq = vec![0f32; rows * cols];
            ty.dequantize(&w, &mut deq);
            let m = in_memory(ty, rows, cols, w.clone());
            let rb = nb * ty.block_bytes();
            let definition = |r: usize, a: &[BlockQ8_1]| {
                let row = &w[r * rb..(r + 1) * rb];
                match ty {
                    GgmlType::Q8_0 => chain_dot_portable(&q8_0::Q8_0::load(ty, row), a),
                    GgmlType::Q4_0 => chain_dot_portable(&q4_0::Q4_0::load(ty, row), a),
                    _ => Q5_0::dot_scalar(row, a),
                }
            };
            for n in [1, 2, 3, 5, 7, 8, 15, 16, 17, 33, 40] {
                let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 4.0).collect();
                let mut xq = vec![BlockQ8_1::default(); n * nb];
                for (row, o) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(nb)) {
                    quantize_row_q8_1(row, o);
                }
                let lanes = if m.wants_q8_1_lanes(n) {
                    crate::kernels::q8_1_lanes(&xq, n, nb)
                } else {
                    Vec::new()
                };
                let acts = Acts {
                    f32: &[],
                    q8_1: &xq,
                    q8_k: &[],
                    tile_scales: &[],
                    q8_k_lanes: &[],
                    q8_k_tiles: &[],
                    q8_1_lanes: &lanes,
                };
                let mut by_row = vec![0f32; rows * n];
                m.rows_kernel(0, rows, &acts, n, &mut by_row);
                let ld = rows + 3;
                let mut by_token = vec![f32::NAN; n * ld];
                let wrote = m.rows_token_major(0, rows, &acts, n, &mut by_token[2..], ld);
                assert_eq!(wrote, !lanes.is_empty(), "{ty:?} n {n}");
                for r in 0..rows {
                    for t in 0..n {
                        let a = &xq[t * nb..(t + 1) * nb];
                        let want = definition(r, a);
                        let at = format!("{ty:?} {nb} blocks, {n} tokens, row {r} token {t}");
                        assert_eq!(by_row[r * n + t].to_bits(), want.to_bits(), "{at}");
                        if wrote {
                            let got = by_token[2 + t * ld + r];
                            assert_eq!(got.to_bits(), want.to_bits(), "{at} token-major");
                        }
                        let exact: f64 = (0..cols)
                            .map(|c| {
                                let b = &a[c / QK];
                                f64::from(deq[r * cols + c])
                                    * f64::from(b.qs[c % QK])
                                    * f64::from(b.d)
                            })
                            .sum();
                        let scale: f64 = (0..cols)
                            .map(|c| f64::from(deq[r * cols + c].abs()) * 4.0)
                            .sum();
                        assert!(
                            (f64::from(want) - exact).abs() <= 1e-5 * (1.0 + scale),
                            "{at}: {want} vs {exact}"
                        );
                    }
                }
                // The formats' one-value dot.
                let (row, a) = (&w[..rb], &xq[..nb]);
                let one = match ty {
                    GgmlType::Q8_0 => q8_0::Q8_0::dot(&q8_0::Q8_0::load(ty, row), a),
                    GgmlType::Q4_0 => q4_0::Q4_0::dot(&q4_0::Q4_0::load(ty, row), a),
                    _ => Q5_0::dot(as_blocks(row), a),
                };
                assert_eq!(one.to_bits(), definition(0, a).to_bits(), "{ty:?} dot");
            }
        }
    }
}
