//! One radix tree of cached pages: an arena of nodes keyed by each page's tokens, walked
//! by lookups and grown by inserts.

use std::collections::HashMap;

use crate::shared::SharedPage;
use crate::sync::Arc;
use crate::IsolationDomain;

pub(super) const ROOT: usize = 0;

pub(super) struct Node {
    /// `None` only at the root.
    pub(super) page: Option<Arc<SharedPage>>,
    pub(super) parent: usize,
    /// The `page_tokens` token ids this node's page covers (its key in the parent).
    pub(super) edge: Box<[u32]>,
    pub(super) children: HashMap<Box<[u32]>, usize>,
}

pub(super) struct Tree {
    /// `None` for the public tree.
    pub(super) domain: Option<IsolationDomain>,
    /// Arena; `None` marks a vacant slot, listed in `vacant`.
    pub(super) nodes: Vec<Option<Node>>,
    vacant: Vec<usize>,
    pub(super) live: usize,
}

impl Tree {
    pub(super) fn new(domain: Option<IsolationDomain>) -> Self {
        Self {
            domain,
            nodes: vec![Some(Node {
                page: None,
                parent: ROOT,
                edge: Box::new([]),
                children: HashMap::new(),
            })],
            vacant: Vec::new(),
            live: 0,
        }
    }

    pub(super) fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("live node id")
    }

    pub(super) fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("live node id")
    }

    /// Node ids of the longest cached path matching `tokens`, at most `limit` pages, every
    /// page readable by `reader` (checked again here although inserts guarantee it: this
    /// is the last point before pages leave the cache).
    pub(super) fn walk(
        &self,
        tokens: &[u32],
        limit: usize,
        p: usize,
        reader: &IsolationDomain,
    ) -> Vec<usize> {
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

    pub(super) fn add_child(
        &mut self,
        parent: usize,
        edge: &[u32],
        page: Arc<SharedPage>,
    ) -> usize {
        let node = Node {
            page: Some(page),
            parent,
            edge: edge.into(),
            children: HashMap::new(),
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

    /// Removes a leaf; returns its parent.
    pub(super) fn remove_leaf(&mut self, id: usize) -> usize {
        let node = self.nodes[id].take().expect("live node id");
        debug_assert!(node.children.is_empty() && id != ROOT);
        self.node_mut(node.parent).children.remove(&node.edge);
        self.vacant.push(id);
        self.live -= 1;
        node.parent
    }

    pub(super) fn live_ids(&self) -> impl Iterator<Item = usize> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(id, n)| *id != ROOT && n.is_some())
            .map(|(id, _)| id)
    }
}
