//! What a page stores: an f16 page holds each appended value exactly as `f16::from_f32`
//! rounds it (the attention kernels and the llama.cpp references assume that rounding).

// Under `--cfg loom` the crate hands out loom's `Arc`, usable only inside a loom model.
#![cfg(not(loom))]

use half::f16;
use kv::{KvDtype, KvLayout, KvPool, KvSlice, PoolConfig, RequestId, ScrubPolicy};

#[test]
fn f16_pages_round_every_value_as_f16_from_f32() {
    // 19 values a row: whole SIMD steps and a remainder.
    const DIM: usize = 19;
    let pool = KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: 1,
            kv_dim: DIM,
            page_tokens: 4,
            dtype: KvDtype::F16,
        },
        pages: 1,
        scrub: ScrubPolicy::Zero,
    });
    let specials = [
        0.0,
        -0.0,
        1.0 / 3.0,
        65504.0,
        65520.0,
        1e9,
        -1e9,
        6e-8,
        2.98e-8,
        1e-5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0009766,
        -2.0004883,
        0.1,
        -7.5e-6,
        3.0e4,
        f32::MIN_POSITIVE,
    ];
    let k: Vec<f32> = specials.to_vec();
    let v: Vec<f32> = specials.iter().map(|x| -x * 1.5).collect();
    let mut leases = pool.allocate(RequestId(1), 1).unwrap();
    leases[0].append(0, &k, &v).unwrap();
    let (ks, vs) = leases[0].read(0, 1).unwrap();
    for (stored, want) in [(ks, &k), (vs, &v)] {
        let KvSlice::F16(stored) = stored else {
            panic!("an f16 pool stores f16");
        };
        for (i, (got, &x)) in stored.iter().zip(want.iter()).enumerate() {
            assert_eq!(got.to_bits(), f16::from_f32(x).to_bits(), "value {i} ({x})");
        }
    }
}
