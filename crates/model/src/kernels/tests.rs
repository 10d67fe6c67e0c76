#[cfg(target_arch = "x86_64")]
use super::cpu::{has_avx2, has_vnni, wide_available};
use super::matmul::{tile_scales, ROW_BLOCK, TOKEN_BLOCK, TOKEN_SPLIT_MIN};
use super::*;
use crate::blocks::{Acts, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK, TILE};
use crate::quant::QuantFormat;
use crate::weights::{quantize_row_q8_1, Matrix};
use gguf::GgmlType;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

/// A test matrix's blocks in the widened formats, for the tests of their kernels.
enum Data {
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
    Q8_0(Vec<BlockQ8_0>),
    Other,
}

fn matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> (Matrix, Vec<f32>, Data) {
    let mut s = seed;
    let vals: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
    let mut w = gguf::GgufWriter::new();
    w.tensor_f32("w", &[cols as u64, rows as u64], ty, &vals);
    let f = gguf::GgufFile::parse(w.to_bytes()).unwrap();
    let info = f.tensor("w").unwrap();
    let deq = f.tensor_f32(info);
    let bytes = f.tensor_bytes(info);
    let data = match ty {
        GgmlType::Q4_0 => Data::Q4_0(crate::quant::q4_0::Q4_0::load(ty, bytes)),
        GgmlType::Q4_1 => Data::Q4_1(crate::quant::q4_1::Q4_1::load(ty, bytes)),
        GgmlType::Q8_0 => Data::Q8_0(crate::quant::q8_0::Q8_0::load(ty, bytes)),
        _ => Data::Other,
    };
    (Matrix::load(&f, info, rows, cols).unwrap(), deq, data)
}

/// Each kernel (SIMD where the CPU has it) against the plain f32 product of the
/// dequantized weights and the dequantized activations, and the SIMD tile against the
/// scalar reference: activation quantization is the only approximation.
#[test]
fn kernels_match_reference_for_every_type_and_tile() {
    // A decode step, a short prompt (split by rows), and a long one (split by tokens), the
    // last two with the default model's 576-wide rows.
    for (rows, cols, n) in [(19, 96, 7), (37, 576, 1), (70, 576, 70)] {
        kernels_match_reference(rows, cols, n);
    }
}

fn kernels_match_reference(rows: usize, cols: usize, n: usize) {
    let mut s = 99u64;
    let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 3.0).collect();
    let mut xq = vec![BlockQ8_1::default(); n * cols / QK];
    for t in 0..n {
        quantize_row_q8_1(
            &x[t * cols..(t + 1) * cols],
            &mut xq[t * cols / QK..(t + 1) * cols / QK],
        );
    }
    let xdq: Vec<f32> = xq
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
        .collect();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::F32,
    ] {
        let (m, deq, d) = matrix(ty, rows, cols, 7);
        let mut out = vec![0f32; n * rows];
        matmul(&m, &x, &xq, n, &mut out);
        for t in 0..n {
            let xin = if ty == GgmlType::F32 { &x } else { &xdq };
            for r in 0..rows {
                let want: f32 = (0..cols)
                    .map(|c| deq[r * cols + c] * xin[t * cols + c])
                    .sum();
                let got = out[t * rows + r];
                // Q4_1's offset term uses ggml's f16-rounded activation sum `s`.
                // Rounding grows with the row's length (the tolerances were set at 3 blocks).
                let tol = if ty == GgmlType::Q4_1 { 2e-2 } else { 2e-3 }
                    * ((cols / QK) as f32 / 3.0).sqrt().max(1.0);
                assert!(
                    (want - got).abs() < tol * (1.0 + want.abs()),
                    "{ty:?} t{t} r{r}: {want} vs {got}"
                );
                // The dispatched (SIMD) tile against the portable definition.
                let nb = cols / QK;
                let a = &xq[t * nb..(t + 1) * nb];
                let scalar = match &d {
                    Data::Q4_0(data) => {
                        super::block_chain::chain_dot_portable(&data[r * nb..(r + 1) * nb], a)
                    }
                    Data::Q4_1(data) => scalar::q4_1(&data[r * nb..(r + 1) * nb], a),
                    Data::Q8_0(data) => {
                        super::block_chain::chain_dot_portable(&data[r * nb..(r + 1) * nb], a)
                    }
                    Data::Other => got,
                };
                assert_eq!(
                    scalar.to_bits(),
                    got.to_bits(),
                    "{ty:?} t{t} r{r}: SIMD {got} vs portable {scalar}"
                );
            }
        }
    }
}

/// `transpose(rows, hd, off, kt)`: a build's `KvElem::widen_transposed` for f16.
type KeysTranspose = dyn Fn(&[&[half::f16]], usize, usize, &mut [f32]);

/// `transpose(rows, hd, off, kt)` is the scalar conversion put in its place: every offset and
/// row count of a block, specials included.
fn check_keys_transpose(transpose: &KeysTranspose, hds: &[usize]) {
    use half::f16;
    let mut s = 67u64;
    for &hd in hds {
        let mut rows: Vec<Vec<f16>> = (0..KEY_BLOCK)
            .map(|_| (0..hd).map(|_| f16::from_f32(lcg(&mut s) * 3e4)).collect())
            .collect();
        rows[3][5] = f16::NAN;
        rows[7][0] = f16::NEG_INFINITY;
        rows[9][hd - 1] = f16::from_bits(1);
        for (off, n) in [
            (0, 32),
            (0, 1),
            (5, 11),
            (16, 16),
            (3, 29),
            (31, 1),
            (13, 7),
            (8, 24),
        ] {
            let refs: Vec<&[f16]> = rows[..n].iter().map(|r| r.as_slice()).collect();
            let mut got = vec![-7.0f32; hd * KEY_BLOCK];
            transpose(&refs, hd, off, &mut got);
            for d in 0..hd {
                for j in 0..KEY_BLOCK {
                    let want = if (off..off + n).contains(&j) {
                        rows[j - off][d].to_f32()
                    } else {
                        -7.0
                    };
                    let g = got[d * KEY_BLOCK + j];
                    assert!(
                        g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                        "hd {hd}, off {off}, n {n}: [{d}][{j}] = {g}, want {want}"
                    );
                }
            }
        }
    }
}

