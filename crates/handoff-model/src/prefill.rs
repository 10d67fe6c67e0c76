//! The prefill node: admits prompts against its context, computes a prompt's KV and first
//! token, and pushes them straight to the decode node's reservation.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use stateright::actor::{Id, Out};

use crate::node::{Node, NodeState, ROUTER};
use crate::protocol::{
    Error, Kv, Manifest, Msg, PageSum, PageWrite, Req, Tenant, Ticket, Token, TokenSum, PREVIOUS,
    PREVIOUS_TENANT,
};
use crate::{Config, PrefillBehaviour};

/// How one prefill turns out. Honest nodes always choose [`PrefillOutcome::Push`]; a
/// [`PrefillBehaviour::Faulty`] node may choose any other outcome, at most once per run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PrefillOutcome {
    /// Push the KV it computed, with a true manifest.
    Push,
    /// The computation fails: `PrefillFailed` to the router, nothing to the decode node.
    Fail,
    /// Push, but wrongly.
    Fault(PushFault),
}

/// The ways a push can be wrong. Each must be refused by the decode node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PushFault {
    /// Another request's KV and manifest, pushed to this request's ticket (requests mixed up).
    WrongRequest,
    /// The manifest names another tenant.
    WrongTenant,
    /// The prompt was truncated: manifest and pages cover one token less.
    Truncated,
    /// The KV of a differently tokenized prompt (the token checksum differs).
    WrongTokens,
    /// The manifest is true but the last page never arrives.
    MissingPage,
    /// The first page is written twice and the last not at all.
    DuplicatePage,
    /// The first page's bytes are corrupted in transit; the manifest's checksum is of the
    /// true bytes.
    CorruptPage,
}

impl PushFault {
    pub const ALL: [PushFault; 7] = [
        PushFault::WrongRequest,
        PushFault::WrongTenant,
        PushFault::Truncated,
        PushFault::WrongTokens,
        PushFault::MissingPage,
        PushFault::DuplicatePage,
        PushFault::CorruptPage,
    ];
}

/// The nondeterministic choice a faulty prefill node makes for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefillChoice {
    pub req: Req,
    pub outcome: PrefillOutcome,
}

/// The prefill node's record of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PrefillReq {
    /// Admitted with this prompt (for a placeholder: the 1-token placeholder).
    Admitted {
        tenant: Tenant,
        prompt_len: u8,
        placeholder: bool,
    },
    /// Rejected at admission; the router was told.
    Rejected(Error),
    /// Prefill asked for a request it does not hold; the router was told.
    Refused,
    /// Computing; the outcome is being chosen.
    Computing {
        tenant: Tenant,
        prompt_len: u8,
        decode: usize,
        ticket: Ticket,
    },
    /// Done: pushed (or failed) and reported to the router.
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrefillState {
    pub reqs: BTreeMap<Req, PrefillReq>,
    /// Every request this node rejected at admission (whatever it did next).
    pub rejected: BTreeSet<Req>,
    /// Non-honest outcomes chosen so far (bounded to one per run).
    pub faults: u8,
}

pub(crate) fn on_start() -> PrefillState {
    PrefillState {
        reqs: BTreeMap::new(),
        rejected: BTreeSet::new(),
        faults: 0,
    }
}

