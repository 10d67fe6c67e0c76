//! Block-format pages (Q8_0, Q4_0): what they store, how they are scrubbed, and that a page
//! moved between nodes arrives as the very blocks it left as. Each test runs on every
//! format.

// Under `--cfg loom` the crate hands out loom's `Arc`, usable only inside a loom model.
#![cfg(not(loom))]

use kv::{
    IsolationDomain, KvBlock, KvDtype, KvLayout, KvPool, KvSlice, Owner, PoolConfig, Q4Block,
    Q8Block, RequestId, ScrubPolicy, SequenceKv,
};

const LAYERS: usize = 2;
const DIM: usize = 64;
const P: usize = 4;

/// A block format as the pool's slices carry it.
trait Format: KvBlock {
    const DTYPE: KvDtype;
    fn blocks(s: KvSlice<'_>) -> Vec<Self>;
}

impl Format for Q8Block {
    const DTYPE: KvDtype = KvDtype::Q8_0;
    fn blocks(s: KvSlice<'_>) -> Vec<Q8Block> {
        match s {
            KvSlice::Q8_0(b) => b.to_vec(),
            _ => panic!("a q8_0 pool stores its blocks"),
        }
    }
}

impl Format for Q4Block {
    const DTYPE: KvDtype = KvDtype::Q4_0;
    fn blocks(s: KvSlice<'_>) -> Vec<Q4Block> {
        match s {
            KvSlice::Q4_0(b) => b.to_vec(),
            _ => panic!("a q4_0 pool stores its blocks"),
        }
    }
}

fn pool<B: Format>(pages: usize, scrub: ScrubPolicy) -> KvPool {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: LAYERS,
            kv_dim: DIM,
            page_tokens: P,
            dtype: B::DTYPE,
        },
        pages,
        scrub,
    })
}

fn owner(req: u64) -> Owner {
    Owner {
        request: RequestId(req),
        domain: IsolationDomain::tenant("a"),
    }
}

/// A row of varied magnitudes, different per position, layer and K/V.
fn row(pos: usize, layer: usize, kv: usize) -> Vec<f32> {
    (0..DIM)
        .map(|i| {
            let x = (pos * 131 + layer * 17 + kv * 7 + i * 29) % 97;
            (x as f32 - 48.0) * 0.037 * (1 + i % 5) as f32
        })
        .collect()
}

#[test]
fn a_block_page_stores_each_rows_blocks_as_quantize_makes_them() {
    stores_each_rows_blocks::<Q8Block>(34);
    stores_each_rows_blocks::<Q4Block>(18);
}

fn stores_each_rows_blocks<B: Format>(block_bytes: usize) {
    let pool = pool::<B>(1, ScrubPolicy::Zero);
    assert_eq!(
        pool.layout().bytes_per_token(),
        LAYERS * 2 * DIM / 32 * block_bytes
    );
    let mut leases = pool.allocate(RequestId(1), 1).unwrap();
    for pos in 0..P {
        for layer in 0..LAYERS {
            leases[0]
                .append(layer, &row(pos, layer, 0), &row(pos, layer, 1))
                .unwrap();
        }
    }
    for layer in 0..LAYERS {
        let (k, v) = leases[0].read(layer, P).unwrap();
        assert_eq!(k.len(), P * DIM);
        for (kv, stored) in [(0, B::blocks(k)), (1, B::blocks(v))] {
            let want: Vec<B> = (0..P)
                .flat_map(|pos| {
                    row(pos, layer, kv)
                        .chunks(B::VALUES)
                        .map(B::quantize)
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(stored, want, "layer {layer} kv {kv}");
        }
    }
}

#[test]
fn block_pages_are_scrubbed_to_zero_or_poison() {
    scrubbed_to_zero_or_poison::<Q8Block>();
    scrubbed_to_zero_or_poison::<Q4Block>();
}

fn scrubbed_to_zero_or_poison<B: Format>() {
    for (scrub, expect) in [
        (ScrubPolicy::Zero, (|x: f32| x == 0.0) as fn(f32) -> bool),
        (ScrubPolicy::Poison, f32::is_nan),
    ] {
        let pool = pool::<B>(1, scrub);
        let mut leases = pool.allocate(RequestId(1), 1).unwrap();
        for layer in 0..LAYERS {
            leases[0]
                .append(layer, &row(0, layer, 0), &row(0, layer, 1))
                .unwrap();
        }
        drop(leases);
        let free = pool.debug_free_pages_raw().unwrap();
        let [raw] = &free[..] else {
            panic!("the one page is free again")
        };
        assert_eq!(raw.len(), LAYERS * 2 * P * DIM);
        assert!(raw.iter().all(|&x| expect(x)), "{scrub:?}");
    }
}

#[test]
fn an_exported_block_page_imports_as_the_same_blocks() {
    exported_page_imports_as_the_same_blocks::<Q8Block>();
    exported_page_imports_as_the_same_blocks::<Q4Block>();
}

fn exported_page_imports_as_the_same_blocks<B: Format>() {
    let from = pool::<B>(4, ScrubPolicy::Zero);
    let to = pool::<B>(4, ScrubPolicy::Zero);
    let n = P + 3;
    let mut a = SequenceKv::new(&from, owner(1));
    a.reserve(n).unwrap();
    for pos in 0..n {
        for layer in 0..LAYERS {
            let mut k = row(pos, layer, 0);
            // An overflowed value makes an infinite scale: the block must still arrive as
            // it left (requantizing its values would store another block).
            if pos == 2 {
                k[5] = f32::INFINITY;
            }
            a.write(layer, pos, &k, &row(pos, layer, 1)).unwrap();
        }
    }
    a.commit(n).unwrap();
    let pages = a.export_pages(n).unwrap();
    assert_eq!(pages[0].len(), from.layout().payload_bytes(P));
    let mut b = SequenceKv::new(&to, owner(2));
    b.reserve(n).unwrap();
    for (i, page) in pages.iter().enumerate() {
        b.import_page(i, (n - i * P).min(P), page).unwrap();
    }
    b.commit(n).unwrap();
    let first = B::blocks(a.runs(0, n).unwrap()[0].k);
    let mut values = vec![0f32; B::VALUES];
    first[2 * DIM / B::VALUES].dequantize(&mut values);
    assert!(values.iter().any(|v| !v.is_finite()));
    for layer in 0..LAYERS {
        let (ra, rb) = (a.runs(layer, n).unwrap(), b.runs(layer, n).unwrap());
        for (x, y) in ra.iter().zip(&rb) {
            assert_eq!(B::blocks(x.k), B::blocks(y.k));
            assert_eq!(B::blocks(x.v), B::blocks(y.v));
        }
    }
}

#[test]
#[should_panic(expected = "multiple of 32")]
fn a_row_that_is_not_whole_q8_0_blocks_is_refused() {
    not_whole_blocks(KvDtype::Q8_0);
}

#[test]
#[should_panic(expected = "multiple of 32")]
fn a_row_that_is_not_whole_q4_0_blocks_is_refused() {
    not_whole_blocks(KvDtype::Q4_0);
}

fn not_whole_blocks(dtype: KvDtype) {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: 1,
            kv_dim: 48,
            page_tokens: P,
            dtype,
        },
        pages: 1,
        scrub: ScrubPolicy::Zero,
    });
}
