//! Who holds pages: cancelled requests dropped, waiting ones promoted, running ones grown
//! (preempting a younger one when the pool is dry), finished prompts offered to the cache.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use kv::{Owner, PrefixCache, SequenceKv, Visibility};

use super::{Running, Worker};
use crate::preemption::{self, Holding, Load};
use crate::{EngineError, EngineMetrics, Event};

impl Worker {
    /// Drops the requests whose client stopped listening. Why it stopped (it went away, or
    /// the server matched a stop string) is the server's to count, not the engine's.
    pub(super) fn drop_cancelled(&mut self) {
        self.waiting.retain(|w| !w.events.is_closed());
        self.running.retain(|r| !r.progress.events.is_closed());
    }

    /// Frees pages for a request of `domain` by evicting cached prefixes that no request
    /// uses (its own tenant's first when it holds the most: `kv::PrefixCache::evict_for`),
    /// if that can make enough room. Cheap when it cannot (the head of the queue may wait
    /// many steps): the cache counts its evictable pages, so nothing is scanned and nothing
    /// is evicted in vain.
    pub(super) fn make_room(&mut self, pages: usize, domain: &kv::IsolationDomain) -> bool {
        let free = self.pool.counts().free;
        if pages <= free {
            return true;
        }
        if let Some(cache) = &mut self.cache {
            if free + cache.evictable_pages() >= pages {
                cache.evict_for(pages - free, domain);
            }
        }
        pages <= self.pool.counts().free
    }

    /// The waiting request to run next: the oldest of the tenant that runs the fewest for
    /// its weight, so that running slots are shared between tenants in proportion to their
    /// weights (and arrival order decides within one). With its tenant's count of running
    /// requests.
    fn next_waiting(&self) -> Option<(usize, usize)> {
        let mut running: HashMap<&str, usize> = HashMap::new();
        for r in &self.running {
            *running
                .entry(r.progress.request.domain.tenant_name())
                .or_default() += 1;
        }
        // `waiting` is in arrival order: the first of each load is the oldest.
        let mut best: Option<(usize, usize, Load)> = None;
        for (i, w) in self.waiting.iter().enumerate() {
            let count = running
                .get(w.request.domain.tenant_name())
                .copied()
                .unwrap_or(0);
            let load = Load::new(count, w.request.weight);
            if best.is_none_or(|(_, _, least)| load.lighter_than(least)) {
                best = Some((i, count, load));
            }
        }
        best.map(|(i, count, _)| (i, count))
    }

    /// Moves waiting requests into the running set, the oldest of the tenant running the
    /// fewest first, while the pool has room for their stream so far plus one page to grow
    /// into, and a spare page for each request already running. When every slot is taken
    /// and another tenant runs at least two more than the waiting request's (for their
    /// weights: `crate::preemption::slot_victim`), the waiting request runs in one of
    /// [`burst_rows`] extra rows while one is free, the pool has room and its tenant runs
    /// nothing else, and otherwise that tenant's youngest running request gives its slot
    /// back. So one tenant's flood delays another's next request by one step, not by its
    /// queue, and a light tenant's occasional request costs the flood one row, not the
    /// recomputation of a request.
    pub(super) fn promote(&mut self) {
        let burst = burst_rows(self.config.max_running);
        while let Some((w, tenant_running)) = self.next_waiting() {
            let mut bursting = None;
            if self.running.len() >= self.config.max_running {
                let tenants: Vec<Holding<'_>> = self
                    .running
                    .iter()
                    .map(|r| Holding {
                        tenant: r.progress.request.domain.tenant_name(),
                        weight: r.progress.request.weight,
                        pages: 0,
                    })
                    .collect();
                let weight = self.waiting[w].request.weight;
                let Some(v) = preemption::slot_victim(&tenants, tenant_running, weight) else {
                    break;
                };
                // Extra rows only for a tenant running nothing (an occasional request):
                // one taken by a tenant already running would be held for as long as its
                // requests run, and the running set would settle on whichever shares the
                // arrival order left (two tenants of weights 3 and 1 flooding four slots
                // settled at 3 to 2 when the light one's flood came first, 3 to 1 when not).
                if self.running.len() < self.config.max_running + burst && tenant_running == 0 {
                    bursting = Some(v);
                } else {
                    let victim = self.running.remove(v);
                    self.preempt(victim);
                    // The victim went back into `waiting`: choose again.
                    continue;
                }
            }
            match self.place(w, self.running.len()) {
                Placement::Placed(r) => self.running.push(*r),
                Placement::Failed => {}
                Placement::NoRoom => {
                    // No room for an extra row: the slot's holder gives its pages back
                    // after all.
                    if let Some(v) = bursting {
                        let victim = self.running.remove(v);
                        self.preempt(victim);
                        continue;
                    }
                    break;
                }
            }
        }
        self.running.sort_by_key(|r| r.progress.arrival);
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        self.metrics
            .waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
    }

