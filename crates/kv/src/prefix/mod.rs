//! The prefix cache: a radix tree over token ids at page granularity, as in SGLang's
//! RadixAttention, but with one tree per isolation domain.
//!
//! A shared prefix cache is a side channel even when no byte crosses tenants: a hit is
//! faster than a miss, so a tenant that can probe a cross-tenant cache learns what other
//! tenants' prompts start with (Early Bird, PromptPeek, InputSnatch). Hence:
//!
//! * A lookup by domain `d` walks only `d`'s own tree and the public tree. Another tenant's
//!   prompt, however identical, is never a hit; a salted domain
//!   ([`IsolationDomain::narrowed`]) is just another domain, so a salt can only narrow
//!   sharing.
//! * The public tree holds only pages whose tokens lie entirely inside a prefix that the
//!   operator declared public ([`PublicPrefixes`]). The cache re-checks this on every insert
//!   instead of trusting the page's [`Visibility`] tag, so a caller bug cannot publish a
//!   tenant's prompt. What a public hit reveals is that *someone* sent a declared-public
//!   prefix recently, which the operator has declared harmless.
//! * A domain's tree may start with public pages (its prompt began with the public system
//!   prompt), so one walk of the domain's tree finds "public prefix + private
//!   continuation". A public page is never stored after a private one in the public tree:
//!   a page's K/V depends on every token before it.
//!
//! Eviction is LRU over the pages that nothing uses and whose nodes are all leaves, kept as
//! lists by the pool (as vLLM's free-block queue): a page joins the end of its holder's list
//! when its last user (a sequence, a lookup result in hand) lets go, leaves it when used
//! again, and eviction takes a list's head, so each evicted page costs O(1) plus O(holders)
//! whatever the size of the trees. Only pages that no request uses are ever evicted.
//!
//! Eviction is fair between tenants (`crate::evict`): a page's holder is its tenant (all of
//! a tenant's salted domains together, so salting cannot buy a larger share) or, for public
//! pages, the operator; pages go first from the holder with the most cached pages. One
//! tenant's flood evicts its own entries before another tenant's.

use std::collections::HashMap;

// The consistency checks the tests run, kept apart from the cache's own work.
mod check;
mod tree;

use crate::evict::Holder;
use crate::shared::SharedPage;
use crate::state::PoolInner;
use crate::sync::Arc;
use crate::{IsolationDomain, Visibility};
use tree::{Tree, ROOT};

/// Token prefixes the operator declared public (e.g. a shared system prompt), from
/// configuration. Pages inside them may be shared across all domains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublicPrefixes {
    prefixes: Vec<Vec<u32>>,
}

impl PublicPrefixes {
    /// No public prefix: nothing is shared across domains.
    pub fn none() -> Self {
        Self::default()
    }

    pub fn new(prefixes: impl IntoIterator<Item = Vec<u32>>) -> Self {
        Self {
            prefixes: prefixes.into_iter().filter(|p| !p.is_empty()).collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.prefixes.is_empty()
    }

    pub fn prefixes(&self) -> &[Vec<u32>] {
        &self.prefixes
    }

    /// Number of leading whole pages of `tokens` whose tokens all lie inside one configured
    /// public prefix (a prefix of `tokens` that is also a prefix of a configured one).
    pub fn public_pages(&self, tokens: &[u32], page_tokens: usize) -> usize {
        if page_tokens == 0 {
            return 0;
        }
        self.prefixes
            .iter()
            .map(|p| common_prefix_len(tokens, p) / page_tokens)
            .max()
            .unwrap_or(0)
    }
}

fn common_prefix_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Why [`PrefixCache::insert`] refused a chain. Nothing is inserted when it fails. The
/// messages name page indices only, never a domain: they may end up in logs or responses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefixError {
    #[error("{pages} pages of {page_tokens} tokens need {needed} token ids, got {got}")]
    TokensShort {
        pages: usize,
        page_tokens: usize,
        needed: usize,
        got: usize,
    },
    #[error("page {page} holds {got} tokens, but this cache is keyed by pages of {want}")]
    PageSize {
        page: usize,
        got: usize,
        want: usize,
    },
    #[error("page {page} is tagged for another isolation domain than the tree it would go into")]
    WrongVisibility { page: usize },
    #[error("page {page} is tagged public, but only the first {public_pages} pages of these tokens lie inside a configured public prefix")]
    NotPublic { page: usize, public_pages: usize },
    #[error("page {page} belongs to another KV pool than the pages this cache holds")]
    ForeignPool { page: usize },
}

