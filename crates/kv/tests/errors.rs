//! One test per refusal: every way a KV access or a prefix-cache operation can be refused,
//! with the pool's accounting checked after each step.

// Under `--cfg loom` the crate hands out loom's `Arc`, usable only inside a loom model.
#![cfg(not(loom))]

use std::sync::Arc;

use kv::{
    IsolationDomain, KvDtype, KvError, KvLayout, KvPool, Owner, PoolConfig, PoolCounts,
    PrefixCache, PrefixError, PublicPrefixes, RequestId, ScrubPolicy, SequenceKv, SharedPage,
    Visibility,
};

const P: usize = 2;
const LAYERS: usize = 2;
const DIM: usize = 3;

fn pool_with(pages: usize, dtype: KvDtype, scrub: ScrubPolicy) -> KvPool {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: LAYERS,
            kv_dim: DIM,
            page_tokens: P,
            dtype,
        },
        pages,
        scrub,
    })
}

fn pool(pages: usize) -> KvPool {
    pool_with(pages, KvDtype::F32, ScrubPolicy::Poison)
}

fn owner(req: u64, domain: &IsolationDomain) -> Owner {
    Owner {
        request: RequestId(req),
        domain: domain.clone(),
    }
}

fn a() -> IsolationDomain {
    IsolationDomain::tenant("a")
}

fn b() -> IsolationDomain {
    IsolationDomain::tenant("b")
}

/// Asserts the accounting identity and the exact split.
#[track_caller]
fn counts(pool: &KvPool, free: usize, leased: usize, cached: usize) {
    let c = pool.counts();
    assert_eq!(c.free + c.leased + c.cached, c.total, "{c:?}");
    assert_eq!(
        c,
        PoolCounts {
            total: c.total,
            free,
            leased,
            cached
        }
    );
}

fn row(tag: f32) -> [f32; DIM] {
    [tag, tag + 0.5, -tag]
}

/// Writes `n` positions on every layer, values tagged by `tag`, and commits them.
fn fill(seq: &mut SequenceKv, from: usize, n: usize, tag: f32) {
    for pos in from..from + n {
        for layer in 0..LAYERS {
            let t = tag + (pos * LAYERS + layer) as f32;
            seq.write(layer, pos, &row(t), &row(-t)).unwrap();
        }
    }
    seq.commit(from + n).unwrap();
}

/// A domain sequence with `pages` full committed pages, shared and returned.
fn shared_prefix(
    pool: &KvPool,
    req: u64,
    domain: &IsolationDomain,
    pages: usize,
) -> (SequenceKv, Vec<Arc<SharedPage>>) {
    let mut seq = SequenceKv::new(pool, owner(req, domain));
    seq.reserve(pages * P).unwrap();
    fill(&mut seq, 0, pages * P, req as f32 * 100.0);
    let shared = seq.share_full_pages_split(0);
    assert_eq!(shared.len(), pages);
    (seq, shared)
}

