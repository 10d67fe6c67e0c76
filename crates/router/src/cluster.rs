//! The nodes behind a router: their identity and limits checked at start, their health and
//! load polled, and the choice of a node for each request.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use engine::{Admission, Admitted, IsolationDomain};
use server::{ApiError, Backend, Submission};
use tonic::transport::Channel;
use transfer::pb::{self, node_client::NodeClient};
use transfer::{TlsIdentity, TransferMetrics};

use crate::discovery::{Discovery, NodeSource, Resolver};
use crate::handoff;

/// How often the router asks every node for its load and health.
const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// A node that has not answered `Info` within this is treated as down.
const INFO_TIMEOUT: Duration = Duration::from_secs(3);
/// Prefix affinity: tokens of the prompt (whole pages) that name a prefix.
const AFFINITY_TOKENS: usize = 64;
/// Prefix affinity is kept unless the node it points to has this many more requests in
/// flight than the least loaded one.
const AFFINITY_SLACK: u64 = 4;
const AFFINITY_ENTRIES: usize = 4096;

#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub prefill: Vec<NodeSource>,
    pub decode: Vec<NodeSource>,
    /// How `dns:` sources are looked up, and how often again.
    pub discovery: Discovery,
    /// xxh3-64 of the router's own GGUF file, which it tokenizes with.
    pub model_checksum: u64,
    pub vocab_size: usize,
    /// `None`: advertise the smallest context any node holds.
    pub max_context: Option<usize>,
    pub deadlines: transfer::Deadlines,
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("no {role} node given")]
    NoNodes { role: &'static str },
    #[error("{role} node {addr} is not reachable: {why}")]
    Unreachable {
        role: &'static str,
        addr: String,
        why: String,
    },
    #[error("{addr} was given as a {expected} node but serves the {actual} role")]
    WrongRole {
        addr: String,
        expected: &'static str,
        actual: String,
    },
    #[error("{addr} serves another model (checksum {theirs:016x}, the router's --model file has {ours:016x}): every node must load the same GGUF file")]
    OtherModel {
        addr: String,
        ours: u64,
        theirs: u64,
    },
    #[error("{addr}'s KV layout ({theirs}) differs from {first}'s ({ours}): pages could not move between them")]
    OtherLayout {
        addr: String,
        first: String,
        ours: String,
        theirs: String,
    },
    #[error("--max-context {context} exceeds what {addr} can hold: its KV pool holds {pool} tokens and it advertises {advertised}. Lower --max-context to at most {advertised} or enlarge that node's pool.")]
    ContextExceedsNode {
        context: usize,
        addr: String,
        pool: usize,
        advertised: usize,
    },
    #[error("internal API client: {0}")]
    Tls(String),
    #[error("{0}")]
    Discovery(String),
}

/// One node as the router sees it.
pub(crate) struct Node {
    pub(crate) addr: String,
    pub(crate) role: transfer::Role,
    /// The `dns:` source whose answer holds this address (`None`: given as an address),
    /// which drains the node when its answer stops holding it.
    found_by: Option<NodeSource>,
    pub(crate) client: NodeClient<Channel>,
    healthy: AtomicBool,
    /// Whether the last poll found it fails a check (said once, not at every poll).
    kept_out: AtomicBool,
    /// Requests running or waiting on the node, as it last reported.
    reported_load: AtomicU64,
    /// Requests this router has in flight there now.
    pub(crate) in_flight: AtomicU64,
    /// What the node advertises, as it last reported (0 while it has never answered).
    max_context: AtomicUsize,
    /// Requests sent to this node (for /metrics).
    pub(crate) sent: AtomicU64,
    /// Its KV pool as last polled: total, free, leased, cached pages.
    pages: [AtomicU64; 4],
}

impl Node {
    fn new(
        addr: String,
        role: transfer::Role,
        found_by: Option<NodeSource>,
        tls: &TlsIdentity,
        frame: Duration,
    ) -> Result<Self, StartupError> {
        let channel = transfer::connect_lazy(&addr, tls, frame)
            .map_err(|e| StartupError::Tls(e.to_string()))?;
        Ok(Self {
            addr,
            role,
            found_by,
            client: NodeClient::new(channel),
            healthy: AtomicBool::new(false),
            kept_out: AtomicBool::new(false),
            reported_load: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            max_context: AtomicUsize::new(0),
            sent: AtomicU64::new(0),
            pages: Default::default(),
        })
    }