pub(crate) fn on_msg(
    cfg: &Config,
    state: &mut Cow<NodeState>,
    _src: Id,
    msg: Msg,
    o: &mut Out<Node>,
) {
    let NodeState::Prefill(s) = state.as_ref() else {
        return;
    };
    match msg {
        Msg::Admit {
            req,
            tenant,
            prompt_len,
        } => {
            if s.reqs.contains_key(&req) {
                return; // a duplicate
            }
            let s = prefill_mut(state);
            if prompt_len <= cfg.prefill_context {
                s.reqs.insert(
                    req,
                    PrefillReq::Admitted {
                        tenant,
                        prompt_len,
                        placeholder: false,
                    },
                );
                o.send(Id::from(ROUTER), Msg::Admitted { req });
            } else if cfg.prefill == PrefillBehaviour::PlaceholderOnOverLength {
                // MUTATION (the incident): marked rejected, replaced by a 1-token placeholder,
                // and carried on as if admitted.
                s.rejected.insert(req);
                s.reqs.insert(
                    req,
                    PrefillReq::Admitted {
                        tenant,
                        prompt_len: 1,
                        placeholder: true,
                    },
                );
                o.send(Id::from(ROUTER), Msg::Admitted { req });
            } else {
                s.rejected.insert(req);
                s.reqs.insert(req, PrefillReq::Rejected(Error::OverLength));
                o.send(
                    Id::from(ROUTER),
                    Msg::Rejected {
                        req,
                        error: Error::OverLength,
                    },
                );
            }
        }
        Msg::Prefill {
            req,
            decode,
            ticket,
        } => match s.reqs.get(&req).copied() {
            Some(PrefillReq::Admitted {
                tenant,
                prompt_len,
                placeholder,
            }) => {
                let faulty = cfg.prefill == PrefillBehaviour::Faulty && s.faults == 0;
                if placeholder || !faulty {
                    prefill_mut(state).reqs.insert(req, PrefillReq::Done);
                    let (manifest, pages) = if placeholder {
                        placeholder_push(req, tenant)
                    } else {
                        honest_push(req, tenant, prompt_len)
                    };
                    push(o, decode, ticket, req, manifest, pages);
                } else {
                    prefill_mut(state).reqs.insert(
                        req,
                        PrefillReq::Computing {
                            tenant,
                            prompt_len,
                            decode,
                            ticket,
                        },
                    );
                    let mut outcomes = vec![PrefillOutcome::Push, PrefillOutcome::Fail];
                    outcomes.extend(PushFault::ALL.map(PrefillOutcome::Fault));
                    o.choose_random(
                        format!("prefill {}", req.0),
                        outcomes
                            .into_iter()
                            .map(|outcome| PrefillChoice { req, outcome })
                            .collect(),
                    );
                }
            }
            Some(PrefillReq::Rejected(_)) | None => {
                prefill_mut(state).reqs.insert(req, PrefillReq::Refused);
                o.send(
                    Id::from(ROUTER),
                    Msg::PrefillFailed {
                        req,
                        error: Error::NotAdmitted,
                    },
                );
            }
            // Duplicates.
            Some(PrefillReq::Refused | PrefillReq::Computing { .. } | PrefillReq::Done) => {}
        },
        _ => {}
    }
}

pub(crate) fn on_random(
    cfg: &Config,
    state: &mut Cow<NodeState>,
    choice: &PrefillChoice,
    o: &mut Out<Node>,
) {
    let NodeState::Prefill(s) = state.as_ref() else {
        return;
    };
    let req = choice.req;
    let Some(PrefillReq::Computing {
        tenant,
        prompt_len,
        decode,
        ticket,
    }) = s.reqs.get(&req).copied()
    else {
        return;
    };
    let s = prefill_mut(state);
    s.reqs.insert(req, PrefillReq::Done);
    let fault = match choice.outcome {
        PrefillOutcome::Push => {
            let (manifest, pages) = honest_push(req, tenant, prompt_len);
            push(o, decode, ticket, req, manifest, pages);
            return;
        }
        PrefillOutcome::Fail => {
            s.faults += 1;
            o.send(
                Id::from(ROUTER),
                Msg::PrefillFailed {
                    req,
                    error: Error::PrefillError,
                },
            );
            return;
        }
        PrefillOutcome::Fault(fault) => fault,
    };
    s.faults += 1;
    let (manifest, pages) = faulty_push(cfg, req, tenant, prompt_len, fault);
    push(o, decode, ticket, req, manifest, pages);
}

/// The push of request `req` (tenant, prompt length) spoiled by `fault`.
pub fn faulty_push(
    cfg: &Config,
    req: Req,
    tenant: Tenant,
    prompt_len: u8,
    fault: PushFault,
) -> (Manifest, Vec<PageWrite>) {
    let (mut manifest, mut pages) = honest_push(req, tenant, prompt_len);
    match fault {
        PushFault::WrongRequest => {
            let (other, other_tenant) = other_request(cfg, req);
            (manifest, pages) = honest_push(other, other_tenant, prompt_len);
        }
        PushFault::WrongTenant => manifest.tenant = Tenant(tenant.0 + 1),
        PushFault::Truncated => {
            (manifest, pages) = honest_push(req, tenant, prompt_len.saturating_sub(1));
        }
        PushFault::WrongTokens => manifest.token_sum = TokenSum::Other(req),
        PushFault::MissingPage => {
            pages.pop();
        }
        PushFault::DuplicatePage => {
            let first = pages[0];
            if pages.len() > 1 {
                pages.pop();
            }
            pages.push(first);
        }
        PushFault::CorruptPage => pages[0].kv = Kv::Garbled,
    }
    (manifest, pages)
}

