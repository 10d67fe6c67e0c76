//! Moving a sequence's K/V between pools (prefill node to decode node): what leaves is read
//! through the checked path, what arrives is written through the checked path, and the
//! written extents prove that every slot of every layer arrived exactly once.

use kv::{
    IsolationDomain, KvDtype, KvError, KvLayout, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy,
    SequenceKv,
};

fn pool(dtype: KvDtype) -> KvPool {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: 3,
            kv_dim: 4,
            page_tokens: 4,
            dtype,
        },
        pages: 16,
        scrub: ScrubPolicy::Poison,
    })
}

fn owner(n: u64) -> Owner {
    Owner {
        request: RequestId(n),
        domain: IsolationDomain::tenant("t"),
    }
}

/// A sequence of `len` positions whose values encode (layer, position, k/v, lane).
fn filled(pool: &KvPool, len: usize) -> SequenceKv {
    let mut s = SequenceKv::new(pool, owner(1));
    s.reserve(len).unwrap();
    for pos in 0..len {
        for layer in 0..3 {
            let k: Vec<f32> = (0..4)
                .map(|i| (layer * 1000 + pos * 10 + i) as f32)
                .collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            s.write(layer, pos, &k, &v).unwrap();
        }
    }
    s.commit(len).unwrap();
    s
}

fn bits(s: &SequenceKv, len: usize) -> Vec<Vec<u32>> {
    (0..3)
        .map(|layer| {
            let mut out = Vec::new();
            for run in s.runs(layer, len).unwrap() {
                for slice in [run.k, run.v] {
                    let mut f = vec![0f32; slice.len()];
                    slice.to_f32(&mut f);
                    out.extend(f.iter().map(|x| x.to_bits()));
                }
            }
            out
        })
        .collect()
}

#[test]
fn export_then_import_reproduces_every_bit() {
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let (src_pool, dst_pool) = (pool(dtype), pool(dtype));
        let src = filled(&src_pool, 10);
        let pages = src.export_pages(10).unwrap();
        assert_eq!(pages.len(), 3);
        assert_eq!(pages[2].len(), src.layout().payload_bytes(2));
        let mut dst = SequenceKv::new(&dst_pool, owner(2));
        dst.reserve(10).unwrap();
        for (i, page) in pages.iter().enumerate() {
            dst.import_page(i, (10 - i * 4).min(4), page).unwrap();
        }
        dst.commit(10).unwrap();
        assert_eq!(bits(&src, 10), bits(&dst, 10));
    }
}

#[test]
fn export_refuses_positions_never_written() {
    let p = pool(KvDtype::F16);
    let s = filled(&p, 6);
    assert!(matches!(
        s.export_pages(7),
        Err(KvError::UnwrittenRead { .. })
    ));
}

#[test]
fn a_page_imported_twice_is_refused() {
    let (a, b) = (pool(KvDtype::F16), pool(KvDtype::F16));
    let pages = filled(&a, 8).export_pages(8).unwrap();
    let mut dst = SequenceKv::new(&b, owner(2));
    dst.reserve(8).unwrap();
    dst.import_page(0, 4, &pages[0]).unwrap();
    assert!(matches!(
        dst.import_page(0, 4, &pages[0]),
        Err(KvError::OutOfOrderWrite { .. })
    ));
}

#[test]
fn a_missing_page_fails_coverage() {
    let (a, b) = (pool(KvDtype::F16), pool(KvDtype::F16));
    let pages = filled(&a, 8).export_pages(8).unwrap();
    let mut dst = SequenceKv::new(&b, owner(2));
    dst.reserve(8).unwrap();
    dst.import_page(1, 4, &pages[1]).unwrap();
    assert!(matches!(dst.commit(8), Err(KvError::UnwrittenRead { .. })));
}

#[test]
fn wrong_shapes_and_unreserved_pages_are_refused() {
    let (a, b) = (pool(KvDtype::F16), pool(KvDtype::F16));
    let pages = filled(&a, 8).export_pages(8).unwrap();
    let mut dst = SequenceKv::new(&b, owner(2));
    dst.reserve(4).unwrap();
    // Claims 3 slots with a 4-slot payload.
    assert!(matches!(
        dst.import_page(0, 3, &pages[0]),
        Err(KvError::PayloadShape { .. })
    ));
    // Truncated payload.
    assert!(matches!(
        dst.import_page(0, 4, &pages[0][..pages[0].len() - 1]),
        Err(KvError::PayloadShape { .. })
    ));
    // Beyond the reservation.
    assert!(matches!(
        dst.import_page(1, 4, &pages[1]),
        Err(KvError::AppendPastCapacity { .. })
    ));
    // A failed import wrote nothing readable.
    assert!(dst.runs(0, 1).is_err());
    assert_eq!(b.counts().leased, 1);
    drop(dst);
    assert_eq!(b.counts().free, 16);
}
