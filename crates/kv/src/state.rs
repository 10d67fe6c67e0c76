//! The pool's shared state behind every handle, lease and shared page: the free list of
//! page buffers, the accounting, the eviction lists, and the one way back into the free
//! list (scrubbed).

use crate::evict::{Eviction, Holder};
use crate::layout::{KvLayout, PageData};
use crate::sync::{Mutex, MutexGuard};

/// What happens to a page's contents when its lease ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrubPolicy {
    /// Zero the page: a stale read, were one possible, would see zeros, not data.
    Zero,
    /// Fill with NaN: any stale read poisons the computation visibly. Used by tests.
    Poison,
    /// Leave the bytes; isolation then rests on the written-extent checks alone.
    None,
}

/// A page's memory and identity. Exactly one of these exists per page; whoever holds it
/// owns the page.
pub(crate) struct PageBuf {
    pub(crate) index: u32,
    pub(crate) data: PageData,
}

pub(crate) struct PoolState {
    pub(crate) free: Vec<PageBuf>,
    pub(crate) leased: usize,
    pub(crate) cached: usize,
    /// The prefix cache's eviction state of every page (`crate::evict`).
    eviction: Eviction,
}

pub(crate) struct PoolInner {
    pub(crate) layout: KvLayout,
    pub(crate) scrub: ScrubPolicy,
    pub(crate) total: usize,
    state: Mutex<PoolState>,
}

impl PoolInner {
    /// Every page's buffer, allocated now and all free.
    pub(crate) fn new(layout: KvLayout, scrub: ScrubPolicy, pages: usize) -> Self {
        assert!(
            layout.is_storable(),
            "{} K/V rows need a multiple of {} values; this layout has {}",
            layout.dtype.name(),
            layout.dtype.values_per_element(),
            layout.kv_dim
        );
        let free = PageData::zeroed_pages(layout.dtype, layout.page_elems(), pages)
            .into_iter()
            .zip(0..pages as u32)
            .rev()
            .map(|(data, index)| PageBuf { index, data })
            .collect();
        PoolInner {
            layout,
            scrub,
            total: pages,
            state: Mutex::new(PoolState {
                free,
                leased: 0,
                cached: 0,
                eviction: Eviction::new(pages),
            }),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding this lock cannot leave the counts half-updated (each update
        // is a single statement after the fallible work), so poisoning is recoverable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a page back: scrub, onto the free list.
    pub(crate) fn give_back(&self, mut buf: PageBuf, was_cached: bool) {
        match self.scrub {
            ScrubPolicy::Zero => buf.data.fill(0.0),
            ScrubPolicy::Poison => buf.data.fill(f32::NAN),
            ScrubPolicy::None => {}
        }
        let mut st = self.lock();
        if was_cached {
            st.cached -= 1;
        } else {
            st.leased -= 1;
        }
        // The last reference is gone, so no user and no cache holds the page any more.
        st.eviction.reset(buf.index);
        st.free.push(buf);
    }

    /// Marks pages as used by one more sequence or lookup result: not evictable.
    pub(crate) fn pin(&self, pages: impl IntoIterator<Item = u32>) {
        let mut st = self.lock();
        for i in pages {
            st.eviction.pin(i);
        }
    }

    /// Ends one use of each page; a cached page nothing uses any more becomes the most
    /// recently used evictable one of its holder.
    pub(crate) fn unpin(&self, pages: impl IntoIterator<Item = u32>) {
        let mut st = self.lock();
        for i in pages {
            st.eviction.unpin(i);
        }
    }

    /// The prefix cache took page `i` (`leafy`: all its nodes are leaves) for `holder`.
    pub(crate) fn cache_enter(&self, i: u32, leafy: bool, holder: Holder) {
        self.lock().eviction.cache_enter(i, leafy, holder);
    }

    /// The prefix cache let go of page `i`.
    pub(crate) fn cache_leave(&self, i: u32) {
        self.lock().eviction.cache_leave(i);
    }

    /// Whether every cache node of page `i` is a leaf changed.
    pub(crate) fn set_leafy(&self, i: u32, leafy: bool, front: bool) {
        self.lock().eviction.set_leafy(i, leafy, front);
    }

    /// Takes the next page to evict off the lists (see `crate::evict` for which);
    /// `for_holder`: who the room is for, and how many pages it wants.
    pub(crate) fn pop_evictable(&self, for_holder: Option<(Holder, usize)>) -> Option<u32> {
        self.lock().eviction.pop(for_holder)
    }

    /// Cached pages that nothing uses.
    pub(crate) fn idle_cached(&self) -> usize {
        self.lock().eviction.idle_cached()
    }

    /// (users, in cache, leafy, listed, holder) of page `i`, for the cache's checks.
    pub(crate) fn use_meta(&self, i: u32) -> (u32, bool, bool, bool, Holder) {
        self.lock().eviction.meta(i)
    }

    /// Cached pages per holder, for the cache's checks.
    pub(crate) fn holder_sizes(&self) -> Vec<usize> {
        self.lock().eviction.holder_sizes()
    }

    /// The evictable lists, for the cache's consistency checks.
    pub(crate) fn evictable_list(&self) -> Vec<u32> {
        self.lock().eviction.lists()
    }
}