/// The result of [`PrefixCache::lookup`]: the longest cached run of whole pages readable by
/// the looking-up domain whose tokens equal the start of the request's tokens. Holding it
/// keeps the pages in use (eviction skips them); hand the pages to
/// [`crate::SequenceKv::with_prefix`], which uses them in turn.
#[derive(Debug, Default)]
pub struct PrefixMatch {
    pages: Vec<Arc<SharedPage>>,
    tokens: usize,
    public: bool,
}

impl PrefixMatch {
    pub fn pages(&self) -> &[Arc<SharedPage>] {
        &self.pages
    }

    pub fn into_pages(mut self) -> Vec<Arc<SharedPage>> {
        let pages = std::mem::take(&mut self.pages);
        release(&pages);
        pages
    }

    /// Tokens covered: pages × page size.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// True if the match came from the public tree (for metrics).
    pub fn is_public(&self) -> bool {
        self.public
    }
}

/// A lookup result in hand uses its pages; dropping it makes them evictable again (and the
/// most recently used).
impl Drop for PrefixMatch {
    fn drop(&mut self) {
        release(&self.pages);
    }
}

fn release(pages: &[Arc<SharedPage>]) {
    if let Some(first) = pages.first() {
        first.pool_inner().unpin(pages.iter().map(|p| p.index()));
    }
}

/// Size of one tree, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Cached pages (nodes) in the tree; public pages at the start of a domain's tree count
    /// there too.
    pub nodes: usize,
}

/// The public tree's place in [`PrefixCache::trees`].
const PUBLIC: usize = 0;
/// The holder of public pages in the pool's eviction lists; tenants are numbered after it.
const PUBLIC_HOLDER: Holder = 0;

/// A page the cache holds, and the tree nodes that hold it (a public page can sit in the
/// public tree and at the start of several domain trees).
struct Cached {
    page: Arc<SharedPage>,
    nodes: Vec<(usize, usize)>,
}

/// A tenant-scoped prefix cache: one radix tree per [`IsolationDomain`] plus one for
/// operator-declared public prefixes. Not internally synchronized: the engine thread owns
/// it, and every method is short. All its pages come from one pool, which keeps the list
/// of evictable pages (see the module documentation).
pub struct PrefixCache {
    page_tokens: usize,
    public_prefixes: PublicPrefixes,
    /// `trees[PUBLIC]` is the public tree; the others belong to the domains of `domains`.
    /// `None` marks a vacant slot, listed in `vacant_trees`.
    trees: Vec<Option<Tree>>,
    vacant_trees: Vec<usize>,
    domains: HashMap<IsolationDomain, usize>,
    /// Each tenant's holder number in the pool's eviction lists (kept: tenants are few,
    /// the operator's key file names them).
    holders: HashMap<String, Holder>,
    /// Every cached page, by its index in the pool.
    pages: HashMap<u32, Cached>,
    /// The pool of every cached page, known from the first insert.
    pool: Option<Arc<PoolInner>>,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Domain names stay out of debug output: it ends up in logs.
        f.debug_struct("PrefixCache")
            .field("page_tokens", &self.page_tokens)
            .field("domains", &self.domains.len())
            .field("public_nodes", &self.tree(PUBLIC).live)
            .field("cached_pages", &self.pages.len())
            .finish()
    }
}

/// The pool's eviction state must not outlive the cache: its pages stop being cached.
impl Drop for PrefixCache {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            for &index in self.pages.keys() {
                pool.cache_leave(index);
            }
        }
    }
}

impl PrefixCache {
    /// A cache with no public prefix: nothing is ever shared across domains.
    pub fn new(page_tokens: usize) -> Self {
        Self::with_public_prefixes(page_tokens, PublicPrefixes::none())
    }

