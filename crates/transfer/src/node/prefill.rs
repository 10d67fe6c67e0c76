//! The prefill role: admit, prefill, and push the prompt's K/V straight to the decode node
//! the router chose, over a channel kept per decode node.

use std::time::Instant;

use engine::handoff::{Manifest, Ticket};
use engine::Event;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::{connect_lazy, status_failure, NodeService, Role};
use crate::pb::{self, node_client::NodeClient};
use crate::wire;

impl NodeService {
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
        adapter: Option<&wire::AdapterId>,
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
                &manifest, adapter,
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
        crate::trace::inject(&tracing::Span::current(), &mut request);
        match client.push_kv(request).await {
            Ok(reply) => match reply.into_inner().failed {
                None => Ok(()),
                Some(f) => Err(f),
            },
            Err(status) => Err(status_failure(&status)),
        }
    }

    pub(super) async fn serve_admit(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::AdmitReply>, Status> {
        use pb::admit_reply::Outcome;
        self.require(Role::Prefill)?;
        let outcome = match self.admit_from_pb(request.into_inner()).await? {
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

    pub(super) async fn serve_prefill(
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
        let request = request.ok_or_else(|| Status::invalid_argument("no request"))?;
        // Admission again, on this call's own values: the verdict of `Admit` is not trusted
        // to still hold (an adapter may have been unloaded since), and a rejection here
        // still ends the request with its error.
        let (request_id, admitted) = match self.admit_from_pb(request).await? {
            Ok(a) => a,
            Err(r) => {
                return Ok(Response::new(pb::PrefillReply {
                    outcome: Some(Outcome::Rejected(wire::rejection_to_pb(&r))),
                }))
            }
        };
        // What the K/V is computed under, as admission left it: the domain narrowed by the
        // adapter's fingerprint, and the adapter (this node's own, which is the one the
        // router named), for the manifest.
        let domain = admitted.request().domain.clone();
        let adapter = admitted.request().adapter.as_ref().map(wire::AdapterId::of);
        // Dropping this call (the router gave up) drops the handle, which cancels the
        // request in the engine.
        // The engine's part: waiting for a running slot, then the prompt's forward pass.
        let prefill_span = tracing::info_span!("prefill");
        let mut handle = match self.engine.submit_prefill(admitted) {
            Ok(h) => h,
            Err(full) => {
                self.metrics.failure("capacity");
                return Ok(Response::new(pb::PrefillReply {
                    outcome: Some(Outcome::Failed(wire::failure("capacity", full.to_string()))),
                }));
            }
        };
        let output = match handle.events.recv().instrument(prefill_span).await {
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
        let pushed = self
            .push(&decode_addr, manifest, adapter.as_ref(), &output)
            .instrument(tracing::info_span!("transfer", bytes))
            .await;
        let outcome = match pushed {
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
}
