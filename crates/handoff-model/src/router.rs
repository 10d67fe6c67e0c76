//! The router: admits each request at the prefill node, reserves at the decode node, starts
//! the handoff, forwards tokens, and answers the client exactly once.

use std::borrow::Cow;

use stateright::actor::{model_timeout, Id, Out};

use crate::node::{Node, NodeState, Timer, DECODE, PREFILL};
use crate::protocol::{Error, Expect, Msg, Req, Ticket, Token, TokenSum};
use crate::{Config, RouterBehaviour};

/// What the router's client has been told about one request, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClientEvent {
    /// A streamed token.
    Token(Token),
    /// The stream ended successfully (HTTP 200 / `finish_reason: stop`). Terminal.
    Success,
    /// The request ended with this error (HTTP 4xx/5xx, or an error event in the stream).
    /// Terminal.
    Error(Error),
}

impl ClientEvent {
    pub fn is_terminal(&self) -> bool {
        !matches!(self, ClientEvent::Token(_))
    }
}

/// Where the router is with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouterPhase {
    /// `Admit` sent, waiting for the prefill node.
    Admitting,
    /// `Reserve` sent, waiting for the decode node.
    Reserving,
    /// `Generate` and `Prefill` sent; forwarding tokens.
    Generating { ticket: Ticket },
    /// The client has its terminal answer; everything else about the request is ignored.
    Answered,
}

/// The router's state for one request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RouterReq {
    pub phase: RouterPhase,
    /// `Finished{tokens}` arrived before all its tokens did (the network reorders).
    pub finished: Option<u8>,
    /// Everything sent to the client, in order: the answer as the client sees it.
    pub client: Vec<ClientEvent>,
}

impl RouterReq {
    pub fn forwarded(&self) -> u8 {
        self.client
            .iter()
            .filter(|e| matches!(e, ClientEvent::Token(_)))
            .count() as u8
    }

