//! The machine's memory read bandwidth, the ceiling of decode: one decode step reads every
//! weight once, so tokens per second can be at most this over the weights' bytes.
//! `BENCH_THREADS` threads (default: rayon's) each sum their part of a buffer of
//! `BENCH_MIB` MiB (default 1,024, far beyond any cache), best of five passes; prints
//! `bandwidth read_gb_s=…`. `bench/decode-bandwidth.sh` sets it beside decode's rate.
use std::time::Instant;

use rayon::prelude::*;

fn main() {
    let mib: usize = std::env::var("BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let threads = std::env::var("BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rayon::current_num_threads);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let words = mib << 17;
    // Written first, so every page is resident before anything is timed.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let chunk = words.div_ceil(threads * 64).max(1 << 12);
    let mut best = f64::INFINITY;
    let mut check = 0u64;
    for _ in 0..5 {
        let t0 = Instant::now();
        let sum = pool.install(|| {
            buf.par_chunks(chunk)
                .map(|c| {
                    // Eight independent lanes, so the loop is bound by loads, not by one
                    // addition chain.
                    let mut acc = [0u64; 8];
                    for block in c.chunks_exact(8) {
                        for (a, &w) in acc.iter_mut().zip(block) {
                            *a = a.wrapping_add(w);
                        }
                    }
                    acc.iter().fold(0u64, |s, &a| s.wrapping_add(a))
                })
                .reduce(|| 0, u64::wrapping_add)
        });
        best = best.min(t0.elapsed().as_secs_f64());
        check ^= std::hint::black_box(sum);
    }
    let gb_s = (words * 8) as f64 / best / 1e9;
    println!(
        "bandwidth read_gb_s={gb_s:.2} threads={threads} mib={mib} check={:x}",
        check & 0xff
    );
}