/// A block's f16 K rows widened and transposed on 256-bit lanes.
#[cfg(target_arch = "x86_64")]
#[test]
fn f16_keys_transpose_into_lanes_exactly_on_256_bits() {
    assert!(has_avx2(), "this test needs AVX2, FMA and F16C");
    check_keys_transpose(
        // SAFETY: AVX2 and F16C are present (asserted); every `hd` given is a multiple of 8.
        &|r, hd, off, kt| unsafe { attention::x86::widen_transposed_f16_256(r, hd, off, kt) },
        &[8, 16, 64, 256],
    );
}

/// The same on 512-bit lanes.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512; scripts/test.sh runs it where the CPU has it"]
fn f16_keys_transpose_into_lanes_exactly_on_512_bits() {
    assert!(wide_available(), "this test needs AVX-512 F, BW, DQ and VL");
    check_keys_transpose(
        // SAFETY: AVX-512 with F16C is present (asserted); every `hd` given is a multiple of 16.
        &|r, hd, off, kt| unsafe { attention::x86::widen_transposed_f16_512(r, hd, off, kt) },
        &[16, 64, 256],
    );
}

/// Both instruction-set builds of the quantized kernels give identical bits.
///
/// It needs a CPU with AVX-512 VNNI, which not every machine has, and a test cannot
/// report "skipped" at run time: so it is ignored by default, `scripts/test.sh` runs it
/// (`--ignored`) where the CPU has VNNI and says that it did not run where not, and run
/// by hand on a CPU without VNNI it fails rather than pass without checking anything.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
fn avx2_and_vnni_kernels_agree_bit_for_bit() {
    assert!(
        has_vnni(),
        "this CPU lacks AVX-512 VNNI: the VNNI kernels cannot run here, so this test checks nothing"
    );
    let cols = 128;
    let nb = cols / QK;
    let mut s = 3u64;
    let x: Vec<f32> = (0..TILE * cols).map(|_| lcg(&mut s) * 2.0).collect();
    let mut xq = vec![BlockQ8_1::default(); TILE * nb];
    for t in 0..TILE {
        quantize_row_q8_1(&x[t * cols..(t + 1) * cols], &mut xq[t * nb..(t + 1) * nb]);
    }
    let acts: Vec<&[BlockQ8_1]> = xq.chunks(nb).collect();
    for ty in [GgmlType::Q4_1] {
        let (_, _, d) = matrix(ty, 3, cols, 5);
        for r in 0..3 {
            let (mut a, mut b) = ([0f32; TILE], [0f32; TILE]);
            // SAFETY: AVX2, FMA, AVX-512 VNNI and VL are present (checked above).
            unsafe {
                match &d {
                    Data::Q4_1(data) => {
                        x86::avx2::q4_1(&data[r * nb..(r + 1) * nb], &acts, None, &mut a);
                        x86::vnni::q4_1(&data[r * nb..(r + 1) * nb], &acts, None, &mut b);
                    }
                    Data::Q4_0(_) | Data::Q8_0(_) | Data::Other => unreachable!(),
                }
            }
            assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "{ty:?} row {r}");
            if let Data::Q4_1(data) = &d {
                // The tile with gathered scales gives the same bits as without.
                let scales = tile_scales(&xq, TILE, nb);
                let mut c = [0f32; TILE];
                let mut d = [0f32; TILE];
                // SAFETY: as above.
                unsafe {
                    x86::avx2::q4_1(&data[r * nb..(r + 1) * nb], &acts, Some(&scales), &mut c);
                    x86::vnni::q4_1(&data[r * nb..(r + 1) * nb], &acts, Some(&scales), &mut d);
                }
                assert_eq!(
                    a.map(f32::to_bits),
                    c.map(f32::to_bits),
                    "scaled avx2 row {r}"
                );
                assert_eq!(
                    a.map(f32::to_bits),
                    d.map(f32::to_bits),
                    "scaled vnni row {r}"
                );
            }
        }
    }
}

