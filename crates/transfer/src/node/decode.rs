//! The decode role: admit, reserve, verify every page that arrives under the reservation's
//! ticket, and only then decode.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use engine::handoff::{
    HandoffError, ImportReservation, Manifest, ReserveError, Ticket, VerifiedImport,
};
use engine::Event;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use super::{status_failure, NodeService, Role};
use crate::pb;
use crate::wire;

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
pub(super) struct PendingImport {
    reservation: ImportReservation,
    /// The adapter this node's own request resolved to (`None`: the base model): a push
    /// must name exactly it.
    adapter: Option<wire::AdapterId>,
    verified: oneshot::Sender<Result<VerifiedImport, HandoffFailure>>,
    /// The decode call's span: the push's verification is recorded under it.
    span: tracing::Span,
}

pub(super) type DecodeStream = ReceiverStream<Result<pb::DecodeEvent, Status>>;

fn event(e: pb::decode_event::Event) -> Result<pb::DecodeEvent, Status> {
    Ok(pb::DecodeEvent { event: Some(e) })
}

impl NodeService {
    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<Ticket, PendingImport>> {
        // Entries are inserted and removed whole; a panic elsewhere cannot leave one torn.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) async fn serve_decode(
        self: &Arc<Self>,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        use pb::decode_event::Event as E;
        self.require(Role::Decode)?;
        let verdict = self.admit_from_pb(request.into_inner()).await?;
        self.metrics
            .decode_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(64);
        let (request_id, admitted) = match verdict {
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
        tokio::spawn(
            async move { node.run_decode(admitted, request_id, tx).await }
                .instrument(tracing::Span::current()),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    pub(super) async fn serve_push_kv(
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
        let (manifest, adapter) = match wire::manifest_from_pb(manifest) {
            Ok(m) => m,
            Err(status) => {
                let f = wire::failure("manifest", status.message());
                self.metrics.failure(&f.reason);
                let _ = pending.verified.send(Err(HandoffFailure(f.clone())));
                return reply(Some(f));
            }
        };
        // K/V is a function of the adapter that computed it: a prefill node that ran another
        // adapter, another version of this one, or the base model must not feed this
        // request. (The manifest's domain carries the fingerprint too, which `begin`
        // compares; this names the difference and holds the file to the same account.)
        if adapter != pending.adapter {
            let f = wire::failure(
                "manifest",
                format!(
                    "the K/V was computed under {}, this request runs under {}",
                    wire::describe_adapter(adapter.as_ref()),
                    wire::describe_adapter(pending.adapter.as_ref())
                ),
            );
            tracing::warn!("push refused: {}", f.message);
            self.metrics.failure(&f.reason);
            // Dropping the reservation with the entry scrubs its pages.
            let _ = pending.verified.send(Err(HandoffFailure(f.clone())));
            return reply(Some(f));
        }
        let PendingImport {
            reservation,
            verified,
            span,
            ..
        } = pending;
        let outcome = self
            .receive(reservation, manifest, &mut frames)
            .instrument(tracing::info_span!(parent: &span, "verification"))
            .await;
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
        let adapter = admitted.request().adapter.as_ref().map(wire::AdapterId::of);
        // Waiting for the pages the prompt needs to be free.
        let waited = async {
            tokio::select! {
                r = self.engine.reserve_import(admitted, request_id) => Ok(r),
                // Err(timed out): the deadline passed, or the router left (nothing to tell).
                _ = tokio::time::sleep(self.deadlines.handoff) => Err(true),
                _ = tx.closed() => Err(false),
            }
        }
        .instrument(tracing::info_span!("queueing"))
        .await;
        let reservation = match waited {
            Ok(r) => r,
            Err(timed_out) => {
                if timed_out {
                    self.metrics.failure("capacity");
                    let _ = tx
                        .send(fail("capacity", "no KV pages became free in time".into()))
                        .await;
                }
                return;
            }
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
                adapter,
                verified: verified_tx,
                span: tracing::Span::current(),
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
        // Generation, from the engine's queue to the last token.
        self.generate(import, &tx)
            .instrument(tracing::info_span!("decode"))
            .await;
    }

    async fn generate(
        &self,
        import: VerifiedImport,
        tx: &mpsc::Sender<Result<pb::DecodeEvent, Status>>,
    ) {
        use pb::decode_event::Event as E;
        let fail = |reason: &str, message: String| event(E::Failed(wire::failure(reason, message)));
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