    fn load(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed) + self.reported_load.load(Ordering::Relaxed)
    }

    pub(crate) fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// A call found the node unreachable: route around it until a poll answers again.
    pub(crate) fn mark_down(&self) {
        if self.healthy.swap(false, Ordering::Relaxed) {
            tracing::warn!("{} node {} is down", self.role.name(), self.addr);
        }
    }

    /// A poll's news: the node is up with these limits.
    fn update(&self, info: &pb::NodeInfo, max_context: usize) {
        self.max_context.store(max_context, Ordering::Relaxed);
        self.reported_load.store(info.load, Ordering::Relaxed);
        self.record_pages(info);
        if !self.healthy.swap(true, Ordering::Relaxed) {
            tracing::info!("{} node {} is up", self.role.name(), self.addr);
        }
    }

    fn record_pages(&self, info: &pb::NodeInfo) {
        for (slot, n) in self.pages.iter().zip([
            info.pages_total,
            info.pages_free,
            info.pages_leased,
            info.pages_cached,
        ]) {
            slot.store(n, Ordering::Relaxed);
        }
    }

    /// A request that cannot fit this node never goes to it.
    fn can_hold(&self, total_tokens: usize) -> bool {
        total_tokens <= self.max_context.load(Ordering::Relaxed)
    }
}

/// Counters the router adds to `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct RouterMetrics {
    pub(crate) transfer: TransferMetrics,
    /// Requests a prefill node's admission refused (they never reached a decode node).
    pub(crate) prefill_rejections: AtomicU64,
    /// Requests a decode node's admission refused.
    pub(crate) decode_rejections: AtomicU64,
    pub(crate) handoffs: AtomicU64,
    pub(crate) affinity_hits: AtomicU64,
}

pub struct Cluster {
    /// The nodes requests may go to: the given addresses, and those the `dns:` sources
    /// answer now (a node that left an answer is dropped here and lives on only in the
    /// requests that hold it).
    prefill: RwLock<Vec<Arc<Node>>>,
    decode: RwLock<Vec<Arc<Node>>>,
    /// The `dns:` sources by role, the resolver that asks for them, and what a new node's
    /// connection needs.
    dns: Vec<(transfer::Role, NodeSource)>,
    resolver: Option<Resolver>,
    discovery: Discovery,
    tls: TlsIdentity,
    admission: Admission,
    /// Checked again at every poll: a node restarted with another model or layout is kept
    /// out.
    expect: Mutex<Expectation>,
    pub(crate) deadlines: transfer::Deadlines,
    pub(crate) metrics: RouterMetrics,
    /// (tenant-scoped prefix key) → address of the prefill node that last ran it.
    affinity: Mutex<HashMap<u64, String>>,
    affinity_keys: std::collections::hash_map::RandomState,
    next_request: AtomicU64,
    pub(crate) request_id_keys: std::collections::hash_map::RandomState,
}

/// What every node of the cluster must be: the router's model, one K/V layout (that of
/// the first node that answered), so pages can move between any two nodes, and, once the
/// router advertises a context, room for it.
struct Expectation {
    model_checksum: u64,
    vocab_size: usize,
    layout: Option<(String, String)>,
    advertised: Option<usize>,
}

impl Expectation {
    /// The node's advertised context, if it is what `addr` was configured as.
    fn check(
        &mut self,
        addr: &str,
        role: transfer::Role,
        info: &pb::NodeInfo,
    ) -> Result<usize, StartupError> {
        let actual = match pb::Role::try_from(info.role) {
            Ok(pb::Role::Prefill) => transfer::Role::Prefill.name().to_owned(),
            Ok(pb::Role::Decode) => transfer::Role::Decode.name().to_owned(),
            _ => format!("unknown ({})", info.role),
        };
        if actual != role.name() {
            return Err(StartupError::WrongRole {
                addr: addr.to_owned(),
                expected: role.name(),
                actual,
            });
        }
        if info.model_checksum != self.model_checksum || info.vocab_size as usize != self.vocab_size
        {
            return Err(StartupError::OtherModel {
                addr: addr.to_owned(),
                ours: self.model_checksum,
                theirs: info.model_checksum,
            });
        }
        let layout = layout_of(info);
        match &self.layout {
            None => self.layout = Some((addr.to_owned(), layout)),
            Some((first, ours)) if *ours != layout => {
                return Err(StartupError::OtherLayout {
                    addr: addr.to_owned(),
                    first: first.clone(),
                    ours: ours.clone(),
                    theirs: layout,
                })
            }
            Some(_) => {}
        }
        let max_context = info.max_context as usize;
        if let Some(advertised) = self.advertised {
            if max_context < advertised {
                return Err(StartupError::ContextExceedsNode {
                    context: advertised,
                    addr: addr.to_owned(),
                    pool: info.pool_tokens as usize,
                    advertised: max_context,
                });
            }
        }
        Ok(max_context)
    }
}

