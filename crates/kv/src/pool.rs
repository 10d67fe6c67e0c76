use crate::sync::{Arc, AtomicU64, Mutex, MutexGuard, Ordering};

use half::{f16, slice::HalfFloatSliceExt};

use crate::evict::{Eviction, Holder};
use crate::{KvError, Owner, RequestId, Visibility};

/// Element type of stored K/V values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

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

/// Shape of one page: `page_tokens` slots, each holding K and V rows of `kv_dim` values
/// for every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub kv_dim: usize,
    pub page_tokens: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    pub fn page_elems(&self) -> usize {
        self.n_layers * 2 * self.page_tokens * self.kv_dim
    }

    pub fn bytes_per_token(&self) -> usize {
        self.n_layers * 2 * self.kv_dim * self.dtype.bytes()
    }

    pub fn page_bytes(&self) -> usize {
        self.page_elems() * self.dtype.bytes()
    }

    /// Offset of the first value of the K (`kv = 0`) or V (`kv = 1`) rows of `layer`.
    /// Rows of consecutive slots are contiguous, so a page's slots form one run.
    fn offset(&self, layer: usize, kv: usize, slot: usize) -> usize {
        ((layer * 2 + kv) * self.page_tokens + slot) * self.kv_dim
    }
}

#[derive(Debug, Clone, Copy)]
pub struct PoolConfig {
    pub layout: KvLayout,
    pub pages: usize,
    pub scrub: ScrubPolicy,
}

pub(crate) enum PageData {
    F16(Box<[f16]>),
    F32(Box<[f32]>),
}

impl PageData {
    fn fill(&mut self, value: f32) {
        match self {
            PageData::F16(d) => d.fill(f16::from_f32(value)),
            PageData::F32(d) => d.fill(value),
        }
    }

    #[cfg(feature = "test-support")]
    fn to_f32(&self) -> Vec<f32> {
        match self {
            PageData::F16(d) => d.iter().map(|x| x.to_f32()).collect(),
            PageData::F32(d) => d.to_vec(),
        }
    }
}

