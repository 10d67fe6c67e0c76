//! Fair eviction between tenants: pages go first from the tenant holding the most cached
//! pages, least recently used within it; another tenant's entries go only when the larger
//! holder has nothing idle left. Under plain global LRU the flood, salt and asking tests fail.

// Under `--cfg loom` the crate hands out loom's `Arc`, usable only inside a loom model.
#![cfg(not(loom))]

use kv::{
    IsolationDomain, KvDtype, KvLayout, KvPool, Owner, PoolConfig, PrefixCache, PublicPrefixes,
    RequestId, ScrubPolicy, SequenceKv, Visibility,
};

const P: usize = 2;
const LAYERS: usize = 1;
const DIM: usize = 2;

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: LAYERS,
            kv_dim: DIM,
            page_tokens: P,
            dtype: KvDtype::F32,
        },
        pages,
        scrub: ScrubPolicy::Poison,
    })
}

/// Runs one request of `domain` over `tokens` (whole pages) and caches its prompt pages,
/// as the engine does when a prompt is done; the request then ends.
fn cache_prompt(
    pool: &KvPool,
    cache: &mut PrefixCache,
    req: u64,
    domain: &IsolationDomain,
    tokens: &[u32],
) {
    let owner = Owner {
        request: RequestId(req),
        domain: domain.clone(),
    };
    let mut seq = SequenceKv::new(pool, owner);
    seq.reserve(tokens.len()).unwrap();
    for pos in 0..tokens.len() {
        for layer in 0..LAYERS {
            let v = [req as f32, pos as f32];
            seq.write(layer, pos, &v, &v).unwrap();
        }
    }
    seq.commit(tokens.len()).unwrap();
    let public = cache.public_pages(tokens);
    let pages = seq.share_full_pages_split(public);
    cache
        .insert(&Visibility::Domain(domain.clone()), tokens, &pages)
        .unwrap();
    cache.debug_check().unwrap();
}

fn hit(cache: &mut PrefixCache, domain: &IsolationDomain, tokens: &[u32]) -> usize {
    cache.lookup(domain, tokens, usize::MAX).len()
}

/// A quiet tenant's prefix, cached first (least recently used), survives a flood of
/// another tenant's prompts: the flooder's own entries are evicted instead.
#[test]
fn a_flood_evicts_the_flooders_own_entries_first() {
    let pool = pool(12);
    let mut cache = PrefixCache::new(P);
    let quiet = IsolationDomain::tenant("quiet");
    let flood = IsolationDomain::tenant("flood");
    let quiet_prompt = [1, 2, 3, 4];
    cache_prompt(&pool, &mut cache, 1, &quiet, &quiet_prompt);
    for i in 0..20u32 {
        let prompt = [100 + i, 7, 8, 9];
        // Room for the next prompt comes from eviction, as in the engine.
        let free = pool.counts().free;
        if free < 2 {
            assert_eq!(cache.evict_for(2 - free, &flood), 2 - free);
        }
        cache_prompt(&pool, &mut cache, 2 + u64::from(i), &flood, &prompt);
        assert_eq!(cache.tenant_pages("quiet"), 2, "after flood prompt {i}");
    }
    assert_eq!(hit(&mut cache, &quiet, &quiet_prompt), 2);
    assert_eq!(cache.tenant_pages("flood"), 10);
    // Pages go from flood's oldest entries first: its newest prompt is still cached.
    assert_eq!(hit(&mut cache, &flood, &[119, 7, 8, 9]), 2);
    assert_eq!(hit(&mut cache, &flood, &[100, 7, 8, 9]), 0);
    cache.debug_check().unwrap();
}

