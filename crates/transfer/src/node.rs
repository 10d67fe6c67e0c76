//! The internal API of one node: a prefill node admits and prefills, then pushes the
//! prompt's K/V straight to the decode node the router chose; a decode node admits,
//! reserves, verifies what arrives, and only then decodes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::handoff::{
    HandoffError, ImportReservation, Manifest, ReserveError, Ticket, VerifiedImport,
};
use engine::{EngineHandle, Event};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};

use crate::metrics::TransferMetrics;
use crate::pb::{self, node_client::NodeClient, node_server::Node};
use crate::tls::TlsIdentity;
use crate::wire;

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
    pub kv_dtype_bytes: usize,
}

/// Why a handoff failed on the decode side, as its metric label and a message the router
/// may show.
#[derive(Debug)]
struct HandoffFailure(pb::Failure);

impl From<HandoffError> for HandoffFailure {
    fn from(e: HandoffError) -> Self {
        Self(wire::failure(e.reason(), e.to_string()))
    }
}

/// A reservation waiting for its push; the decode call that made it waits on `verified`.
struct PendingImport {
    reservation: ImportReservation,
    verified: oneshot::Sender<Result<VerifiedImport, HandoffFailure>>,
}

pub struct NodeService {
    identity: NodeIdentity,
    engine: EngineHandle,
    metrics: Arc<TransferMetrics>,
    deadlines: Deadlines,
    tls: TlsIdentity,
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
    ) -> Self {
        Self {
            identity,
            engine,
            metrics,
            deadlines,
            tls,
            pending: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// The largest message this node accepts: a request of the whole context, or a page.
    pub fn max_message_bytes(&self) -> usize {
        let page = self.identity.n_layers
            * 2
            * self.identity.page_tokens
            * self.identity.kv_dim
            * self.identity.kv_dtype_bytes;
        let request = self.engine.max_context() * 6;
        page.max(request) + 64 * 1024
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

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<Ticket, PendingImport>> {
        // Entries are inserted and removed whole; a panic elsewhere cannot leave one torn.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn channel(&self, addr: &str) -> Result<Channel, Status> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = peers.get(addr) {
            return Ok(c.clone());
        }
        let channel = connect_lazy(addr, &self.tls, self.deadlines.frame)
            .map_err(|e| Status::invalid_argument(format!("decode address {addr:?}: {e}")))?;
        peers.insert(addr.to_owned(), channel.clone());
        Ok(channel)
    }

    /// Prefill: pushes the K/V to the decode node. Errors are the failure to report.
    async fn push(
        &self,
        decode_addr: &str,
        manifest: Manifest,
        output: &engine::handoff::PrefillOutput,
    ) -> Result<(), pb::Failure> {
        let channel = self
            .channel(decode_addr)
            .map_err(|s| wire::failure("peer_gone", s.message()))?;
        let mut client = NodeClient::new(channel)
            .max_decoding_message_size(self.max_message_bytes())
            .max_encoding_message_size(self.max_message_bytes());
        let mut frames = Vec::with_capacity(output.pages.len() + 1);
        frames.push(pb::KvFrame {
            frame: Some(pb::kv_frame::Frame::Manifest(wire::manifest_to_pb(
                &manifest,
            ))),
        });
        for (i, page) in output.pages.iter().enumerate() {
            let tokens = (output.prompt.len() - i * output.page_tokens).min(output.page_tokens);
            frames.push(pb::KvFrame {
                frame: Some(pb::kv_frame::Frame::Page(pb::Page {
                    index: i as u32,
                    tokens: tokens as u32,
                    data: page.clone(),
                })),
            });
        }
        let mut request = Request::new(tokio_stream::iter(frames));
        request.set_timeout(self.deadlines.handoff);
        match client.push_kv(request).await {
            Ok(reply) => match reply.into_inner().failed {
                None => Ok(()),
                Some(f) => Err(f),
            },
            Err(status) => Err(status_failure(&status)),
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

type DecodeStream = ReceiverStream<Result<pb::DecodeEvent, Status>>;

fn event(e: pb::decode_event::Event) -> Result<pb::DecodeEvent, Status> {
    Ok(pb::DecodeEvent { event: Some(e) })
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
            kv_dtype_bytes: id.kv_dtype_bytes as u32,
            load,
            pages_total: pages.total as u64,
            pages_free: pages.free as u64,
            pages_leased: pages.leased as u64,
            pages_cached: pages.cached as u64,
        }))
    }

    async fn admit(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::AdmitReply>, Status> {
        use pb::admit_reply::Outcome;
        self.require(Role::Prefill)?;
        let (_, request) = wire::request_from_pb(request.into_inner())?;
        let outcome = match self.engine.admission().admit(request) {
            Ok(_) => {
                self.metrics
                    .admitted
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Outcome::Admitted(true)
            }
            Err(r) => {
                self.metrics
                    .rejected
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Outcome::Rejected(wire::rejection_to_pb(&r))
            }
        };
        Ok(Response::new(pb::AdmitReply {
            outcome: Some(outcome),
        }))
    }

    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillReply>, Status> {
        use pb::prefill_reply::Outcome;
        self.require(Role::Prefill)?;
        let pb::PrefillRequest {
            request,
            decode_addr,
            ticket,
        } = request.into_inner();
        let ticket = Ticket::from_bytes(&ticket)
            .ok_or_else(|| Status::invalid_argument("ticket must be 16 bytes"))?;
        let (request_id, request) =
            wire::request_from_pb(request.ok_or_else(|| Status::invalid_argument("no request"))?)?;
        let domain = request.domain.clone();
        // Admission again, on this call's own values: the verdict of `Admit` is not trusted
        // to still hold, and a rejection here still ends the request with its error.
        let admitted = match self.engine.admission().admit(request) {
            Ok(a) => a,
            Err(r) => {
                return Ok(Response::new(pb::PrefillReply {
                    outcome: Some(Outcome::Rejected(wire::rejection_to_pb(&r))),
                }))
            }
        };
        // Dropping this call (the router gave up) drops the handle, which cancels the
        // request in the engine.
        let mut handle = match self.engine.submit_prefill(admitted) {
            Ok(h) => h,
            Err(full) => {
                self.metrics.failure("capacity");
                return Ok(Response::new(pb::PrefillReply {
                    outcome: Some(Outcome::Failed(wire::failure("capacity", full.to_string()))),
                }));
            }
        };
        let output = match handle.events.recv().await {
            Some(Event::Prefilled(out)) => out,
            Some(Event::Failed(e)) => {
                let f = wire::failure_from_engine(&e);
                self.metrics.failure(&f.reason);
                return Ok(Response::new(pb::PrefillReply {
                    outcome: Some(Outcome::Failed(f)),
                }));
            }
            other => {
                tracing::error!("prefill ended with an unexpected event: {other:?}");
                return Ok(Response::new(pb::PrefillReply {
                    outcome: Some(Outcome::Failed(wire::failure(
                        "model",
                        "the prefill ended without K/V",
                    ))),
                }));
            }
        };
        let started = Instant::now();
        let manifest = Manifest::describe(ticket, request_id, domain, &output);
        let bytes = output.bytes();
        let outcome = match self.push(&decode_addr, manifest, &output).await {
            Ok(()) => {
                self.metrics.transferred(true, bytes, started.elapsed());
                Outcome::Done(pb::prefill_reply::Done {
                    bytes: bytes as u64,
                    pages: output.pages.len() as u32,
                    cached_tokens: output.cached_tokens as u64,
                })
            }
            Err(f) => {
                self.metrics.failure(&f.reason);
                Outcome::Failed(f)
            }
        };
        Ok(Response::new(pb::PrefillReply {
            outcome: Some(outcome),
        }))
    }

    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        use pb::decode_event::Event as E;
        self.require(Role::Decode)?;
        let (request_id, request) = wire::request_from_pb(request.into_inner())?;
        self.metrics
            .decode_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(64);
        let admitted = match self.engine.admission().admit(request) {
            Ok(a) => a,
            Err(r) => {
                self.metrics
                    .rejected
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = tx.try_send(event(E::Rejected(wire::rejection_to_pb(&r))));
                return Ok(Response::new(ReceiverStream::new(rx)));
            }
        };
        self.metrics
            .admitted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let node = self.clone();
        tokio::spawn(async move { node.run_decode(admitted, request_id, tx).await });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn push_kv(
        &self,
        request: Request<Streaming<pb::KvFrame>>,
    ) -> Result<Response<pb::PushReply>, Status> {
        self.require(Role::Decode)?;
        let started = Instant::now();
        let mut frames = request.into_inner();
        let reply = |failed: Option<pb::Failure>| Ok(Response::new(pb::PushReply { failed }));
        let manifest = match self.next_frame(&mut frames).await {
            Ok(Some(pb::kv_frame::Frame::Manifest(m))) => m,
            Ok(_) => {
                self.metrics.failure("manifest");
                return reply(Some(wire::failure(
                    "manifest",
                    "a push must begin with its manifest",
                )));
            }
            Err(f) => {
                self.metrics.failure(&f.reason);
                return reply(Some(f));
            }
        };
        // The ticket first: whatever else is wrong with the manifest then ends that
        // reservation at once, rather than at its deadline.
        let pending = Ticket::from_bytes(&manifest.ticket).and_then(|t| self.pending().remove(&t));
        let Some(pending) = pending else {
            self.metrics.failure("manifest");
            return reply(Some(wire::failure(
                "manifest",
                "no reservation holds this ticket (expired, cancelled, or already filled)",
            )));
        };
        let manifest = match wire::manifest_from_pb(manifest) {
            Ok(m) => m,
            Err(status) => {
                let f = wire::failure("manifest", status.message());
                self.metrics.failure(&f.reason);
                let _ = pending.verified.send(Err(HandoffFailure(f.clone())));
                return reply(Some(f));
            }
        };
        let PendingImport {
            reservation,
            verified,
        } = pending;
        let outcome = self.receive(reservation, manifest, &mut frames).await;
        let failure = match outcome {
            Ok((import, bytes)) => {
                if verified.send(Ok(import)).is_ok() {
                    self.metrics.transferred(false, bytes, started.elapsed());
                    None
                } else {
                    // The decode call gave up (timeout, router gone) while the pages came
                    // in: the verified sequence is dropped with the send error.
                    self.metrics.failure("timeout");
                    Some(wire::failure(
                        "timeout",
                        "the reservation expired during the push",
                    ))
                }
            }
            Err(HandoffFailure(f)) => {
                self.metrics.failure(&f.reason);
                let _ = verified.send(Err(HandoffFailure(f.clone())));
                Some(f)
            }
        };
        reply(failure)
    }
}

impl NodeService {
    /// The next frame's content, `None` at the end of the stream.
    async fn next_frame(
        &self,
        frames: &mut Streaming<pb::KvFrame>,
    ) -> Result<Option<pb::kv_frame::Frame>, pb::Failure> {
        match tokio::time::timeout(self.deadlines.frame, frames.message()).await {
            Err(_) => Err(wire::failure(
                "timeout",
                "no frame within the frame deadline",
            )),
            Ok(Err(status)) => Err(status_failure(&status)),
            Ok(Ok(None)) => Ok(None),
            Ok(Ok(Some(pb::KvFrame { frame: None }))) => {
                Err(wire::failure("protocol", "empty frame"))
            }
            Ok(Ok(Some(pb::KvFrame { frame: Some(f) }))) => Ok(Some(f)),
        }
    }

    /// Checks the manifest, writes and checks every page, then coverage. On any failure the
    /// reservation (or transfer) is dropped here, scrubbing its pages.
    async fn receive(
        &self,
        reservation: ImportReservation,
        manifest: Manifest,
        frames: &mut Streaming<pb::KvFrame>,
    ) -> Result<(VerifiedImport, usize), HandoffFailure> {
        let mut transfer = reservation.begin(manifest)?;
        let mut bytes = 0;
        loop {
            match self.next_frame(frames).await.map_err(HandoffFailure)? {
                None => break,
                Some(pb::kv_frame::Frame::Page(page)) => {
                    bytes += page.data.len();
                    transfer.receive_page(page.index as usize, page.tokens as usize, &page.data)?;
                }
                Some(pb::kv_frame::Frame::Manifest(_)) => {
                    return Err(HandoffFailure(wire::failure(
                        "manifest",
                        "a second manifest in one push",
                    )))
                }
            }
        }
        Ok((transfer.finish()?, bytes))
    }

    /// Decode: reserve, announce the ticket, wait for the verified K/V, then stream tokens.
    /// Ends early, releasing everything, when the router stops listening.
    async fn run_decode(
        self: Arc<Self>,
        admitted: engine::Admitted,
        request_id: String,
        tx: mpsc::Sender<Result<pb::DecodeEvent, Status>>,
    ) {
        use pb::decode_event::Event as E;
        let fail = |reason: &str, message: String| event(E::Failed(wire::failure(reason, message)));
        let reservation = tokio::select! {
            r = self.engine.reserve_import(admitted, request_id) => r,
            _ = tokio::time::sleep(self.deadlines.handoff) => {
                self.metrics.failure("capacity");
                let _ = tx.send(fail("capacity", "no KV pages became free in time".into())).await;
                return;
            }
            _ = tx.closed() => return,
        };
        let reservation = match reservation {
            Ok(r) => r,
            Err(ReserveError::Full(full)) => {
                self.metrics.failure("capacity");
                let _ = tx.send(fail("capacity", full.to_string())).await;
                return;
            }
            Err(ReserveError::Engine(e)) => {
                let f = wire::failure_from_engine(&e);
                self.metrics.failure(&f.reason);
                let _ = tx.send(event(E::Failed(f))).await;
                return;
            }
        };
        let ticket = reservation.ticket();
        let (verified_tx, verified_rx) = oneshot::channel();
        self.pending().insert(
            ticket,
            PendingImport {
                reservation,
                verified: verified_tx,
            },
        );
        let reserved = event(E::Reserved(pb::decode_event::Reserved {
            ticket: ticket.to_bytes().to_vec(),
        }));
        if tx.send(reserved).await.is_err() {
            self.pending().remove(&ticket);
            return;
        }
        let verified = tokio::select! {
            v = verified_rx => v,
            _ = tokio::time::sleep(self.deadlines.handoff) => {
                // Dropping the entry (if the push has not taken it) scrubs the pages.
                if self.pending().remove(&ticket).is_some() {
                    self.metrics.failure("timeout");
                }
                let _ = tx.send(fail("timeout", "the prompt's K/V did not arrive in time".into())).await;
                return;
            }
            _ = tx.closed() => {
                self.pending().remove(&ticket);
                return;
            }
        };
        let import = match verified {
            Ok(Ok(import)) => import,
            Ok(Err(HandoffFailure(f))) => {
                let _ = tx.send(event(E::Failed(f))).await;
                return;
            }
            Err(_) => {
                let _ = tx
                    .send(fail("peer_gone", "the push ended without a verdict".into()))
                    .await;
                return;
            }
        };
        let mut handle = match self.engine.submit_import(import) {
            Ok(h) => h,
            Err(full) => {
                self.metrics.failure("capacity");
                let _ = tx.send(fail("capacity", full.to_string())).await;
                return;
            }
        };
        loop {
            let ev = tokio::select! {
                ev = handle.events.recv() => ev,
                // The router is gone: dropping the handle cancels the request.
                _ = tx.closed() => return,
            };
            let (out, last) = match ev {
                Some(Event::Token(t)) => (E::Token(wire::token_to_pb(&t)), false),
                Some(Event::Finished { reason, usage }) => {
                    (E::Finished(wire::finished_to_pb(reason, &usage)), true)
                }
                Some(Event::Failed(e)) => {
                    let f = wire::failure_from_engine(&e);
                    self.metrics.failure(&f.reason);
                    (E::Failed(f), true)
                }
                Some(Event::Prefilled(_)) | None => (
                    E::Failed(wire::failure("shutdown", "the decode engine stopped")),
                    true,
                ),
            };
            if tx.send(event(out)).await.is_err() || last {
                return;
            }
        }
    }
}