/// A page's memory and identity. Exactly one of these exists per page; whoever holds it
/// owns the page.
pub(crate) struct PageBuf {
    index: u32,
    generation: u64,
    data: PageData,
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

struct PoolState {
    free: Vec<PageBuf>,
    leased: usize,
    cached: usize,
    /// The prefix cache's eviction state of every page (`crate::evict`).
    eviction: Eviction,
}

pub(crate) struct PoolInner {
    layout: KvLayout,
    scrub: ScrubPolicy,
    total: usize,
    state: Mutex<PoolState>,
    /// Current generation of each page, for validating descriptors that left the process
    /// (block tables sent between prefill and decode).
    generations: Box<[AtomicU64]>,
}

impl PoolInner {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding this lock cannot leave the counts half-updated (each update
        // is a single statement after the fallible work), so poisoning is recoverable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a page back: scrub, new generation, onto the free list.
    fn give_back(&self, mut buf: PageBuf, was_cached: bool) {
        match self.scrub {
            ScrubPolicy::Zero => buf.data.fill(0.0),
            ScrubPolicy::Poison => buf.data.fill(f32::NAN),
            ScrubPolicy::None => {}
        }
        buf.generation += 1;
        self.generations[buf.index as usize].store(buf.generation, Ordering::Release);
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
        let layout = config.layout;
        let elems = layout.page_elems();
        let free = (0..config.pages)
            .rev()
            .map(|i| {
                let data = match layout.dtype {
                    KvDtype::F16 => PageData::F16(vec![f16::ZERO; elems].into_boxed_slice()),
                    KvDtype::F32 => PageData::F32(vec![0f32; elems].into_boxed_slice()),
                };
                PageBuf {
                    index: i as u32,
                    generation: 0,
                    data,
                }
            })
            .collect();
        let generations = (0..config.pages).map(|_| AtomicU64::new(0)).collect();
        Self {
            inner: Arc::new(PoolInner {
                layout,
                scrub: config.scrub,
                total: config.pages,
                state: Mutex::new(PoolState {
                    free,
                    leased: 0,
                    cached: 0,
                    eviction: Eviction::new(config.pages),
                }),
                generations,
            }),
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
            .map(|buf| PageLease {
                buf: Some(buf),
                owner,
                written: vec![0; self.inner.layout.n_layers].into_boxed_slice(),
                pool: self.inner.clone(),
            })
            .collect())
    }

    pub(crate) fn inner(&self) -> &Arc<PoolInner> {
        &self.inner
    }

    /// True if `page` was handed out by this pool (and so has this pool's layout).
    pub fn owns_shared(&self, page: &SharedPage) -> bool {
        Arc::ptr_eq(&self.inner, &page.pool)
    }

    /// Test support: the raw contents (as f32) of the free page that `d` names, whatever its
    /// generation, or `None` if that page is leased or cached (its memory then lives inside
    /// its owner and is unreachable from here, by construction). Refused for pools that do
    /// not scrub: their free pages may still hold a previous tenant's data, and this must
    /// not become a way to read it.
    #[cfg(feature = "test-support")]
    #[doc(hidden)]
    pub fn debug_free_page_raw(&self, d: &PageDescriptor) -> Option<Vec<f32>> {
        if self.inner.scrub == ScrubPolicy::None {
            return None;
        }
        let st = self.inner.lock();
        st.free
            .iter()
            .find(|b| b.index == d.index)
            .map(|b| b.data.to_f32())
    }

    /// Test support: the raw contents of every free page; `None` for pools that do not
    /// scrub (see [`KvPool::debug_free_page_raw`]).
    #[cfg(feature = "test-support")]
    #[doc(hidden)]
    pub fn debug_free_pages_raw(&self) -> Option<Vec<Vec<f32>>> {
        if self.inner.scrub == ScrubPolicy::None {
            return None;
        }
        let st = self.inner.lock();
        Some(st.free.iter().map(|b| b.data.to_f32()).collect())
    }

    /// Checks that a descriptor still names the page's current tenure.
    pub fn validate(&self, d: &PageDescriptor) -> Result<(), KvError> {
        let current = self
            .inner
            .generations
            .get(d.index as usize)
            .map(|g| g.load(Ordering::Acquire))
            .ok_or(KvError::StaleDescriptor {
                held: d.generation,
                current: u64::MAX,
            })?;
        if current != d.generation {
            return Err(KvError::StaleDescriptor {
                held: d.generation,
                current,
            });
        }
        Ok(())
    }
}

/// Names one tenure of one page, for protocols that refer to pages from outside (for
/// example a decode node's block table sent to a prefill node). It grants no access: it
/// can only be checked against the pool with [`KvPool::validate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageDescriptor {
    index: u32,
    generation: u64,
}

/// Exclusive, writable ownership of one page, bound to one request. Neither `Clone` nor
/// `Copy`; dropping it scrubs the page and returns it to the pool under a new generation.
pub struct PageLease {
    // Always `Some` while the lease is alive; taken only by `Drop` and `freeze`, which
    // consume the lease.
    buf: Option<PageBuf>,
    owner: RequestId,
    /// Slots written under this lease, per layer. Reads beyond are refused.
    written: Box<[u32]>,
    pool: Arc<PoolInner>,
}

impl std::fmt::Debug for PageLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageLease")
            .field("owner", &self.owner)
            .field("descriptor", &self.descriptor())
            .field("written", &self.written)
            .finish()
    }
}

/// Borrowed K or V rows of consecutive slots, in the pool's element type.
#[derive(Clone, Copy)]
pub enum KvSlice<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl KvSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F16(s) => s.len(),
            KvSlice::F32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the first `min(self.len(), out.len())` values into `out` as f32 (exact for
    /// both types) and returns how many it copied.
    pub fn to_f32(&self, out: &mut [f32]) -> usize {
        match self {
            KvSlice::F16(s) => {
                for (o, v) in out.iter_mut().zip(s.iter()) {
                    *o = v.to_f32();
                }
            }
            KvSlice::F32(s) => {
                for (o, v) in out.iter_mut().zip(s.iter()) {
                    *o = *v;
                }
            }
        }
        self.len().min(out.len())
    }
}