#[test]
fn unwritten_read() {
    let pool = pool(2);
    let mut leases = pool.allocate(RequestId(1), 1).unwrap();
    let lease = &mut leases[0];
    assert!(matches!(
        lease.read(0, 1),
        Err(KvError::UnwrittenRead { written: 0, .. })
    ));
    lease.append(0, &row(1.0), &row(2.0)).unwrap();
    lease.read(0, 1).unwrap();
    assert!(matches!(
        lease.read(0, 2),
        Err(KvError::UnwrittenRead { written: 1, .. })
    ));
    // Layer 1 was never written under this lease.
    assert!(matches!(
        lease.read(1, 1),
        Err(KvError::UnwrittenRead { layer: 1, .. })
    ));
    drop(leases);

    let mut seq = SequenceKv::new(&pool, owner(2, &a()));
    seq.reserve(2 * P).unwrap();
    counts(&pool, 0, 2, 0);
    assert!(matches!(
        seq.runs(0, 1),
        Err(KvError::UnwrittenRead { position: 0, .. })
    ));
    fill(&mut seq, 0, 3, 1.0);
    assert_eq!(seq.runs(0, 3).unwrap().len(), 2);
    assert!(matches!(
        seq.runs(0, 4),
        Err(KvError::UnwrittenRead {
            position: 3,
            written: 3,
            ..
        })
    ));
    // Past the reserved capacity.
    assert!(matches!(
        seq.runs(0, 2 * P + 1),
        Err(KvError::UnwrittenRead { .. })
    ));
    // A commit cannot declare unwritten positions complete.
    assert!(matches!(seq.commit(4), Err(KvError::UnwrittenRead { .. })));
    assert_eq!(seq.len(), 3);
    // Only one layer written at position 3: still unreadable on the other.
    seq.write(0, 3, &row(9.0), &row(9.0)).unwrap();
    seq.runs(0, 4).unwrap();
    assert!(matches!(
        seq.runs(1, 4),
        Err(KvError::UnwrittenRead { layer: 1, .. })
    ));
    assert!(seq.commit(4).is_err());
    drop(seq);
    counts(&pool, 2, 0, 0);
}

#[test]
fn shared_page_read_beyond_page() {
    let pool = pool(1);
    let (_seq, shared) = shared_prefix(&pool, 1, &a(), 1);
    let reader = owner(2, &a());
    shared[0].read(&reader, 0, P).unwrap();
    assert!(matches!(
        shared[0].read(&reader, 0, P + 1),
        Err(KvError::UnwrittenRead { .. })
    ));
    assert!(matches!(
        shared[0].read(&reader, LAYERS, 1),
        Err(KvError::NoSuchLayer { .. })
    ));
}

#[test]
fn append_past_capacity_page_and_sequence() {
    let pool = pool(2);
    let mut leases = pool.allocate(RequestId(1), 1).unwrap();
    for _ in 0..P {
        leases[0].append(0, &row(1.0), &row(1.0)).unwrap();
    }
    assert!(matches!(
        leases[0].append(0, &row(1.0), &row(1.0)),
        Err(KvError::AppendPastCapacity {
            position: P,
            capacity: P,
            ..
        })
    ));
    drop(leases);

    let mut seq = SequenceKv::new(&pool, owner(2, &a()));
    seq.reserve(P + 1).unwrap();
    assert_eq!(seq.capacity(), 2 * P);
    fill(&mut seq, 0, 2 * P, 1.0);
    assert!(matches!(
        seq.write(0, 2 * P, &row(1.0), &row(1.0)),
        Err(KvError::AppendPastCapacity {
            position: 4,
            capacity: 4,
            ..
        })
    ));
    counts(&pool, 0, 2, 0);
}

#[test]
fn malformed_writes() {
    let pool = pool(1);
    let mut seq = SequenceKv::new(&pool, owner(1, &a()));
    seq.reserve(P).unwrap();
    assert!(matches!(
        seq.write(LAYERS, 0, &row(1.0), &row(1.0)),
        Err(KvError::NoSuchLayer { .. })
    ));
    assert!(matches!(
        seq.write(0, 0, &[1.0], &row(1.0)),
        Err(KvError::RowShape { got: 1, want: DIM })
    ));
    // Nothing was written by the refused calls.
    assert!(seq.runs(0, 1).is_err());
}

#[test]
fn out_of_order_write() {
    let pool = pool(2);
    let mut seq = SequenceKv::new(&pool, owner(1, &a()));
    seq.reserve(2 * P).unwrap();
    assert!(matches!(
        seq.write(0, 1, &row(1.0), &row(1.0)),
        Err(KvError::OutOfOrderWrite {
            position: 1,
            expected: 0,
            ..
        })
    ));
    seq.write(0, 0, &row(1.0), &row(1.0)).unwrap();
    // Rewriting a written slot is out of order too: writes are append-only.
    assert!(matches!(
        seq.write(0, 0, &row(2.0), &row(2.0)),
        Err(KvError::OutOfOrderWrite { expected: 1, .. })
    ));
    // Each layer has its own extent.
    assert!(matches!(
        seq.write(1, 1, &row(1.0), &row(1.0)),
        Err(KvError::OutOfOrderWrite {
            layer: 1,
            expected: 0,
            ..
        })
    ));
    counts(&pool, 0, 2, 0);
}

