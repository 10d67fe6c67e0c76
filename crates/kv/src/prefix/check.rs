//! `PrefixCache::debug_check`: the structural, isolation and eviction-accounting
//! invariants of the cache, checked by the tests after every step.

use std::collections::HashMap;

use super::tree::ROOT;
use super::{PrefixCache, PUBLIC, PUBLIC_HOLDER};
use crate::evict::Holder;
use crate::Visibility;

impl PrefixCache {
    /// Test support: checks the cache's structural and isolation invariants: every page in
    /// a domain's tree is readable by that domain, the public tree holds only public pages
    /// inside a configured public prefix, child links match parent links, the page table
    /// names exactly the nodes holding each page, and the pool's eviction state agrees
    /// (a page is evictable exactly when nothing uses it and all its nodes are leaves).
    #[doc(hidden)]
    pub fn debug_check(&self) -> Result<(), String> {
        let mut counted: HashMap<u32, Vec<(usize, usize)>> = HashMap::new();
        let p = self.page_tokens;
        for (domain, &t) in &self.domains {
            let named = self
                .trees
                .get(t)
                .and_then(|x| x.as_ref())
                .and_then(|x| x.domain.as_ref());
            if named != Some(domain) {
                return Err("domain map and trees disagree".into());
            }
        }
        for (t, tree) in self.trees.iter().enumerate() {
            let Some(tree) = tree else { continue };
            let domain = tree.domain.as_ref();
            if (t == PUBLIC) != domain.is_none() {
                return Err(format!("tree {t} has the wrong kind"));
            }
            if domain.is_some() && tree.live == 0 {
                return Err("empty domain tree kept".into());
            }
            let mut live = 0;
            for id in tree.live_ids() {
                live += 1;
                let node = tree.node(id);
                let page = node.page.as_ref().ok_or("non-root node without page")?;
                counted.entry(page.index()).or_default().push((t, id));
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
        if counted.len() != self.pages.len() {
            return Err("the page table does not match the trees".into());
        }
        let Some(pool) = &self.pool else {
            return if self.pages.is_empty() {
                Ok(())
            } else {
                Err("pages without a pool".into())
            };
        };
        let mut idle = 0;
        let mut sizes: HashMap<Holder, usize> = HashMap::new();
        for (index, cached) in &self.pages {
            let mut want = counted.get(index).cloned().unwrap_or_default();
            let mut have = cached.nodes.clone();
            want.sort_unstable();
            have.sort_unstable();
            if want != have || cached.page.index() != *index {
                return Err(format!("page {index}: nodes do not match the trees"));
            }
            let (users, in_cache, leafy, listed, holder) = pool.use_meta(*index);
            if !in_cache || leafy != self.leafy(*index) {
                return Err(format!("page {index}: the pool's view of it is stale"));
            }
            let want_holder = match cached.page.visibility() {
                Visibility::Public => Some(PUBLIC_HOLDER),
                Visibility::Domain(d) => self.holders.get(d.tenant_name()).copied(),
            };
            if want_holder != Some(holder) {
                return Err(format!("page {index}: counted against the wrong holder"));
            }
            *sizes.entry(holder).or_default() += 1;
            if listed != (users == 0 && leafy) {
                return Err(format!(
                    "page {index}: listed {listed} with {users} users, leafy {leafy}"
                ));
            }
            idle += usize::from(users == 0);
        }
        if idle != pool.idle_cached() {
            return Err(format!(
                "{} idle cached pages counted, {idle} found",
                pool.idle_cached()
            ));
        }
        for (h, &size) in pool.holder_sizes().iter().enumerate() {
            let found = Holder::try_from(h)
                .ok()
                .and_then(|h| sizes.get(&h))
                .copied()
                .unwrap_or(0);
            if found != size {
                return Err(format!("holder {h}: {size} pages counted, {found} found"));
            }
        }
        if pool
            .evictable_list()
            .iter()
            .any(|i| !self.pages.contains_key(i))
        {
            return Err("the evictable list names a page the cache lacks".into());
        }
        Ok(())
    }
}