/// The tenant the room is for counts the pages it is about to hold: a flooder holding no
/// more in the cache than a quiet tenant still evicts its own idle entries first (global
/// LRU would take the quiet tenant's, cached first).
#[test]
fn the_tenant_asking_for_room_counts_what_it_asks_for() {
    let pool = pool(8);
    let mut cache = PrefixCache::new(P);
    let quiet = IsolationDomain::tenant("quiet");
    let flood = IsolationDomain::tenant("flood");
    cache_prompt(&pool, &mut cache, 1, &quiet, &[1, 2, 3, 4]);
    cache_prompt(&pool, &mut cache, 2, &flood, &[9, 8, 7, 6]);
    assert_eq!(cache.evict_for(1, &flood), 1);
    assert_eq!(cache.tenant_pages("quiet"), 2);
    assert_eq!(cache.tenant_pages("flood"), 1);
    // Without a requester, the largest holder gives the page.
    assert_eq!(cache.evict(1), 1);
    assert_eq!(cache.tenant_pages("quiet"), 1);
    assert_eq!(cache.tenant_pages("flood"), 1);
    cache.debug_check().unwrap();
}

/// Salted domains of one tenant count together: a tenant cannot spread its entries over
/// many salts to look small.
#[test]
fn salts_count_against_their_tenant() {
    let pool = pool(8);
    let mut cache = PrefixCache::new(P);
    let quiet = IsolationDomain::tenant("quiet");
    let flood = IsolationDomain::tenant("flood");
    cache_prompt(&pool, &mut cache, 1, &quiet, &[1, 2, 3, 4]);
    cache_prompt(&pool, &mut cache, 2, &quiet, &[5, 6, 7, 8]);
    for i in 0..2u32 {
        let salted = flood.narrowed(format!("salt-{i}"));
        cache_prompt(
            &pool,
            &mut cache,
            3 + u64::from(i),
            &salted,
            &[50 + i, 1, 2, 3],
        );
    }
    assert_eq!(cache.tenant_pages("flood"), 4);
    assert_eq!(cache.tenant_pages("quiet"), 4);
    // Equal shares: the least recently used goes, which is quiet's first prompt's leaf.
    assert_eq!(cache.evict(1), 1);
    assert_eq!(cache.tenant_pages("quiet"), 3);
    // Now flood holds the most, although each of its domains holds only two pages.
    assert_eq!(cache.evict(2), 2);
    assert_eq!(cache.tenant_pages("flood"), 2);
    assert_eq!(cache.tenant_pages("quiet"), 3);
    cache.debug_check().unwrap();
}

/// When the largest holder has nothing idle (its pages are in use), the pages running
/// work needs still come from the others: fairness never makes a request wait behind idle
/// entries.
#[test]
fn pages_in_use_send_eviction_to_the_next_holder() {
    let pool = pool(8);
    let mut cache = PrefixCache::new(P);
    let quiet = IsolationDomain::tenant("quiet");
    let flood = IsolationDomain::tenant("flood");
    cache_prompt(&pool, &mut cache, 1, &quiet, &[1, 2, 3, 4]);
    cache_prompt(&pool, &mut cache, 2, &flood, &[9, 8, 7, 6]);
    cache_prompt(&pool, &mut cache, 3, &flood, &[9, 8, 5, 5]);
    let held = cache.lookup(&flood, &[9, 8, 7, 6], usize::MAX);
    let held2 = cache.lookup(&flood, &[9, 8, 5, 5], usize::MAX);
    assert_eq!(held.len() + held2.len(), 4);
    assert_eq!(cache.evictable_pages(), 2);
    assert_eq!(cache.evict(2), 2);
    assert_eq!(cache.tenant_pages("quiet"), 0);
    assert_eq!(cache.tenant_pages("flood"), 3);
    drop((held, held2));
    cache.debug_check().unwrap();
}

/// Public pages count against the operator, not against the tenant whose request cached
/// them: a tenant using the shared system prompt is not charged for it.
#[test]
fn public_pages_count_against_no_tenant() {
    let pool = pool(8);
    let public = PublicPrefixes::new([vec![1, 2]]);
    let mut cache = PrefixCache::with_public_prefixes(P, public);
    let a = IsolationDomain::tenant("a");
    cache_prompt(&pool, &mut cache, 1, &a, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(cache.tenant_pages("a"), 2);
    assert_eq!(cache.cached_pages(), 3);
    cache.debug_check().unwrap();
}
