//! Loom model of the pool's concurrency: allocate, release, freeze and the drop of the
//! last reference to a shared page, from several threads, in every interleaving loom can
//! reach. Run with `crates/kv/loom.sh`; compiled only under `--cfg loom`.
#![cfg(loom)]

use kv::{
    KvDtype, KvError, KvLayout, KvPool, PageLease, PoolConfig, RequestId, ScrubPolicy, Visibility,
};
use loom::sync::Arc;
use loom::thread;

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: 1,
            kv_dim: 1,
            page_tokens: 1,
            dtype: KvDtype::F32,
        },
        pages,
        scrub: ScrubPolicy::Poison,
    })
}

fn assert_balanced(pool: &KvPool) {
    let c = pool.counts();
    assert_eq!(c.free + c.leased + c.cached, c.total, "{c:?}");
}

/// Every free page holds only the scrub pattern (NaN) or its initial zeros: no thread's
/// data survives its release.
fn assert_free_pages_scrubbed(pool: &KvPool) {
    for page in pool.debug_free_pages_raw().expect("poison pool") {
        assert!(page.iter().all(|x| x.is_nan() || *x == 0.0), "{page:?}");
    }
}

/// Writes a value unique to `who` and checks the lease reads back exactly that.
fn write_own(lease: &mut PageLease, who: f32) {
    assert!(matches!(
        lease.read(0, 1),
        Err(KvError::UnwrittenRead { .. })
    ));
    lease.append(0, &[who], &[-who]).unwrap();
    let (k, v) = lease.read(0, 1).unwrap();
    let (mut kb, mut vb) = ([0f32], [0f32]);
    k.to_f32(&mut kb);
    v.to_f32(&mut vb);
    assert_eq!((kb[0], vb[0]), (who, -who));
}

/// Three contenders make the full interleaving space too large to finish; loom's
/// preemption bound keeps every schedule with up to this many forced switches, which is
/// where such races live in practice.
fn bounded() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(4);
    b
}

#[test]
fn concurrent_allocate_release() {
    bounded().check(|| {
        let pool = pool(2);
        let handles: Vec<_> = (1..=2u64)
            .map(|t| {
                let pool = pool.clone();
                thread::spawn(move || {
                    // Thread 2 asks for both pages: it gets both or none, never one.
                    let want = t as usize;
                    match pool.allocate(RequestId(t), want) {
                        Ok(mut leases) => {
                            assert_eq!(leases.len(), want);
                            for lease in &mut leases {
                                write_own(lease, t as f32);
                            }
                            assert_balanced(&pool);
                            drop(leases);
                        }
                        Err(KvError::PoolExhausted { needed, .. }) => assert_eq!(needed, want),
                        Err(e) => panic!("{e}"),
                    }
                    assert_balanced(&pool);
                })
            })
            .collect();
        // The main thread is a third contender, and freezes what it gets.
        if let Ok(mut leases) = pool.allocate(RequestId(3), 1) {
            let mut lease = leases.pop().unwrap();
            write_own(&mut lease, 3.0);
            let page = lease
                .freeze(Visibility::Public)
                .map_err(|(_, e)| e)
                .unwrap();
            assert_balanced(&pool);
            drop(page);
        }
        for h in handles {
            h.join().unwrap();
        }
        let c = pool.counts();
        assert_eq!((c.free, c.leased, c.cached), (2, 0, 0));
        assert_free_pages_scrubbed(&pool);
    });
}

#[test]
fn concurrent_shared_page_drop_and_reuse() {
    loom::model(|| {
        let pool = pool(2);
        let mut lease = pool.allocate(RequestId(1), 1).unwrap().pop().unwrap();
        write_own(&mut lease, 1.0);
        let page = lease
            .freeze(Visibility::Public)
            .map_err(|(_, e)| e)
            .unwrap();
        assert_eq!(pool.counts().cached, 1);

        // Two readers drop their references concurrently; whichever is last returns the page.
        let reader = {
            let page = Arc::clone(&page);
            thread::spawn(move || drop(page))
        };
        // A third thread wants both pages: it can only get them once the shared page is
        // back and scrubbed, and then it is no longer cached.
        let taker = {
            let pool = pool.clone();
            thread::spawn(move || {
                if let Ok(mut leases) = pool.allocate(RequestId(2), 2) {
                    assert_eq!(pool.counts().cached, 0);
                    for lease in &mut leases {
                        write_own(lease, 2.0);
                    }
                }
                assert_balanced(&pool);
            })
        };
        drop(page);
        assert_balanced(&pool);
        reader.join().unwrap();
        taker.join().unwrap();
        let c = pool.counts();
        assert_eq!((c.free, c.leased, c.cached), (2, 0, 0));
        assert_free_pages_scrubbed(&pool);
    });
}
