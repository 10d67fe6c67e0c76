//! The decode node: reserves pages against its own capacity, verifies the push it receives
//! against what the router told it to expect, and only then streams tokens.

use std::borrow::Cow;
use std::collections::BTreeMap;

use stateright::actor::{model_timeout, Id, Out};

use crate::node::{Node, NodeState, Timer, ROUTER};
use crate::protocol::{decode_token, verify, Error, Expect, Kv, Msg, Req, Ticket, Token, PREVIOUS};
use crate::{Config, DecodeBehaviour};

/// Tokens in every successful answer: the first (sampled by the prefill node, carried in the
/// manifest) and one decoded here over the reserved pages.
pub const ANSWER_TOKENS: u8 = 2;

/// Where one reservation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodePhase {
    /// Refused at `Reserve` (the router was told); no pages were taken.
    Refused(Error),
    /// Pages reserved, waiting for the push.
    AwaitingPush,
    /// The push was accepted; waiting for `Generate` if it has not come yet.
    Verified { first_token: Token },
    /// Token 0 sent; the next decode step sends the last token and `Finished`.
    Streaming,
    /// `Finished` sent; pages released (not scrubbed: the next owner's push must cover them).
    Finished,
    /// `Failed` sent; pages scrubbed and released.
    Failed(Error),
}

impl DecodePhase {
    /// Whether the reservation still owns its pages.
    pub fn holds_pages(&self) -> bool {
        matches!(
            self,
            DecodePhase::AwaitingPush | DecodePhase::Verified { .. } | DecodePhase::Streaming
        )
    }
}

/// The decode node's record of one request. Records are kept after they end, so duplicate
/// and late messages find a tombstone rather than room for a new reservation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reservation {
    pub expect: Expect,
    pub ticket: Option<Ticket>,
    /// Physical pages, in slot order.
    pub pages: Vec<u8>,
    pub phase: DecodePhase,
    /// `Generate` has arrived.
    pub generate: bool,
    /// Auxiliary (not part of the protocol): whether the push that was accepted passed
    /// [`verify`], whatever this node's behaviour; `None` before a push was accepted.
    pub push_verified: Option<bool>,
    /// Auxiliary: tokens emitted for this request.
    pub tokens: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DecodeState {
    /// The contents of every physical page.
    pub pool: Vec<Kv>,
    pub next_ticket: u8,
    pub records: BTreeMap<Req, Reservation>,
}

impl DecodeState {
    fn by_ticket(&self, ticket: Ticket) -> Option<(Req, &Reservation)> {
        self.records
            .iter()
            .find(|(_, r)| r.ticket == Some(ticket))
            .map(|(req, r)| (*req, r))
    }

    fn free_pages(&self) -> Vec<u8> {
        (0..self.pool.len() as u8)
            .filter(|p| {
                !self
                    .records
                    .values()
                    .any(|r| r.phase.holds_pages() && r.pages.contains(p))
            })
            .collect()
    }
}

/// The pool starts full of the previous customer's KV: pages are reused without being erased.
pub(crate) fn on_start(cfg: &Config) -> DecodeState {
    DecodeState {
        pool: (0..cfg.decode_pages)
            .map(|slot| Kv::Of {
                req: PREVIOUS,
                slot,
            })
            .collect(),
        next_ticket: 0,
        records: BTreeMap::new(),
    }
}