fn layout_of(info: &pb::NodeInfo) -> String {
    format!(
        "{} layers x {} values, {} elements, {}-token pages",
        info.n_layers, info.kv_dim, info.kv_dtype, info.page_tokens
    )
}

async fn info(client: &mut NodeClient<Channel>) -> Result<pb::NodeInfo, String> {
    let mut request = tonic::Request::new(pb::InfoRequest {});
    request.set_timeout(INFO_TIMEOUT);
    match tokio::time::timeout(INFO_TIMEOUT, client.info(request)).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(status)) => Err(status.message().to_owned()),
        Err(_) => Err("no answer within the deadline".into()),
    }
}

impl Cluster {
    /// Connects to every node and checks the cluster can keep the promise it would make.
    /// A node that does not answer yet is kept as down (the polls bring it in once it
    /// answers and passes the same checks); a role with no reachable node is refused.
    pub async fn connect(
        config: ClusterConfig,
        tls: &TlsIdentity,
    ) -> Result<Arc<Self>, StartupError> {
        let mut expect = Expectation {
            model_checksum: config.model_checksum,
            vocab_size: config.vocab_size,
            layout: None,
            advertised: None,
        };
        let dns: Vec<(transfer::Role, NodeSource)> = [
            (transfer::Role::Prefill, &config.prefill),
            (transfer::Role::Decode, &config.decode),
        ]
        .into_iter()
        .flat_map(|(role, sources)| {
            sources
                .iter()
                .filter(|s| matches!(s, NodeSource::Dns { .. }))
                .map(move |s| (role, s.clone()))
        })
        .collect();
        let resolver = if dns.is_empty() {
            None
        } else {
            Some(Resolver::new(&config.discovery).map_err(StartupError::Discovery)?)
        };
        let mut nodes = Vec::new();
        for (role, sources) in [
            (transfer::Role::Prefill, &config.prefill),
            (transfer::Role::Decode, &config.decode),
        ] {
            if sources.is_empty() {
                return Err(StartupError::NoNodes { role: role.name() });
            }
            // A pool found by DNS may have no node yet (pods still starting): the router
            // waits for one rather than exiting. A pool of fixed addresses is refused now.
            let by_dns = sources.iter().any(|s| matches!(s, NodeSource::Dns { .. }));
            let (found, reachable, unreachable) = loop {
                let attempt =
                    find_nodes(role, sources, resolver.as_ref(), tls, &config, &mut expect).await?;
                if attempt.1 > 0 || !by_dns {
                    break attempt;
                }
                let (what, why) = attempt.2.clone().unwrap_or_default();
                tracing::warn!(
                    "no {} node reachable yet ({what}: {why}); asking again in {:?}",
                    role.name(),
                    config.discovery.interval
                );
                tokio::time::sleep(config.discovery.interval).await;
            };
            nodes.extend(found);
            if reachable == 0 {
                let (addr, why) = unreachable.unwrap_or_default();
                return Err(StartupError::Unreachable {
                    role: role.name(),
                    addr,
                    why,
                });
            }
        }
        let contexts: Vec<usize> = nodes
            .iter()
            .filter(|n| n.is_healthy())
            .map(|n| n.max_context.load(Ordering::Relaxed))
            .collect();
        // Both roles have a reachable node here; this only fails for an empty list.
        let admission =
            Admission::narrowest_of_nodes(&contexts, config.max_context, config.vocab_size)
                .ok_or(StartupError::NoNodes { role: "prefill" })?;
        // From now on a node must hold what the router advertises, or it is kept out.
        expect.advertised = Some(admission.max_context());
        let (prefill, decode) = nodes
            .into_iter()
            .partition(|n| n.role == transfer::Role::Prefill);
        let cluster = Arc::new(Self {
            prefill: RwLock::new(prefill),
            decode: RwLock::new(decode),
            dns,
            resolver,
            discovery: config.discovery,
            tls: tls.clone(),
            admission,
            expect: Mutex::new(expect),
            deadlines: config.deadlines,
            metrics: RouterMetrics::default(),
            affinity: Mutex::new(HashMap::new()),
            affinity_keys: Default::default(),
            next_request: AtomicU64::new(1),
            request_id_keys: Default::default(),
        });
        tokio::spawn(poll(Arc::downgrade(&cluster)));
        if cluster.resolver.is_some() {
            tokio::spawn(rediscover(Arc::downgrade(&cluster)));
        }
        Ok(cluster)
    }

