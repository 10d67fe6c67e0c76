use crate::layout::{KvLayout, KvSlice, Row};
use crate::lease::PageLease;
use crate::pool::KvPool;
use crate::shared::SharedPage;
use crate::sync::Arc;
use crate::{KvError, Owner, Visibility};

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

/// Owned pages go back to the pool by their own drop; shared pages are released from this
/// sequence's use, so that the prefix cache may evict them from now on.
impl Drop for SequenceKv {
    fn drop(&mut self) {
        let shared: Vec<u32> = self
            .blocks
            .iter()
            .filter_map(|b| match b {
                Block::Shared(page) => Some(page.index()),
                Block::Owned(_) => None,
            })
            .collect();
        if !shared.is_empty() {
            self.pool.inner().unpin(shared);
        }
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
    /// domain; the prefix cache only offers such pages, and this re-checks it. Pages must
    /// also come from `pool`: another pool's page has another layout, and its positions
    /// would not line up with this sequence's.
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
        if prefix.iter().any(|p| !pool.owns_shared(p)) {
            return Err(KvError::ForeignPool {
                request: owner.request,
            });
        }
        let len = prefix.len() * pool.layout().page_tokens;
        // In use while this sequence lives: the prefix cache must not evict them.
        pool.inner().pin(prefix.iter().map(|p| p.index()));
        Ok(Self {
            owner,
            pool: pool.clone(),
            blocks: prefix.into_iter().map(Block::Shared).collect(),
            len,
        })
    }

    pub fn layout(&self) -> KvLayout {
        self.pool.layout()
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
        self.write_row(layer, position, Row::Values(k), Row::Values(v))
    }

    /// [`Self::write`] of rows computed or received (`Row`).
    pub(crate) fn write_row(
        &mut self,
        layer: usize,
        position: usize,
        k: Row<'_>,
        v: Row<'_>,
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
        lease.append_row(layer, k, v)
    }

    /// Declares positions `[len, new_len)` complete; refused unless every layer holds them.
    pub fn commit(&mut self, new_len: usize) -> Result<(), KvError> {
        if new_len < self.len {
            // Forgetting committed positions would let a later write land over a page that
            // may already be frozen and shared.
            return Err(KvError::CommitBackwards {
                request: self.owner.request,
                len: self.len,
                new_len,
            });
        }
        let layers = self.pool.layout().n_layers;
        for layer in 0..layers {
            self.runs(layer, new_len)?;
        }
        self.len = new_len;
        Ok(())
    }

    /// Forgets positions `[new_len, ..)`: speculative decoding's rejected draft tokens. Their
    /// slots read as never written (`UnwrittenRead`) until written again, in order, so no
    /// read after a rollback sees what a rolled-back position held. Refused, changing
    /// nothing, if a forgotten position lies in a shared page (frozen pages are immutable
    /// and may be another sequence's prefix) or if `new_len` is past the committed length.
    /// Positions written but not yet committed (a step that failed part-way) are forgotten
    /// too. The pages stay reserved.
    pub fn rollback(&mut self, new_len: usize) -> Result<(), KvError> {
        let request = self.owner.request;
        if new_len > self.len {
            return Err(KvError::RollbackForward {
                request,
                len: self.len,
                new_len,
            });
        }
        let p = self.pool.layout().page_tokens;
        // Pages from the one holding `new_len` on; the page before is wholly kept.
        let first = new_len / p;
        if let Some(page) =
            (first..self.blocks.len()).find(|&i| matches!(self.blocks[i], Block::Shared(_)))
        {
            return Err(KvError::RollbackIntoShared {
                request,
                new_len,
                page,
            });
        }
        for (i, block) in self.blocks.iter_mut().enumerate().skip(first) {
            if let Block::Owned(lease) = block {
                lease.truncate(new_len.saturating_sub(i * p));
            }
        }
        self.len = new_len;
        Ok(())
    }

    /// The K/V rows of positions `[0, upto)` on `layer`, one run per page. Fails if any of
    /// those positions was not written for this sequence.
    pub fn runs(&self, layer: usize, upto: usize) -> Result<Vec<KvRun<'_>>, KvError> {
        #[cfg(feature = "bench-unchecked-baseline")]
        if upto <= self.capacity() {
            return Ok(self.runs_unchecked_baseline(layer, upto));
        }
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

    /// FAULT INJECTION ONLY (the `fault-injection` feature, never in default builds): the
    /// incident's bug, so tests can prove that `kvwarden audit` catches it. Declares positions
    /// `[0, upto)` written and committed without writing them, as the incident's decode side
    /// trusted a transfer that never delivered the prompt's K/V: every later read of those
    /// positions passes the written-extent check and sees whatever the pages held before.
    #[cfg(feature = "fault-injection")]
    pub fn fault_claim_unwritten(&mut self, upto: usize) {
        let p = self.pool.layout().page_tokens;
        let upto = upto.min(self.capacity());
        for (i, block) in self.blocks.iter_mut().enumerate() {
            if let Block::Owned(lease) = block {
                lease.fault_mark_written(upto.saturating_sub(i * p).min(p));
            }
        }
        self.len = self.len.max(upto);
    }

