//! The properties the checker verifies, over the whole deployment's state.

use stateright::Expectation;

use crate::decode::{DecodePhase, DecodeState, ANSWER_TOKENS};
use crate::node::{NodeState, Timer, DECODE, PREFILL, ROUTER};
use crate::prefill::PrefillState;
use crate::protocol::{Error, Req, Token};
use crate::router::{ClientEvent, RouterState};
use crate::{HandoffModel, State};

pub const P_REJECTED_NEVER_AT_DECODE: &str =
    "a request the prefill node rejected never reaches the decode node";
pub const NO_TOKEN_FOR_P_REJECTED: &str =
    "no token is emitted or forwarded for a request the prefill node rejected";
pub const TOKENS_ONLY_FROM_VERIFIED_PUSH: &str =
    "the decode node emits tokens only from a push that passed verification";
pub const ONE_TERMINAL_ANSWER: &str =
    "each client gets at most one terminal answer, and nothing after it";
pub const SUCCESS_ONLY_FROM_OWN_VERIFIED_KV: &str =
    "a success answers the complete stream, computed from the request's own verified KV";
pub const NO_FOREIGN_DATA: &str =
    "no client ever receives a token computed from another request's data";
/// The liveness argument that does not depend on how stateright checks `eventually`: the
/// deadline is armed until the answer, timers fire (fairly) at some point, and the router's
/// deadline handler always answers. So every request is answered, over any losses, crashes
/// or cycles.
pub const DEADLINE_ARMED: &str = "every unanswered request has the router's deadline armed";
/// Checked by stateright on paths that end (no action left). Paths into a state already seen
/// are not followed, so a path that ends only through such a state may be missed: the
/// [`DEADLINE_ARMED`] invariant is the complete argument; this is its end-to-end check.
pub const EVERY_REQUEST_ANSWERED: &str =
    "every request eventually gets exactly one terminal answer";
pub const SOME_SUCCESS: &str = "some request succeeds";
pub const SOME_ALL_SUCCEED: &str = "every request succeeds";
pub const SOME_PREFILL_REJECTION: &str =
    "the prefill node rejects a request and its client gets that error";
pub const SOME_PUSH_REFUSED: &str = "the decode node refuses a corrupted push";
pub const SOME_CAPACITY_REFUSAL: &str = "the decode node refuses a reservation for capacity";
pub const SOME_ERROR_AFTER_TOKENS: &str = "a client gets tokens and then an error";
pub const SOME_RESERVATION_TIMEOUT: &str = "a reservation times out";

/// Every property: (expectation, name, condition).
pub type Condition = fn(&HandoffModel, &State) -> bool;
pub const ALL: [(Expectation, &str, Condition); 15] = [
    (
        Expectation::Always,
        P_REJECTED_NEVER_AT_DECODE,
        p_rejected_never_at_decode,
    ),
    (
        Expectation::Always,
        NO_TOKEN_FOR_P_REJECTED,
        no_token_for_p_rejected,
    ),
    (
        Expectation::Always,
        TOKENS_ONLY_FROM_VERIFIED_PUSH,
        tokens_only_from_verified_push,
    ),
    (
        Expectation::Always,
        ONE_TERMINAL_ANSWER,
        one_terminal_answer,
    ),
    (
        Expectation::Always,
        SUCCESS_ONLY_FROM_OWN_VERIFIED_KV,
        success_only_from_own_verified_kv,
    ),
    (Expectation::Always, NO_FOREIGN_DATA, no_foreign_data),
    (Expectation::Always, DEADLINE_ARMED, deadline_armed),
    (
        Expectation::Eventually,
        EVERY_REQUEST_ANSWERED,
        every_request_answered,
    ),
    (Expectation::Sometimes, SOME_SUCCESS, some_success),
    (Expectation::Sometimes, SOME_ALL_SUCCEED, some_all_succeed),
    (
        Expectation::Sometimes,
        SOME_PREFILL_REJECTION,
        some_prefill_rejection,
    ),
    (Expectation::Sometimes, SOME_PUSH_REFUSED, some_push_refused),
    (
        Expectation::Sometimes,
        SOME_CAPACITY_REFUSAL,
        some_capacity_refusal,
    ),
    (
        Expectation::Sometimes,
        SOME_ERROR_AFTER_TOKENS,
        some_error_after_tokens,
    ),
    (
        Expectation::Sometimes,
        SOME_RESERVATION_TIMEOUT,
        some_reservation_timeout,
    ),
];

pub fn router(s: &State) -> &RouterState {
    match &*s.actor_states[ROUTER] {
        NodeState::Router(r) => r,
        other => unreachable!("router is {other:?}"),
    }
}

pub fn prefill(s: &State) -> Option<&PrefillState> {
    match &*s.actor_states[PREFILL] {
        NodeState::Prefill(p) => Some(p),
        _ => None,
    }
}