#[test]
fn write_to_shared_page() {
    let pool = pool(3);
    let mut seq = SequenceKv::new(&pool, owner(1, &a()));
    seq.reserve(2 * P).unwrap();
    fill(&mut seq, 0, P, 1.0);
    let shared = seq.share_full_pages_split(0);
    assert_eq!(shared.len(), 1);
    counts(&pool, 1, 1, 1);
    assert!(matches!(
        seq.write(0, 0, &row(1.0), &row(1.0)),
        Err(KvError::WriteToShared { position: 0, .. })
    ));
    // A sequence started on a cached prefix cannot write into it either.
    let mut other = SequenceKv::with_prefix(&pool, owner(2, &a()), shared).unwrap();
    assert_eq!(other.len(), P);
    assert!(matches!(
        other.write(0, 1, &row(1.0), &row(1.0)),
        Err(KvError::WriteToShared { position: 1, .. })
    ));
    // The page after the prefix is this sequence's own.
    other.reserve(2 * P).unwrap();
    counts(&pool, 0, 2, 1);
    other.write(0, P, &row(1.0), &row(1.0)).unwrap();
}

#[test]
fn not_full_page_cannot_be_frozen() {
    let pool = pool(1);
    let mut leases = pool.allocate(RequestId(1), 1).unwrap();
    let mut lease = leases.pop().unwrap();
    for layer in 0..LAYERS {
        lease.append(layer, &row(1.0), &row(1.0)).unwrap();
    }
    let (lease, err) = lease.freeze(Visibility::Public).unwrap_err();
    assert!(matches!(err, KvError::NotFull { written: 1, .. }));
    counts(&pool, 0, 1, 0);
    drop(lease);
    counts(&pool, 1, 0, 0);
}

#[test]
fn foreign_domain_shared_page() {
    let pool = pool(2);
    let (_seq, shared) = shared_prefix(&pool, 1, &a(), 1);
    counts(&pool, 1, 0, 1);
    assert!(matches!(
        shared[0].read(&owner(2, &b()), 0, 1),
        Err(KvError::ForeignPage {
            request: RequestId(2)
        })
    ));
    assert!(matches!(
        shared[0].read(&owner(3, &a().narrowed("s")), 0, 1),
        Err(KvError::ForeignPage { .. })
    ));
    shared[0].read(&owner(4, &a()), 0, 1).unwrap();
    assert!(matches!(
        SequenceKv::with_prefix(&pool, owner(2, &b()), shared.clone()),
        Err(KvError::ForeignPage { .. })
    ));
    assert!(matches!(
        SequenceKv::with_prefix(&pool, owner(3, &a().narrowed("s")), shared.clone()),
        Err(KvError::ForeignPage { .. })
    ));
    // The refused sequences took nothing with them.
    counts(&pool, 1, 0, 1);
}

#[test]
fn foreign_pool_shared_page() {
    let pool1 = pool(1);
    let pool2 = pool(1);
    let (_seq, shared) = shared_prefix(&pool1, 1, &a(), 1);
    assert!(matches!(
        SequenceKv::with_prefix(&pool2, owner(2, &a()), shared),
        Err(KvError::ForeignPool { .. })
    ));
}