    /// What `runs` costs without its checks; exists only in the benchmark build.
    #[cfg(feature = "bench-unchecked-baseline")]
    fn runs_unchecked_baseline(&self, layer: usize, upto: usize) -> Vec<KvRun<'_>> {
        let p = self.pool.layout().page_tokens;
        let mut out = Vec::with_capacity(upto.div_ceil(p));
        for (i, block) in self.blocks.iter().enumerate() {
            let start = i * p;
            if start >= upto {
                break;
            }
            let n = (upto - start).min(p);
            let (k, v) = match block {
                Block::Owned(lease) => lease.rows_unchecked_baseline(layer, n),
                Block::Shared(page) => page.rows_unchecked_baseline(layer, n),
            };
            out.push(KvRun { k, v, tokens: n });
        }
        out
    }

    /// Freezes every fully written page of the committed prefix into a shared page (in
    /// place) and returns the leading run of shared pages whose visibility is `visibility`,
    /// for the prefix cache. Stops at the first page that is not full: a cached prefix is
    /// always whole pages.
    ///
    /// `visibility` must be this sequence's own domain or [`Visibility::Public`]: tagging a
    /// request's pages with another tenant's domain would hand that tenant this request's
    /// data, so such a call freezes nothing and returns no pages. Prefer
    /// [`SequenceKv::share_full_pages_split`], which takes the domain from the owner.
    pub fn share_full_pages(&mut self, visibility: &Visibility) -> Vec<Arc<SharedPage>> {
        if !self.may_publish_as(visibility) {
            return Vec::new();
        }
        let full = self.full_pages();
        self.freeze_leading(|_| visibility.clone());
        self.leading_shared(full, |page| page.visibility() == visibility)
    }

    /// Like [`SequenceKv::share_full_pages`], with two visibilities: the first
    /// `public_pages` full pages are frozen [`Visibility::Public`], the rest of the full
    /// committed pages are frozen for this sequence's own domain. Returns every full
    /// committed page (pages it already shared, e.g. a cached prefix it started from,
    /// included), in order, ready for [`crate::PrefixCache::insert`].
    ///
    /// The caller asserts that the tokens of the first `public_pages` pages lie inside an
    /// operator-configured public prefix: compute it with
    /// [`crate::PublicPrefixes::public_pages`]. This type does not know tokens, so the prefix
    /// cache re-checks that claim before it offers any page to other domains; a page frozen
    /// public by mistake stays reachable only through this sequence.
    pub fn share_full_pages_split(&mut self, public_pages: usize) -> Vec<Arc<SharedPage>> {
        // K/V computed under an adapter is never the public (base-model) prefix's.
        let public_pages = if self.owner.domain.adapter().is_some() {
            0
        } else {
            public_pages
        };
        let own = Visibility::Domain(self.owner.domain.clone());
        let full = self.full_pages();
        self.freeze_leading(|i| {
            if i < public_pages {
                Visibility::Public
            } else {
                own.clone()
            }
        });
        let domain = self.owner.domain.clone();
        self.leading_shared(full, |page| page.visibility().readable_by(&domain))
    }

    fn may_publish_as(&self, visibility: &Visibility) -> bool {
        match visibility {
            Visibility::Public => self.owner.domain.adapter().is_none(),
            Visibility::Domain(d) => *d == self.owner.domain,
        }
    }

    /// Whole pages inside the committed length.
    fn full_pages(&self) -> usize {
        self.len / self.pool.layout().page_tokens
    }

    /// Freezes owned pages among the first `full_pages()`, page `i` with visibility
    /// `visibility(i)`, stopping at the first one that cannot be frozen.
    fn freeze_leading(&mut self, visibility: impl Fn(usize) -> Visibility) {
        let full = self.full_pages();
        let mut stopped = false;
        let mut frozen = Vec::new();
        // Rebuilt rather than edited in place: `freeze` consumes the lease.
        self.blocks = std::mem::take(&mut self.blocks)
            .into_iter()
            .enumerate()
            .map(|(i, block)| match block {
                Block::Owned(lease) if !stopped && i < full => match lease.freeze(visibility(i)) {
                    Ok(page) => {
                        frozen.push(page.index());
                        Block::Shared(page)
                    }
                    Err((lease, _not_full)) => {
                        stopped = true;
                        Block::Owned(lease)
                    }
                },
                other => other,
            })
            .collect();
        // This sequence uses the pages it froze, like those it started from.
        self.pool.inner().pin(frozen);
    }

    /// Clones of the leading run (among the first `full` pages) of shared pages that
    /// satisfy `keep`.
    fn leading_shared(
        &self,
        full: usize,
        keep: impl Fn(&SharedPage) -> bool,
    ) -> Vec<Arc<SharedPage>> {
        self.blocks
            .iter()
            .take(full)
            .map_while(|b| match b {
                Block::Shared(page) if keep(page) => Some(page.clone()),
                _ => None,
            })
            .collect()
    }
}