#[test]
fn ggml_expf_is_accurate_and_saturates() {
    let mut x = -87.0f32;
    while x < 88.0 {
        let want = (x as f64).exp();
        let got = ggml_expf(x) as f64;
        assert!(
            (got - want).abs() <= 4e-7 * want,
            "exp({x}): {got} vs {want}"
        );
        x += 0.173;
    }
    assert_eq!(ggml_expf(-200.0), 0.0);
    assert_eq!(ggml_expf(200.0), f32::INFINITY);
    assert!((silu(2.0) - 2.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6);
    // The vectorized SwiGLU gives the scalar definition's bits, including lanes that
    // fall back to the scalar path.
    let mut s = 17u64;
    let mut gate: Vec<f32> = (0..203).map(|_| lcg(&mut s) * 30.0).collect();
    gate[50] = 150.0;
    gate[77] = -150.0;
    let up: Vec<f32> = (0..203).map(|_| lcg(&mut s)).collect();
    let want: Vec<u32> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| (silu(*g) * u).to_bits())
        .collect();
    swiglu(&mut gate, &up);
    assert_eq!(gate.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
}

/// The tokens-in-lanes products' task blocks: whole lane groups, at most 256 tokens, none
/// empty, enough to keep the threads busy, and 500 tokens on two threads in two blocks of
/// 256 (not eight of 64).
#[test]
fn lanes_blocks_are_whole_groups_shared_evenly() {
    use super::matmul::lanes_block;
    use crate::blocks::LANE_TOKENS;
    for threads in 1..=16 {
        for tokens in TOKEN_SPLIT_MIN..2100 {
            let block = lanes_block(tokens, threads);
            let blocks = tokens.div_ceil(block);
            let at = format!("{tokens} tokens, {threads} threads: {block}");
            assert!(block.is_multiple_of(LANE_TOKENS) && block <= 256, "{at}");
            assert!((blocks - 1) * block < tokens, "{at}: an empty block");
            // Rounding up to whole lane groups at most halves the blocks.
            let want = threads.min(tokens / LANE_TOKENS).div_ceil(2);
            assert!(blocks >= want, "{at}: idle threads");
        }
    }
    assert_eq!(lanes_block(500, 2), 256);
    assert_eq!(lanes_block(200, 2), 112);
}

/// Batch invariance across both work splits (by rows below `TOKEN_SPLIT_MIN` tokens, by
/// token blocks from it on, with partial tiles, token blocks and row blocks) for every
/// weight type: a token's row of the product is the same alone and in any batch.
#[test]
fn matmul_rows_do_not_depend_on_batch() {
    let cols = 256;
    for ty in [
        GgmlType::Q4_1,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::F32,
        GgmlType::Q4_K,
    ] {
        // Decode-sized (split by rows) and prefill-sized (split by tokens), each with a token
        // count of whole tiles (the 512-bit tiles write token-major) and one with a rest.
        let shapes = [
            (37, 9),
            (37, 12),
            (37, 32),
            (ROW_BLOCK + 13, TOKEN_SPLIT_MIN + TOKEN_BLOCK + 5),
            (ROW_BLOCK + 13, TOKEN_SPLIT_MIN + TOKEN_BLOCK + 4),
        ];
        for (rows, n) in shapes {
            let (m, _, _) = matrix(ty, rows, cols, 3);
            let mut s = 5u64;
            let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
            let mut xq = vec![BlockQ8_1::default(); n * cols / QK];
            for t in 0..n {
                quantize_row_q8_1(
                    &x[t * cols..(t + 1) * cols],
                    &mut xq[t * cols / QK..(t + 1) * cols / QK],
                );
            }
            let mut all = vec![0f32; n * rows];
            matmul(&m, &x, &xq, n, &mut all);
            for t in 0..n {
                let mut one = vec![0f32; rows];
                let nb = cols / QK;
                matmul(
                    &m,
                    &x[t * cols..(t + 1) * cols],
                    &xq[t * nb..(t + 1) * nb],
                    1,
                    &mut one,
                );
                assert_eq!(
                    one,
                    all[t * rows..(t + 1) * rows],
                    "{ty:?}: token {t} of {n} differs alone vs batched"
                );
            }
        }
    }
}

/// The register-tiled 512-bit Q4_1 product against the 256-bit kernel, row by row and token
/// by token, bit for bit: whole micro-tiles, leftover rows, several tiles of tokens and the
/// tokens after the last tile (padded to a tile, or through the 256-bit kernel).
/// Ignored like the test above, and run by `scripts/test.sh` where the CPU has the features.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
fn wide_q4_1_tiles_match_the_256_bit_kernel_bit_for_bit() {
    assert!(
        wide_available(),
        "this CPU lacks AVX-512 (F, BW, DQ, VL, VNNI): the wide kernel cannot run here"
    );
    // Tokens past whole tiles: padded to a tile (15, 5) or through the 256-bit kernel (3).
    for n in [3 * TILE + 3, TILE + 1, TILE - 1] {
        wide_q4_1_tiles_against_the_256_bit_kernel(n);
    }
}

#[cfg(target_arch = "x86_64")]
fn wide_q4_1_tiles_against_the_256_bit_kernel(n: usize) {
    let rows = tile_out::ROWS * 2 + 3;
    let cols = 256;
    let nb = cols / QK;
    let mut s = 11u64;
    let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 4.0).collect();
    let mut xq = vec![BlockQ8_1::default(); n * nb];
    for t in 0..n {
        quantize_row_q8_1(&x[t * cols..(t + 1) * cols], &mut xq[t * nb..(t + 1) * nb]);
    }
    let (_, _, d) = matrix(GgmlType::Q4_1, rows, cols, 17);
    let Data::Q4_1(data) = &d else {
        unreachable!("a Q4_1 matrix")
    };
    let mut wide = vec![0f32; rows * n];
    // SAFETY: the features are present (checked above).
    unsafe { x86_512::q4_1_rows(data, nb, &xq, n, &mut wide) };
    for r in 0..rows {
        for t in 0..n {
            let mut one = [0f32; 1];
            // SAFETY: AVX2 and FMA are present (implied by the check above).
            unsafe {
                x86::avx2::q4_1(
                    &data[r * nb..(r + 1) * nb],
                    &[&xq[t * nb..(t + 1) * nb]],
                    None,
                    &mut one,
                )
            };
            assert_eq!(
                wide[r * n + t].to_bits(),
                one[0].to_bits(),
                "row {r} token {t}"
            );
        }
    }
}

