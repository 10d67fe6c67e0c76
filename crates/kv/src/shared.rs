//! Immutable, reference-counted pages readable by one isolation domain (or by all, if
//! public); the last reference returns the page to the pool.

use crate::layout::{rows, KvLayout, KvSlice};
use crate::state::{PageBuf, PoolInner};
use crate::sync::Arc;
use crate::{KvError, Owner, Visibility};

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
    /// A frozen page; the pool already counts it as cached.
    pub(crate) fn new(buf: PageBuf, visibility: Visibility, pool: Arc<PoolInner>) -> Self {
        SharedPage {
            buf: Some(buf),
            visibility,
            pool,
        }
    }

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
}

impl Drop for SharedPage {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf, true);
        }
    }
}
