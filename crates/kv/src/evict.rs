//! What the prefix cache's eviction needs to know of each page, kept by the pool so that
//! the code that drops a page's users (a finished sequence, a dropped lookup) can make it
//! evictable at once, in O(1), without the cache scanning for it: the same design as
//! vLLM's free-block queue, with one list per holder.
//!
//! Fairness: every cached page belongs to one *holder* (a tenant, or the operator's public
//! prefixes), chosen by the cache when the page enters it. Eviction takes from the holder
//! that has the most pages in the cache, counting for the tenant the room is for the pages
//! it is about to hold, least recently used first within it, and between holders of equal
//! size the one whose next page was used least recently. So a tenant that floods the cache
//! evicts its own entries before anyone else's, and another tenant's entries go only once
//! the flooder has nothing idle left in the cache: then the pages are needed by running
//! work, which must not wait behind idle entries. Choosing the holder costs O(holders) per
//! evicted page.

/// A holder of cached pages, as the prefix cache numbers them.
pub(crate) type Holder = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct UseMeta {
    /// Sequences and lookup results holding the page.
    users: u32,
    /// The prefix cache holds the page.
    in_cache: bool,
    /// Every cache node of the page is a leaf (a node with children cannot go first).
    leafy: bool,
    /// In its holder's list: `users == 0 && in_cache && leafy`.
    listed: bool,
    holder: Holder,
    /// When it was last listed as most recently used: orders holders of equal size.
    stamp: u64,
    prev: u32,
    next: u32,
}

impl Default for UseMeta {
    fn default() -> Self {
        Self {
            users: 0,
            in_cache: false,
            leafy: false,
            listed: false,
            holder: 0,
            stamp: 0,
            prev: NIL,
            next: NIL,
        }
    }
}

/// One holder's evictable pages (an intrusive doubly linked list through [`UseMeta`]),
/// and how many pages it has in the cache, evictable or not.
#[derive(Debug, Clone, Copy)]
struct HolderList {
    head: u32,
    tail: u32,
    cached: usize,
}

impl Default for HolderList {
    fn default() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            cached: 0,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Eviction {
    meta: Vec<UseMeta>,
    holders: Vec<HolderList>,
    /// Pages in the prefix cache that nothing uses: what eviction could at most free.
    idle_cached: usize,
    tick: u64,
}

impl Eviction {
    pub(crate) fn new(pages: usize) -> Self {
        Self {
            meta: vec![UseMeta::default(); pages],
            holders: Vec::new(),
            idle_cached: 0,
            tick: 0,
        }
    }

    /// The page went back to the pool: no user and no cache holds it any more.
    pub(crate) fn reset(&mut self, i: u32) {
        let m = &self.meta[i as usize];
        debug_assert!(!m.listed && !m.in_cache && m.users == 0);
        self.meta[i as usize] = UseMeta::default();
    }

    fn unlist(&mut self, i: u32) {
        let UseMeta {
            prev,
            next,
            listed,
            holder,
            ..
        } = self.meta[i as usize];
        if !listed {
            return;
        }
        let list = &mut self.holders[holder as usize];
        if prev == NIL {
            list.head = next;
        }
        if next == NIL {
            list.tail = prev;
        }
        if prev != NIL {
            self.meta[prev as usize].next = next;
        }
        if next != NIL {
            self.meta[next as usize].prev = prev;
        }
        let m = &mut self.meta[i as usize];
        (m.prev, m.next, m.listed) = (NIL, NIL, false);
    }

    /// Lists page `i` if it is evictable and unlists it if not. `front`: it goes next in
    /// its holder's list (a parent whose last child was just evicted was used no later
    /// than that child); otherwise last (it was just used).
    fn update(&mut self, i: u32, front: bool) {
        let m = self.meta[i as usize];
        let evictable = m.users == 0 && m.in_cache && m.leafy;
        if evictable == m.listed {
            return;
        }
        if !evictable {
            self.unlist(i);
            return;
        }
        let h = m.holder as usize;
        let HolderList { head, tail, .. } = self.holders[h];
        if front {
            let stamp = match head {
                NIL => m.stamp,
                head => self.meta[head as usize].stamp.min(m.stamp),
            };
            let m = &mut self.meta[i as usize];
            (m.prev, m.next, m.listed, m.stamp) = (NIL, head, true, stamp);
            match head {
                NIL => self.holders[h].tail = i,
                head => self.meta[head as usize].prev = i,
            }
            self.holders[h].head = i;
        } else {
            self.tick += 1;
            let m = &mut self.meta[i as usize];
            (m.prev, m.next, m.listed, m.stamp) = (tail, NIL, true, self.tick);
            match tail {
                NIL => self.holders[h].head = i,
                tail => self.meta[tail as usize].next = i,
            }
            self.holders[h].tail = i;
        }
    }

