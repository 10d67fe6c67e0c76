//! The paged KV cache, with ownership enforced by construction.
//!
//! The incident this project answers (see `ARCHITECTURE.md`) was a decode step reading KV
//! pages that had been handed to a request but never rewritten for it. Here:
//!
//! * Page memory lives inside the page's current owner. A [`PageLease`] *moves* the page's
//!   buffer out of the pool; nothing else can name it. Dropping the lease scrubs the buffer
//!   and moves it back. There is no raw page index or page handle other than the owning
//!   ones anywhere in the public API, so "read page 17" cannot be expressed.
//! * Each lease records, per layer, how many slots were written under it. Reading past that
//!   extent is [`KvError::UnwrittenRead`], a hard error in release builds too.
//! * A full page can be frozen into a [`SharedPage`]: immutable, reference-counted, tagged
//!   with the isolation domain it may be read from. A sequence of another domain cannot
//!   read it (checked at every read), and the prefix cache never offers it across domains.
//! * The per-request view that attention reads ([`SequenceKv`]) is built only from that
//!   request's leases and its own domain's shared pages.
//! * The [`PrefixCache`] keeps one radix tree per isolation domain plus one for prefixes the
//!   operator declared public, so a cache hit (and its timing) never crosses tenants.

// Memory safety here rests on the compiler alone: the only unsafe code in the workspace is
// the SIMD kernels of the `model` crate and `gguf`'s mapping of the model file, each with
// its own safety argument and test.
#![forbid(unsafe_code)]

mod block;
mod error;
mod evict;
mod layout;
mod lease;
mod page_memory;
mod pool;
mod prefix;
mod q4;
mod q8;
mod sequence;
mod shared;
mod state;
mod sync;
mod transfer;

pub use block::KvBlock;
pub use error::KvError;
pub use layout::{KvDtype, KvLayout, KvSlice};
pub use lease::PageLease;
pub use pool::{KvPool, PoolConfig, PoolCounts};
pub use prefix::{PrefixCache, PrefixError, PrefixMatch, PublicPrefixes, TreeStats};
pub use q4::Q4Block;
pub use q8::{Q8Block, Q8_BLOCK_BYTES, Q8_VALUES};
pub use sequence::{KvRun, SequenceKv};
pub use shared::SharedPage;
pub use state::ScrubPolicy;

/// False only in the benchmark-only build that measures what the read checks cost; servers
/// refuse to start without them.
pub const CHECKS_ENABLED: bool = !cfg!(feature = "bench-unchecked-baseline");

/// The unit of isolation: requests in one domain may share cached prefixes, requests in
/// different domains never see each other's pages. Built by the server from the
/// authenticated tenant (and optionally narrowed by a client-supplied salt); never taken
/// from the client alone.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IsolationDomain {
    tenant: String,
    salt: Option<String>,
    /// The fingerprint of the LoRA adapter the domain's K/V is computed under (`None`: the
    /// base model). K/V is a function of the weights that computed it, so the same tokens
    /// under another adapter (or none) are another domain: nothing is shared across it,
    /// and public pages, computed under the base model, are not readable from it.
    adapter: Option<u128>,
}

impl IsolationDomain {
    /// The domain of an authenticated tenant.
    pub fn tenant(tenant: impl Into<String>) -> Self {
        Self {
            tenant: tenant.into(),
            salt: None,
            adapter: None,
        }
    }

    /// Narrows this domain by a client salt: the result shares nothing with the unsalted
    /// domain or with any other salt, and it can never widen to another tenant.
    pub fn narrowed(&self, salt: impl Into<String>) -> Self {
        Self {
            tenant: self.tenant.clone(),
            salt: Some(salt.into()),
            adapter: self.adapter,
        }
    }

    /// This domain as computed under an adapter (by its fingerprint; `None`: the base
    /// model). Replaces whatever adapter the domain named: the engine sets it from the
    /// adapter a request actually runs with, never from what a client claimed.
    pub fn computed_under(&self, adapter: Option<u128>) -> Self {
        Self {
            tenant: self.tenant.clone(),
            salt: self.salt.clone(),
            adapter,
        }
    }

    /// The fingerprint of the adapter this domain's K/V is computed under.
    pub fn adapter(&self) -> Option<u128> {
        self.adapter
    }

    pub fn tenant_name(&self) -> &str {
        &self.tenant
    }

    /// The client salt that narrowed this domain, if any.
    pub fn salt(&self) -> Option<&str> {
        self.salt.as_deref()
    }
}

/// Who may read a page: its own domain, or everyone when the operator published it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Visibility {
    Domain(IsolationDomain),
    /// A prefix the operator marked public in configuration (e.g. a shared system prompt).
    Public,
}

impl Visibility {
    pub fn readable_by(&self, domain: &IsolationDomain) -> bool {
        match self {
            // Public pages hold the base model's K/V: under an adapter they would be wrong
            // and would mix two computations into one sequence.
            Visibility::Public => domain.adapter.is_none(),
            Visibility::Domain(d) => d == domain,
        }
    }
}

/// Identifies one request for the lifetime of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// The owner a lease is bound to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    pub request: RequestId,
    pub domain: IsolationDomain,
}