pub(crate) fn on_msg(
    cfg: &Config,
    state: &mut Cow<NodeState>,
    _src: Id,
    msg: Msg,
    o: &mut Out<Node>,
) {
    let NodeState::Decode(s) = state.as_ref() else {
        return;
    };
    match msg {
        Msg::Reserve { req, expect } => {
            if s.records.contains_key(&req) {
                return; // a duplicate: the first answer is still on its way (or lost)
            }
            let free = s.free_pages();
            let needed = usize::from(expect.prompt_len);
            let s = decode_mut(state);
            if free.len() < needed {
                let error = Error::NoCapacity;
                s.records.insert(
                    req,
                    Reservation {
                        expect,
                        ticket: None,
                        pages: Vec::new(),
                        phase: DecodePhase::Refused(error),
                        generate: false,
                        push_verified: None,
                        tokens: 0,
                    },
                );
                o.send(Id::from(ROUTER), Msg::Rejected { req, error });
                return;
            }
            let ticket = Ticket(s.next_ticket);
            s.next_ticket += 1;
            s.records.insert(
                req,
                Reservation {
                    expect,
                    ticket: Some(ticket),
                    pages: free[..needed].to_vec(),
                    phase: DecodePhase::AwaitingPush,
                    generate: false,
                    push_verified: None,
                    tokens: 0,
                },
            );
            o.set_timer(Timer::Reservation(ticket), model_timeout());
            o.send(Id::from(ROUTER), Msg::Reserved { req, ticket });
        }
        Msg::Generate { ticket } => {
            let Some((req, r)) = s.by_ticket(ticket) else {
                return;
            };
            if r.generate {
                return;
            }
            let s = decode_mut(state);
            s.records.get_mut(&req).unwrap().generate = true;
            start_stream(s, req, ticket, o);
        }
        Msg::Push {
            ticket,
            manifest,
            pages,
        } => {
            // Only a reservation waiting for its push takes writes: a late or duplicate push,
            // or one to an unknown ticket, never touches a page.
            let Some((req, r)) = s.by_ticket(ticket) else {
                return;
            };
            if r.phase != DecodePhase::AwaitingPush {
                if cfg.decode == DecodeBehaviour::WriteLatePushes && !r.phase.holds_pages() {
                    // MUTATION: the late writer lands on pages that may have a new owner.
                    let (pages_of, s) = (r.pages.clone(), decode_mut(state));
                    for page in &pages {
                        if let Some(&physical) = pages_of.get(usize::from(page.slot)) {
                            s.pool[usize::from(physical)] = page.kv;
                        }
                    }
                }
                return;
            }
            let reserved = r.pages.clone();
            let verdict = verify(&r.expect, reserved.len() as u8, &manifest, &pages);
            let s = decode_mut(state);
            // The pages land in the reservation as they arrive; writes outside it are dropped.
            for page in &pages {
                if let Some(&physical) = reserved.get(usize::from(page.slot)) {
                    s.pool[usize::from(physical)] = page.kv;
                }
            }
            let accept = match cfg.decode {
                DecodeBehaviour::Verify | DecodeBehaviour::WriteLatePushes => verdict.is_ok(),
                // MUTATION: any push is accepted.
                DecodeBehaviour::SkipVerification => true,
            };
            let r = s.records.get_mut(&req).unwrap();
            match verdict {
                _ if accept => {
                    r.push_verified = Some(verdict.is_ok());
                    r.phase = DecodePhase::Verified {
                        first_token: manifest.first_token,
                    };
                    start_stream(s, req, ticket, o);
                }
                Ok(()) => unreachable!("a verified push is accepted"),
                Err(mismatch) => fail(s, req, ticket, Error::Verification(mismatch), o),
            }
        }
        _ => {}
    }
}

pub(crate) fn on_timeout(state: &mut Cow<NodeState>, timer: &Timer, o: &mut Out<Node>) {
    let NodeState::Decode(s) = state.as_ref() else {
        return;
    };
    match *timer {
        Timer::Reservation(ticket) => {
            let Some((req, r)) = s.by_ticket(ticket) else {
                return;
            };
            // No valid push (or no `Generate`) in time.
            if matches!(
                r.phase,
                DecodePhase::AwaitingPush | DecodePhase::Verified { .. }
            ) {
                fail(decode_mut(state), req, ticket, Error::Timeout, o);
            }
        }
        Timer::DecodeStep(ticket) => {
            let Some((req, r)) = s.by_ticket(ticket) else {
                return;
            };
            if r.phase != DecodePhase::Streaming {
                return;
            }
            let context: Vec<Kv> = r.pages.iter().map(|&p| s.pool[usize::from(p)]).collect();
            let token = decode_token(req, &context);
            let s = decode_mut(state);
            let r = s.records.get_mut(&req).unwrap();
            let index = r.tokens;
            r.tokens += 1;
            r.phase = DecodePhase::Finished;
            o.send(Id::from(ROUTER), Msg::Token { req, index, token });
            o.send(
                Id::from(ROUTER),
                Msg::Finished {
                    req,
                    tokens: ANSWER_TOKENS,
                },
            );
        }
        Timer::Deadline(_) => {}
    }
}

/// Streams once the push is verified and `Generate` has arrived (in either order).
fn start_stream(s: &mut DecodeState, req: Req, ticket: Ticket, o: &mut Out<Node>) {
    let r = s.records.get_mut(&req).unwrap();
    let DecodePhase::Verified { first_token } = r.phase else {
        return;
    };
    if !r.generate {
        return;
    }
    r.phase = DecodePhase::Streaming;
    r.tokens = 1;
    o.cancel_timer(Timer::Reservation(ticket));
    o.send(
        Id::from(ROUTER),
        Msg::Token {
            req,
            index: 0,
            token: first_token,
        },
    );
    o.set_timer(Timer::DecodeStep(ticket), model_timeout());
}

/// Ends a reservation with `error`: its pages are scrubbed and released.
fn fail(s: &mut DecodeState, req: Req, ticket: Ticket, error: Error, o: &mut Out<Node>) {
    let r = s.records.get_mut(&req).unwrap();
    r.phase = DecodePhase::Failed(error);
    let pages = r.pages.clone();
    for p in pages {
        s.pool[usize::from(p)] = Kv::Scrubbed;
    }
    o.cancel_timer(Timer::Reservation(ticket));
    o.send(Id::from(ROUTER), Msg::Failed { req, reason: error });
}

fn decode_mut<'a>(state: &'a mut Cow<NodeState>) -> &'a mut DecodeState {
    match state.to_mut() {
        NodeState::Decode(s) => s,
        _ => unreachable!("decode state"),
    }
}