    /// The nodes of `role` requests may go to now.
    pub(crate) fn nodes(&self, role: transfer::Role) -> Vec<Arc<Node>> {
        let pool = match role {
            transfer::Role::Prefill => &self.prefill,
            transfer::Role::Decode => &self.decode,
        };
        pool.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn all_nodes(&self) -> Vec<Arc<Node>> {
        let mut all = self.nodes(transfer::Role::Prefill);
        all.extend(self.nodes(transfer::Role::Decode));
        all
    }

    /// Nodes a request may try, of both roles.
    pub(crate) fn node_count(&self) -> usize {
        let count = |pool: &RwLock<Vec<Arc<Node>>>| pool.read().map_or(0, |p| p.len());
        count(&self.prefill) + count(&self.decode)
    }

    /// Brings `role`'s nodes found by `source` in line with its latest answer: a new
    /// address becomes a node (down until a poll finds it passes every check), one that
    /// left the answer is dropped from the pool (drained: its requests finish, none is sent).
    fn apply_answer(
        &self,
        role: transfer::Role,
        source: &NodeSource,
        answer: &std::collections::BTreeSet<String>,
    ) {
        let pool = match role {
            transfer::Role::Prefill => &self.prefill,
            transfer::Role::Decode => &self.decode,
        };
        let mut nodes = pool.write().unwrap_or_else(|p| p.into_inner());
        nodes.retain(|n| {
            let keep = n.found_by.as_ref() != Some(source) || answer.contains(&n.addr);
            if !keep {
                tracing::info!("{} node {} left {source}: drained", role.name(), n.addr);
            }
            keep
        });
        for addr in answer {
            if nodes
                .iter()
                .any(|n| &n.addr == addr && n.found_by.as_ref() == Some(source))
            {
                continue;
            }
            match Node::new(
                addr.clone(),
                role,
                Some(source.clone()),
                &self.tls,
                self.deadlines.frame,
            ) {
                Ok(node) => {
                    tracing::info!("{} node {addr} found by {source}", role.name());
                    nodes.push(Arc::new(node));
                }
                Err(e) => tracing::warn!("{} node {addr} found by {source}: {e}", role.name()),
            }
        }
    }

    pub(crate) fn next_request(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// The least loaded healthy node of `nodes` that can hold the request.
    fn least_loaded(nodes: &[Arc<Node>], total_tokens: usize) -> Option<&Arc<Node>> {
        nodes
            .iter()
            .filter(|n| n.is_healthy() && n.can_hold(total_tokens))
            .min_by_key(|n| n.load())
    }

    /// The prefill node for a request: the one that last ran the same prompt prefix for
    /// the same domain (its prefix cache likely holds it) unless it is down, gone or much
    /// busier than the least loaded one. The key mixes in the domain, so affinity never
    /// crosses tenants, and nothing is learned from another tenant's traffic.
    pub(crate) fn pick_prefill(
        &self,
        domain: &IsolationDomain,
        prompt: &[u32],
        total_tokens: usize,
    ) -> Option<Arc<Node>> {
        let nodes = self.nodes(transfer::Role::Prefill);
        let least = Self::least_loaded(&nodes, total_tokens)?;
        let key = (prompt.len() > AFFINITY_TOKENS).then(|| {
            self.affinity_keys
                .hash_one((domain, &prompt[..AFFINITY_TOKENS]))
        });
        let mut affinity = self.affinity.lock().unwrap_or_else(|p| p.into_inner());
        let remembered = key
            .and_then(|k| affinity.get(&k))
            .and_then(|addr| nodes.iter().find(|n| &n.addr == addr));
        let chosen = match remembered {
            Some(n)
                if n.is_healthy()
                    && n.can_hold(total_tokens)
                    && n.load() <= least.load() + AFFINITY_SLACK =>
            {
                self.metrics.affinity_hits.fetch_add(1, Ordering::Relaxed);
                n
            }
            _ => least,
        };
        if let Some(k) = key {
            if affinity.len() >= AFFINITY_ENTRIES {
                affinity.clear();
            }
            affinity.insert(k, chosen.addr.clone());
        }
        Some(chosen.clone())
    }

    pub(crate) fn pick_decode(&self, total_tokens: usize) -> Option<Arc<Node>> {
        Self::least_loaded(&self.nodes(transfer::Role::Decode), total_tokens).cloned()
    }
}

/// One attempt at `role`'s nodes at start: each source's addresses (a `dns:` source's as
/// its name resolves now), each asked for its `Info` and checked. Returns the nodes, how
/// many answered, and the first that did not (or the source that named none).
async fn find_nodes(
    role: transfer::Role,
    sources: &[NodeSource],
    resolver: Option<&Resolver>,
    tls: &TlsIdentity,
    config: &ClusterConfig,
    expect: &mut Expectation,
) -> Result<(Vec<Arc<Node>>, usize, Option<(String, String)>), StartupError> {
    let mut found = Vec::new();
    let mut addrs: Vec<(String, Option<NodeSource>)> = Vec::new();
    let mut unreachable = None;
    for source in sources {
        match source {
            NodeSource::Address(addr) => addrs.push((addr.clone(), None)),
            NodeSource::Dns { name, port } => {
                let Some(resolver) = resolver else { continue };
                match resolver.addresses(name, *port).await {
                    Ok(answer) if !answer.is_empty() => {
                        addrs.extend(answer.into_iter().map(|a| (a, Some(source.clone()))))
                    }
                    Ok(_) => {
                        tracing::warn!("{source} names no {} node yet", role.name());
                        unreachable.get_or_insert((source.to_string(), "no address".into()));
                    }
                    Err(why) => {
                        tracing::warn!("{source}: {why}");
                        unreachable.get_or_insert((source.to_string(), why));
                    }
                }
            }
        }
    }
    let mut reachable = 0;
    for (addr, found_by) in addrs {
        let node = Node::new(addr, role, found_by, tls, config.deadlines.frame)?;
        let mut client = node.client.clone();
        let addr = &node.addr;
        match info(&mut client).await {
            Ok(info) => {
                let max_context = expect.check(addr, role, &info)?;
                if let Some(context) = config.max_context {
                    if context > max_context {
                        return Err(StartupError::ContextExceedsNode {
                            context,
                            addr: addr.clone(),
                            pool: info.pool_tokens as usize,
                            advertised: max_context,
                        });
                    }
                }
                node.update(&info, max_context);
                reachable += 1;
            }
            Err(why) => {
                tracing::warn!("{} node {addr} is not reachable yet: {why}", role.name());
                unreachable.get_or_insert((addr.clone(), why));
            }
        }
        found.push(Arc::new(node));
    }
    Ok((found, reachable, unreachable))
}

/// Looks every `dns:` source up again, every `Discovery::interval`, and applies the answers
/// (`Cluster::apply_answer`). An unanswered question leaves its pool as it was.
async fn rediscover(cluster: std::sync::Weak<Cluster>) {
    loop {
        let Some(interval) = cluster.upgrade().map(|c| c.discovery.interval) else {
            return;
        };
        tokio::time::sleep(interval).await;
        let Some(c) = cluster.upgrade() else {
            return;
        };
        let Some(resolver) = &c.resolver else {
            return;
        };
        for (role, source) in &c.dns {
            let NodeSource::Dns { name, port } = source else {
                continue;
            };
            match resolver.addresses(name, *port).await {
                Ok(answer) => c.apply_answer(*role, source, &answer),
                Err(why) => tracing::warn!("{source}: {why}; its nodes are kept as they were"),
            }
        }
    }
}

/// Polls every node's `Info`: health and load. A node that comes back is used again.
async fn poll(cluster: std::sync::Weak<Cluster>) {
    loop {
        tokio::time::sleep(POLL_INTERVAL).await;
        let Some(c) = cluster.upgrade() else {
            return;
        };
        for node in c.all_nodes() {
            let mut client = node.client.clone();
            match info(&mut client).await {
                Ok(info) => {
                    let checked = c
                        .expect
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .check(&node.addr, node.role, &info);
                    match checked {
                        Ok(max_context) => {
                            node.kept_out.store(false, Ordering::Relaxed);
                            node.update(&info, max_context)
                        }
                        Err(why) => {
                            let was_up = node.healthy.swap(false, Ordering::Relaxed);
                            if !node.kept_out.swap(true, Ordering::Relaxed) || was_up {
                                tracing::error!(
                                    "{} node {} is kept out: {why}",
                                    node.role.name(),
                                    node.addr
                                );
                            }
                        }
                    }
                }
                Err(why) => {
                    if node.healthy.swap(false, Ordering::Relaxed) {
                        tracing::warn!("{} node {} is down: {why}", node.role.name(), node.addr);
                    }
                }
            }
        }
    }
}

impl Backend for Cluster {
    fn admission(&self) -> &Admission {
        &self.admission
    }

    fn submit(self: Arc<Self>, admitted: Admitted) -> Submission {
        Box::pin(handoff::start(self, admitted))
    }

    fn render_metrics(&self, out: &mut String) {
        self.metrics.transfer.render(out);
        let nodes = self.all_nodes();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let m = &self.metrics;
        let _ = writeln!(
            out,
            "# HELP kvwarden_router_rejections_total Requests a node's admission refused, by role (prefill rejections never reach a decode node).\n# TYPE kvwarden_router_rejections_total counter\nkvwarden_router_rejections_total{{role=\"prefill\"}} {}\nkvwarden_router_rejections_total{{role=\"decode\"}} {}",
            get(&m.prefill_rejections),
            get(&m.decode_rejections)
        );
        let _ = writeln!(
            out,
            "# HELP kvwarden_router_handoffs_total Requests whose K/V reached a decode node verified.\n# TYPE kvwarden_router_handoffs_total counter\nkvwarden_router_handoffs_total {}",
            get(&m.handoffs)
        );
        let _ = writeln!(
            out,
            "# HELP kvwarden_router_prefix_affinity_hits_total Requests sent to the prefill node that last ran their prefix.\n# TYPE kvwarden_router_prefix_affinity_hits_total counter\nkvwarden_router_prefix_affinity_hits_total {}",
            get(&m.affinity_hits)
        );
        let _ = writeln!(
            out,
            "# HELP kvwarden_kv_pages KV pool pages by state, over every node (as of the last poll).\n# TYPE kvwarden_kv_pages gauge"
        );
        for (i, state) in ["total", "free", "leased", "cached"].iter().enumerate() {
            let sum: u64 = nodes
                .iter()
                .map(|n| n.pages[i].load(Ordering::Relaxed))
                .sum();
            let _ = writeln!(out, "kvwarden_kv_pages{{state=\"{state}\"}} {sum}");
        }
        let _ = writeln!(
            out,
            "# HELP kvwarden_router_node_up Whether the node answered its last poll.\n# TYPE kvwarden_router_node_up gauge"
        );
        for n in &nodes {
            let _ = writeln!(
                out,
                "kvwarden_router_node_up{{role=\"{}\",node=\"{}\"}} {}",
                n.role.name(),
                n.addr,
                u8::from(n.is_healthy())
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvwarden_router_node_requests_total Requests sent to each node.\n# TYPE kvwarden_router_node_requests_total counter"
        );
        for n in &nodes {
            let _ = writeln!(
                out,
                "kvwarden_router_node_requests_total{{role=\"{}\",node=\"{}\"}} {}",
                n.role.name(),
                n.addr,
                get(&n.sent)
            );
        }
    }

    fn health(&self) -> Result<(), ApiError> {
        for role in [transfer::Role::Prefill, transfer::Role::Decode] {
            if !self.nodes(role).iter().any(|n| n.is_healthy()) {
                let role = role.name();
                return Err(ApiError::Engine(engine::EngineError::Remote {
                    reason: "peer_gone".into(),
                    message: format!("no {role} node is reachable"),
                }));
            }
        }
        Ok(())
    }
}
