//! Q8_0 pages: what they store, how they are scrubbed, and that a page moved between nodes
//! arrives as the very blocks it left as.

// Under `--cfg loom` the crate hands out loom's `Arc`, usable only inside a loom model.
#![cfg(not(loom))]

use kv::{
    IsolationDomain, KvDtype, KvLayout, KvPool, KvSlice, Owner, PoolConfig, Q8Block, RequestId,
    ScrubPolicy, SequenceKv, Q8_VALUES,
};

const LAYERS: usize = 2;
const DIM: usize = 64;
const P: usize = 4;

fn pool(pages: usize, scrub: ScrubPolicy) -> KvPool {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: LAYERS,
            kv_dim: DIM,
            page_tokens: P,
            dtype: KvDtype::Q8_0,
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

fn blocks(s: KvSlice<'_>) -> Vec<Q8Block> {
    match s {
        KvSlice::Q8_0(b) => b.to_vec(),
        _ => panic!("a q8_0 pool stores blocks"),
    }
}

#[test]
fn a_q8_0_page_stores_each_rows_blocks_as_quantize_makes_them() {
    let pool = pool(1, ScrubPolicy::Zero);
    assert_eq!(pool.layout().bytes_per_token(), LAYERS * 2 * DIM / 32 * 34);
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
        for (kv, stored) in [(0, blocks(k)), (1, blocks(v))] {
            let want: Vec<Q8Block> = (0..P)
                .flat_map(|pos| {
                    row(pos, layer, kv)
                        .chunks(Q8_VALUES)
                        .map(Q8Block::quantize)
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(stored, want, "layer {layer} kv {kv}");
        }
    }
}

#[test]
fn q8_0_pages_are_scrubbed_to_zero_or_poison() {
    for (scrub, expect) in [
        (ScrubPolicy::Zero, (|x: f32| x == 0.0) as fn(f32) -> bool),
        (ScrubPolicy::Poison, f32::is_nan),
    ] {
        let pool = pool(1, scrub);
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
fn an_exported_q8_0_page_imports_as_the_same_blocks() {
    let from = pool(4, ScrubPolicy::Zero);
    let to = pool(4, ScrubPolicy::Zero);
    let n = P + 3;
    let mut a = SequenceKv::new(&from, owner(1));
    a.reserve(n).unwrap();
    for pos in 0..n {
        for layer in 0..LAYERS {
            let mut k = row(pos, layer, 0);
            // An overflowed value makes an infinite scale: the block must still arrive as
            // it left (requantizing its values would store a zero scale instead).
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
    let first = blocks(a.runs(0, n).unwrap()[0].k);
    assert!(first[2 * DIM / Q8_VALUES].d.is_infinite());
    for layer in 0..LAYERS {
        let (ra, rb) = (a.runs(layer, n).unwrap(), b.runs(layer, n).unwrap());
        for (x, y) in ra.iter().zip(&rb) {
            assert_eq!(blocks(x.k), blocks(y.k));
            assert_eq!(blocks(x.v), blocks(y.v));
        }
    }
}

#[test]
#[should_panic(expected = "multiple of 32")]
fn a_row_that_is_not_whole_blocks_is_refused() {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: 1,
            kv_dim: 48,
            page_tokens: P,
            dtype: KvDtype::Q8_0,
        },
        pages: 1,
        scrub: ScrubPolicy::Zero,
    });
}