/// Random attention inputs: `rows` query rows of `heads` heads (f16-valued), and `keys`
/// K/V rows, K scaled so that scores rise and fall across blocks.
struct AttentionCase {
    q: Vec<f32>,
    k: Vec<Vec<half::f16>>,
    v: Vec<Vec<half::f16>>,
}

fn attention_case(s: &mut u64, hd: usize, heads: usize, rows: usize, keys: usize) -> AttentionCase {
    use half::f16;
    let q = (0..rows * heads * hd)
        .map(|i| f16::from_f32(lcg(s) * (1.0 + (i / hd % heads) as f32)).to_f32())
        .collect();
    let mk = |s: &mut u64, amp: f32| -> Vec<Vec<f16>> {
        (0..keys)
            .map(|j| {
                let wave = 1.0 + (j as f32 * 0.37).sin() * 0.8;
                (0..hd)
                    .map(|_| f16::from_f32(lcg(s) * amp * wave))
                    .collect()
            })
            .collect()
    };
    let k = mk(s, 1.5);
    let v = mk(s, 40.0);
    AttentionCase { q, k, v }
}

/// Output bits, every NaN as one pattern (NaN payloads are not part of the arithmetic).
fn attention_bits(x: &[f32]) -> Vec<u32> {
    x.iter()
        .map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() })
        .collect()
}

/// The shapes the attention tests cover: head sizes of the supported models and odd ones,
/// starting positions before, at and across block boundaries, windows.
fn attention_shapes() -> Vec<(usize, usize, usize, usize, Option<usize>)> {
    let mut v = Vec::new();
    for hd in [64usize, 128, 256, 80, 32] {
        for (heads, first, rows, window) in [
            (1, 0, 1, None),
            (3, 0, 16, None),
            (2, 31, 3, None),
            (4, 45, 16, None),
            (5, 64, 7, None),
            (1, 200, 1, None),
            (3, 90, 16, Some(40)),
            (2, 300, 1, Some(33)),
            (4, 17, 5, Some(1)),
            // Tiles as large as `crate::attention`'s tasks.
            (4, 70, 64, None),
            (2, 33, 64, Some(40)),
        ] {
            v.push((hd, heads, first, rows, window));
        }
    }
    v
}

/// Every shape of [`attention_shapes`] with random inputs from `seed`: the case and its shape.
fn attention_cases(seed: u64) -> Vec<(AttentionCase, RowsShape)> {
    let mut s = seed;
    attention_shapes()
        .into_iter()
        .map(|(hd, heads, first, rows, window)| {
            (
                attention_case(&mut s, hd, heads, rows, first + rows),
                shape_of(hd, heads, first, window),
            )
        })
        .collect()
}

fn shape_of(hd: usize, heads: usize, first: usize, window: Option<usize>) -> RowsShape {
    RowsShape {
        heads,
        hd,
        first,
        base: 0,
        scale: 1.0 / (hd as f32).sqrt(),
        window,
    }
}

fn rows_of(rows: &[Vec<half::f16>]) -> Vec<&[half::f16]> {
    rows.iter().map(|r| r.as_slice()).collect()
}

fn row_refs<T>(rows: &[Vec<T>]) -> Vec<&[T]> {
    rows.iter().map(|r| r.as_slice()).collect()
}

/// A build of `attend_rows` for f16 caches.
type AttendRows = dyn Fn(&[f32], &RowsShape, &[&[half::f16]], &[&[half::f16]], &mut [f32]);

/// Every case of [`attention_cases`] through `build`, against the portable build bit for bit.
fn check_attention_build(seed: u64, name: &str, build: &AttendRows) {
    for (c, shape) in attention_cases(seed) {
        let (k, v) = (rows_of(&c.k), rows_of(&c.v));
        let mut want = vec![0f32; c.q.len()];
        attend_rows_portable(&c.q, &shape, &k, &v, &mut want);
        let mut got = vec![0f32; c.q.len()];
        build(&c.q, &shape, &k, &v, &mut got);
        assert_eq!(
            attention_bits(&got),
            attention_bits(&want),
            "{name}: {shape:?}, {} rows",
            c.q.len() / (shape.heads * shape.hd)
        );
    }
}

/// The 256-bit build of the attention arithmetic gives the portable build's bits, on every
/// shape of [`attention_shapes`] (tiles of 1 to 64 rows, 1 to 5 heads, windows), with the
/// head size known at compile time or not.
#[cfg(target_arch = "x86_64")]
#[test]
fn attention_256_bit_build_gives_the_portable_bits() {
    use attention::x86::attend_rows_256 as build;
    use half::f16;
    assert!(has_avx2(), "this test needs AVX2, FMA and F16C");
    // SAFETY (both closures): AVX2, FMA and F16C are present (asserted).
    check_attention_build(41, "256-bit", &|q, sh, k, v, o| unsafe {
        build::<f16, 0>(q, sh, k, v, o)
    });
    check_attention_build(41, "256-bit, fixed size", &|q, sh, k, v, o| unsafe {
        match sh.hd {
            64 => build::<f16, 64>(q, sh, k, v, o),
            128 => build::<f16, 128>(q, sh, k, v, o),
            256 => build::<f16, 256>(q, sh, k, v, o),
            _ => build::<f16, 0>(q, sh, k, v, o),
        }
    });
}

