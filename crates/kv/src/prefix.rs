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
//! Eviction is LRU over leaves of all trees, and only frees pages that no running request
//! holds. It is global, so one tenant's load can evict another's entries: that reveals
//! load, not content, but per-domain quotas would be needed to hide even that.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::sync::Arc;
use crate::{IsolationDomain, SharedPage, Visibility};

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
}

/// The result of [`PrefixCache::lookup`]: the longest cached run of whole pages readable by
/// the looking-up domain whose tokens equal the start of the request's tokens. Holding it
/// keeps the pages alive (eviction skips them); hand the pages to
/// [`crate::SequenceKv::with_prefix`].
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

    pub fn into_pages(self) -> Vec<Arc<SharedPage>> {
        self.pages
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

/// Size of one tree, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Cached pages (nodes) in the tree; public pages at the start of a domain's tree count
    /// there too.
    pub nodes: usize,
}

const ROOT: usize = 0;

struct Node {
    /// `None` only at the root.
    page: Option<Arc<SharedPage>>,
    parent: usize,
    /// The `page_tokens` token ids this node's page covers (its key in the parent).
    edge: Box<[u32]>,
    children: HashMap<Box<[u32]>, usize>,
    last_used: u64,
}

struct Tree {
    /// Arena; `None` marks a vacant slot, listed in `vacant`.
    nodes: Vec<Option<Node>>,
    vacant: Vec<usize>,
    live: usize,
}

impl Tree {
    fn new() -> Self {
        Self {
            nodes: vec![Some(Node {
                page: None,
                parent: ROOT,
                edge: Box::new([]),
                children: HashMap::new(),
                last_used: 0,
            })],
            vacant: Vec::new(),
            live: 0,
        }
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("live node id")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("live node id")
    }

    /// Node ids of the longest cached path matching `tokens`, at most `limit` pages, every
    /// page readable by `reader` (checked again here although inserts guarantee it: this
    /// is the last point before pages leave the cache).
    fn walk(&self, tokens: &[u32], limit: usize, p: usize, reader: &IsolationDomain) -> Vec<usize> {
        let mut path = Vec::new();
        let mut at = ROOT;
        for i in 0..limit {
            let Some(&child) = self.node(at).children.get(&tokens[i * p..(i + 1) * p]) else {
                break;
            };
            let readable = self
                .node(child)
                .page
                .as_ref()
                .is_some_and(|pg| pg.visibility().readable_by(reader));
            if !readable {
                debug_assert!(false, "unreadable page in a tree its reader may walk");
                break;
            }
            path.push(child);
            at = child;
        }
        path
    }

    fn add_child(&mut self, parent: usize, edge: &[u32], page: Arc<SharedPage>, now: u64) -> usize {
        let node = Node {
            page: Some(page),
            parent,
            edge: edge.into(),
            children: HashMap::new(),
            last_used: now,
        };
        let id = match self.vacant.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        self.node_mut(parent).children.insert(edge.into(), id);
        self.live += 1;
        id
    }

    fn remove_leaf(&mut self, id: usize) -> (Arc<SharedPage>, usize) {
        let node = self.nodes[id].take().expect("live node id");
        debug_assert!(node.children.is_empty() && id != ROOT);
        self.node_mut(node.parent).children.remove(&node.edge);
        self.vacant.push(id);
        self.live -= 1;
        (node.page.expect("non-root node holds a page"), node.parent)
    }

    fn live_ids(&self) -> impl Iterator<Item = usize> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(id, n)| *id != ROOT && n.is_some())
            .map(|(id, _)| id)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum TreeId {
    Public,
    Domain(IsolationDomain),
}

/// Identity of a page while the cache holds a reference to it (the address cannot be
/// reused while that reference lives).
fn page_key(page: &Arc<SharedPage>) -> usize {
    Arc::as_ptr(page) as *const () as usize
}

