//! The pool's public handle: allocates every page up front, leases pages out all or
//! nothing, and reports its accounting.

use crate::layout::KvLayout;
use crate::lease::PageLease;
use crate::shared::SharedPage;
use crate::state::{PoolInner, ScrubPolicy};
use crate::sync::Arc;
use crate::{KvError, RequestId};

#[derive(Debug, Clone, Copy)]
pub struct PoolConfig {
    pub layout: KvLayout,
    pub pages: usize,
    pub scrub: ScrubPolicy,
}

/// Snapshot of the pool's accounting. `free + leased + cached == total` always holds;
/// it is read under one lock, so the snapshot is consistent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolCounts {
    pub total: usize,
    pub free: usize,
    pub leased: usize,
    pub cached: usize,
}

/// The pool of KV pages. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct KvPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("layout", &self.inner.layout)
            .field("counts", &self.counts())
            .finish()
    }
}

impl KvPool {
    /// Allocates every page up front: the capacity a node advertises must exist before it
    /// accepts its first request.
    pub fn new(config: PoolConfig) -> Self {
        Self {
            inner: Arc::new(PoolInner::new(config.layout, config.scrub, config.pages)),
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.inner.layout
    }

    pub fn scrub_policy(&self) -> ScrubPolicy {
        self.inner.scrub
    }

    /// Total token slots: the most any set of sequences can hold at once.
    pub fn capacity_tokens(&self) -> usize {
        self.inner.total * self.inner.layout.page_tokens
    }

    pub fn counts(&self) -> PoolCounts {
        let st = self.inner.lock();
        PoolCounts {
            total: self.inner.total,
            free: st.free.len(),
            leased: st.leased,
            cached: st.cached,
        }
    }

    /// Leases `n` pages to `owner`, all or nothing.
    pub fn allocate(&self, owner: RequestId, n: usize) -> Result<Vec<PageLease>, KvError> {
        let bufs = {
            let mut st = self.inner.lock();
            if st.free.len() < n {
                return Err(KvError::PoolExhausted {
                    needed: n,
                    free: st.free.len(),
                });
            }
            let at = st.free.len() - n;
            let bufs = st.free.split_off(at);
            st.leased += n;
            bufs
        };
        Ok(bufs
            .into_iter()
            .map(|buf| PageLease::new(buf, owner, self.inner.clone()))
            .collect())
    }

    pub(crate) fn inner(&self) -> &Arc<PoolInner> {
        &self.inner
    }

    /// True if `page` was handed out by this pool (and so has this pool's layout).
    pub fn owns_shared(&self, page: &SharedPage) -> bool {
        Arc::ptr_eq(&self.inner, page.pool_inner())
    }

    /// Test support: the raw contents (as f32) of every free page. Leased and cached pages
    /// are not among them: their memory lives inside their owner and is unreachable from
    /// here, by construction. Refused for pools that do not scrub: their free pages may
    /// still hold a previous tenant's data, and this must not become a way to read it.
    #[cfg(feature = "test-support")]
    #[doc(hidden)]
    pub fn debug_free_pages_raw(&self) -> Option<Vec<Vec<f32>>> {
        if self.inner.scrub == ScrubPolicy::None {
            return None;
        }
        let st = self.inner.lock();
        Some(st.free.iter().map(|b| b.data.to_f32()).collect())
    }
}