    pub fn terminals(&self) -> impl Iterator<Item = &ClientEvent> {
        self.client.iter().filter(|e| e.is_terminal())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RouterState {
    /// Indexed by request number.
    pub reqs: Vec<RouterReq>,
}

impl RouterState {
    pub fn req(&self, req: Req) -> Option<&RouterReq> {
        self.reqs.get(usize::from(req.0))
    }
}

/// What the router knows about a request independently of the prefill node: the tenant it
/// authenticated, and the length and checksum of the token ids it tokenized itself.
pub fn expect(cfg: &Config, req: Req) -> Expect {
    let spec = &cfg.requests[usize::from(req.0)];
    Expect {
        req,
        tenant: spec.tenant,
        prompt_len: spec.prompt_len,
        token_sum: TokenSum::Prompt(req),
    }
}

pub(crate) fn on_start(cfg: &Config, o: &mut Out<Node>) -> RouterState {
    let mut reqs = Vec::new();
    for (i, spec) in cfg.requests.iter().enumerate() {
        let req = Req(i as u8);
        o.send(
            Id::from(PREFILL),
            Msg::Admit {
                req,
                tenant: spec.tenant,
                prompt_len: spec.prompt_len,
            },
        );
        if cfg.router != RouterBehaviour::NoDeadline {
            o.set_timer(Timer::Deadline(req), model_timeout());
        }
        reqs.push(RouterReq {
            phase: RouterPhase::Admitting,
            finished: None,
            client: Vec::new(),
        });
    }
    RouterState { reqs }
}

/// The terminal answer: recorded for the client, the deadline disarmed, the request closed.
fn answer(state: &mut RouterState, req: Req, event: ClientEvent, o: &mut Out<Node>) {
    let r = &mut state.reqs[usize::from(req.0)];
    r.client.push(event);
    r.phase = RouterPhase::Answered;
    o.cancel_timer(Timer::Deadline(req));
}

pub(crate) fn on_msg(
    cfg: &Config,
    state: &mut Cow<NodeState>,
    src: Id,
    msg: Msg,
    o: &mut Out<Node>,
) {
    let NodeState::Router(s) = state.as_ref() else {
        return;
    };
    let Some(req) = msg_req(&msg) else {
        return;
    };
    let Some(r) = s.req(req) else {
        return;
    };
    // After the terminal answer nothing about the request matters: duplicates, late and
    // out-of-order messages all land here.
    if r.phase == RouterPhase::Answered && cfg.router != RouterBehaviour::ForwardAfterAnswer {
        return;
    }
    let (phase, forwarded, finished) = (r.phase, r.forwarded(), r.finished);
    match (usize::from(src), msg) {
        (PREFILL, Msg::Admitted { .. }) if phase == RouterPhase::Admitting => {
            reserve(cfg, state, req, o);
        }
        (PREFILL, Msg::Rejected { error, .. }) if phase == RouterPhase::Admitting => {
            if cfg.router == RouterBehaviour::ProceedOnPrefillRejection {
                // MUTATION (the incident's queue): only "finished" is checked, not "rejected".
                reserve(cfg, state, req, o);
            } else {
                answer(router_mut(state), req, ClientEvent::Error(error), o);
            }
        }
        (DECODE, Msg::Reserved { ticket, .. }) if phase == RouterPhase::Reserving => {
            router_mut(state).reqs[usize::from(req.0)].phase = RouterPhase::Generating { ticket };
            o.send(Id::from(DECODE), Msg::Generate { ticket });
            o.send(
                Id::from(PREFILL),
                Msg::Prefill {
                    req,
                    decode: DECODE,
                    ticket,
                },
            );
        }
        (DECODE, Msg::Rejected { error, .. }) if phase == RouterPhase::Reserving => {
            answer(router_mut(state), req, ClientEvent::Error(error), o);
        }
        (PREFILL, Msg::PrefillFailed { error, .. }) => {
            answer(router_mut(state), req, ClientEvent::Error(error), o);
        }
        (DECODE, Msg::Failed { reason, .. }) => {
            answer(router_mut(state), req, ClientEvent::Error(reason), o);
        }
        (DECODE, Msg::Token { index, token, .. })
            if matches!(phase, RouterPhase::Generating { .. }) =>
        {
            // Forward strictly in order; a token that arrives early is redelivered later
            // (or lost, and the deadline ends the request).
            if index != forwarded {
                return;
            }
            let s = router_mut(state);
            let r = &mut s.reqs[usize::from(req.0)];
            r.client.push(ClientEvent::Token(token));
            if r.finished == Some(r.forwarded()) {
                answer(s, req, ClientEvent::Success, o);
            }
        }
        (DECODE, Msg::Finished { tokens, .. })
            if matches!(phase, RouterPhase::Generating { .. }) =>
        {
            if finished.is_some() {
                return;
            }
            if forwarded == tokens {
                answer(router_mut(state), req, ClientEvent::Success, o);
            } else {
                router_mut(state).reqs[usize::from(req.0)].finished = Some(tokens);
            }
        }
        // `PrefillDone` carries nothing the router acts on: success comes from the decode
        // node's stream. Anything else is out of phase (a duplicate) and ignored.
        _ => {}
    }
}

pub(crate) fn on_timeout(state: &mut Cow<NodeState>, timer: &Timer, o: &mut Out<Node>) {
    let Timer::Deadline(req) = *timer else {
        return;
    };
    let NodeState::Router(s) = state.as_ref() else {
        return;
    };
    if s.req(req).is_some_and(|r| r.phase != RouterPhase::Answered) {
        answer(
            router_mut(state),
            req,
            ClientEvent::Error(Error::Deadline),
            o,
        );
    }
}

fn reserve(cfg: &Config, state: &mut Cow<NodeState>, req: Req, o: &mut Out<Node>) {
    router_mut(state).reqs[usize::from(req.0)].phase = RouterPhase::Reserving;
    o.send(
        Id::from(DECODE),
        Msg::Reserve {
            req,
            expect: expect(cfg, req),
        },
    );
}

fn router_mut<'a>(state: &'a mut Cow<NodeState>) -> &'a mut RouterState {
    match state.to_mut() {
        NodeState::Router(s) => s,
        _ => unreachable!("router state"),
    }
}

fn msg_req(msg: &Msg) -> Option<Req> {
    match *msg {
        Msg::Admitted { req }
        | Msg::Rejected { req, .. }
        | Msg::Reserved { req, .. }
        | Msg::PrefillDone { req }
        | Msg::PrefillFailed { req, .. }
        | Msg::Token { req, .. }
        | Msg::Finished { req, .. }
        | Msg::Failed { req, .. } => Some(req),
        _ => None,
    }
}
