//! A model-checked specification of kvwarden's disaggregated prefill/decode handoff.
//!
//! The incident this protocol exists to prevent (described at the top of README.md): a prefill node rejected
//! an over-length prompt, replaced it by a one-token placeholder and carried on; the decode
//! node, which had reserved pages for the whole prompt, decoded over pages nobody had
//! rewritten, full of other customers' KV, and the client got HTTP 200. This crate states the
//! protocol as three [stateright] actors and checks, over every interleaving of a small
//! deployment, that no request can end that way.
//!
//! # The protocol, as modelled
//!
//! Message names follow the handoff's steps; the right column names the real thing in
//! `crates/transfer/proto/node.proto` and `engine::handoff`.
//!
//! | model | meaning | real |
//! |---|---|---|
//! | `Admit{req, tenant, prompt_len}` R → P | the router asks the prefill node to admit the prompt | `Admit(GenerateRequest)` |
//! | `Admitted{req}` / `Rejected{req, OverLength}` P → R | prefill admission; a rejection ends the request with that original error, and the decode node never hears of it | `AdmitReply{admitted \| rejected: Rejection.context_length_exceeded}` |
//! | `Reserve{req, expect}` R → D | the decode node admits against its own pool and reserves pages; `expect` ([`Expect`]) is what the router knows itself: id, tenant, prompt length, checksum of the token ids | `Decode(GenerateRequest)`: request id, tenant, the prompt itself (decode computes length and checksum) |
//! | `Reserved{req, ticket}` / `Rejected{req, NoCapacity}` D → R | the reservation, or a refusal | the first `DecodeEvent`: `reserved{ticket}` / `rejected` |
//! | `Generate{ticket}` R → D | the router opens the token stream | the same `Decode` stream, kept open after `reserved` |
//! | `Prefill{req, decode, ticket}` R → P | the router starts the prefill, naming where to push | `Prefill(PrefillRequest{request, decode_addr, ticket})` |
//! | `Push{ticket, manifest, pages}` P → D | the prefill node pushes the KV straight to the decode node; the [`Manifest`] claims id, tenant, length, token checksum, first token, page count and per-page checksums | `PushKv(stream KvFrame)`: a `Manifest` frame, then `Page` frames |
//! | `PrefillDone` / `PrefillFailed` P → R | the prefill's result | `PrefillReply{done \| rejected \| failed}` |
//! | [`protocol::verify`] in D | manifest against `expect`, coverage (every slot written exactly once), every page checksum; only then `Verified` | `ImportReservation::begin` → `ImportTransfer::receive_page` → `finish` → `VerifiedImport` |
//! | [`Mismatch`] `Request`, `Tenant`, `PromptLength` / `TokenSum` / `PageCount`, `Coverage` / `PageSum` | which check failed | `HandoffError::Manifest` / `TokenChecksum` / `Coverage` / `PageChecksum` |
//! | `Token{req, index, token}`, `Finished{req, tokens}` D → R | the stream, only from `Verified` | `DecodeEvent.token`, `DecodeEvent.finished` |
//! | `Failed{req, reason}` D → R | a refused push (pages scrubbed) or a reservation timeout | `DecodeEvent.failed{Failure{reason: manifest, checksum, coverage, timeout, ..}}` |
//! | [`router::ClientEvent`] | the router's answer to the client: tokens, then exactly one of success or error | the OpenAI response or stream: 200 / `finish_reason`, or 4xx/5xx / an error event |
//! | `Timer::Deadline` (R) | the router's per-request deadline; also stands for a broken stream (`peer_gone`) | the router's timeouts |
//! | `Timer::Reservation`, `Timer::DecodeStep` (D) | a reservation's deadline; one decode step | the decode node's reservation timeout; its scheduler |
//!
//! A page holds one token slot of every layer; data is modelled by provenance ([`Kv`],
//! [`Token`]), so an answer built on someone else's KV is visible in the state.
//!
//! # The environment
//!
//! - The network is stateright's unordered duplicating network: any message may be delivered
//!   any number of times, in any order; up to [`Config::max_losses`] messages may also be lost.
//! - At most [`Config::max_crashes`] of the prefill and decode nodes crash, at any point, and
//!   stay down (the router is not crashed: its clients would have no one to answer them).
//! - Timers fire nondeterministically, at any time while armed.
//! - [`PrefillBehaviour::Faulty`]: once per run, the prefill node may fail, or push any of the
//!   [`PushFault`]s (another request's KV, wrong tenant, truncated prompt, other tokens, a
//!   missing page, a page written twice, a corrupted page).
//! - The decode pool starts full of a previous customer's KV, and a finished request's pages
//!   are released without scrubbing (the real pool scrubs on release; the model does not rely
//!   on it): only the protocol stands between an answer and stale KV.
//!
//! # Properties ([`properties`])
//!
//! Always: a request the prefill node rejected never reaches the decode node; no token is
//! emitted or forwarded for it; the decode node emits tokens only from a push that passed
//! verification; each client gets at most one terminal answer and nothing after it; a success
//! answers the complete stream computed from the request's own verified KV; no client ever
//! receives a token computed from another request's data; every unanswered request has the
//! router's deadline armed (so, since a deadline always answers, every request is answered
//! under fair timers, even over loss, crashes and cycles).
//!
//! Eventually (stateright checks it on paths that end): every request gets exactly one
//! terminal answer.
//!
//! Sometimes (the model is not vacuous): a request succeeds; the prefill node rejects one and
//! its client gets that error; the decode node refuses a corrupted push; it refuses a
//! reservation for capacity; a client gets tokens and then an error; a reservation times out.
//!
//! # Mutations
//!
//! [`DecodeBehaviour::SkipVerification`], [`DecodeBehaviour::WriteLatePushes`],
//! [`RouterBehaviour::ProceedOnPrefillRejection`], [`PrefillBehaviour::PlaceholderOnOverLength`],
//! [`RouterBehaviour::ForwardAfterAnswer`] and [`RouterBehaviour::NoDeadline`] break the
//! protocol on purpose; the tests check that the checker then finds counterexamples (with the
//! placeholder and no verification together, it finds the incident itself).