#[test]
fn sharing_under_another_domain_is_refused() {
    let pool = pool(2);
    let mut seq = SequenceKv::new(&pool, owner(1, &a()));
    seq.reserve(P).unwrap();
    fill(&mut seq, 0, P, 1.0);
    assert!(seq.share_full_pages(&Visibility::Domain(b())).is_empty());
    // Nothing was frozen.
    counts(&pool, 1, 1, 0);
    assert_eq!(seq.owned_pages(), 1);
    assert_eq!(seq.share_full_pages(&Visibility::Domain(a())).len(), 1);
    counts(&pool, 1, 0, 1);
}

#[test]
fn cross_tenant_prefix_lookup_misses() {
    let pool = pool(4);
    let tokens = [7, 8, 9, 10, 11];
    let mut cache = PrefixCache::new(P);
    let (_seq, shared) = shared_prefix(&pool, 1, &a(), 2);
    assert_eq!(
        cache.insert(&Visibility::Domain(a()), &tokens, &shared),
        Ok(2)
    );
    assert_eq!(cache.cached_pages(), 2);
    // Tenant B with exactly tenant A's tokens: nothing.
    let m = cache.lookup(&b(), &tokens, usize::MAX);
    assert!(m.is_empty());
    assert_eq!(m.tokens(), 0);
    // Tenant A gets both pages, the very same ones.
    let m = cache.lookup(&a(), &tokens, usize::MAX);
    assert_eq!((m.len(), m.tokens(), m.is_public()), (2, 2 * P, false));
    assert!(m
        .pages()
        .iter()
        .zip(&shared)
        .all(|(x, y)| Arc::ptr_eq(x, y)));
    // Capped by max_pages, and by whole pages of the tokens given.
    assert_eq!(cache.lookup(&a(), &tokens, 1).len(), 1);
    assert_eq!(cache.lookup(&a(), &tokens[..3], usize::MAX).len(), 1);
    assert_eq!(cache.lookup(&a(), &[7, 8, 0, 10], usize::MAX).len(), 1);
    assert!(cache.lookup(&a(), &[0, 8, 9, 10], usize::MAX).is_empty());
    // B's own pages for the same tokens live in B's tree and never replace A's.
    let (_seqb, sharedb) = shared_prefix(&pool, 2, &b(), 2);
    assert_eq!(
        cache.insert(&Visibility::Domain(b()), &tokens, &sharedb),
        Ok(2)
    );
    let ma = cache.lookup(&a(), &tokens, usize::MAX);
    let mb = cache.lookup(&b(), &tokens, usize::MAX);
    assert!(ma
        .pages()
        .iter()
        .zip(&shared)
        .all(|(x, y)| Arc::ptr_eq(x, y)));
    assert!(mb
        .pages()
        .iter()
        .zip(&sharedb)
        .all(|(x, y)| Arc::ptr_eq(x, y)));
    assert_eq!(cache.domain_stats(&a()).nodes, 2);
    assert_eq!(cache.domain_stats(&b()).nodes, 2);
    cache.debug_check().unwrap();
}

#[test]
fn salted_domain_misses() {
    let pool = pool(4);
    let tokens = [1, 2, 3, 4];
    let mut cache = PrefixCache::new(P);
    let (_seq, shared) = shared_prefix(&pool, 1, &a(), 2);
    cache
        .insert(&Visibility::Domain(a()), &tokens, &shared)
        .unwrap();
    let salted = a().narrowed("s1");
    assert!(cache.lookup(&salted, &tokens, usize::MAX).is_empty());
    let (_seq2, shared2) = shared_prefix(&pool, 2, &salted, 2);
    cache
        .insert(&Visibility::Domain(salted.clone()), &tokens, &shared2)
        .unwrap();
    // The salt narrows both ways, and another salt is another domain.
    let m = cache.lookup(&a(), &tokens, usize::MAX);
    assert!(m
        .pages()
        .iter()
        .zip(&shared)
        .all(|(x, y)| Arc::ptr_eq(x, y)));
    let m = cache.lookup(&salted, &tokens, usize::MAX);
    assert!(m
        .pages()
        .iter()
        .zip(&shared2)
        .all(|(x, y)| Arc::ptr_eq(x, y)));
    assert!(cache
        .lookup(&a().narrowed("s2"), &tokens, usize::MAX)
        .is_empty());
    // Same salt under another tenant is not the salted domain either.
    assert!(cache
        .lookup(&b().narrowed("s1"), &tokens, usize::MAX)
        .is_empty());
}

