//! The protocol's vocabulary: identifiers, what the router knows about a request, the manifest
//! a prefill node pushes, the messages, and the verification a decode node runs on a push.
//!
//! Data is modelled by *provenance*, not by value: a KV page holds "slot `i` of request `r`'s
//! prompt" (or garbage, or zeros), a checksum is a function of what it sums, and a token is
//! labelled by the KV it was computed from. So "did this answer read another request's data"
//! is a question the checker can ask of any state.

/// A request, as the router numbers it. [`PREVIOUS`] is not one of the model's requests: it
/// stands for the customer whose KV was left in the decode node's pool before the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Req(pub u8);

/// The request that used the decode node's pages before this run (its KV is still in them:
/// pages are reused without being erased).
pub const PREVIOUS: Req = Req(9);

/// A tenant (isolation domain).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(pub u8);

/// The tenant of [`PREVIOUS`].
pub const PREVIOUS_TENANT: Tenant = Tenant(9);

/// A decode node's handle on one reservation (`Reserved{ticket}`); the prefill node pushes to
/// it and the router opens the token stream with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u8);

/// The checksum of a prompt's token ids. Abstract: it names the token sequence it sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TokenSum {
    /// The request's own prompt.
    Prompt(Req),
    /// The one-token placeholder an engine substitutes for a prompt it rejected (the incident).
    Placeholder(Req),
    /// Some other token sequence (a prefill that tokenized or templated differently).
    Other(Req),
}

/// The contents of one KV page. A page is the unit of coverage: one token slot, all layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kv {
    /// The KV of prompt slot `slot` of request `req` (so: `req`'s tenant's data).
    Of { req: Req, slot: u8 },
    /// The KV of a request's one-token placeholder.
    Placeholder(Req),
    /// Bytes corrupted in transit.
    Garbled,
    /// Zeros: the page was scrubbed.
    Scrubbed,
}

/// The checksum of one page's bytes. Abstract: it names the contents it sums, so a page whose
/// bytes differ from what the sender summed fails its check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageSum(pub Kv);

/// A generated token, labelled by the KV it was computed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Token {
    /// Computed only from request `r`'s prompt. For `r`'s own client this is the only correct
    /// content; for anyone else's it is a leak of `r`'s tenant's data.
    From(Req),
    /// Computed over pages that were not all this request's own prompt KV in order, but held
    /// no other request's data either (garbled, scrubbed, misplaced or placeholder KV).
    Garbage,
}

/// What the router knows about a request independently of the prefill node, sent to the
/// decode node with `Reserve` (the real `ReserveRequest.expect`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Expect {
    pub req: Req,
    pub tenant: Tenant,
    /// Prompt length in tokens (one page per token in the model).
    pub prompt_len: u8,
    pub token_sum: TokenSum,
}

/// What the prefill node claims about the KV it pushes (the real `PushManifest`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Manifest {
    pub req: Req,
    pub tenant: Tenant,
    pub prompt_len: u8,
    pub token_sum: TokenSum,
    /// The first generated token, sampled on the prefill node.
    pub first_token: Token,
    pub page_count: u8,
    /// One checksum per page, indexed by slot.
    pub page_sums: Vec<PageSum>,
}

/// One page of a push: which slot of the reservation it fills, and its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageWrite {
    pub slot: u8,
    pub kv: Kv,
}

/// Why a request ended without success. Every one is a terminal error for the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Error {
    /// The prompt is longer than the node's context (the prefill node's admission check).
    OverLength,
    /// The decode node has no room for the prompt's pages.
    NoCapacity,
    /// The prefill node was asked to prefill a request it had not admitted.
    NotAdmitted,
    /// The prefill computation failed.
    PrefillError,
    /// The decode node refused the push.
    Verification(Mismatch),
    /// The decode node's reservation got no valid push (or no `Generate`) before its deadline.
    Timeout,
    /// The router's own deadline for the request expired (a lost message, a dead peer).
    Deadline,
}

/// Which of the decode node's checks a push failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mismatch {
    Request,
    Tenant,
    PromptLength,
    TokenSum,
    /// `page_count` does not match the reservation, or the page checksum list its count.
    PageCount,
    /// Some slot of the reservation was written zero times or twice, or a write fell outside it.
    Coverage,
    PageSum,
}

/// Every message of the protocol. Names follow the real gRPC service.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    /// R → P: admit this prompt (P checks it against its context and pool).
    Admit {
        req: Req,
        tenant: Tenant,
        prompt_len: u8,
    },
    /// P → R.
    Admitted { req: Req },
    /// P → R or D → R: a refusal; the router ends the request with `error`.
    Rejected { req: Req, error: Error },
    /// R → D: reserve pages for this request; `expect` is what R knows independently.
    Reserve { req: Req, expect: Expect },
    /// D → R.
    Reserved { req: Req, ticket: Ticket },
    /// R → D: open the token stream for this reservation.
    Generate { ticket: Ticket },
    /// R → P: compute the prompt's KV and push it to `decode`'s `ticket`.
    Prefill {
        req: Req,
        decode: usize,
        ticket: Ticket,
    },
    /// P → D: the KV pages and the manifest that describes them.
    Push {
        ticket: Ticket,
        manifest: Manifest,
        pages: Vec<PageWrite>,
    },
    /// P → R.
    PrefillDone { req: Req },
    /// P → R.
    PrefillFailed { req: Req, error: Error },
    /// D → R: token `index` of the answer.
    Token { req: Req, index: u8, token: Token },
    /// D → R: the stream is complete after `tokens` tokens.
    Finished { req: Req, tokens: u8 },
    /// D → R: the reservation failed; its pages have been scrubbed.
    Failed { req: Req, reason: Error },
}