/// The 512-bit build gives the portable build's bits, as the 256-bit one does.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512; scripts/test.sh runs it where the CPU has it"]
fn attention_512_bit_build_gives_the_portable_bits() {
    use attention::x86::attend_rows_512 as build;
    use half::f16;
    assert!(wide_available(), "this test needs AVX-512 F, BW, DQ and VL");
    // SAFETY: AVX-512 F, BW, DQ, VL (with AVX2, FMA, F16C) are present (asserted).
    check_attention_build(43, "512-bit", &|q, sh, k, v, o| unsafe {
        match sh.hd {
            64 => build::<f16, 64>(q, sh, k, v, o),
            128 => build::<f16, 128>(q, sh, k, v, o),
            256 => build::<f16, 256>(q, sh, k, v, o),
            _ => build::<f16, 0>(q, sh, k, v, o),
        }
    });
}

/// A block-format cache's attention (Q8_0, Q4_0) is an f32 cache's attention over the
/// blocks' values, bit for bit, on this CPU's build and the portable one: dequantization is
/// exact and nothing after it depends on the element type.
#[test]
fn block_kv_attention_is_f32_attention_over_its_values() {
    block_attention_is_f32_attention::<kv::Q8Block>();
    block_attention_is_f32_attention::<kv::Q4Block>();
}

fn block_attention_is_f32_attention<B: kv::KvBlock + KvElem>() {
    use kv::KvBlock;
    for (c, shape) in attention_cases(53) {
        if !shape.hd.is_multiple_of(<B as KvBlock>::VALUES) {
            continue;
        }
        let quantize = |rows: &[Vec<half::f16>]| -> Vec<Vec<B>> {
            rows.iter()
                .map(|r| {
                    let x: Vec<f32> = r.iter().map(|v| v.to_f32()).collect();
                    x.chunks(<B as KvBlock>::VALUES).map(B::quantize).collect()
                })
                .collect()
        };
        let widen = |rows: &[Vec<B>]| -> Vec<Vec<f32>> {
            rows.iter()
                .map(|r| {
                    let mut x = vec![0f32; r.len() * <B as KvBlock>::VALUES];
                    for (o, b) in x.chunks_mut(<B as KvBlock>::VALUES).zip(r) {
                        b.dequantize(o);
                    }
                    x
                })
                .collect()
        };
        let (kq, vq) = (quantize(&c.k), quantize(&c.v));
        let (kf, vf) = (widen(&kq), widen(&vq));
        // Quantization changed the values: the comparison is not of a cache with itself.
        assert_ne!(kf[0], c.k[0].iter().map(|v| v.to_f32()).collect::<Vec<_>>());
        let mut blocks = vec![0f32; c.q.len()];
        attend_rows(&c.q, &shape, &row_refs(&kq), &row_refs(&vq), &mut blocks);
        let mut f32s = vec![0f32; c.q.len()];
        attend_rows(&c.q, &shape, &row_refs(&kf), &row_refs(&vf), &mut f32s);
        let mut portable = vec![0f32; c.q.len()];
        attend_rows_portable(&c.q, &shape, &row_refs(&kq), &row_refs(&vq), &mut portable);
        assert_eq!(attention_bits(&blocks), attention_bits(&f32s), "{shape:?}");
        assert_eq!(
            attention_bits(&blocks),
            attention_bits(&portable),
            "{shape:?}"
        );
    }
}

/// The vector widening of block rows (V rows one at a time; K rows transposed for a block
/// of keys) gives `kv::KvBlock::dequantize`'s values, bit for bit, special scales included.
#[test]
fn block_rows_widen_to_their_blocks_values() {
    widen_gives_the_blocks_values::<kv::Q8Block>();
    widen_gives_the_blocks_values::<kv::Q4Block>();
}

fn widen_gives_the_blocks_values<B: kv::KvBlock + KvElem>() {
    use kv::KvBlock;
    let mut s = 0x5eedu64;
    let mut byte = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 56) as u8
    };
    for hd in [64, 128, 256] {
        let per_row = hd / <B as KvBlock>::VALUES;
        for keys in [1, 5, 16, 17, 32] {
            let rows: Vec<Vec<B>> = (0..keys)
                .map(|r| {
                    (0..per_row)
                        .map(|i| {
                            let mut wire: Vec<u8> = (0..B::BYTES).map(|_| byte()).collect();
                            // Scales: ordinary, then infinite, NaN and subnormal ones.
                            let d = match (r + i) % 7 {
                                3 => 0x7c00u16,
                                4 => 0x7e01,
                                5 => 0x0003,
                                _ => 0x2c00 | u16::from(wire[0] & 0x3f),
                            };
                            wire[..2].copy_from_slice(&d.to_le_bytes());
                            B::from_bytes(&wire)
                        })
                        .collect()
                })
                .collect();
            let exact: Vec<Vec<f32>> = rows
                .iter()
                .map(|r| {
                    let mut x = vec![0f32; hd];
                    for (o, b) in x.chunks_mut(<B as KvBlock>::VALUES).zip(r) {
                        b.dequantize(o);
                    }
                    x
                })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (r, want) in rows.iter().zip(&exact) {
                let mut got = vec![0f32; hd];
                B::widen(r, &mut got);
                assert_eq!(bits(&got), bits(want), "hd {hd}");
            }
            let off = attention::KEY_BLOCK - keys;
            let mut kt = vec![0f32; hd * attention::KEY_BLOCK];
            let refs: Vec<&[B]> = rows.iter().map(|r| &r[..]).collect();
            B::widen_transposed(&refs, hd, off, &mut kt);
            for (i, want) in exact.iter().enumerate() {
                for (d, w) in want.iter().enumerate() {
                    let got = kt[d * attention::KEY_BLOCK + off + i];
                    assert_eq!(
                        got.to_bits(),
                        w.to_bits(),
                        "hd {hd} keys {keys} key {i} d {d}"
                    );
                }
            }
        }
    }
}