#[test]
fn public_prefix_hit_across_tenants() {
    let pool = pool(6);
    // Two public pages, then A's private continuation.
    let system = vec![1, 2, 3, 4, 5];
    let public = PublicPrefixes::new([system.clone()]);
    let tokens_a = [1, 2, 3, 4, 90, 91, 92];
    assert_eq!(public.public_pages(&tokens_a, P), 2);
    assert_eq!(public.public_pages(&[1, 2, 3], P), 1);
    assert_eq!(public.public_pages(&[1, 9, 3, 4], P), 0);
    let mut cache = PrefixCache::with_public_prefixes(P, public);

    let mut seq = SequenceKv::new(&pool, owner(1, &a()));
    seq.reserve(7).unwrap();
    fill(&mut seq, 0, 7, 1.0);
    let n_public = cache.public_pages(&tokens_a[..seq.len()]);
    let pages = seq.share_full_pages_split(n_public);
    assert_eq!(pages.len(), 3);
    assert_eq!(*pages[0].visibility(), Visibility::Public);
    assert_eq!(*pages[1].visibility(), Visibility::Public);
    assert_eq!(*pages[2].visibility(), Visibility::Domain(a()));
    counts(&pool, 2, 1, 3);
    assert_eq!(
        cache.insert(&Visibility::Domain(a()), &tokens_a, &pages),
        Ok(3)
    );
    assert_eq!(cache.public_stats().nodes, 2);
    assert_eq!(cache.domain_stats(&a()).nodes, 3);
    assert_eq!(cache.cached_pages(), 3);

    // B shares the system prompt: public hit, not A's continuation.
    let m = cache.lookup(&b(), &tokens_a, usize::MAX);
    assert_eq!((m.len(), m.is_public()), (2, true));
    assert!(m.pages().iter().zip(&pages).all(|(x, y)| Arc::ptr_eq(x, y)));
    let seq_b = SequenceKv::with_prefix(&pool, owner(2, &b()), m.into_pages()).unwrap();
    assert_eq!(seq_b.len(), 2 * P);
    for layer in 0..LAYERS {
        seq_b.runs(layer, 2 * P).unwrap();
    }
    // A salted domain of another tenant also gets only the public part.
    assert_eq!(
        cache
            .lookup(&b().narrowed("x"), &tokens_a, usize::MAX)
            .len(),
        2
    );
    // A gets its own longer chain.
    let m = cache.lookup(&a(), &tokens_a, usize::MAX);
    assert_eq!((m.len(), m.is_public()), (3, false));
    cache.debug_check().unwrap();
}