#![forbid(unsafe_code)]

pub mod decode;
pub mod node;
pub mod prefill;
pub mod properties;
pub mod protocol;
pub mod router;
pub mod trace;

use std::sync::Arc;

use stateright::actor::{ActorModel, ActorModelAction, ActorModelState, Id, LossyNetwork, Network};
use stateright::{Model, Property};

pub use node::{Node, NodeState, Timer};
pub use prefill::{PrefillChoice, PrefillOutcome, PushFault};
pub use protocol::{Error, Expect, Kv, Manifest, Mismatch, Msg, Req, Tenant, Ticket, Token};

/// One state of the deployment. Its history counts the messages lost so far.
pub type State = ActorModelState<Node, u8>;
/// One step of the deployment.
pub type Action = ActorModelAction<Msg, Timer, PrefillChoice>;

/// The checked model: stateright's actor model of the three nodes, with the environment
/// bounded as [`Config`] says (losses, crashes; a crashed node never recovers; the router
/// never crashes). The unordered duplicating network's "last message delivered" is cleared
/// from every state: no behaviour depends on it, and keeping it would multiply the states.
#[derive(Clone)]
pub struct HandoffModel {
    pub cfg: Arc<Config>,
    actors: ActorModel<Node, Arc<Config>, u8>,
}

impl Model for HandoffModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        self.actors.init_states()
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        self.actors.actions(state, actions);
        let losses_left = state.history < self.cfg.max_losses;
        actions.retain(|action| match action {
            ActorModelAction::Drop(_) => losses_left,
            ActorModelAction::Crash(id) => *id != Id::from(node::ROUTER),
            ActorModelAction::Recover(_) => false,
            _ => true,
        });
    }

    fn next_state(&self, state: &State, action: Action) -> Option<State> {
        let lost = matches!(action, ActorModelAction::Drop(_));
        let mut next = self.actors.next_state(state, action)?;
        if lost {
            next.history += 1;
        }
        if let Network::UnorderedDuplicating(_, last) = &mut next.network {
            *last = None;
        }
        Some(next)
    }

    fn format_action(&self, action: &Action) -> String {
        self.actors.format_action(action)
    }

    fn format_step(&self, state: &State, action: Action) -> Option<String> {
        self.actors.format_step(state, action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::ALL
            .into_iter()
            .map(|(expectation, name, condition)| Property {
                expectation,
                name,
                condition,
            })
            .collect()
    }
}

