//! The internal API of one node: a prefill node admits and prefills, then pushes the
//! prompt's K/V straight to the decode node the router chose; a decode node admits,
//! reserves, verifies what arrives, and only then decodes.

mod decode;
mod prefill;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::handoff::Ticket;
use engine::EngineHandle;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::metrics::TransferMetrics;
use crate::pb::{self, node_server::Node};
use crate::tls::TlsIdentity;
use crate::wire;
use decode::{DecodeStream, PendingImport};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Timeouts of the internal API.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// Decode: from `Reserved` until the K/V must have arrived and verified.
    pub handoff: Duration,
    /// Between two frames of one push, and for connecting to a peer.
    pub frame: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self {
            handoff: Duration::from_secs(60),
            frame: Duration::from_secs(10),
        }
    }
}

/// What a node tells the router about itself.
#[derive(Debug, Clone)]
pub struct NodeIdentity {
    pub role: Role,
    pub model_checksum: u64,
    pub pool_tokens: usize,
    pub page_tokens: usize,
    pub n_layers: usize,
    pub kv_dim: usize,
    pub kv_dtype: engine::KvDtype,
}
pub struct NodeService {
    identity: NodeIdentity,
    engine: EngineHandle,
    metrics: Arc<TransferMetrics>,
    deadlines: Deadlines,
    tls: TlsIdentity,
    /// Compiles the constraints that arrive, against this node's own vocabulary.
    vocabulary: Arc<constraint::Vocabulary>,
    /// The LoRA adapters this node holds: a request's adapter is resolved here, by name
    /// and identity, and `Info` reports the set.
    adapters: Arc<engine::Adapters>,
    pending: Mutex<HashMap<Ticket, PendingImport>>,
    /// Prefill: channels to the decode nodes it pushed to, reused across requests.
    peers: Mutex<HashMap<String, Channel>>,
}

impl NodeService {
    pub fn new(
        identity: NodeIdentity,
        engine: EngineHandle,
        metrics: Arc<TransferMetrics>,
        deadlines: Deadlines,
        tls: TlsIdentity,
        vocabulary: Arc<constraint::Vocabulary>,
        adapters: Arc<engine::Adapters>,
    ) -> Self {
        Self {
            identity,
            engine,
            metrics,
            deadlines,
            tls,
            vocabulary,
            adapters,
            pending: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// The largest message this node accepts: a request of the whole context with the
    /// largest constraint, or a page.
    pub fn max_message_bytes(&self) -> usize {
        let page = self.identity.kv_dtype.bytes_for(
            self.identity.n_layers * 2 * self.identity.page_tokens * self.identity.kv_dim,
        );
        let request = self.engine.max_context() * 6 + constraint::limits::MAX_SOURCE_BYTES;
        page.max(request) + 64 * 1024
    }

    /// A request off the wire, resolved against this node's vocabulary and adapters and
    /// admitted by its own admission. `Ok(Err(_))` is a verdict for the router (the client
    /// sees that error); `Err(_)` a malformed call.
    async fn admit_from_pb(
        &self,
        request: pb::GenerateRequest,
    ) -> Result<Result<(String, engine::Admitted), engine::Rejection>, Status> {
        match wire::request_from_pb_blocking(request, &self.vocabulary, &self.adapters).await {
            Ok((request_id, request)) => Ok(self
                .engine
                .admission()
                .admit(request)
                .map(|admitted| (request_id, admitted))),
            Err(wire::RequestError::Rejected(r)) => Ok(Err(r)),
            Err(wire::RequestError::Invalid(status)) => Err(status),
        }
    }

    fn require(&self, role: Role) -> Result<(), Status> {
        if self.identity.role == role {
            Ok(())
        } else {
            Err(Status::failed_precondition(format!(
                "this is a {} node",
                self.identity.role.name()
            )))
        }
    }
}

/// A transport status as a failure label.
pub fn status_failure(status: &Status) -> pb::Failure {
    let reason = match status.code() {
        tonic::Code::DeadlineExceeded => "timeout",
        tonic::Code::InvalidArgument
        | tonic::Code::FailedPrecondition
        | tonic::Code::ResourceExhausted
        | tonic::Code::OutOfRange => "protocol",
        _ => "peer_gone",
    };
    wire::failure(reason, status.message())
}

/// A channel to a node over mutual TLS, connected on first use.
pub fn connect_lazy(
    addr: &str,
    tls: &TlsIdentity,
    connect_timeout: Duration,
) -> Result<Channel, tonic::transport::Error> {
    let uri = if addr.starts_with("https://") {
        addr.to_owned()
    } else {
        format!("https://{addr}")
    };
    Ok(Endpoint::from_shared(uri)?
        .tls_config(tls.client_config())?
        .connect_timeout(connect_timeout)
        // A peer that was SIGSTOPped or whose link was cut answers no ping: found within
        // interval + timeout, and every call on it fails instead of hanging.
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true)
        .connect_lazy())
}

#[tonic::async_trait]
impl Node for Arc<NodeService> {
    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        let id = &self.identity;
        let m = self.engine.metrics();
        let load = engine::EngineMetrics::get(&m.running) + engine::EngineMetrics::get(&m.waiting);
        let pages = self.engine.pool_counts();
        Ok(Response::new(pb::NodeInfo {
            role: match id.role {
                Role::Prefill => pb::Role::Prefill,
                Role::Decode => pb::Role::Decode,
            } as i32,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            model_checksum: id.model_checksum,
            vocab_size: self.engine.admission().vocab_size() as u64,
            max_context: self.engine.max_context() as u64,
            pool_tokens: id.pool_tokens as u64,
            page_tokens: id.page_tokens as u32,
            n_layers: id.n_layers as u32,
            kv_dim: id.kv_dim as u32,
            kv_dtype: id.kv_dtype.name().to_owned(),
            load,
            pages_total: pages.total as u64,
            pages_free: pages.free as u64,
            pages_leased: pages.leased as u64,
            pages_cached: pages.cached as u64,
            adapters: wire::adapters_to_pb(&self.adapters),
        }))
    }

    async fn admit(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::AdmitReply>, Status> {
        let span = tracing::info_span!("node.admit");
        crate::trace::continue_from(&span, &request);
        self.serve_admit(request).instrument(span).await
    }

    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillReply>, Status> {
        let span = tracing::info_span!("node.prefill");
        crate::trace::continue_from(&span, &request);
        self.serve_prefill(request).instrument(span).await
    }

    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        let span = tracing::info_span!("node.decode");
        crate::trace::continue_from(&span, &request);
        self.serve_decode(request).instrument(span).await
    }

    async fn push_kv(
        &self,
        request: Request<Streaming<pb::KvFrame>>,
    ) -> Result<Response<pb::PushReply>, Status> {
        let span = tracing::info_span!("node.push_kv");
        crate::trace::continue_from(&span, &request);
        self.serve_push_kv(request).instrument(span).await
    }
}