#[test]
fn prefix_insert_refusals() {
    let pool = pool(8);
    let public = PublicPrefixes::new([vec![1, 2]]);
    let mut cache = PrefixCache::with_public_prefixes(P, public);
    let (_seq, pages_a) = shared_prefix(&pool, 1, &a(), 2);
    let tokens = [1, 2, 3, 4];

    // A's pages offered for B's tree.
    assert_eq!(
        cache.insert(&Visibility::Domain(b()), &tokens, &pages_a),
        Err(PrefixError::WrongVisibility { page: 0 })
    );
    // Domain pages offered for the public tree.
    assert_eq!(
        cache.insert(&Visibility::Public, &tokens, &pages_a),
        Err(PrefixError::WrongVisibility { page: 0 })
    );
    // Too few tokens for the pages.
    assert!(matches!(
        cache.insert(&Visibility::Domain(a()), &tokens[..3], &pages_a),
        Err(PrefixError::TokensShort {
            needed: 4,
            got: 3,
            ..
        })
    ));
    // Pages of a pool with another page size.
    let other = KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: 1,
            kv_dim: 1,
            page_tokens: 1,
            dtype: KvDtype::F32,
        },
        pages: 1,
        scrub: ScrubPolicy::Zero,
    });
    let mut s = SequenceKv::new(&other, owner(5, &a()));
    s.reserve(1).unwrap();
    s.write(0, 0, &[1.0], &[1.0]).unwrap();
    s.commit(1).unwrap();
    let small = s.share_full_pages_split(0);
    assert!(matches!(
        cache.insert(&Visibility::Domain(a()), &tokens, &small),
        Err(PrefixError::PageSize {
            got: 1,
            want: P,
            ..
        })
    ));

    // Public-tagged pages outside any configured public prefix: a caller claiming tenant
    // data is public is not believed.
    let mut seq = SequenceKv::new(&pool, owner(2, &a()));
    seq.reserve(4).unwrap();
    fill(&mut seq, 0, 4, 1.0);
    let wrongly_public = seq.share_full_pages_split(2);
    assert!(wrongly_public
        .iter()
        .all(|p| *p.visibility() == Visibility::Public));
    assert_eq!(
        cache.insert(&Visibility::Domain(a()), &tokens, &wrongly_public),
        Err(PrefixError::NotPublic {
            page: 1,
            public_pages: 1
        })
    );
    assert_eq!(
        cache.insert(&Visibility::Public, &[9, 9, 9, 9], &wrongly_public),
        Err(PrefixError::NotPublic {
            page: 0,
            public_pages: 0
        })
    );
    // A cache configured with no public prefix publishes nothing.
    let mut private_only = PrefixCache::new(P);
    assert!(matches!(
        private_only.insert(&Visibility::Public, &tokens, &wrongly_public[..1]),
        Err(PrefixError::NotPublic { page: 0, .. })
    ));
    // Nothing was inserted by any refused call.
    assert_eq!(cache.cached_pages(), 0);
    assert_eq!(private_only.cached_pages(), 0);
    assert!(cache.lookup(&a(), &tokens, usize::MAX).is_empty());
    assert!(cache.lookup(&b(), &tokens, usize::MAX).is_empty());
    cache.debug_check().unwrap();
}

#[test]
fn existing_nodes_win() {
    let pool = pool(4);
    let tokens = [1, 2, 3, 4];
    let mut cache = PrefixCache::new(P);
    let (_s1, first) = shared_prefix(&pool, 1, &a(), 1);
    let (_s2, second) = shared_prefix(&pool, 2, &a(), 2);
    assert_eq!(
        cache.insert(&Visibility::Domain(a()), &tokens, &first),
        Ok(1)
    );
    // Only the second page is new.
    assert_eq!(
        cache.insert(&Visibility::Domain(a()), &tokens, &second),
        Ok(1)
    );
    let m = cache.lookup(&a(), &tokens, usize::MAX);
    assert!(Arc::ptr_eq(&m.pages()[0], &first[0]));
    assert!(Arc::ptr_eq(&m.pages()[1], &second[1]));
    cache.debug_check().unwrap();
}