/// A query row's output is the same computed alone, in a tile with others, with its heads
/// apart or together, and from a K/V view that starts later (a window's `base`): the
/// arithmetic depends on positions only (chunk and batch invariance at the kernel).
#[test]
fn attention_rows_are_the_same_alone_or_in_a_tile() {
    for (c, shape) in attention_cases(47) {
        let (hd, heads, first, window) = (shape.hd, shape.heads, shape.first, shape.window);
        let rows = c.q.len() / (heads * hd);
        let (k, v) = (rows_of(&c.k), rows_of(&c.v));
        let mut tile = vec![0f32; c.q.len()];
        attend_rows(&c.q, &shape, &k, &v, &mut tile);
        let width = heads * hd;
        for r in 0..rows {
            let p = first + r;
            for h in 0..heads {
                let q = &c.q[r * width + h * hd..][..hd];
                let base = shape.from(p);
                let one = RowsShape {
                    heads: 1,
                    first: p,
                    base,
                    ..shape
                };
                let mut alone = vec![0f32; hd];
                attend_rows(q, &one, &k[base..=p], &v[base..=p], &mut alone);
                assert_eq!(
                    attention_bits(&alone),
                    attention_bits(&tile[r * width + h * hd..][..hd]),
                    "hd {hd}, row {p}, head {h}, window {window:?}"
                );
            }
        }
    }
}