/// A tenant-scoped prefix cache: one radix tree per [`IsolationDomain`] plus one for
/// operator-declared public prefixes. Not internally synchronized: the engine owns it
/// behind its scheduler lock, and every method is short.
pub struct PrefixCache {
    page_tokens: usize,
    public_prefixes: PublicPrefixes,
    public: Tree,
    domains: HashMap<IsolationDomain, Tree>,
    /// Tree nodes referencing each cached page (a public page can sit in the public tree
    /// and at the start of several domain trees). A page no request holds has
    /// `Arc::strong_count == refs`.
    refs: HashMap<usize, usize>,
    clock: u64,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Domain names stay out of debug output: it ends up in logs.
        f.debug_struct("PrefixCache")
            .field("page_tokens", &self.page_tokens)
            .field("domains", &self.domains.len())
            .field("public_nodes", &self.public.live)
            .field("cached_pages", &self.refs.len())
            .finish()
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
            public: Tree::new(),
            domains: HashMap::new(),
            refs: HashMap::new(),
            clock: 0,
        }
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
        self.refs.len()
    }

    pub fn domain_stats(&self, domain: &IsolationDomain) -> TreeStats {
        TreeStats {
            nodes: self.domains.get(domain).map_or(0, |t| t.live),
        }
    }

    pub fn public_stats(&self) -> TreeStats {
        TreeStats {
            nodes: self.public.live,
        }
    }

    /// Domains that currently have a tree.
    pub fn domains(&self) -> usize {
        self.domains.len()
    }

    /// The longest run of whole cached pages readable by `domain` whose tokens equal the
    /// start of `tokens`, at most `max_pages` pages, from the domain's own tree or the public
    /// tree, whichever is longer. Marks the matched entries recently used.
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
        let own = self
            .domains
            .get(domain)
            .map(|t| t.walk(tokens, limit, p, domain))
            .unwrap_or_default();
        let public = self.public.walk(tokens, limit, p, domain);
        self.clock += 1;
        let now = self.clock;
        let (tree, path, is_public) = if public.len() > own.len() {
            (&mut self.public, public, true)
        } else {
            match self.domains.get_mut(domain) {
                Some(t) => (t, own, false),
                None => return PrefixMatch::default(),
            }
        };
        let pages = path
            .iter()
            .map(|&id| {
                let node = tree.node_mut(id);
                node.last_used = now;
                node.page.clone().expect("non-root node holds a page")
            })
            .collect::<Vec<_>>();
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
        for (i, page) in pages.iter().enumerate() {
            let got = page.layout().page_tokens;
            if got != p {
                return Err(PrefixError::PageSize {
                    page: i,
                    got,
                    want: p,
                });
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

        self.clock += 1;
        let now = self.clock;
        let leading_public = pages
            .iter()
            .take_while(|pg| *pg.visibility() == Visibility::Public)
            .count();
        let mut added = Self::insert_chain(
            &mut self.public,
            &mut self.refs,
            tokens,
            &pages[..leading_public],
            p,
            now,
        );
        // No tree for a domain that offered nothing: an empty tree would only take memory.
        if let (Visibility::Domain(domain), false) = (visibility, pages.is_empty()) {
            let tree = self.domains.entry(domain.clone()).or_insert_with(Tree::new);
            added += Self::insert_chain(tree, &mut self.refs, tokens, pages, p, now);
        }
        Ok(added)
    }

    fn insert_chain(
        tree: &mut Tree,
        refs: &mut HashMap<usize, usize>,
        tokens: &[u32],
        pages: &[Arc<SharedPage>],
        p: usize,
        now: u64,
    ) -> usize {
        let mut added = 0;
        let mut at = ROOT;
        for (i, page) in pages.iter().enumerate() {
            let edge = &tokens[i * p..(i + 1) * p];
            at = match tree.node(at).children.get(edge) {
                Some(&child) => {
                    tree.node_mut(child).last_used = now;
                    child
                }
                None => {
                    let count = refs.entry(page_key(page)).or_insert(0);
                    if *count == 0 {
                        added += 1;
                    }
                    *count += 1;
                    tree.add_child(at, edge, page.clone(), now)
                }
            };
        }
        added
    }

    /// Evicts least recently used leaves whose page no running request holds, until
    /// `pages_wanted` pages went back to the pool or nothing more can go. Returns the pages
    /// returned to the pool.
    pub fn evict(&mut self, pages_wanted: usize) -> usize {
        if pages_wanted == 0 {
            return 0;
        }
        let mut freed = 0;
        let mut candidates: Vec<(TreeId, usize)> = Vec::new();
        let mut heap = BinaryHeap::new();
        let trees = std::iter::once((TreeId::Public, &self.public)).chain(
            self.domains
                .iter()
                .map(|(d, t)| (TreeId::Domain(d.clone()), t)),
        );
        for (tid, tree) in trees {
            for id in tree.live_ids() {
                if self.evictable(tree, id) {
                    heap.push(Reverse((tree.node(id).last_used, candidates.len())));
                    candidates.push((tid.clone(), id));
                }
            }
        }
        while let Some(Reverse((_, c))) = heap.pop() {
            let (tid, id) = candidates[c].clone();
            let tree = match &tid {
                TreeId::Public => &self.public,
                TreeId::Domain(d) => &self.domains[d],
            };
            // Removing a leaf elsewhere can change a shared page's reference count.
            if !self.evictable(tree, id) {
                continue;
            }
            let tree = match &tid {
                TreeId::Public => &mut self.public,
                TreeId::Domain(d) => self.domains.get_mut(d).expect("tree exists"),
            };
            let (page, parent) = tree.remove_leaf(id);
            let key = page_key(&page);
            let count = self.refs.get_mut(&key).expect("cached page is counted");
            *count -= 1;
            if *count == 0 {
                self.refs.remove(&key);
                freed += 1;
            }
            drop(page);
            if freed >= pages_wanted {
                break;
            }
            let tree = match &tid {
                TreeId::Public => &self.public,
                TreeId::Domain(d) => &self.domains[d],
            };
            if parent != ROOT && self.evictable(tree, parent) {
                heap.push(Reverse((tree.node(parent).last_used, candidates.len())));
                candidates.push((tid, parent));
            }
        }
        self.domains.retain(|_, t| t.live > 0);
        freed
    }

    /// A leaf whose page only the cache holds.
    fn evictable(&self, tree: &Tree, id: usize) -> bool {
        let Some(node) = tree.nodes[id].as_ref() else {
            return false;
        };
        let Some(page) = node.page.as_ref() else {
            return false;
        };
        node.children.is_empty()
            && self
                .refs
                .get(&page_key(page))
                .is_some_and(|&r| Arc::strong_count(page) == r)
    }

    /// Test support: every distinct page the cache holds.
    #[doc(hidden)]
    pub fn debug_pages(&self) -> Vec<Arc<SharedPage>> {
        let mut seen = HashMap::new();
        let trees = std::iter::once(&self.public).chain(self.domains.values());
        for tree in trees {
            for node in tree.nodes.iter().flatten() {
                if let Some(page) = &node.page {
                    seen.entry(page_key(page)).or_insert_with(|| page.clone());
                }
            }
        }
        seen.into_values().collect()
    }

    /// Test support: checks the cache's structural and isolation invariants: every page in
    /// a domain's tree is readable by that domain, the public tree holds only public pages
    /// inside a configured public prefix, child links match parent links, and `refs`
    /// counts exactly the nodes holding each page.
    #[doc(hidden)]
    pub fn debug_check(&self) -> Result<(), String> {
        let mut counted: HashMap<usize, usize> = HashMap::new();
        let p = self.page_tokens;
        let trees = std::iter::once((None, &self.public))
            .chain(self.domains.iter().map(|(d, t)| (Some(d), t)));
        for (domain, tree) in trees {
            if domain.is_some() && tree.live == 0 {
                return Err("empty domain tree kept".into());
            }
            let mut live = 0;
            for id in tree.live_ids() {
                live += 1;
                let node = tree.node(id);
                let page = node.page.as_ref().ok_or("non-root node without page")?;
                *counted.entry(page_key(page)).or_insert(0) += 1;
                if tree.nodes[node.parent]
                    .as_ref()
                    .map(|n| n.children.get(&node.edge))
                    != Some(Some(&id))
                {
                    return Err(format!("node {id} not linked from its parent"));
                }
                if node.edge.len() != p {
                    return Err(format!("node {id} edge of {} tokens", node.edge.len()));
                }
                // Rebuild the node's token path to re-check public pages.
                let mut path = Vec::new();
                let mut at = id;
                while at != ROOT {
                    let n = tree.node(at);
                    path.push(n.edge.clone());
                    at = n.parent;
                }
                let depth = path.len();
                let tokens: Vec<u32> = path.into_iter().rev().flat_map(|e| e.into_vec()).collect();
                let public_ok = self.public_pages(&tokens) >= depth;
                match (domain, page.visibility()) {
                    (_, Visibility::Public) if !public_ok => {
                        return Err(format!(
                            "public page at depth {depth} outside public prefixes"
                        ))
                    }
                    (_, Visibility::Public) => {}
                    (None, Visibility::Domain(_)) => {
                        return Err("domain page in public tree".into())
                    }
                    (Some(d), Visibility::Domain(pd)) if d != pd => {
                        return Err("foreign domain page in a domain tree".into())
                    }
                    (Some(_), Visibility::Domain(_)) => {}
                }
                for (edge, &child) in &node.children {
                    let c = tree.nodes[child].as_ref().ok_or("dangling child")?;
                    if c.parent != id || &c.edge != edge {
                        return Err(format!("child {child} of {id} mislinked"));
                    }
                }
            }
            if live != tree.live {
                return Err(format!("live count {} but {live} nodes", tree.live));
            }
        }
        if counted != self.refs {
            return Err("reference counts do not match the trees".into());
        }
        Ok(())
    }
}