#[test]
fn eviction_frees_only_unused_pages_lru_first() {
    let pool = pool(4);
    let mut cache = PrefixCache::new(P);
    let (s1, p1) = shared_prefix(&pool, 1, &a(), 2);
    let (s2, p2) = shared_prefix(&pool, 2, &b(), 2);
    cache
        .insert(&Visibility::Domain(a()), &[1, 2, 3, 4], &p1)
        .unwrap();
    cache
        .insert(&Visibility::Domain(b()), &[1, 2, 3, 4], &p2)
        .unwrap();
    // Pages are in use while a sequence (or a lookup result) holds them; a bare clone of
    // the `Arc` is not a use.
    drop((p1, p2));
    counts(&pool, 0, 0, 4);
    assert_eq!(cache.evictable_pages(), 0);
    // Everything is used by running requests: nothing can go.
    assert_eq!(cache.evict(4), 0);
    drop(s1);
    // A's pages are now cache-only; B's are still used by s2.
    assert_eq!(cache.evictable_pages(), 2);
    counts(&pool, 0, 0, 4);
    assert_eq!(cache.evict(1), 1);
    counts(&pool, 1, 0, 3);
    assert_eq!(cache.evict(4), 1);
    counts(&pool, 2, 0, 2);
    assert_eq!(cache.evictable_pages(), 0);
    assert_eq!(cache.domain_stats(&a()).nodes, 0);
    assert_eq!(cache.domains(), 1);
    cache.debug_check().unwrap();
    drop(s2);
    assert_eq!(cache.evictable_pages(), 2);
    // Touch B's chain, then add a fresher one for A: LRU takes B's leaf first.
    assert_eq!(cache.lookup(&b(), &[1, 2, 3, 4], usize::MAX).len(), 2);
    let (s3, p3) = shared_prefix(&pool, 3, &a(), 1);
    cache
        .insert(&Visibility::Domain(a()), &[5, 6], &p3)
        .unwrap();
    drop((s3, p3));
    assert_eq!(cache.evict(1), 1);
    assert_eq!(cache.lookup(&b(), &[1, 2, 3, 4], usize::MAX).len(), 1);
    assert_eq!(cache.lookup(&a(), &[5, 6], usize::MAX).len(), 1);
    // A lookup result in hand pins its pages.
    let held = cache.lookup(&b(), &[1, 2], usize::MAX);
    assert_eq!(cache.evict(1), 1);
    assert_eq!(cache.evict(1), 0);
    drop(held);
    assert_eq!(cache.evict(9), 1);
    counts(&pool, 4, 0, 0);
    assert_eq!(cache.cached_pages(), 0);
    assert_eq!(cache.evictable_pages(), 0);
    assert_eq!(cache.domains(), 0);
    cache.debug_check().unwrap();
}

/// A long chain nothing uses goes leaf first, one page per eviction, and a page that a
/// later request computed again (its own copy, under the cached parent) keeps that parent
/// until it is itself unused.
#[test]
fn eviction_walks_up_a_chain_and_waits_for_used_descendants() {
    let pool = pool(8);
    let mut cache = PrefixCache::new(P);
    let tokens: Vec<u32> = (1..=8).collect();
    let (s1, p1) = shared_prefix(&pool, 1, &a(), 3);
    cache
        .insert(&Visibility::Domain(a()), &tokens, &p1)
        .unwrap();
    // Request 2 computed the same first page itself, then a fourth one: only the fourth
    // is new, a child of request 1's third page.
    let (s2, p2) = shared_prefix(&pool, 2, &a(), 4);
    assert_eq!(cache.insert(&Visibility::Domain(a()), &tokens, &p2), Ok(1));
    drop((p1, p2, s1));
    cache.debug_check().unwrap();
    // Request 1's three pages are unused but under request 2's page: nothing can go yet.
    assert_eq!(cache.evictable_pages(), 3);
    assert_eq!(cache.evict(8), 0);
    drop(s2);
    cache.debug_check().unwrap();
    assert_eq!(cache.evictable_pages(), 4);
    for left in (0..4).rev() {
        assert_eq!(cache.evict(1), 1);
        assert_eq!(cache.domain_stats(&a()).nodes, left);
        cache.debug_check().unwrap();
    }
    counts(&pool, 8, 0, 0);
}