/// The arithmetic computes softmax attention: against an f64 evaluation of the same
/// inputs, within f32 rounding.
#[test]
fn attention_matches_an_f64_softmax() {
    for (c, shape) in attention_cases(53) {
        let (hd, heads, first) = (shape.hd, shape.heads, shape.first);
        let rows = c.q.len() / (heads * hd);
        let (k, v) = (rows_of(&c.k), rows_of(&c.v));
        let mut got = vec![0f32; c.q.len()];
        attend_rows(&c.q, &shape, &k, &v, &mut got);
        let width = heads * hd;
        for r in 0..rows {
            let p = first + r;
            for h in 0..heads {
                let q = &c.q[r * width + h * hd..][..hd];
                let keys = shape.from(p)..=p;
                let scores: Vec<f64> = keys
                    .clone()
                    .map(|j| {
                        q.iter()
                            .zip(&c.k[j])
                            .map(|(a, b)| *a as f64 * b.to_f64())
                            .sum::<f64>()
                            * shape.scale as f64
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = w.iter().sum();
                for d in 0..hd {
                    let want: f64 = keys
                        .clone()
                        .zip(&w)
                        .map(|(j, w)| w * c.v[j][d].to_f64())
                        .sum::<f64>()
                        / l;
                    let g = got[r * width + h * hd + d] as f64;
                    assert!(
                        (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "hd {hd}, row {p}, head {h}, dim {d}: {g} vs {want}"
                    );
                }
            }
        }
    }
}

/// Values the arithmetic must carry the same way on every build: an infinite V entry, K rows
/// whose scores overflow to infinity (NaN weights) or are NaN, and a cache element type of
/// f32.
#[cfg(target_arch = "x86_64")]
#[test]
fn attention_builds_agree_on_special_values() {
    use half::f16;
    assert!(has_avx2(), "this test needs AVX2, FMA and F16C");
    let mut s = 59u64;
    let hd = 64;
    let mut c = attention_case(&mut s, hd, 2, 4, 70);
    c.v[5][3] = f16::INFINITY;
    c.k[40] = vec![f16::MAX; hd];
    c.k[41][7] = f16::NAN;
    let shape = shape_of(hd, 2, 66, None);
    let (k, v) = (rows_of(&c.k), rows_of(&c.v));
    let mut want = vec![0f32; c.q.len()];
    attend_rows_portable(&c.q, &shape, &k, &v, &mut want);
    let mut got = vec![0f32; c.q.len()];
    // SAFETY: AVX2, FMA and F16C are present (asserted).
    unsafe { attention::x86::attend_rows_256::<f16, 64>(&c.q, &shape, &k, &v, &mut got) };
    assert_eq!(attention_bits(&got), attention_bits(&want));
    assert!(
        want.iter().any(|x| x.is_nan()),
        "the special values reached the output"
    );
    let kf: Vec<Vec<f32>> =
        c.k.iter()
            .map(|r| r.iter().map(|x| x.to_f32()).collect())
            .collect();
    let vf: Vec<Vec<f32>> =
        c.v.iter()
            .map(|r| r.iter().map(|x| x.to_f32()).collect())
            .collect();
    let k32: Vec<&[f32]> = kf.iter().map(|r| r.as_slice()).collect();
    let v32: Vec<&[f32]> = vf.iter().map(|r| r.as_slice()).collect();
    let mut p32 = vec![0f32; c.q.len()];
    attend_rows_portable(&c.q, &shape, &k32, &v32, &mut p32);
    let mut g32 = vec![0f32; c.q.len()];
    // SAFETY: as above.
    unsafe { attention::x86::attend_rows_256::<f32, 64>(&c.q, &shape, &k32, &v32, &mut g32) };
    assert_eq!(attention_bits(&g32), attention_bits(&p32), "f32 cache");
    // The f32 cache holds the same values, so its arithmetic is the f16 cache's.
    assert_eq!(
        attention_bits(&p32),
        attention_bits(&want),
        "f32 vs f16 cache"
    );
}

/// Widening f16 K/V rows on vector lanes is the scalar conversion, subnormals and
/// specials included.
#[test]
fn f16_widening_matches_the_scalar_conversion() {
    use half::f16;
    let mut s = 61u64;
    let mut src: Vec<f16> = (0..203).map(|_| f16::from_f32(lcg(&mut s) * 1e5)).collect();
    src.extend([
        f16::from_bits(1),
        f16::from_bits(0x83ff),
        f16::INFINITY,
        f16::NEG_INFINITY,
        f16::NAN,
        f16::ZERO,
        f16::NEG_ZERO,
    ]);
    let mut got = vec![0f32; src.len()];
    <f16 as KvElem>::widen(&src, &mut got);
    for (x, y) in src.iter().zip(&got) {
        assert_eq!(
            attention_bits(&[x.to_f32()]),
            attention_bits(&[*y]),
            "widen({x})"
        );
    }
}

/// The 256-bit per-product Q4_1 loop (two rows × a tile of four tokens, leftover rows and
/// tokens) against the same kernel one row and one token at a time, bit for bit.
#[cfg(target_arch = "x86_64")]
#[test]
fn q4_1_row_pairs_match_single_rows_bit_for_bit() {
    assert!(has_avx2(), "this test needs AVX2 and FMA");
    let (rows, cols, n) = (5, 256, 2 * TILE + 3);
    let nb = cols / QK;
    let mut s = 31u64;
    let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 4.0).collect();
    let mut xq = vec![BlockQ8_1::default(); n * nb];
    for t in 0..n {
        quantize_row_q8_1(&x[t * cols..(t + 1) * cols], &mut xq[t * nb..(t + 1) * nb]);
    }
    let (_, _, d) = matrix(GgmlType::Q4_1, rows, cols, 37);
    let Data::Q4_1(data) = &d else {
        unreachable!("a Q4_1 matrix")
    };
    let scales = tile_scales(&xq, n, nb);
    let mut tiled = vec![0f32; rows * n];
    // SAFETY: AVX2 and FMA are present (checked above).
    unsafe { x86::avx2::q4_1_rows(data, nb, &xq, &scales, n, &mut tiled) };
    let mut wide_vnni = tiled.clone();
    if has_vnni() {
        // SAFETY: VNNI is present (checked).
        unsafe { x86::vnni::q4_1_rows(data, nb, &xq, &scales, n, &mut wide_vnni) };
    }
    for r in 0..rows {
        for t in 0..n {
            let mut one = [0f32; 1];
            // SAFETY: as above.
            unsafe {
                x86::avx2::q4_1(
                    &data[r * nb..(r + 1) * nb],
                    &[&xq[t * nb..(t + 1) * nb]],
                    None,
                    &mut one,
                )
            };
            assert_eq!(
                tiled[r * n + t].to_bits(),
                one[0].to_bits(),
                "avx2 row {r} token {t}"
            );
            assert_eq!(
                wide_vnni[r * n + t].to_bits(),
                one[0].to_bits(),
                "vnni row {r} token {t}"
            );
        }
    }
}

/// Vectorized Q8_1 quantization against the scalar definition, bit for bit: random blocks,
/// ties at exactly .5 after scaling, an all-zero block, a block with a NaN (left to the
/// scalar path) and blocks after it.
#[test]
fn simd_q8_1_quantization_matches_the_scalar_definition() {
    use super::quantize_row_q8_1_scalar;
    let mut s = 53u64;
    let mut x: Vec<f32> = (0..QK * 40).map(|_| lcg(&mut s) * 7.0).collect();
    // amax 127 makes the scale exactly 1, so these elements land on .5 ties.
    for (i, v) in x[QK..2 * QK].iter_mut().enumerate() {
        *v = if i == 0 { 127.0 } else { i as f32 - 0.5 - 16.0 };
    }
    x[2 * QK..3 * QK].fill(0.0);
    x[30 * QK + 3] = f32::NAN;
    let mut a = vec![BlockQ8_1::default(); 40];
    let mut b = vec![BlockQ8_1::default(); 40];
    quantize_row_q8_1(&x, &mut a);
    quantize_row_q8_1_scalar(&x, &mut b);
    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
        assert_eq!(p.qs, q.qs, "block {i}");
        assert_eq!(p.d.to_bits(), q.d.to_bits(), "block {i} d");
        assert_eq!(p.s.to_bits(), q.s.to_bits(), "block {i} s");
    }
}

/// The vectorized query rounding against the scalar conversion, bit for bit: ties, values
/// beyond f16's range, subnormals, and a length that leaves a remainder.
#[test]
fn query_rounding_matches_the_scalar_conversion() {
    use half::f16;
    let mut s = 9u64;
    let mut q: Vec<f32> = (0..203).map(|_| lcg(&mut s) * 70_000.0).collect();
    q.extend([
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        65520.0,
        -65504.0,
        1e-7,
        -3e-8,
        f32::INFINITY,
        0.0,
        -0.0,
    ]);
    let mut fast = vec![0f32; q.len()];
    <f16 as KvElem>::round_queries(&q, &mut fast);
    for (x, y) in q.iter().zip(&fast) {
        assert_eq!(
            f16::from_f32(*x).to_f32().to_bits(),
            y.to_bits(),
            "round({x})"
        );
    }
}

/// The 512-bit tiles writing token-major (a prefill's layer output) against their row-major
/// result, bit for bit: whole micro-tiles and leftover rows, two-tile and one-tile passes,
/// and a token count that is not a whole number of tiles (refused, nothing written).
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
fn wide_token_major_tiles_match_row_major_bit_for_bit() {
    assert!(
        wide_available(),
        "this CPU lacks AVX-512 (F, BW, DQ, VL, VNNI): the wide kernel cannot run here"
    );
    let (rows, cols) = (tile_out::ROWS * 2 + 3, 256);
    let nb = cols / QK;
    for n in [12, 8, 4] {
        let mut s = 41u64;
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 3.0).collect();
        let mut xq = vec![BlockQ8_1::default(); n * nb];
        for t in 0..n {
            quantize_row_q8_1(&x[t * cols..(t + 1) * cols], &mut xq[t * nb..(t + 1) * nb]);
        }
        // (Q8_0, Q5_0 and Q4_0: `quant/tests.rs`' block-chain test.)
        let types = [GgmlType::Q4_1, GgmlType::Q5_1];
        for ty in types {
            let (m, _, _) = matrix(ty, rows, cols, 43);
            let mut by_row = vec![0f32; rows * n];
            // Token-major into a wider output, as a row block of a layer: columns 5.. of 40.
            let ld = rows + 7;
            let mut by_token = vec![f32::NAN; n * ld];
            let acts = Acts {
                f32: &[],
                q8_1: &xq,
                q8_k: &[],
                tile_scales: &[],
                q8_k_lanes: &[],
                q8_k_tiles: &[],
                q8_1_lanes: &[],
            };
            // Through the matrix as the driver calls it: row-major, then token-major.
            m.rows_kernel(0, rows, &acts, n, &mut by_row);
            let wrote = m.rows_token_major(0, rows, &acts, n, &mut by_token[5..], ld);
            assert!(wrote, "{ty:?}: {n} tokens are whole tiles");
            for r in 0..rows {
                for t in 0..n {
                    assert_eq!(
                        by_token[t * ld + 5 + r].to_bits(),
                        by_row[r * n + t].to_bits(),
                        "{ty:?} n {n} row {r} token {t}"
                    );
                }
            }
            // Nothing outside the row block's columns was touched.
            for t in 0..n {
                assert!(by_token[t * ld..t * ld + 5].iter().all(|v| v.is_nan()));
                assert!(by_token[t * ld + 5 + rows..(t + 1) * ld]
                    .iter()
                    .all(|v| v.is_nan()));
            }
        }
    }
    let (_, _, d) = matrix(GgmlType::Q4_1, 4, cols, 47);
    let Data::Q4_1(data) = &d else {
        unreachable!("a Q4_1 matrix")
    };
    let xq = vec![BlockQ8_1::default(); 6 * nb];
    let mut out = vec![0f32; 6 * 4];
    // SAFETY: the features are present (checked above).
    let wrote = unsafe { x86_512::token_major(data, nb, &xq, 6, &mut out, 4) };
    assert!(!wrote, "6 tokens are not whole tiles");
}

