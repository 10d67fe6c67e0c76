//! K/V computed under a LoRA adapter is a function of that adapter: a domain narrowed by an
//! adapter's fingerprint shares nothing with the same tenant's base-model domain, with
//! another adapter's, or with the public (base-model) prefixes. Without the adapter in
//! `IsolationDomain`, or with public pages readable under an adapter, these tests fail.

#![cfg(not(loom))]

use kv::{
    IsolationDomain, KvDtype, KvLayout, KvPool, Owner, PoolConfig, PrefixCache, PublicPrefixes,
    RequestId, ScrubPolicy, SequenceKv, Visibility,
};

const P: usize = 2;

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: 1,
            kv_dim: 2,
            page_tokens: P,
            dtype: KvDtype::F32,
        },
        pages,
        scrub: ScrubPolicy::Poison,
    })
}

fn cache_prompt(
    pool: &KvPool,
    cache: &mut PrefixCache,
    req: u64,
    domain: &IsolationDomain,
    tokens: &[u32],
) -> Vec<std::sync::Arc<kv::SharedPage>> {
    let owner = Owner {
        request: RequestId(req),
        domain: domain.clone(),
    };
    let mut seq = SequenceKv::new(pool, owner);
    seq.reserve(tokens.len()).unwrap();
    for pos in 0..tokens.len() {
        let v = [req as f32, pos as f32];
        seq.write(0, pos, &v, &v).unwrap();
    }
    seq.commit(tokens.len()).unwrap();
    let public = cache.public_pages(tokens);
    let pages = seq.share_full_pages_split(public);
    cache
        .insert(&Visibility::Domain(domain.clone()), tokens, &pages)
        .unwrap();
    cache.debug_check().unwrap();
    pages
}

fn hit(cache: &mut PrefixCache, domain: &IsolationDomain, tokens: &[u32]) -> usize {
    cache.lookup(domain, tokens, usize::MAX).tokens()
}

#[test]
fn an_adapters_cached_prefix_serves_only_that_adapter() {
    let pool = pool(64);
    let mut cache = PrefixCache::new(P);
    let alice = IsolationDomain::tenant("alice");
    let under_a = alice.computed_under(Some(0xA));
    let under_b = alice.computed_under(Some(0xB));
    let prompt = [1, 2, 3, 4, 5, 6, 7];
    cache_prompt(&pool, &mut cache, 1, &under_a, &prompt);
    assert_eq!(hit(&mut cache, &under_a, &prompt), 6);
    assert_eq!(hit(&mut cache, &under_b, &prompt), 0, "another adapter");
    assert_eq!(hit(&mut cache, &alice, &prompt), 0, "the base model");
    let bob_under_a = IsolationDomain::tenant("bob").computed_under(Some(0xA));
    assert_eq!(hit(&mut cache, &bob_under_a, &prompt), 0, "another tenant");
    // Salting keeps the adapter; the adapter keeps the salt.
    let salted = under_a.narrowed("s");
    assert_eq!(salted.adapter(), Some(0xA));
    assert_eq!(salted.computed_under(Some(0xA)).salt(), Some("s"));
    assert_eq!(hit(&mut cache, &salted, &prompt), 0, "a salted domain");
    // The base model's K/V never serves the adapter either.
    cache_prompt(&pool, &mut cache, 2, &alice, &[9, 9, 9, 9, 9]);
    assert_eq!(hit(&mut cache, &under_a, &[9, 9, 9, 9, 9]), 0);
    assert_eq!(hit(&mut cache, &alice, &[9, 9, 9, 9, 9]), 4);
}

#[test]
fn public_prefixes_are_base_model_k_v_and_never_read_or_written_under_an_adapter() {
    let pool = pool(64);
    let public = PublicPrefixes::new([vec![1, 2, 3, 4]]);
    let mut cache = PrefixCache::with_public_prefixes(P, public);
    let base = IsolationDomain::tenant("alice");
    let under_a = base.computed_under(Some(0xA));
    let prompt = [1, 2, 3, 4, 5, 6];

    // Under the adapter the public prefix's pages stay the request's own domain's.
    let pages = cache_prompt(&pool, &mut cache, 1, &under_a, &prompt);
    assert!(pages
        .iter()
        .all(|p| *p.visibility() == Visibility::Domain(under_a.clone())));
    let other = IsolationDomain::tenant("bob");
    assert_eq!(hit(&mut cache, &other, &prompt), 0, "nothing was published");

    // A base request publishes it; an adapter request still cannot read it.
    cache_prompt(&pool, &mut cache, 2, &base, &prompt);
    assert_eq!(
        hit(&mut cache, &other, &prompt),
        4,
        "public for base requests"
    );
    let bob_a = other.computed_under(Some(0xA));
    assert_eq!(
        hit(&mut cache, &bob_a, &prompt),
        0,
        "public pages under an adapter"
    );
    assert!(!Visibility::Public.readable_by(&bob_a));
    assert!(Visibility::Public.readable_by(&other));
}

#[test]
fn a_sequence_under_an_adapter_cannot_publish_its_pages() {
    let pool = pool(8);
    let domain = IsolationDomain::tenant("alice").computed_under(Some(1));
    let mut seq = SequenceKv::new(
        &pool,
        Owner {
            request: RequestId(1),
            domain,
        },
    );
    seq.reserve(4).unwrap();
    for pos in 0..4 {
        seq.write(0, pos, &[1.0, 2.0], &[3.0, 4.0]).unwrap();
    }
    seq.commit(4).unwrap();
    assert!(seq.share_full_pages(&Visibility::Public).is_empty());
}