/// The decode node's check of a push against its reservation (step 5 of the protocol):
/// identity, coverage, integrity. `reserved` is the number of pages reserved for the request.
pub fn verify(
    expect: &Expect,
    reserved: u8,
    manifest: &Manifest,
    pages: &[PageWrite],
) -> Result<(), Mismatch> {
    if manifest.req != expect.req {
        return Err(Mismatch::Request);
    }
    if manifest.tenant != expect.tenant {
        return Err(Mismatch::Tenant);
    }
    if manifest.prompt_len != expect.prompt_len {
        return Err(Mismatch::PromptLength);
    }
    if manifest.token_sum != expect.token_sum {
        return Err(Mismatch::TokenSum);
    }
    if manifest.page_count != reserved || manifest.page_sums.len() != usize::from(reserved) {
        return Err(Mismatch::PageCount);
    }
    // Coverage: every reserved slot written exactly once, nothing outside the reservation.
    let mut written = vec![0u8; usize::from(reserved)];
    for page in pages {
        match written.get_mut(usize::from(page.slot)) {
            Some(count) => *count += 1,
            None => return Err(Mismatch::Coverage),
        }
    }
    if written.iter().any(|&count| count != 1) {
        return Err(Mismatch::Coverage);
    }
    // Integrity: every page's bytes match the manifest's checksum for its slot.
    for page in pages {
        if manifest.page_sums[usize::from(page.slot)] != PageSum(page.kv) {
            return Err(Mismatch::PageSum);
        }
    }
    Ok(())
}

/// The token a decode step computes for `req` over its reserved pages, in slot order: what the
/// answer *says*, so the checker can tell an honest answer from one built on someone else's KV.
pub fn decode_token(req: Req, pages: &[Kv]) -> Token {
    // Any other request's data in the context leaks into the answer.
    for kv in pages {
        if let Kv::Of { req: other, .. } = kv {
            if *other != req {
                return Token::From(*other);
            }
        }
    }
    let own = pages.iter().enumerate().all(|(slot, kv)| {
        *kv == Kv::Of {
            req,
            slot: slot as u8,
        }
    });
    if own && !pages.is_empty() {
        Token::From(req)
    } else {
        Token::Garbage
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect() -> Expect {
        Expect {
            req: Req(0),
            tenant: Tenant(0),
            prompt_len: 2,
            token_sum: TokenSum::Prompt(Req(0)),
        }
    }

    fn honest() -> (Manifest, Vec<PageWrite>) {
        let pages: Vec<PageWrite> = (0..2)
            .map(|slot| PageWrite {
                slot,
                kv: Kv::Of { req: Req(0), slot },
            })
            .collect();
        let manifest = Manifest {
            req: Req(0),
            tenant: Tenant(0),
            prompt_len: 2,
            token_sum: TokenSum::Prompt(Req(0)),
            first_token: Token::From(Req(0)),
            page_count: 2,
            page_sums: pages.iter().map(|p| PageSum(p.kv)).collect(),
        };
        (manifest, pages)
    }

    #[test]
    fn verify_accepts_an_honest_push_and_names_each_mismatch() {
        let (manifest, pages) = honest();
        assert_eq!(verify(&expect(), 2, &manifest, &pages), Ok(()));

        let mut m = manifest.clone();
        m.tenant = Tenant(1);
        assert_eq!(verify(&expect(), 2, &m, &pages), Err(Mismatch::Tenant));

        let mut p = pages.clone();
        p[1].slot = 0;
        assert_eq!(verify(&expect(), 2, &manifest, &p), Err(Mismatch::Coverage));

        assert_eq!(
            verify(&expect(), 2, &manifest, &pages[..1]),
            Err(Mismatch::Coverage)
        );

        let mut p = pages.clone();
        p[0].kv = Kv::Garbled;
        assert_eq!(verify(&expect(), 2, &manifest, &p), Err(Mismatch::PageSum));
    }

    #[test]
    fn decode_token_names_foreign_data() {
        let own = [
            Kv::Of {
                req: Req(0),
                slot: 0,
            },
            Kv::Of {
                req: Req(0),
                slot: 1,
            },
        ];
        assert_eq!(decode_token(Req(0), &own), Token::From(Req(0)));
        let stale = [
            Kv::Of {
                req: Req(0),
                slot: 0,
            },
            Kv::Of {
                req: PREVIOUS,
                slot: 1,
            },
        ];
        assert_eq!(decode_token(Req(0), &stale), Token::From(PREVIOUS));
        let scrubbed = [
            Kv::Of {
                req: Req(0),
                slot: 0,
            },
            Kv::Scrubbed,
        ];
        assert_eq!(decode_token(Req(0), &scrubbed), Token::Garbage);
    }
}
