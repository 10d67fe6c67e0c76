//! The nodes behind a router: their identity and limits checked at start, their health and
//! load polled, and the choice of a node for each request.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use engine::{AdapterInfo, AdapterRef, Admission, Admitted, IsolationDomain};
use server::{ApiError, Backend, Submission};
use tonic::transport::Channel;
use transfer::pb::{self, node_client::NodeClient};
use transfer::wire::AdapterId;
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
    #[error("{addr}'s LoRA adapters differ from {first}'s: {difference}. Every node must be given the same --lora adapters (the same files, under the same names, at the same scales).")]
    OtherAdapters {
        addr: String,
        first: String,
        difference: String,
    },
    #[error("{addr} reports a malformed adapter set: {why}")]
    BadAdapters { addr: String, why: String },
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
    /// The LoRA adapters every node holds (sorted by name), as the first node reported
    /// them: requests name them by these identities, which each node checks against its
    /// own.
    adapters: Vec<AdapterInfo>,
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

/// What every node of the cluster must be: the router's model, one K/V layout and one set
/// of LoRA adapters (those of the first node that answered), so pages can move between any
/// two nodes and a request's adapter means the same on both, and, once the router
/// advertises a context, room for it.
struct Expectation {
    model_checksum: u64,
    vocab_size: usize,
    layout: Option<(String, String)>,
    adapters: Option<(String, Vec<AdapterInfo>)>,
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
        let adapters =
            transfer::wire::adapters_from_pb(info.adapters.clone()).map_err(|status| {
                StartupError::BadAdapters {
                    addr: addr.to_owned(),
                    why: status.message().to_owned(),
                }
            })?;
        match &self.adapters {
            None => self.adapters = Some((addr.to_owned(), adapters)),
            Some((first, ours)) => {
                let ids =
                    |set: &[AdapterInfo]| set.iter().map(AdapterId::of_info).collect::<Vec<_>>();
                if let Some(difference) = adapter_difference(&ids(ours), &ids(&adapters), first) {
                    return Err(StartupError::OtherAdapters {
                        addr: addr.to_owned(),
                        first: first.clone(),
                        difference,
                    });
                }
            }
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

/// How a node's adapter set `theirs` differs from the pool's `ours` (that of node
/// `first`), adapter by adapter; `None` when they are the same. Both sorted by name.
fn adapter_difference(ours: &[AdapterId], theirs: &[AdapterId], first: &str) -> Option<String> {
    let mut differences = Vec::new();
    for a in ours {
        match theirs.iter().find(|b| b.name == a.name) {
            None => differences.push(format!("it lacks {a}")),
            Some(b) if b != a => differences.push(format!(
                "its `{}` is another version: fingerprint {:032x}, file xxh3-128 {:032x}, where {first}'s has fingerprint {:032x}, file xxh3-128 {:032x}",
                a.name, b.fingerprint, b.file_checksum, a.fingerprint, a.file_checksum
            )),
            Some(_) => {}
        }
    }
    for b in theirs {
        if !ours.iter().any(|a| a.name == b.name) {
            differences.push(format!("it holds {b}, which {first} does not"));
        }
    }
    (!differences.is_empty()).then(|| differences.join("; "))
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
            adapters: None,
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
        // Both roles have a node that answered, so the pool's adapter set is known; a node
        // that joins later with another set is kept out by the polls.
        let adapters = expect
            .adapters
            .as_ref()
            .map(|(_, set)| set.clone())
            .unwrap_or_default();
        if !adapters.is_empty() {
            tracing::info!(
                "every node holds the LoRA adapters {}",
                adapters
                    .iter()
                    .map(|a| AdapterId::of_info(a).to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
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
            adapters,
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

    /// The LoRA adapters every node holds, sorted by name (the cluster's `/v1/models`).
    pub fn adapters(&self) -> &[AdapterInfo] {
        &self.adapters
    }

    /// The adapter `name`, as a request names it to the nodes: by identity, without
    /// weights (each node resolves it in its own set and refuses another version).
    pub fn adapter(&self, name: &str) -> Option<AdapterRef> {
        self.adapters
            .iter()
            .find(|a| a.name == name)
            .map(|a| AdapterRef::remote(&a.name, a.fingerprint, a.file_checksum))
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

/// The router's adapters for the tenants' API: references by identity to what every node
/// holds (`Cluster::adapter`); `--lora-access` decides who may select each.
impl server::adapters::AdapterSet for Cluster {
    fn get(&self, name: &str) -> Option<AdapterRef> {
        self.adapter(name)
    }

    fn info(&self) -> Vec<AdapterInfo> {
        self.adapters.clone()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str, fingerprint: u128, file_checksum: u128) -> AdapterId {
        AdapterId {
            name: name.into(),
            fingerprint,
            file_checksum,
        }
    }

    fn info(role: pb::Role, adapters: &[AdapterId]) -> pb::NodeInfo {
        pb::NodeInfo {
            role: role as i32,
            model_checksum: 7,
            vocab_size: 100,
            max_context: 256,
            pool_tokens: 256,
            page_tokens: 16,
            n_layers: 2,
            kv_dim: 32,
            kv_dtype: "f16".into(),
            adapters: adapters
                .iter()
                .map(|a| pb::LoadedAdapter {
                    adapter: Some(transfer::wire::adapter_to_pb(a)),
                    scale: 1.0,
                    rank: 8,
                })
                .collect(),
            ..Default::default()
        }
    }

    fn expectation() -> Expectation {
        Expectation {
            model_checksum: 7,
            vocab_size: 100,
            layout: None,
            adapters: None,
            advertised: None,
        }
    }

    /// The first node's set is the pool's; every other node, of either role and whether it
    /// answers at start or joins later (both go through `check`), must hold exactly it, and
    /// a refusal names the difference adapter by adapter.
    #[test]
    fn a_node_whose_adapters_differ_from_the_pools_is_refused_naming_the_difference() {
        let (a, b) = (id("alpha", 1, 10), id("beta", 2, 20));
        let mut expect = expectation();
        expect
            .check(
                "p:1",
                transfer::Role::Prefill,
                &info(pb::Role::Prefill, &[b.clone(), a.clone()]),
            )
            .expect("the first node sets the pool's adapters");
        expect
            .check(
                "d:1",
                transfer::Role::Decode,
                &info(pb::Role::Decode, &[a.clone(), b.clone()]),
            )
            .expect("the same set, listed in another order");
        let cases: Vec<(&str, Vec<AdapterId>, &[&str])> = vec![
            ("lacks one", vec![a.clone()], &["lacks `beta`"]),
            ("holds none", vec![], &["lacks `alpha`", "lacks `beta`"]),
            (
                "holds one more",
                vec![a.clone(), b.clone(), id("gamma", 3, 30)],
                &["holds `gamma`", "which p:1 does not"],
            ),
            (
                "another version",
                vec![a.clone(), id("beta", 9, 20)],
                &[
                    "its `beta` is another version",
                    "fingerprint 00000000000000000000000000000009",
                    "where p:1's has fingerprint 00000000000000000000000000000002",
                ],
            ),
            (
                "the same arithmetic from another file",
                vec![a.clone(), id("beta", 2, 21)],
                &[
                    "its `beta` is another version",
                    "file xxh3-128 00000000000000000000000000000015",
                ],
            ),
        ];
        for (case, set, names) in cases {
            let err = expect
                .check("d:2", transfer::Role::Decode, &info(pb::Role::Decode, &set))
                .expect_err(case);
            let message = err.to_string();
            assert!(
                matches!(err, StartupError::OtherAdapters { .. }),
                "{case}: {message}"
            );
            assert!(
                message.starts_with("d:2's LoRA adapters differ from p:1's"),
                "{case}: {message}"
            );
            for name in names {
                assert!(message.contains(name), "{case}: {message} lacks {name:?}");
            }
        }
        // The pool's set is unchanged by the refusals.
        let (first, set) = expect.adapters.expect("the pool's set");
        assert_eq!(first, "p:1");
        let set: Vec<AdapterId> = set.iter().map(AdapterId::of_info).collect();
        assert_eq!(set, vec![a, b]);
    }

    #[test]
    fn a_malformed_adapter_set_is_refused() {
        let mut expect = expectation();
        let mut twice = info(pb::Role::Prefill, &[id("alpha", 1, 10), id("alpha", 1, 10)]);
        let err = expect
            .check("p:1", transfer::Role::Prefill, &twice)
            .expect_err("a name listed twice");
        assert!(matches!(err, StartupError::BadAdapters { .. }), "{err}");
        twice.adapters.truncate(1);
        twice.adapters[0]
            .adapter
            .as_mut()
            .unwrap()
            .fingerprint
            .pop();
        let err = expect
            .check("p:1", transfer::Role::Prefill, &twice)
            .expect_err("a short fingerprint");
        assert!(err.to_string().contains("16 bytes"), "{err}");
    }
}