#[test]
fn public_page_shared_by_trees_is_freed_once() {
    let pool = pool(2);
    let mut cache = PrefixCache::with_public_prefixes(P, PublicPrefixes::new([vec![1, 2]]));
    let mut seq = SequenceKv::new(&pool, owner(1, &a()));
    seq.reserve(2 * P).unwrap();
    fill(&mut seq, 0, 2 * P, 1.0);
    let pages = seq.share_full_pages_split(1);
    cache
        .insert(&Visibility::Domain(a()), &[1, 2, 3, 4], &pages)
        .unwrap();
    assert_eq!(cache.cached_pages(), 2);
    drop((seq, pages));
    counts(&pool, 0, 0, 2);
    // The public page sits in the public tree and in A's tree: evicting it takes both.
    assert_eq!(cache.evict(2), 2);
    counts(&pool, 2, 0, 0);
    cache.debug_check().unwrap();
}

#[test]
fn pool_exhaustion_is_all_or_nothing() {
    let pool = pool(3);
    let held = pool.allocate(RequestId(1), 2).unwrap();
    counts(&pool, 1, 2, 0);
    assert_eq!(
        pool.allocate(RequestId(2), 2).unwrap_err(),
        KvError::PoolExhausted { needed: 2, free: 1 }
    );
    counts(&pool, 1, 2, 0);
    let mut seq = SequenceKv::new(&pool, owner(3, &a()));
    assert!(matches!(
        seq.reserve(2 * P),
        Err(KvError::PoolExhausted { needed: 2, free: 1 })
    ));
    assert_eq!(seq.pages(), 0);
    counts(&pool, 1, 2, 0);
    seq.reserve(P).unwrap();
    counts(&pool, 0, 3, 0);
    // Growing by one more page fails and keeps what the sequence had.
    assert!(matches!(
        seq.reserve(2 * P),
        Err(KvError::PoolExhausted { needed: 1, free: 0 })
    ));
    assert_eq!(seq.pages(), 1);
    drop(held);
    counts(&pool, 2, 1, 0);
    seq.reserve(3 * P).unwrap();
    counts(&pool, 0, 3, 0);
}

fn scrub_case(dtype: KvDtype, scrub: ScrubPolicy, expect: fn(f32) -> bool) {
    let pool = pool_with(1, dtype, scrub);
    let mut leases = pool.allocate(RequestId(1), 1).unwrap();
    // Leased memory is not reachable through the pool.
    assert!(pool.debug_free_pages_raw().unwrap().is_empty());
    for layer in 0..LAYERS {
        for _ in 0..P {
            leases[0].append(layer, &row(3.0), &row(4.0)).unwrap();
        }
    }
    drop(leases);
    counts(&pool, 1, 0, 0);
    let free = pool.debug_free_pages_raw().unwrap();
    let [raw] = &free[..] else {
        panic!("the one page is free again")
    };
    assert_eq!(raw.len(), LAYERS * 2 * P * DIM);
    assert!(
        raw.iter().all(|&x| expect(x)),
        "{dtype:?} {scrub:?}: {raw:?}"
    );

    // Same through a frozen shared page.
    let mut seq = SequenceKv::new(&pool, owner(2, &a()));
    seq.reserve(P).unwrap();
    fill(&mut seq, 0, P, 7.0);
    let shared = seq.share_full_pages_split(0);
    assert!(pool.debug_free_pages_raw().unwrap().is_empty());
    drop((seq, shared));
    counts(&pool, 1, 0, 0);
    let free = pool.debug_free_pages_raw().unwrap();
    let [raw] = &free[..] else {
        panic!("the one page is free again")
    };
    assert!(
        raw.iter().all(|&x| expect(x)),
        "{dtype:?} {scrub:?}: {raw:?}"
    );
}

#[test]
fn scrub_poison_and_zero() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        scrub_case(dtype, ScrubPolicy::Poison, f32::is_nan);
        scrub_case(dtype, ScrubPolicy::Zero, |x| x == 0.0);
    }
}

#[test]
fn raw_access_refused_without_scrub() {
    let pool = pool_with(1, KvDtype::F32, ScrubPolicy::None);
    let leases = pool.allocate(RequestId(1), 1).unwrap();
    drop(leases);
    assert!(pool.debug_free_pages_raw().is_none());
}
