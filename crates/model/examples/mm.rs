use model::kernels::matmul;
use model::weights::{quantize_row_q8_1, BlockQ8_1, Matrix};
use std::time::Instant;
fn main() {
    rayon::ThreadPoolBuilder::new()
        .build()
        .unwrap()
        .install(body);
}
fn body() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let file = gguf::GgufFile::open(root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    for (name, rows, cols) in [
        ("blk.0.ffn_up.weight", 1536, 576),
        ("token_embd.weight", 49152, 576),
    ] {
        let m = Matrix::load(&file, file.tensor(name).unwrap(), rows, cols).unwrap();
        for n in [1usize, 16, 128] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut xq = vec![BlockQ8_1::default(); n * cols / 32];
            for t in 0..n {
                quantize_row_q8_1(
                    &x[t * cols..(t + 1) * cols],
                    &mut xq[t * cols / 32..(t + 1) * cols / 32],
                );
            }
            let mut out = vec![0f32; n * rows];
            let iters = (200_000_000 / (rows * cols * n)).max(2);
            let t0 = Instant::now();
            for _ in 0..iters {
                matmul(&m, &x, &xq, n, &mut out);
            }
            let dt = t0.elapsed().as_secs_f64() / iters as f64;
            println!(
                "{name} n={n}: {:.3} ms, {:.2} GMAC/s",
                dt * 1e3,
                (rows * cols * n) as f64 / dt / 1e9
            );
        }
    }
}
