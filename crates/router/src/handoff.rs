//! One request through the cluster. The router carries control only: admission verdicts,
//! the decode node's ticket, and the token stream; K/V goes from prefill to decode.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use engine::{Admitted, EngineError, Event, RequestHandle, RequestId};
use server::{ApiError, SubmitError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tonic::codec::Streaming;
use tracing::Instrument;
use transfer::pb::{self, decode_event::Event as DecodeEv};
use transfer::wire;

use crate::cluster::{Cluster, Node};

/// Counts a request against a node's load for as long as it is held.
struct InFlight(Arc<Node>);

impl InFlight {
    fn new(node: Arc<Node>) -> Self {
        node.in_flight.fetch_add(1, Ordering::Relaxed);
        node.sent.fetch_add(1, Ordering::Relaxed);
        Self(node)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn remote(f: pb::Failure) -> EngineError {
    EngineError::Remote {
        reason: f.reason,
        message: f.message,
    }
}

fn unavailable(message: &str) -> SubmitError {
    SubmitError::Failed(ApiError::Engine(EngineError::Remote {
        reason: "peer_gone".into(),
        message: message.to_owned(),
    }))
}

fn status_error(status: &tonic::Status) -> EngineError {
    remote(transfer::node::status_failure(status))
}

/// Admission on a prefill node, then a reservation on a decode node; then the rest runs in
/// its own task, feeding the returned handle. A refusal at either step is returned here,
/// so the client gets its status code; after this, failures are events.
pub(crate) async fn start(
    cluster: Arc<Cluster>,
    admitted: Admitted,
) -> Result<RequestHandle, SubmitError> {
    let request = admitted.request();
    let total_tokens = request.prompt.len().saturating_add(request.max_tokens);
    let number = cluster.next_request();
    let request_id = format!("{:016x}", cluster.request_id_keys.hash_one(number));
    let wire_request = wire::request_to_pb(&request_id, request);
    let timeout = cluster.deadlines.handoff;

    // Until the decode node has reserved, nothing has been computed or held for this
    // request, so a node that turns out to be unreachable is skipped for another.
    let attempts = cluster.node_count();
    let mut last_error = unavailable("no node is up that can hold this request");
    for _ in 0..attempts {
        let prefill = match cluster.pick_prefill(&request.domain, &request.prompt, total_tokens) {
            Some(node) => node,
            None => break,
        };
        match admit(&cluster, &prefill, &wire_request).await {
            Ok(()) => {}
            Err(Placement::Refused(e)) => return Err(e),
            Err(Placement::Unreachable(e)) => {
                prefill.mark_down();
                last_error = e;
                continue;
            }
        }
        let decode = match cluster.pick_decode(total_tokens) {
            Some(node) => node,
            None => break,
        };
        let decode_load = InFlight::new(decode.clone());
        // Open for the whole decode stream: the decode node's spans are its children.
        let decode_span = tracing::info_span!("call.decode");
        let reserved = reserve(&cluster, &decode, &wire_request, &decode_span)
            .instrument(decode_span.clone())
            .await;
        let (events, ticket) = match reserved {
            Ok(reserved) => reserved,
            Err(Placement::Refused(e)) => return Err(e),
            Err(Placement::Unreachable(e)) => {
                decode.mark_down();
                last_error = e;
                continue;
            }
        };
        let prefill_load = InFlight::new(prefill.clone());
        let mut prefill_call = tonic::Request::new(pb::PrefillRequest {
            request: Some(wire_request),
            decode_addr: decode.addr.clone(),
            ticket,
        });
        prefill_call.set_timeout(timeout);
        let prefill_span = tracing::info_span!("call.prefill");
        transfer::trace::inject(&prefill_span, &mut prefill_call);
        let (tx, rx) = unbounded_channel();
        let prefill_client = prefill.client.clone();
        tokio::spawn(async move {
            run(
                &cluster,
                prefill_client,
                prefill_call,
                (prefill_load, prefill_span),
                events,
                tx,
            )
            .instrument(decode_span)
            .await;
            drop(decode_load);
        });
        return Ok(RequestHandle {
            id: RequestId(number),
            events: rx,
        });
    }
    Err(last_error)
}

/// Why a node did not take a request: its refusal is the client's answer; an unreachable
/// node is skipped.
enum Placement {
    Refused(SubmitError),
    Unreachable(SubmitError),
}

fn placement_error(status: &tonic::Status) -> Placement {
    let e = SubmitError::Failed(ApiError::Engine(status_error(status)));
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
            Placement::Unreachable(e)
        }
        _ => Placement::Refused(e),
    }
}

/// The prefill node's own admission.
async fn admit(
    cluster: &Cluster,
    prefill: &Node,
    wire_request: &pb::GenerateRequest,
) -> Result<(), Placement> {
    let mut call = tonic::Request::new(wire_request.clone());
    call.set_timeout(cluster.deadlines.handoff);
    let span = tracing::info_span!("call.admit");
    transfer::trace::inject(&span, &mut call);
    let verdict = prefill
        .client
        .clone()
        .admit(call)
        .instrument(span)
        .await
        .map_err(|s| placement_error(&s))?
        .into_inner();
    match verdict.outcome {
        Some(pb::admit_reply::Outcome::Admitted(_)) => Ok(()),
        Some(pb::admit_reply::Outcome::Rejected(r)) => {
            cluster
                .metrics
                .prefill_rejections
                .fetch_add(1, Ordering::Relaxed);
            let rejection = wire::rejection_from_pb(r).map_err(|s| placement_error(&s))?;
            Err(Placement::Refused(SubmitError::Rejected(rejection)))
        }
        None => Err(Placement::Refused(unavailable(
            "the prefill node answered no verdict",
        ))),
    }
}

/// The decode node's admission and reservation: its stream, and the ticket for the push.
async fn reserve(
    cluster: &Cluster,
    decode: &Node,
    wire_request: &pb::GenerateRequest,
    span: &tracing::Span,
) -> Result<(Streaming<pb::DecodeEvent>, Vec<u8>), Placement> {
    let mut call = tonic::Request::new(wire_request.clone());
    transfer::trace::inject(span, &mut call);
    let mut events = decode
        .client
        .clone()
        .decode(call)
        .await
        .map_err(|s| placement_error(&s))?
        .into_inner();
    let first = tokio::time::timeout(cluster.deadlines.handoff, events.message()).await;
    let refused =
        |e: EngineError| Err(Placement::Refused(SubmitError::Failed(ApiError::Engine(e))));
    match first {
        Ok(Ok(Some(pb::DecodeEvent {
            event: Some(DecodeEv::Reserved(r)),
        }))) => Ok((events, r.ticket)),
        Ok(Ok(Some(pb::DecodeEvent {
            event: Some(DecodeEv::Rejected(r)),
        }))) => {
            cluster
                .metrics
                .decode_rejections
                .fetch_add(1, Ordering::Relaxed);
            let rejection = wire::rejection_from_pb(r).map_err(|s| placement_error(&s))?;
            Err(Placement::Refused(SubmitError::Rejected(rejection)))
        }
        Ok(Ok(Some(pb::DecodeEvent {
            event: Some(DecodeEv::Failed(f)),
        }))) => {
            cluster.metrics.transfer.failure(&f.reason);
            refused(remote(f))
        }
        Ok(Ok(_)) => Err(Placement::Refused(unavailable(
            "the decode node answered no reservation",
        ))),
        Ok(Err(s)) => Err(placement_error(&s)),
        Err(_) => {
            cluster.metrics.transfer.failure("timeout");
            refused(EngineError::Remote {
                reason: "timeout".into(),
                message: "the decode node reserved no pages in time".into(),
            })
        }
    }
}
/// Drives the prefill call and relays the decode stream until the request ends. Returning
/// drops both calls, which cancels the request on both nodes (the decode node scrubs its
/// reservation).
async fn run(
    cluster: &Cluster,
    mut prefill_client: pb::node_client::NodeClient<tonic::transport::Channel>,
    prefill_call: tonic::Request<pb::PrefillRequest>,
    // The prefill call's load and span, both released with its reply.
    prefill_load: (InFlight, tracing::Span),
    mut events: Streaming<pb::DecodeEvent>,
    tx: UnboundedSender<Event>,
) {
    let idle = cluster.deadlines.handoff;
    let fail = |e: EngineError| {
        if let EngineError::Remote { reason, .. } = &e {
            cluster.metrics.transfer.failure(reason);
        }
        let _ = tx.send(Event::Failed(e));
    };
    let prefill = prefill_client.prefill(prefill_call);
    tokio::pin!(prefill);
    // The prefill node's part ends with its reply; it stops counting as its load then.
    let mut prefill_load = Some(prefill_load);
    let mut prefill_pending = true;
    // The decode node sends nothing after `Reserved` until the K/V verified.
    let mut verified = false;
    loop {
        tokio::select! {
            _ = tx.closed() => return,
            reply = &mut prefill, if prefill_pending => {
                prefill_pending = false;
                prefill_load.take();
                match reply.map(|r| r.into_inner().outcome) {
                    Ok(Some(pb::prefill_reply::Outcome::Done(_))) => {}
                    Ok(Some(pb::prefill_reply::Outcome::Failed(f))) => return fail(remote(f)),
                    Ok(Some(pb::prefill_reply::Outcome::Rejected(r))) => {
                        // Admitted a moment ago by the same node: its limits changed.
                        let message = wire::rejection_from_pb(r)
                            .map_or_else(|s| s.message().to_owned(), |r| r.to_string());
                        return fail(EngineError::Remote { reason: "protocol".into(), message });
                    }
                    Ok(None) => {
                        return fail(EngineError::Remote {
                            reason: "protocol".into(),
                            message: "the prefill node answered no outcome".into(),
                        })
                    }
                    Err(status) => return fail(status_error(&status)),
                }
            }
            next = tokio::time::timeout(idle, events.message()) => {
                let event = match next {
                    Err(_) => return fail(EngineError::Remote {
                        reason: "timeout".into(),
                        message: "the decode node sent nothing in time".into(),
                    }),
                    Ok(Err(status)) => return fail(status_error(&status)),
                    Ok(Ok(None)) => return fail(EngineError::Remote {
                        reason: "peer_gone".into(),
                        message: "the decode stream ended without an answer".into(),
                    }),
                    Ok(Ok(Some(pb::DecodeEvent { event }))) => event,
                };
                if !verified && matches!(event, Some(DecodeEv::Token(_) | DecodeEv::Finished(_))) {
                    verified = true;
                    cluster.metrics.handoffs.fetch_add(1, Ordering::Relaxed);
                }
                match event {
                    Some(DecodeEv::Token(t)) => match wire::token_from_pb(t) {
                        Ok(t) => {
                            if tx.send(Event::Token(t)).is_err() {
                                return;
                            }
                        }
                        Err(s) => return fail(status_error(&s)),
                    },
                    Some(DecodeEv::Finished(f)) => {
                        let (reason, usage) = wire::finished_from_pb(&f);
                        let _ = tx.send(Event::Finished { reason, usage });
                        return;
                    }
                    Some(DecodeEv::Failed(f)) => return fail(remote(f)),
                    Some(DecodeEv::Reserved(_) | DecodeEv::Rejected(_)) | None => {
                        return fail(EngineError::Remote {
                            reason: "protocol".into(),
                            message: "the decode node broke the stream's order".into(),
                        })
                    }
                }
            }
        }
    }
}