    pub(crate) fn pin(&mut self, i: u32) {
        let m = &mut self.meta[i as usize];
        m.users += 1;
        if m.users == 1 && m.in_cache {
            self.idle_cached -= 1;
        }
        self.update(i, false);
    }

    pub(crate) fn unpin(&mut self, i: u32) {
        let m = &mut self.meta[i as usize];
        debug_assert!(m.users > 0, "unpin without pin");
        m.users = m.users.saturating_sub(1);
        if m.users == 0 && m.in_cache {
            self.idle_cached += 1;
        }
        self.update(i, false);
    }

    pub(crate) fn cache_enter(&mut self, i: u32, leafy: bool, holder: Holder) {
        let h = holder as usize;
        if self.holders.len() <= h {
            self.holders.resize(h + 1, HolderList::default());
        }
        self.holders[h].cached += 1;
        let m = &mut self.meta[i as usize];
        debug_assert!(!m.in_cache);
        (m.in_cache, m.leafy, m.holder) = (true, leafy, holder);
        if m.users == 0 {
            self.idle_cached += 1;
        }
        self.update(i, false);
    }

    pub(crate) fn cache_leave(&mut self, i: u32) {
        let m = self.meta[i as usize];
        debug_assert!(m.in_cache);
        // Off the list under its holder before the page stops being cached.
        self.meta[i as usize].in_cache = false;
        self.update(i, false);
        let list = &mut self.holders[m.holder as usize];
        list.cached = list.cached.saturating_sub(1);
        if m.users == 0 {
            self.idle_cached -= 1;
        }
    }

    pub(crate) fn set_leafy(&mut self, i: u32, leafy: bool, front: bool) {
        self.meta[i as usize].leafy = leafy;
        self.update(i, front);
    }

    /// Takes the next page to evict off its holder's list: from the holder with the most
    /// cached pages among those with an evictable page, its least recently used one. The
    /// holder the room is for (if known) counts the `wanted` pages it is about to hold too.
    pub(crate) fn pop(&mut self, for_holder: Option<(Holder, usize)>) -> Option<u32> {
        let size = |h: usize, l: &HolderList| match for_holder {
            Some((f, wanted)) if f as usize == h => l.cached + wanted,
            _ => l.cached,
        };
        let head = self
            .holders
            .iter()
            .enumerate()
            .filter(|(_, l)| l.head != NIL)
            .max_by(|(ha, a), (hb, b)| {
                size(*ha, a).cmp(&size(*hb, b)).then_with(|| {
                    let (sa, sb) = (
                        self.meta[a.head as usize].stamp,
                        self.meta[b.head as usize].stamp,
                    );
                    sb.cmp(&sa)
                })
            })?
            .1
            .head;
        self.unlist(head);
        Some(head)
    }

    pub(crate) fn idle_cached(&self) -> usize {
        self.idle_cached
    }

    /// (users, in cache, leafy, listed, holder) of page `i`.
    pub(crate) fn meta(&self, i: u32) -> (u32, bool, bool, bool, Holder) {
        let m = self.meta[i as usize];
        (m.users, m.in_cache, m.leafy, m.listed, m.holder)
    }

    /// Cached pages each holder has (index = holder).
    pub(crate) fn holder_sizes(&self) -> Vec<usize> {
        self.holders.iter().map(|l| l.cached).collect()
    }

    /// Every holder's list, head first, one after another.
    pub(crate) fn lists(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for list in &self.holders {
            let mut at = list.head;
            while at != NIL && out.len() <= self.meta.len() {
                out.push(at);
                at = self.meta[at as usize].next;
            }
        }
        out
    }
}