    /// Gives waiting request `w` its pages: a cached prefix of its own domain (or a public
    /// one) and room for its stream so far plus one page to grow into, with `headroom` spare
    /// pages left for the requests already running. The request leaves `waiting` unless
    /// there is no room (then nothing changed).
    pub(super) fn place(&mut self, w: usize, headroom: usize) -> Placement {
        let head = &self.waiting[w];
        let owner = Owner {
            request: head.id,
            domain: head.request.domain.clone(),
        };
        let stream: Vec<u32> = (0..head.stream_len())
            .map(|i| head.stream_token(i))
            .collect();
        // The last token of the stream is always computed, since sampling needs its logits.
        let prefix = match &mut self.cache {
            Some(cache) => {
                let max_pages = (stream.len() - 1) / self.config.page_tokens;
                cache.lookup(&owner.domain, &stream, max_pages)
            }
            None => kv::PrefixMatch::default(),
        };
        let cached = prefix.tokens();
        let mut kv = match SequenceKv::with_prefix(&self.pool, owner, prefix.into_pages()) {
            Ok(kv) => kv,
            Err(e) => {
                // Unreachable unless the cache broke its contract: fail the request, loudly.
                EngineMetrics::add(&self.metrics.isolation_failures, 1);
                tracing::error!("prefix cache offered an unreadable page: {e}");
                if let Some(failed) = self.waiting.remove(w) {
                    failed.end(Event::Failed(EngineError::Isolation(e)));
                }
                return Placement::Failed;
            }
        };
        let target = (stream.len() + self.config.page_tokens).min(head.total_tokens);
        let domain = kv.owner().domain.clone();
        let placed = self.make_room(kv.pages_needed(target) + headroom, &domain)
            && match kv.reserve(target) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!("reservation deferred: {e}");
                    false
                }
            };
        if !placed {
            return Placement::NoRoom;
        }
        let Some(mut progress) = self.waiting.remove(w) else {
            return Placement::NoRoom;
        };
        #[cfg(feature = "fault-injection")]
        if progress.fault_claim > 0 {
            kv.fault_claim_unwritten(progress.fault_claim);
        }
        if progress.cached_tokens.is_none() {
            progress.cached_tokens = Some(cached);
            EngineMetrics::add(
                &self.metrics.prompt_tokens,
                progress.request.prompt.len() as u64,
            );
            EngineMetrics::add(&self.metrics.cached_prompt_tokens, cached as u64);
        }
        Placement::Placed(Box::new(Running::new(progress, kv)))
    }

    /// Gives every running request the pages its next input needs, oldest first. When the
    /// pool is dry, a younger request is preempted (the one asking, if it is the youngest),
    /// chosen fairly between tenants (`crate::preemption::victim`).
    pub(super) fn grow(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let need = {
                let r = &self.running[i];
                r.kv.pages_needed(r.progress.stream_len())
            };
            // The domain is cloned only at a page boundary, not at every step.
            let room = need == 0 || {
                let domain = self.running[i].progress.request.domain.clone();
                self.make_room(need, &domain)
            };
            if room {
                let r = &mut self.running[i];
                if r.kv.reserve(r.progress.stream_len()).is_ok() {
                    i += 1;
                    continue;
                }
            }
            let holdings: Vec<Holding<'_>> = self
                .running
                .iter()
                .map(|r| Holding {
                    tenant: r.progress.request.domain.tenant_name(),
                    weight: r.progress.request.weight,
                    pages: r.kv.owned_pages(),
                })
                .collect();
            let Some(v) = preemption::victim(&holdings, i) else {
                break;
            };
            let victim = self.running.remove(v);
            self.preempt(victim);
            // The victim is `i` or younger: `i` now indexes the same request, or the next
            // one if it was the victim, or is past the end.
        }
        self.grow_for_drafts();
    }

    /// Room for drafts (`crate::speculation`): a decode row whose pages end at its next
    /// position gets one more page, only from free pages beyond a spare one per running
    /// request, never by eviction or preemption, and only while the policy could let a
    /// step carry drafts at all. Within the request's admitted total, so the capacity
    /// promise is untouched.
    fn grow_for_drafts(&mut self) {
        let spec = self.config.speculation;
        let running = self.running.len();
        if !spec.allows(running, !self.waiting.is_empty()) {
            return;
        }
        for i in 0..running {
            let r = &self.running[i];
            if r.remaining() != 1
                || r.progress.prefill_only
                || r.progress.request.constraint.is_some()
            {
                continue;
            }
            let want = (r.progress.stream_len() + spec.max_draft).min(r.progress.total_tokens);
            let need = r.kv.pages_needed(want);
            if need == 0 || self.pool.counts().free < need + running {
                continue;
            }
            if let Err(e) = self.running[i].kv.reserve(want) {
                tracing::debug!("no room for a draft: {e}");
            }
        }
    }

    /// Returns a request's pages and puts it back at the head of the queue, to recompute.
    fn preempt(&mut self, r: Running) {
        EngineMetrics::add(&self.metrics.preemptions, 1);
        let progress = r.release();
        let at = self
            .waiting
            .iter()
            .position(|w| w.arrival > progress.arrival)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, progress);
    }

    /// Offers a request's full prompt pages to the prefix cache once its prompt is in KV.
    pub(super) fn share_prompt(&mut self, i: usize) {
        share_prompt_of(
            &mut self.cache,
            self.config.page_tokens,
            &mut self.running[i],
        );
    }
}

/// Where [`Worker::place`] left a waiting request.
pub(super) enum Placement {
    Placed(Box<Running>),
    /// Not enough pages: the request still waits.
    NoRoom,
    /// Ended with an error.
    Failed,
}

/// [`Worker::share_prompt`] for a request wherever it is held.
pub(super) fn share_prompt_of(
    cache: &mut Option<PrefixCache>,
    page_tokens: usize,
    r: &mut Running,
) {
    let Some(cache) = cache else {
        return;
    };
    let public = cache.public_pages(&r.progress.request.prompt);
    let pages = r.kv.share_full_pages_split(public);
    let prompt_pages = r.progress.request.prompt.len() / page_tokens;
    let pages = &pages[..pages.len().min(prompt_pages)];
    let visibility = Visibility::Domain(r.progress.request.domain.clone());
    if let Err(e) = cache.insert(&visibility, &r.progress.request.prompt, pages) {
        tracing::warn!("prompt pages not cached: {e}");
    }
}

/// Rows beyond `max_running` that requests of tenants running less than their share may
/// take instead of preempting a heavier tenant's request: an eighth, at least one.
pub(crate) fn burst_rows(max_running: usize) -> usize {
    max_running.div_ceil(8).max(1)
}