/// The router's behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterBehaviour {
    /// The protocol.
    Correct,
    /// MUTATION (the incident's admission queue, which checked only whether execution had
    /// finished): a rejection from the prefill node is treated as an admission.
    ProceedOnPrefillRejection,
    /// MUTATION: after the terminal answer, a failure that still arrives is passed on too.
    ForwardAfterAnswer,
    /// MUTATION: no per-request deadline, so a lost message or a dead peer leaves the client
    /// waiting forever.
    NoDeadline,
}

/// The prefill node's behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillBehaviour {
    /// Rejects over-length prompts and pushes what it computed.
    Honest,
    /// Adversarial: at most once per run, fails or pushes any [`PushFault`] instead.
    Faulty,
    /// MUTATION (the incident's engine): an over-length prompt is marked rejected but replaced
    /// by a one-token placeholder and admitted; its push truthfully describes the placeholder.
    PlaceholderOnOverLength,
}

/// The decode node's behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeBehaviour {
    /// The protocol: a push is accepted only if [`protocol::verify`] passes.
    Verify,
    /// MUTATION: any push to a waiting reservation is accepted.
    SkipVerification,
    /// MUTATION (a late writer landing on reused pages): verifies, but a push that arrives
    /// after its reservation ended is still written into the pages it had held.
    WriteLatePushes,
}

/// One request of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    pub tenant: Tenant,
    /// Prompt length in tokens (one page each).
    pub prompt_len: u8,
}

/// A deployment to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub requests: Vec<RequestSpec>,
    /// The longest prompt the prefill node admits.
    pub prefill_context: u8,
    /// Pages in the decode node's pool.
    pub decode_pages: u8,
    pub router: RouterBehaviour,
    pub prefill: PrefillBehaviour,
    pub decode: DecodeBehaviour,
    /// How many messages the network may lose in a run (it always reorders and duplicates).
    ///
    /// For the safety properties a loss adds no behaviour: the duplicating network already
    /// lets any message go undelivered forever, and no property looks at the network. Nor
    /// does a crash: in an asynchronous model a node may already take no further step. Losses
    /// and crashes matter to liveness, where they let a path end with a client unanswered.
    pub max_losses: u8,
    /// How many of the prefill and decode nodes may crash in a run (for good).
    pub max_crashes: usize,
}

impl Config {
    /// Two tenants' requests, one of them longer than the prefill node's context (the
    /// incident's shape); an adversarial prefill node, one lost message, one crash.
    pub fn over_length() -> Config {
        Config {
            requests: vec![
                RequestSpec {
                    tenant: Tenant(0),
                    prompt_len: 2,
                },
                RequestSpec {
                    tenant: Tenant(1),
                    prompt_len: 3,
                },
            ],
            prefill_context: 2,
            // Room for the long prompt: as in the incident, only the prefill side is short.
            decode_pages: 3,
            router: RouterBehaviour::Correct,
            prefill: PrefillBehaviour::Faulty,
            decode: DecodeBehaviour::Verify,
            max_losses: 1,
            max_crashes: 1,
        }
    }

    /// Two tenants' requests that both fit, competing for a decode pool that holds only one
    /// of them at a time, so the second reuses the first's (unscrubbed) pages.
    pub fn contention() -> Config {
        Config {
            requests: vec![
                RequestSpec {
                    tenant: Tenant(0),
                    prompt_len: 2,
                },
                RequestSpec {
                    tenant: Tenant(1),
                    prompt_len: 1,
                },
            ],
            prefill_context: 2,
            decode_pages: 2,
            router: RouterBehaviour::Correct,
            prefill: PrefillBehaviour::Faulty,
            decode: DecodeBehaviour::Verify,
            max_losses: 1,
            max_crashes: 1,
        }
    }

    /// The model of this deployment, with every property of [`properties::ALL`].
    pub fn into_model(self) -> HandoffModel {
        let cfg = Arc::new(self);
        let actors = ActorModel::new(cfg.clone(), 0)
            .actor(Node::Router(cfg.clone()))
            .actor(Node::Prefill(cfg.clone()))
            .actor(Node::Decode(cfg.clone()))
            .init_network(Network::new_unordered_duplicating([]))
            .lossy_network(if cfg.max_losses > 0 {
                LossyNetwork::Yes
            } else {
                LossyNetwork::No
            })
            .max_crashes(cfg.max_crashes);
        HandoffModel { cfg, actors }
    }
}