    /// A cache whose public tree accepts pages inside `public` prefixes.
    pub fn with_public_prefixes(page_tokens: usize, public: PublicPrefixes) -> Self {
        assert!(page_tokens > 0, "pages hold at least one token");
        Self {
            page_tokens,
            public_prefixes: public,
            trees: vec![Some(Tree::new(None))],
            vacant_trees: Vec::new(),
            domains: HashMap::new(),
            holders: HashMap::new(),
            pages: HashMap::new(),
            pool: None,
        }
    }

    fn tree(&self, t: usize) -> &Tree {
        self.trees[t].as_ref().expect("live tree")
    }

    fn tree_mut(&mut self, t: usize) -> &mut Tree {
        self.trees[t].as_mut().expect("live tree")
    }

    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }

    pub fn public_prefixes(&self) -> &PublicPrefixes {
        &self.public_prefixes
    }

    /// How many leading pages of `tokens` may be frozen [`Visibility::Public`]: pass this
    /// to [`crate::SequenceKv::share_full_pages_split`].
    pub fn public_pages(&self, tokens: &[u32]) -> usize {
        self.public_prefixes.public_pages(tokens, self.page_tokens)
    }

    /// Distinct pages the cache holds (each counted once however many trees hold it).
    pub fn cached_pages(&self) -> usize {
        self.pages.len()
    }

    /// Cached pages that no sequence or lookup result uses: the most that
    /// [`PrefixCache::evict`] could free. Kept as a counter, so a caller can see in O(1)
    /// that evicting cannot make enough room, and not try. (It frees fewer when some such
    /// page has a descendant in use: that node cannot go before its children.)
    pub fn evictable_pages(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.idle_cached())
    }

    pub fn domain_stats(&self, domain: &IsolationDomain) -> TreeStats {
        TreeStats {
            nodes: self.domains.get(domain).map_or(0, |&t| self.tree(t).live),
        }
    }

    pub fn public_stats(&self) -> TreeStats {
        TreeStats {
            nodes: self.tree(PUBLIC).live,
        }
    }

    /// Domains that currently have a tree.
    pub fn domains(&self) -> usize {
        self.domains.len()
    }

    /// The longest run of whole cached pages readable by `domain` whose tokens equal the
    /// start of `tokens`, at most `max_pages` pages, from the domain's own tree or the public
    /// tree, whichever is longer. The pages are in use while the result is held.
    ///
    /// The caller needs the logits of the last prompt token, so it should pass at most
    /// `(tokens.len() - 1) / page_tokens` to leave that token to compute.
    pub fn lookup(
        &mut self,
        domain: &IsolationDomain,
        tokens: &[u32],
        max_pages: usize,
    ) -> PrefixMatch {
        let p = self.page_tokens;
        let limit = max_pages.min(tokens.len() / p);
        let own_tree = self.domains.get(domain).copied();
        let own = own_tree
            .map(|t| self.tree(t).walk(tokens, limit, p, domain))
            .unwrap_or_default();
        // The public tree holds base-model K/V: a domain computed under an adapter cannot
        // read it (`Visibility::readable_by`), so it does not walk it.
        let public = match domain.adapter() {
            None => self.tree(PUBLIC).walk(tokens, limit, p, domain),
            Some(_) => Vec::new(),
        };
        let (tree, path, is_public) = if public.len() > own.len() {
            (PUBLIC, public, true)
        } else {
            match own_tree {
                Some(t) => (t, own, false),
                None => return PrefixMatch::default(),
            }
        };
        let tree = self.tree(tree);
        let pages: Vec<Arc<SharedPage>> = path
            .iter()
            .filter_map(|&id| tree.node(id).page.clone())
            .collect();
        if let (Some(pool), false) = (&self.pool, pages.is_empty()) {
            pool.pin(pages.iter().map(|pg| pg.index()));
        }
        PrefixMatch {
            tokens: pages.len() * p,
            public: is_public && !pages.is_empty(),
            pages,
        }
    }

    /// Caches the pages of a request that ran in `visibility` (its domain; or
    /// [`Visibility::Public`] to fill only the public tree), as returned by
    /// [`crate::SequenceKv::share_full_pages_split`]: `pages[i]` holds the K/V of
    /// `tokens[i * P..(i + 1) * P]`. Every page must be tagged `visibility` or public, and
    /// a public page must lie inside a configured public prefix; otherwise nothing is
    /// inserted. The leading public pages also go into the public tree. Where a node
    /// already exists, the cached page stays and the offered one is not kept.
    ///
    /// Returns how many pages the cache newly holds.
    pub fn insert(
        &mut self,
        visibility: &Visibility,
        tokens: &[u32],
        pages: &[Arc<SharedPage>],
    ) -> Result<usize, PrefixError> {
        let p = self.page_tokens;
        let needed = pages.len().saturating_mul(p);
        if tokens.len() < needed {
            return Err(PrefixError::TokensShort {
                pages: pages.len(),
                page_tokens: p,
                needed,
                got: tokens.len(),
            });
        }
        let public_pages = self.public_pages(tokens);
        let pool = self
            .pool
            .clone()
            .or_else(|| pages.first().map(|pg| pg.pool_inner().clone()));
        for (i, page) in pages.iter().enumerate() {
            let got = page.layout().page_tokens;
            if got != p {
                return Err(PrefixError::PageSize {
                    page: i,
                    got,
                    want: p,
                });
            }
            if !pool
                .as_ref()
                .is_some_and(|pool| Arc::ptr_eq(pool, page.pool_inner()))
            {
                return Err(PrefixError::ForeignPool { page: i });
            }
            match page.visibility() {
                Visibility::Public if i >= public_pages => {
                    return Err(PrefixError::NotPublic {
                        page: i,
                        public_pages,
                    })
                }
                Visibility::Public => {}
                tagged @ Visibility::Domain(_) if tagged == visibility => {}
                Visibility::Domain(_) => return Err(PrefixError::WrongVisibility { page: i }),
            }
        }
        let Some(pool) = pool else {
            return Ok(0);
        };
        self.pool = Some(pool);

        let leading_public = pages
            .iter()
            .take_while(|pg| *pg.visibility() == Visibility::Public)
            .count();
        let mut added = self.insert_chain(PUBLIC, tokens, &pages[..leading_public]);
        // No tree for a domain that offered nothing: an empty tree would only take memory.
        if let (Visibility::Domain(domain), false) = (visibility, pages.is_empty()) {
            let t = self.tree_for(domain);
            added += self.insert_chain(t, tokens, pages);
        }
        Ok(added)
    }

    fn tree_for(&mut self, domain: &IsolationDomain) -> usize {
        if let Some(&t) = self.domains.get(domain) {
            return t;
        }
        let tree = Tree::new(Some(domain.clone()));
        let t = match self.vacant_trees.pop() {
            Some(t) => {
                self.trees[t] = Some(tree);
                t
            }
            None => {
                self.trees.push(Some(tree));
                self.trees.len() - 1
            }
        };
        self.domains.insert(domain.clone(), t);
        t
    }

    fn insert_chain(&mut self, t: usize, tokens: &[u32], pages: &[Arc<SharedPage>]) -> usize {
        let p = self.page_tokens;
        let mut added = 0;
        let mut at = ROOT;
        for (i, page) in pages.iter().enumerate() {
            let edge = &tokens[i * p..(i + 1) * p];
            if let Some(&child) = self.tree(t).node(at).children.get(edge) {
                at = child;
                continue;
            }
            let parent_page = self.tree(t).node(at).page.as_ref().map(|pg| pg.index());
            let id = self.tree_mut(t).add_child(at, edge, page.clone());
            let index = page.index();
            let new = !self.pages.contains_key(&index);
            let holder = self.holder_of(page.visibility());
            let cached = self.pages.entry(index).or_insert_with(|| Cached {
                page: page.clone(),
                nodes: Vec::new(),
            });
            debug_assert!(Arc::ptr_eq(&cached.page, page), "one live page per index");
            cached.nodes.push((t, id));
            let leafy = self.leafy(index);
            if let Some(pool) = &self.pool {
                if new {
                    added += 1;
                    pool.cache_enter(index, leafy, holder);
                } else {
                    pool.set_leafy(index, leafy, false);
                }
                // The parent has a child now: it cannot be evicted before it.
                if let Some(parent) = parent_page {
                    pool.set_leafy(parent, false, false);
                }
            }
            at = id;
        }
        added
    }

    /// Whose share of the cache a page counts against: its tenant's, or the operator's.
    fn holder_of(&mut self, visibility: &Visibility) -> Holder {
        let Visibility::Domain(domain) = visibility else {
            return PUBLIC_HOLDER;
        };
        let next = Holder::try_from(self.holders.len() + 1).unwrap_or(Holder::MAX);
        *self
            .holders
            .entry(domain.tenant_name().to_owned())
            .or_insert(next)
    }

    /// Cached pages that count against `tenant` (all its domains, salted or not).
    pub fn tenant_pages(&self, tenant: &str) -> usize {
        match (self.holders.get(tenant), &self.pool) {
            (Some(&h), Some(pool)) => pool.holder_sizes().get(h as usize).copied().unwrap_or(0),
            _ => 0,
        }
    }

    /// True if every node of cached page `index` is a leaf.
    fn leafy(&self, index: u32) -> bool {
        self.pages.get(&index).is_some_and(|c| {
            c.nodes
                .iter()
                .all(|&(t, n)| self.tree(t).node(n).children.is_empty())
        })
    }

    /// Evicts pages that nothing uses, leaves first, until `pages_wanted` pages went back
    /// to the pool or nothing more can go: from the tenant holding the most cached pages
    /// first, least recently used first within it (see the module documentation). Each
    /// evicted page costs O(1) (plus the few tree nodes that hold it) and O(holders).
    /// Returns the pages returned to the pool.
    pub fn evict(&mut self, pages_wanted: usize) -> usize {
        self.evict_inner(pages_wanted, None)
    }

    /// [`PrefixCache::evict`] to make room for a request of `domain`: its tenant counts as
    /// holding the pages it wants as well as its cached ones, so a tenant whose requests
    /// need room gives up its own idle entries before it reaches a smaller tenant's.
    pub fn evict_for(&mut self, pages_wanted: usize, domain: &IsolationDomain) -> usize {
        let holder = self.holders.get(domain.tenant_name()).copied();
        self.evict_inner(pages_wanted, holder.map(|h| (h, pages_wanted)))
    }

    fn evict_inner(&mut self, pages_wanted: usize, for_holder: Option<(Holder, usize)>) -> usize {
        let Some(pool) = self.pool.clone() else {
            return 0;
        };
        let mut freed = 0;
        let mut emptied = Vec::new();
        while freed < pages_wanted {
            let Some(index) = pool.pop_evictable(for_holder) else {
                break;
            };
            let Some(cached) = self.pages.remove(&index) else {
                debug_assert!(false, "the evictable list names a page the cache lacks");
                continue;
            };
            let mut parents = Vec::new();
            for &(t, n) in &cached.nodes {
                let tree = self.tree_mut(t);
                let parent = tree.remove_leaf(n);
                if let Some(pg) = tree.node(parent).page.as_ref() {
                    parents.push(pg.index());
                }
                if t != PUBLIC && tree.live == 0 {
                    emptied.push(t);
                }
            }
            pool.cache_leave(index);
            // The cache held the last reference: dropping it returns the page.
            if Arc::strong_count(&cached.page) == 1 {
                freed += 1;
            }
            drop(cached);
            for parent in parents {
                if self.pages.contains_key(&parent) {
                    // Used no later than the child just evicted: it goes next.
                    pool.set_leafy(parent, self.leafy(parent), true);
                }
            }
        }
        for t in emptied {
            if let Some(tree) = self.trees[t].take() {
                if let Some(domain) = tree.domain {
                    self.domains.remove(&domain);
                }
                self.vacant_trees.push(t);
            }
        }
        freed
    }

    /// Test support: every distinct page the cache holds.
    #[doc(hidden)]
    pub fn debug_pages(&self) -> Vec<Arc<SharedPage>> {
        self.pages.values().map(|c| c.page.clone()).collect()
    }
}
