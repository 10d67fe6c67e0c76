//! Exclusive, writable ownership of one page by one request: append-only writes, reads
//! bounded by what was written, and freezing a full page into a shared one.

use crate::layout::{rows, KvSlice, Row};
use crate::shared::SharedPage;
use crate::state::{PageBuf, PoolInner};
use crate::sync::Arc;
use crate::{KvError, RequestId, Visibility};

/// Exclusive, writable ownership of one page, bound to one request. Neither `Clone` nor
/// `Copy`; dropping it scrubs the page and returns it to the pool.
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
            .field("page", &self.buf().index)
            .field("written", &self.written)
            .finish()
    }
}

impl PageLease {
    /// A fresh lease of `buf` to `owner`, nothing written yet.
    pub(crate) fn new(buf: PageBuf, owner: RequestId, pool: Arc<PoolInner>) -> Self {
        PageLease {
            buf: Some(buf),
            owner,
            written: vec![0; pool.layout.n_layers].into_boxed_slice(),
            pool,
        }
    }

    fn buf(&self) -> &PageBuf {
        self.buf.as_ref().expect("a live lease holds its page")
    }

    pub fn owner(&self) -> RequestId {
        self.owner
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
        self.append_row(layer, Row::Values(k), Row::Values(v))
    }

    /// [`Self::append`] of rows computed or received (`Row`).
    pub(crate) fn append_row(
        &mut self,
        layer: usize,
        k: Row<'_>,
        v: Row<'_>,
    ) -> Result<(), KvError> {
        let layout = self.pool.layout;
        if layer >= layout.n_layers {
            return Err(KvError::NoSuchLayer {
                layer,
                layers: layout.n_layers,
            });
        }
        if let Err(got) = k.fits(&layout).and(v.fits(&layout)) {
            return Err(KvError::RowShape {
                got,
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
        d.store(ko, layout.kv_dim, k);
        d.store(vo, layout.kv_dim, v);
        self.written[layer] += 1;
        Ok(())
    }

    /// Forgets every slot from `slots` on, on every layer: they read as never written
    /// until they are appended again. The bytes stay until rewritten or scrubbed with the
    /// page; no read reaches them meanwhile, and they are this lease's own.
    pub fn truncate(&mut self, slots: usize) {
        let slots = slots.min(self.pool.layout.page_tokens) as u32;
        for w in self.written.iter_mut() {
            *w = (*w).min(slots);
        }
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
        let buf = self.buf.take().expect("a live lease holds its page");
        let pool = self.pool.clone();
        {
            let mut st = pool.lock();
            st.leased -= 1;
            st.cached += 1;
        }
        Ok(Arc::new(SharedPage::new(buf, visibility, pool)))
    }
}

impl Drop for PageLease {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf, false);
        }
    }
}
