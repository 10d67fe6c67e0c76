use std::sync::Arc;

use crate::{KvError, KvPool, Owner, PageLease, SharedPage, Visibility};

pub use crate::pool::KvSlice;

/// One page's worth of a sequence's K and V rows on one layer: `tokens` consecutive
/// positions, `kv_dim` values each.
pub struct KvRun<'a> {
    pub k: KvSlice<'a>,
    pub v: KvSlice<'a>,
    pub tokens: usize,
}

enum Block {
    Owned(PageLease),
    Shared(Arc<SharedPage>),
}

/// The KV cache of one request: its block table. Built only from pages leased to this
/// request and shared pages readable by its domain, so attention over it cannot reach
/// anyone else's data. Dropping it returns every page it owns.
pub struct SequenceKv {
    owner: Owner,
    pool: KvPool,
    blocks: Vec<Block>,
    /// Positions whose K/V is written on every layer.
    len: usize,
}

impl std::fmt::Debug for SequenceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceKv")
            .field("owner", &self.owner)
            .field("pages", &self.blocks.len())
            .field("len", &self.len)
            .finish()
    }
}

impl SequenceKv {
    pub fn new(pool: &KvPool, owner: Owner) -> Self {
        Self {
            owner,
            pool: pool.clone(),
            blocks: Vec::new(),
            len: 0,
        }
    }

    /// Starts a sequence on a cached prefix. Every page must be readable by the owner's
    /// domain; the prefix cache only offers such pages, and this re-checks it.
    pub fn with_prefix(
        pool: &KvPool,
        owner: Owner,
        prefix: Vec<Arc<SharedPage>>,
    ) -> Result<Self, KvError> {
        if prefix
            .iter()
            .any(|p| !p.visibility().readable_by(&owner.domain))
        {
            return Err(KvError::ForeignPage {
                request: owner.request,
            });
        }
        let len = prefix.len() * pool.layout().page_tokens;
        Ok(Self {
            owner,
            pool: pool.clone(),
            blocks: prefix.into_iter().map(Block::Shared).collect(),
            len,
        })
    }

    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Positions whose K/V is complete on every layer.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Token slots reserved (owned or shared).
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.pool.layout().page_tokens
    }

    pub fn pages(&self) -> usize {
        self.blocks.len()
    }

    /// Pages of this sequence that the pool could not give to anyone else if it finished now.
    pub fn owned_pages(&self) -> usize {
        self.blocks
            .iter()
            .filter(|b| matches!(b, Block::Owned(_)))
            .count()
    }

    /// Makes room for `total_tokens` positions, leasing pages all or nothing.
    pub fn reserve(&mut self, total_tokens: usize) -> Result<(), KvError> {
        let p = self.pool.layout().page_tokens;
        let want = total_tokens.div_ceil(p);
        if want > self.blocks.len() {
            let leases = self
                .pool
                .allocate(self.owner.request, want - self.blocks.len())?;
            self.blocks.extend(leases.into_iter().map(Block::Owned));
        }
        Ok(())
    }

    /// Pages needed to grow to `total_tokens` positions.
    pub fn pages_needed(&self, total_tokens: usize) -> usize {
        total_tokens
            .div_ceil(self.pool.layout().page_tokens)
            .saturating_sub(self.blocks.len())
    }

    /// Writes K and V of `position` on `layer`. Positions are written in order, on a page
    /// this sequence owns.
    pub fn write(
        &mut self,
        layer: usize,
        position: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let p = self.pool.layout().page_tokens;
        let capacity = self.capacity();
        let request = self.owner.request;
        let block = self
            .blocks
            .get_mut(position / p)
            .ok_or(KvError::AppendPastCapacity {
                request,
                position,
                capacity,
            })?;
        let lease = match block {
            Block::Owned(l) => l,
            Block::Shared(_) => return Err(KvError::WriteToShared { request, position }),
        };
        if lease.owner() != request {
            return Err(KvError::ForeignLease {
                request,
                owner: lease.owner(),
            });
        }
        let expected = lease.written(layer);
        if position % p != expected {
            return Err(KvError::OutOfOrderWrite {
                request,
                layer,
                position,
                expected: (position / p) * p + expected,
            });
        }
        lease.append(layer, k, v)
    }

    /// Declares positions `[len, new_len)` complete; refused unless every layer holds them.
    pub fn commit(&mut self, new_len: usize) -> Result<(), KvError> {
        let layers = self.pool.layout().n_layers;
        for layer in 0..layers {
            self.runs(layer, new_len)?;
        }
        self.len = new_len;
        Ok(())
    }

    /// The K/V rows of positions `[0, upto)` on `layer`, one run per page. Fails if any of
    /// those positions was not written for this sequence.
    pub fn runs(&self, layer: usize, upto: usize) -> Result<Vec<KvRun<'_>>, KvError> {
        let p = self.pool.layout().page_tokens;
        if upto > self.capacity() {
            return Err(KvError::UnwrittenRead {
                request: self.owner.request,
                layer,
                position: upto - 1,
                written: self.capacity(),
            });
        }
        let mut out = Vec::with_capacity(upto.div_ceil(p));
        for (i, block) in self.blocks.iter().enumerate() {
            let start = i * p;
            if start >= upto {
                break;
            }
            let n = (upto - start).min(p);
            let (k, v) = match block {
                Block::Owned(lease) => {
                    if lease.owner() != self.owner.request {
                        return Err(KvError::ForeignLease {
                            request: self.owner.request,
                            owner: lease.owner(),
                        });
                    }
                    lease.read(layer, n).map_err(|e| match e {
                        KvError::UnwrittenRead {
                            request,
                            layer,
                            written,
                            ..
                        } => KvError::UnwrittenRead {
                            request,
                            layer,
                            position: start + written,
                            written: start + written,
                        },
                        other => other,
                    })?
                }
                Block::Shared(page) => page.read(&self.owner, layer, n)?,
            };
            out.push(KvRun { k, v, tokens: n });
        }
        Ok(out)
    }

    /// Freezes every fully written page of the committed prefix into a shared page (in
    /// place) and returns the leading run of shared pages, for the prefix cache. Stops at
    /// the first page that is not full: a cached prefix is always whole pages.
    pub fn share_full_pages(&mut self, visibility: &Visibility) -> Vec<Arc<SharedPage>> {
        let p = self.pool.layout().page_tokens;
        let full_pages = self.len / p;
        let old = std::mem::take(&mut self.blocks);
        let mut shared = Vec::new();
        let mut stopped = false;
        for (i, block) in old.into_iter().enumerate() {
            let block = match block {
                Block::Owned(lease) if !stopped && i < full_pages => {
                    match lease.freeze(visibility.clone()) {
                        Ok(page) => Block::Shared(page),
                        Err((lease, _not_full)) => {
                            stopped = true;
                            Block::Owned(lease)
                        }
                    }
                }
                other => other,
            };
            if !stopped && i < full_pages {
                match &block {
                    Block::Shared(page) if page.visibility() == visibility => {
                        shared.push(page.clone())
                    }
                    _ => stopped = true,
                }
            }
            self.blocks.push(block);
        }
        shared
    }
}