fn rows<'a>(
    layout: &KvLayout,
    data: &'a PageData,
    layer: usize,
    n: usize,
) -> (KvSlice<'a>, KvSlice<'a>) {
    let k0 = layout.offset(layer, 0, 0);
    let v0 = layout.offset(layer, 1, 0);
    let len = n * layout.kv_dim;
    match data {
        PageData::F16(d) => (
            KvSlice::F16(&d[k0..k0 + len]),
            KvSlice::F16(&d[v0..v0 + len]),
        ),
        PageData::F32(d) => (
            KvSlice::F32(&d[k0..k0 + len]),
            KvSlice::F32(&d[v0..v0 + len]),
        ),
    }
}

impl PageLease {
    fn buf(&self) -> &PageBuf {
        self.buf.as_ref().expect("a live lease holds its page")
    }

    pub fn owner(&self) -> RequestId {
        self.owner
    }

    pub fn descriptor(&self) -> PageDescriptor {
        let b = self.buf();
        PageDescriptor {
            index: b.index,
            generation: b.generation,
        }
    }

    /// Slots written on `layer` under this lease.
    pub fn written(&self, layer: usize) -> usize {
        self.written.get(layer).map_or(0, |&w| w as usize)
    }

    /// Slots written on every layer: the prefix of the page that is readable throughout.
    pub fn complete_slots(&self) -> usize {
        self.written.iter().copied().min().unwrap_or(0) as usize
    }

    /// Appends one slot's K and V rows on `layer`. Writes are append-only and in order, so
    /// the written extent is always a prefix of the page.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        let layout = self.pool.layout;
        if layer >= layout.n_layers {
            return Err(KvError::NoSuchLayer {
                layer,
                layers: layout.n_layers,
            });
        }
        if k.len() != layout.kv_dim || v.len() != layout.kv_dim {
            return Err(KvError::RowShape {
                got: k.len().min(v.len()),
                want: layout.kv_dim,
            });
        }
        let slot = self.written[layer] as usize;
        if slot >= layout.page_tokens {
            return Err(KvError::AppendPastCapacity {
                request: self.owner,
                position: slot,
                capacity: layout.page_tokens,
            });
        }
        let ko = layout.offset(layer, 0, slot);
        let vo = layout.offset(layer, 1, slot);
        let d = &mut self.buf.as_mut().expect("a live lease holds its page").data;
        match d {
            PageData::F16(d) => {
                // The slice conversion checks the CPU once per row and converts several
                // values per instruction (per element, it was a call each); same rounding.
                d[ko..ko + k.len()].convert_from_f32_slice(k);
                d[vo..vo + v.len()].convert_from_f32_slice(v);
            }
            PageData::F32(d) => {
                d[ko..ko + k.len()].copy_from_slice(k);
                d[vo..vo + v.len()].copy_from_slice(v);
            }
        }
        self.written[layer] += 1;
        Ok(())
    }

    /// K and V rows of the first `n` slots of `layer`, all written under this lease.
    pub fn read(&self, layer: usize, n: usize) -> Result<(KvSlice<'_>, KvSlice<'_>), KvError> {
        let layout = &self.pool.layout;
        if layer >= layout.n_layers {
            return Err(KvError::NoSuchLayer {
                layer,
                layers: layout.n_layers,
            });
        }
        let written = self.written[layer] as usize;
        if n > written {
            return Err(KvError::UnwrittenRead {
                request: self.owner,
                layer,
                position: n - 1,
                written,
            });
        }
        Ok(rows(layout, &self.buf().data, layer, n))
    }

    #[cfg(feature = "bench-unchecked-baseline")]
    pub(crate) fn rows_unchecked_baseline(
        &self,
        layer: usize,
        n: usize,
    ) -> (KvSlice<'_>, KvSlice<'_>) {
        rows(&self.pool.layout, &self.buf().data, layer, n)
    }

    /// Fault injection only: records `slots` as written on every layer without writing them
    /// (see `SequenceKv::fault_claim_unwritten`).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn fault_mark_written(&mut self, slots: usize) {
        let slots = slots.min(self.pool.layout.page_tokens) as u32;
        for w in self.written.iter_mut() {
            *w = (*w).max(slots);
        }
    }

    /// Turns a fully written page into an immutable shared page readable by `visibility`.
    /// A partly written page cannot be shared: its free slots would be writable by nobody
    /// and readable by nobody, and the next writer must get a fresh private page.
    pub fn freeze(mut self, visibility: Visibility) -> Result<Arc<SharedPage>, (Self, KvError)> {
        let cap = self.pool.layout.page_tokens;
        if let Some((layer, &w)) = self
            .written
            .iter()
            .enumerate()
            .find(|(_, &w)| w as usize != cap)
        {
            return Err((
                self,
                KvError::NotFull {
                    layer,
                    written: w as usize,
                    capacity: cap,
                },
            ));
        }
        let buf = self.buf.take();
        let pool = self.pool.clone();
        {
            let mut st = pool.lock();
            st.leased -= 1;
            st.cached += 1;
        }
        Ok(Arc::new(SharedPage {
            buf,
            visibility,
            pool,
        }))
    }
}

