//! One prefill-sized product (ROWS × COLS weights, TOKENS tokens; default an FFN up
//! projection of the default model over 256 tokens) per weight type named, best of 30, in
//! nanoseconds per token pair and 32-element block (the unit of the 512-bit tiles). For
//! comparing kernel changes on one machine; run it alone, one thread:
//! `RAYON_NUM_THREADS=1 cargo bench -p model --bench kernels -- q4_1 q4_0 q8_0 q5_0 q5_1`
use std::time::Instant;

use model::kernels::matmul;
use model::weights::{quantize_row_q8_1, BlockQ8_1, Matrix, QK};

fn main() {
    // `cargo bench` passes `--bench`; the rest are type names.
    let types: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (rows, cols, n) = (env("ROWS", 1536), env("COLS", 576), env("TOKENS", 256));
    let mut seed = 7u64;
    let mut rnd = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    let x: Vec<f32> = (0..n * cols).map(|_| rnd()).collect();
    let mut xq = vec![BlockQ8_1::default(); n * cols / QK];
    for (row, o) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(cols / QK)) {
        quantize_row_q8_1(row, o);
    }
    for t in &types {
        if t == "attention" {
            let only: Option<usize> = std::env::var("ATT_HEADS").ok().and_then(|v| v.parse().ok());
            let keys: usize = std::env::var("ATT_KEYS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(256);
            let pick =
                |k: &str, all: Vec<usize>| match std::env::var(k).ok().and_then(|v| v.parse().ok())
                {
                    Some(v) => vec![v],
                    None => all,
                };
            for hd in pick("ATT_HD", vec![64, 256]) {
                for rows in pick("ATT_ROWS", vec![1, 16]) {
                    for heads in (1..=6).filter(|h| only.is_none_or(|o| o == *h)) {
                        let ns = attention_ns_per_head_key(hd, heads, rows, keys);
                        println!(
                            "attention, head size {hd}, {heads} heads, {rows} rows at {keys} keys: {ns:.2} ns per head and key"
                        );
                    }
                }
            }
            continue;
        }
        // Super-block formats need COLS a multiple of 256 (ROWS=576 COLS=1536, the default
        // model's FFN down projection); their time includes the Q8_K quantization.
        let ty = model::quant::table::by_name(t)
            .unwrap_or_else(|| panic!("type {t} (one of {})", model::quant::table::names()));
        let vals: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let mut w = gguf::GgufWriter::new();
        w.tensor_f32("w", &[cols as u64, rows as u64], ty, &vals);
        let f = gguf::GgufFile::parse(w.to_bytes()).unwrap();
        let m = Matrix::load(&f, f.tensor("w").unwrap(), rows, cols).unwrap();
        let mut out = vec![0f32; n * rows];
        let mut best = f64::MAX;
        for _ in 0..30 {
            let t0 = Instant::now();
            matmul(&m, &x, &xq, n, &mut out);
            best = best.min(t0.elapsed().as_secs_f64());
        }
        let pairs = (rows * n / 2 * cols / QK) as f64;
        println!(
            "{t}: {:.3} ms, {:.3} ns per token-pair block",
            best * 1e3,
            best * 1e9 / pairs
        );
    }
}

/// Attention of `rows` query rows (the last `rows` positions of `keys`) × `heads` query
/// heads sharing one KV head over f16 rows of `hd`: nanoseconds per query head and key seen.
pub fn attention_ns_per_head_key(hd: usize, heads: usize, rows: usize, keys: usize) -> f64 {
    use half::f16;
    use model::kernels::{attend_rows, RowsShape};
    let mut seed = 3u64;
    let mut rnd = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    let kv: Vec<f16> = (0..2 * keys * hd).map(|_| f16::from_f32(rnd())).collect();
    let (kd, vd) = kv.split_at(keys * hd);
    let k: Vec<&[f16]> = kd.chunks_exact(hd).collect();
    let v: Vec<&[f16]> = vd.chunks_exact(hd).collect();
    let q: Vec<f32> = (0..rows * heads * hd)
        .map(|_| f16::from_f32(rnd()).to_f32())
        .collect();
    let shape = RowsShape {
        heads,
        hd,
        first: keys - rows,
        base: 0,
        scale: 1.0 / (hd as f32).sqrt(),
        window: None,
    };
    let mut out = vec![0f32; q.len()];
    let mut best = f64::MAX;
    let reps: usize = std::env::var("ATT_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    for _ in 0..reps {
        let t0 = Instant::now();
        attend_rows(&q, &shape, &k, &v, &mut out);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    let seen: usize = (0..rows).map(|r| keys - rows + r + 1).sum();
    best * 1e9 / (heads * seen) as f64
}