#[test]
fn f32_dot_gives_the_portable_bits_on_every_path_and_length() {
    let mut s = 7;
    for len in [0, 1, 7, 8, 9, 15, 16, 17, 64, 576, 1000, 1536] {
        let a: Vec<f32> = (0..len).map(|_| lcg(&mut s) * 3.0).collect();
        let b: Vec<f32> = (0..len).map(|_| lcg(&mut s) * 0.01).collect();
        let want = f32_dot::dot_f32_portable(&a, &b);
        assert_eq!(dot_f32(&a, &b).to_bits(), want.to_bits(), "length {len}");
        let naive: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!(
            (want as f64 - naive).abs() < 1e-4,
            "length {len}: {want} vs {naive}"
        );
    }
}

#[test]
fn low_rank_halves_give_the_portable_bits_on_every_path() {
    let mut s = 11;
    for (rank, n_in, n_out) in [
        (1, 8, 8),
        (3, 13, 5),
        (16, 576, 192),
        (8, 1536, 577),
        (5, 7, 31),
    ] {
        let a: Vec<f32> = (0..rank * n_in).map(|_| lcg(&mut s)).collect();
        let x: Vec<f32> = (0..n_in).map(|_| lcg(&mut s) * 2.0).collect();
        let mut u = vec![0f32; rank];
        dot_rows_f32(&a, &x, &mut u);
        for (r, got) in u.iter().enumerate() {
            let want = dot_f32_portable(&a[r * n_in..(r + 1) * n_in], &x);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "A·x row {r} of {rank}×{n_in}"
            );
        }
        let bt: Vec<f32> = (0..rank * n_out).map(|_| lcg(&mut s) * 0.1).collect();
        let y0: Vec<f32> = (0..n_out).map(|_| lcg(&mut s)).collect();
        let (mut fast, mut portable) = (y0.clone(), y0.clone());
        add_scaled_combination(&bt, n_out, &u, 0.75, &mut fast);
        add_scaled_combination_portable(&bt, n_out, &u, 0.75, &mut portable);
        // A block of outputs from the middle, as the batch splits them.
        let from = n_out / 3;
        let mut block = y0[from..].to_vec();
        add_scaled_combination(&bt[from..], n_out, &u, 0.75, &mut block);
        assert_eq!(block, portable[from..].to_vec());
        for o in 0..n_out {
            assert_eq!(fast[o].to_bits(), portable[o].to_bits(), "B·u output {o}");
            let t: f64 = (0..rank)
                .map(|j| u[j] as f64 * bt[j * n_out + o] as f64)
                .sum();
            let want = y0[o] as f64 + 0.75 * t;
            assert!(
                (portable[o] as f64 - want).abs() < 1e-4,
                "{} vs {want}",
                portable[o]
            );
        }
    }
}
