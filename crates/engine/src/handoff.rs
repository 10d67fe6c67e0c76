//! The engine's half of the disaggregated mode: a prefill node hands a prompt's K/V and
//! first token to a decode node, which verifies every part of it before it decodes.
//!
//! The incident (`ARCHITECTURE.md`) was a decode node that generated over pages it had
//! reserved but that were never written for the request. Here a decode node can only run
//! a received sequence as a [`VerifiedImport`], and the only way to make one is
//! [`ImportReservation::begin`] → [`ImportTransfer::receive_page`] → [`ImportTransfer::finish`],
//! which checks, in order:
//!
//! 1. the manifest names this reservation (ticket), the request id, isolation domain and
//!    prompt length the router told the decode node itself, and a checksum of the prompt
//!    tokens that equals the decode node's own checksum of the tokens the router sent it
//!    (a prefill that ran a placeholder instead of the prompt fails here);
//! 2. each page arrives once, in order, with the slot count its position implies and the
//!    checksum the manifest promised;
//! 3. every slot of every layer of the prompt was written under this reservation's leases
//!    (`SequenceKv::commit` over the written extents).
//!
//! Any failure drops the reservation, whose leases scrub their pages and return them.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use kv::{IsolationDomain, KvError, RequestId, SequenceKv};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::admission::Admitted;
use crate::slot::{QueueFull, Slot};
use crate::{EngineError, TokenEvent};

/// Names one reservation on a decode node. Random, so a stale or guessed ticket does not
/// name a live reservation; it grants nothing by itself (the manifest must also match).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(pub u128);

impl Ticket {
    pub fn random() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let keys = std::collections::hash_map::RandomState::new();
        let hi = keys.hash_one((n, 0u8));
        let lo = keys.hash_one((n, 1u8));
        Self(((hi as u128) << 64) | lo as u128)
    }

    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        Some(Self(u128::from_le_bytes(bytes.try_into().ok()?)))
    }
}

/// Checksum of prompt token ids (u32 little-endian).
pub fn token_checksum(tokens: &[u32]) -> u64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64(&bytes)
}

/// Checksum of one page payload, seeded with its index so that pages cannot be swapped.
pub fn page_checksum(index: usize, payload: &[u8]) -> u64 {
    xxh3_64_with_seed(payload, index as u64)
}

/// What a prefill node computed for one request: the prompt's K/V as page payloads
/// (`kv::SequenceKv::export_pages`), the first sampled token, and the sampler's position.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillOutput {
    pub first: TokenEvent,
    pub sampler_state: [u64; 4],
    /// The tokens the K/V was computed from, to checksum into the manifest.
    pub prompt: Vec<u32>,
    pub page_tokens: usize,
    pub pages: Vec<Vec<u8>>,
    pub cached_tokens: usize,
}

impl PrefillOutput {
    pub fn bytes(&self) -> usize {
        self.pages.iter().map(Vec::len).sum()
    }
}

/// What a prefill node claims it sends. Every field is checked against what the decode
/// node knows independently before a page is written.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    pub ticket: Ticket,
    pub request_id: String,
    pub domain: IsolationDomain,
    pub prompt_len: usize,
    pub token_checksum: u64,
    pub first_token: TokenEvent,
    pub sampler_state: [u64; 4],
    pub page_tokens: usize,
    pub page_checksums: Vec<u64>,
    pub cached_tokens: usize,
}

impl Manifest {
    /// The manifest that describes `output` truthfully.
    pub fn describe(
        ticket: Ticket,
        request_id: String,
        domain: IsolationDomain,
        output: &PrefillOutput,
    ) -> Self {
        Self {
            ticket,
            request_id,
            domain,
            prompt_len: output.prompt.len(),
            token_checksum: token_checksum(&output.prompt),
            first_token: output.first.clone(),
            sampler_state: output.sampler_state,
            page_tokens: output.page_tokens,
            page_checksums: output
                .pages
                .iter()
                .enumerate()
                .map(|(i, p)| page_checksum(i, p))
                .collect(),
            cached_tokens: output.cached_tokens,
        }
    }
}

/// Why a received sequence was refused. Each ends the request with an error; none leaves a
/// page behind.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HandoffError {
    #[error("manifest does not match the reservation: {0}")]
    Manifest(String),
    #[error("the prefill node computed K/V for other prompt tokens than the router sent (token checksum mismatch)")]
    TokenChecksum,
    #[error("page {index}: checksum mismatch")]
    PageChecksum { index: usize },
    #[error("K/V coverage check failed: {0}")]
    Coverage(String),
}

impl HandoffError {
    /// The metric label of this failure.
    pub fn reason(&self) -> &'static str {
        match self {
            HandoffError::Manifest(_) => "manifest",
            HandoffError::TokenChecksum | HandoffError::PageChecksum { .. } => "checksum",
            HandoffError::Coverage(_) => "coverage",
        }
    }
}

fn coverage(e: KvError) -> HandoffError {
    // The detail names internal request numbers: logged here, not sent to the peer.
    tracing::warn!("handoff coverage failure: {e}");
    HandoffError::Coverage(match e {
        KvError::UnwrittenRead {
            layer, position, ..
        } => {
            format!("slot {position} of layer {layer} was never written")
        }
        KvError::OutOfOrderWrite {
            layer, position, ..
        } => format!("slot {position} of layer {layer} written twice or out of order"),
        KvError::AppendPastCapacity { position, .. } => {
            format!("slot {position} lies beyond the reserved prompt")
        }
        KvError::PayloadShape { got, want } => {
            format!("page payload of {got} bytes, expected {want}")
        }
        other => other.to_string(),
    })
}