impl Drop for PageLease {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf, false);
        }
    }
}

/// An immutable, fully written page that several sequences of one isolation domain (or
/// all, if public) may read. Returned to the pool when the last reference goes.
pub struct SharedPage {
    buf: Option<PageBuf>,
    visibility: Visibility,
    pool: Arc<PoolInner>,
}

impl std::fmt::Debug for SharedPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPage")
            .field("visibility", &self.visibility)
            .finish()
    }
}

impl SharedPage {
    pub fn visibility(&self) -> &Visibility {
        &self.visibility
    }

    /// The page's index in its pool: its identity while it is alive.
    pub(crate) fn index(&self) -> u32 {
        self.buf
            .as_ref()
            .expect("a live shared page holds its buffer")
            .index
    }

    pub(crate) fn pool_inner(&self) -> &Arc<PoolInner> {
        &self.pool
    }

    /// Layout of the pool this page belongs to.
    pub fn layout(&self) -> KvLayout {
        self.pool.layout
    }

    #[cfg(feature = "bench-unchecked-baseline")]
    pub(crate) fn rows_unchecked_baseline(
        &self,
        layer: usize,
        n: usize,
    ) -> (KvSlice<'_>, KvSlice<'_>) {
        let buf = self
            .buf
            .as_ref()
            .expect("a live shared page holds its buffer");
        rows(&self.pool.layout, &buf.data, layer, n)
    }

    /// K and V rows of the first `n` slots of `layer`, if `owner` may read this page.
    pub fn read(
        &self,
        owner: &Owner,
        layer: usize,
        n: usize,
    ) -> Result<(KvSlice<'_>, KvSlice<'_>), KvError> {
        if !self.visibility.readable_by(&owner.domain) {
            return Err(KvError::ForeignPage {
                request: owner.request,
            });
        }
        let layout = &self.pool.layout;
        if layer >= layout.n_layers {
            return Err(KvError::NoSuchLayer {
                layer,
                layers: layout.n_layers,
            });
        }
        if n > layout.page_tokens {
            return Err(KvError::UnwrittenRead {
                request: owner.request,
                layer,
                position: n - 1,
                written: layout.page_tokens,
            });
        }
        let buf = self
            .buf
            .as_ref()
            .expect("a live shared page holds its buffer");
        Ok(rows(layout, &buf.data, layer, n))
    }

    pub fn descriptor(&self) -> PageDescriptor {
        let b = self
            .buf
            .as_ref()
            .expect("a live shared page holds its buffer");
        PageDescriptor {
            index: b.index,
            generation: b.generation,
        }
    }
}

impl Drop for SharedPage {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf, true);
        }
    }
}