/// The push of the KV it computed, with a manifest that says what it is.
pub fn honest_push(req: Req, tenant: Tenant, prompt_len: u8) -> (Manifest, Vec<PageWrite>) {
    let pages: Vec<PageWrite> = (0..prompt_len)
        .map(|slot| PageWrite {
            slot,
            kv: Kv::Of { req, slot },
        })
        .collect();
    let manifest = Manifest {
        req,
        tenant,
        prompt_len,
        token_sum: TokenSum::Prompt(req),
        first_token: Token::From(req),
        page_count: prompt_len,
        page_sums: pages.iter().map(|p| PageSum(p.kv)).collect(),
    };
    (manifest, pages)
}

/// The incident's push: the placeholder's one page, with a manifest that truthfully describes
/// the placeholder (valid metadata, wrong request).
fn placeholder_push(req: Req, tenant: Tenant) -> (Manifest, Vec<PageWrite>) {
    let page = PageWrite {
        slot: 0,
        kv: Kv::Placeholder(req),
    };
    let manifest = Manifest {
        req,
        tenant,
        prompt_len: 1,
        token_sum: TokenSum::Placeholder(req),
        first_token: Token::Garbage,
        page_count: 1,
        page_sums: vec![PageSum(page.kv)],
    };
    (manifest, vec![page])
}

/// The request a prefill node that mixes requests up would push instead of `req`.
fn other_request(cfg: &Config, req: Req) -> (Req, Tenant) {
    cfg.requests
        .iter()
        .enumerate()
        .map(|(i, spec)| (Req(i as u8), spec.tenant))
        .find(|(other, _)| *other != req)
        .unwrap_or((PREVIOUS, PREVIOUS_TENANT))
}

fn push(
    o: &mut Out<Node>,
    decode: usize,
    ticket: Ticket,
    req: Req,
    manifest: Manifest,
    pages: Vec<PageWrite>,
) {
    o.send(
        Id::from(decode),
        Msg::Push {
            ticket,
            manifest,
            pages,
        },
    );
    o.send(Id::from(ROUTER), Msg::PrefillDone { req });
}

fn prefill_mut<'a>(state: &'a mut Cow<NodeState>) -> &'a mut PrefillState {
    match state.to_mut() {
        NodeState::Prefill(s) => s,
        _ => unreachable!("prefill state"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{verify, Mismatch};
    use crate::router::expect;

    /// Each fault, on a one-page and a two-page prompt, fails exactly the check it targets.
    #[test]
    fn every_push_fault_fails_verification() {
        let cfg = Config::contention();
        for (req, spec) in [(Req(0), cfg.requests[0]), (Req(1), cfg.requests[1])] {
            let expect = expect(&cfg, req);
            let (m, p) = honest_push(req, spec.tenant, spec.prompt_len);
            assert_eq!(verify(&expect, spec.prompt_len, &m, &p), Ok(()));
            for fault in PushFault::ALL {
                let (m, p) = faulty_push(&cfg, req, spec.tenant, spec.prompt_len, fault);
                let want = match fault {
                    PushFault::WrongRequest => Mismatch::Request,
                    PushFault::WrongTenant => Mismatch::Tenant,
                    PushFault::Truncated => Mismatch::PromptLength,
                    PushFault::WrongTokens => Mismatch::TokenSum,
                    PushFault::MissingPage | PushFault::DuplicatePage => Mismatch::Coverage,
                    PushFault::CorruptPage => Mismatch::PageSum,
                };
                assert_eq!(
                    verify(&expect, spec.prompt_len, &m, &p),
                    Err(want),
                    "{fault:?} on {req:?}"
                );
            }
        }
    }
}