/// Why a decode node did not reserve pages.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReserveError {
    #[error(transparent)]
    Full(#[from] QueueFull),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Pages reserved on a decode node for one admitted request, waiting for its K/V. Made
/// only by the engine ([`crate::EngineHandle::reserve_import`]); dropping it returns the
/// pages, scrubbed.
#[derive(Debug)]
pub struct ImportReservation {
    pub(crate) id: RequestId,
    pub(crate) ticket: Ticket,
    pub(crate) request_id: String,
    pub(crate) admitted: Admitted,
    pub(crate) kv: SequenceKv,
    pub(crate) vocab_size: usize,
    /// The request's place in the engine, held until the request ends.
    pub(crate) slot: Slot,
}

impl ImportReservation {
    pub fn ticket(&self) -> Ticket {
        self.ticket
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Checks the manifest against what this node was told by the router (step 1).
    pub fn begin(self, manifest: Manifest) -> Result<ImportTransfer, HandoffError> {
        let request = &self.admitted.request;
        let mismatch = |what: &str| Err(HandoffError::Manifest(what.to_owned()));
        if manifest.ticket != self.ticket {
            return mismatch("ticket");
        }
        if manifest.request_id != self.request_id {
            return mismatch("request id");
        }
        if manifest.domain != request.domain {
            // Named by what differs: the operator reads whether a push came for another
            // tenant or was computed under another adapter (the domain holds both).
            let other_adapter = manifest.domain.adapter() != request.domain.adapter()
                && manifest.domain.computed_under(None) == request.domain.computed_under(None);
            return mismatch(if other_adapter {
                "the adapter the K/V was computed under"
            } else {
                "tenant"
            });
        }
        if manifest.prompt_len != request.prompt.len() {
            return mismatch("prompt length");
        }
        let page_tokens = self.kv.layout().page_tokens;
        if manifest.page_tokens != page_tokens {
            return mismatch("page size");
        }
        if manifest.page_checksums.len() != request.prompt.len().div_ceil(page_tokens) {
            return mismatch("page count");
        }
        if manifest.token_checksum != token_checksum(&request.prompt) {
            return Err(HandoffError::TokenChecksum);
        }
        if manifest.first_token.id as usize >= self.vocab_size {
            return mismatch("first token outside the vocabulary");
        }
        Ok(ImportTransfer {
            reservation: self,
            manifest,
            next_page: 0,
        })
    }
}

/// A reservation whose manifest matched, receiving pages.
#[derive(Debug)]
pub struct ImportTransfer {
    reservation: ImportReservation,
    manifest: Manifest,
    next_page: usize,
}

impl ImportTransfer {
    /// Writes one page after checking its place and checksum (step 2).
    pub fn receive_page(
        &mut self,
        index: usize,
        tokens: usize,
        payload: &[u8],
    ) -> Result<(), HandoffError> {
        let m = &self.manifest;
        if index != self.next_page || index >= m.page_checksums.len() {
            return Err(HandoffError::Coverage(format!(
                "page {index} arrived where page {} was expected",
                self.next_page
            )));
        }
        let want_tokens = (m.prompt_len - index * m.page_tokens).min(m.page_tokens);
        if tokens != want_tokens {
            return Err(HandoffError::Coverage(format!(
                "page {index} claims {tokens} slots, the prompt puts {want_tokens} there"
            )));
        }
        if page_checksum(index, payload) != m.page_checksums[index] {
            return Err(HandoffError::PageChecksum { index });
        }
        self.reservation
            .kv
            .import_page(index, tokens, payload)
            .map_err(coverage)?;
        self.next_page += 1;
        Ok(())
    }

    /// Checks that the whole prompt arrived on every layer (step 3).
    pub fn finish(mut self) -> Result<VerifiedImport, HandoffError> {
        let pages = self.manifest.page_checksums.len();
        if self.next_page != pages {
            return Err(HandoffError::Coverage(format!(
                "{} of {pages} pages arrived",
                self.next_page
            )));
        }
        self.reservation
            .kv
            .commit(self.manifest.prompt_len)
            .map_err(coverage)?;
        let ImportReservation {
            id,
            admitted,
            kv,
            slot,
            ..
        } = self.reservation;
        Ok(VerifiedImport {
            id,
            admitted,
            kv,
            slot,
            first_token: self.manifest.first_token,
            sampler_state: self.manifest.sampler_state,
            cached_tokens: self.manifest.cached_tokens,
        })
    }
}

/// A prompt's K/V that arrived complete and checked. The only way into a decode node's
/// engine for received data ([`crate::EngineHandle::submit_import`]); built only by
/// [`ImportTransfer::finish`].
#[derive(Debug)]
pub struct VerifiedImport {
    pub(crate) id: RequestId,
    pub(crate) admitted: Admitted,
    pub(crate) kv: SequenceKv,
    pub(crate) first_token: TokenEvent,
    pub(crate) sampler_state: [u64; 4],
    pub(crate) cached_tokens: usize,
    pub(crate) slot: Slot,
}