pub fn decode(s: &State) -> Option<&DecodeState> {
    match &*s.actor_states[DECODE] {
        NodeState::Decode(d) => Some(d),
        _ => None,
    }
}

fn p_rejected(s: &State) -> impl Iterator<Item = Req> + '_ {
    prefill(s)
        .into_iter()
        .flat_map(|p| p.rejected.iter().copied())
}

fn p_rejected_never_at_decode(_: &HandoffModel, s: &State) -> bool {
    let Some(d) = decode(s) else { return true };
    p_rejected(s).all(|req| !d.records.contains_key(&req))
}

fn no_token_for_p_rejected(_: &HandoffModel, s: &State) -> bool {
    let r = router(s);
    p_rejected(s).all(|req| {
        let emitted = decode(s)
            .and_then(|d| d.records.get(&req))
            .is_some_and(|rec| rec.tokens > 0);
        let forwarded = r.req(req).is_some_and(|rr| rr.forwarded() > 0);
        !emitted && !forwarded
    })
}

fn tokens_only_from_verified_push(_: &HandoffModel, s: &State) -> bool {
    let Some(d) = decode(s) else { return true };
    d.records
        .values()
        .all(|rec| rec.tokens == 0 || rec.push_verified == Some(true))
}

fn one_terminal_answer(_: &HandoffModel, s: &State) -> bool {
    router(s).reqs.iter().all(|r| {
        let terminals = r.terminals().count();
        terminals == 0 || (terminals == 1 && r.client.last().is_some_and(|e| e.is_terminal()))
    })
}

fn success_only_from_own_verified_kv(_: &HandoffModel, s: &State) -> bool {
    router(s).reqs.iter().enumerate().all(|(i, r)| {
        if !r.client.contains(&ClientEvent::Success) {
            return true;
        }
        let req = Req(i as u8);
        let tokens: Vec<_> = r
            .client
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Token(t) => Some(*t),
                _ => None,
            })
            .collect();
        let verified = decode(s)
            .and_then(|d| d.records.get(&req))
            .is_some_and(|rec| rec.push_verified == Some(true));
        verified
            && tokens.len() == usize::from(ANSWER_TOKENS)
            && tokens.iter().all(|t| *t == Token::From(req))
    })
}

fn no_foreign_data(_: &HandoffModel, s: &State) -> bool {
    router(s).reqs.iter().enumerate().all(|(i, r)| {
        r.client.iter().all(|e| match e {
            ClientEvent::Token(Token::From(from)) => *from == Req(i as u8),
            _ => true,
        })
    })
}

fn deadline_armed(_: &HandoffModel, s: &State) -> bool {
    let r = router(s);
    r.reqs.iter().enumerate().all(|(i, rr)| {
        rr.terminals().count() > 0
            || s.timers_set[ROUTER]
                .iter()
                .any(|t| *t == Timer::Deadline(Req(i as u8)))
    })
}

fn every_request_answered(_: &HandoffModel, s: &State) -> bool {
    router(s).reqs.iter().all(|r| r.terminals().count() == 1)
}

fn some_success(_: &HandoffModel, s: &State) -> bool {
    router(s)
        .reqs
        .iter()
        .any(|r| r.client.contains(&ClientEvent::Success))
}

fn some_all_succeed(_: &HandoffModel, s: &State) -> bool {
    router(s)
        .reqs
        .iter()
        .all(|r| r.client.contains(&ClientEvent::Success))
}

fn some_prefill_rejection(_: &HandoffModel, s: &State) -> bool {
    let r = router(s);
    p_rejected(s).any(|req| {
        r.req(req)
            .is_some_and(|rr| rr.client == [ClientEvent::Error(Error::OverLength)])
    })
}

fn some_push_refused(_: &HandoffModel, s: &State) -> bool {
    decode(s).is_some_and(|d| {
        d.records
            .values()
            .any(|rec| matches!(rec.phase, DecodePhase::Failed(Error::Verification(_))))
    })
}

fn some_capacity_refusal(_: &HandoffModel, s: &State) -> bool {
    decode(s).is_some_and(|d| {
        d.records
            .values()
            .any(|rec| rec.phase == DecodePhase::Refused(Error::NoCapacity))
    })
}

fn some_error_after_tokens(_: &HandoffModel, s: &State) -> bool {
    router(s)
        .reqs
        .iter()
        .any(|r| r.forwarded() > 0 && matches!(r.client.last(), Some(ClientEvent::Error(_))))
}

fn some_reservation_timeout(_: &HandoffModel, s: &State) -> bool {
    decode(s).is_some_and(|d| {
        d.records
            .values()
            .any(|rec| rec.phase == DecodePhase::Failed(Error::Timeout))
    })
}
