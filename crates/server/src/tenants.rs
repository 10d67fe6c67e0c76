//! Per-tenant limits on what one tenant may hold in the backend at once: requests in
//! flight and the tokens they may occupy (prompt plus `max_tokens`). Without them one
//! tenant can fill the engine's bounded queue and every other tenant sees 429s; with them
//! the flooding tenant is refused (429, `Retry-After`) while the others' requests still
//! find room. The request's place is taken before any work on its prompt (so a tenant's
//! tokenizations count against it, refused ones too while they run), its tokens once
//! admission has counted them, before the backend sees the request; released when its
//! response ends, however it ends (the permit lives in the response, so a client that
//! hangs up releases it too).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The configured bounds; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantLimits {
    pub max_requests: Option<usize>,
    pub max_tokens: Option<usize>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Held {
    requests: usize,
    tokens: usize,
}

/// What every tenant holds now.
#[derive(Debug, Default)]
pub struct TenantUsage {
    limits: TenantLimits,
    held: Mutex<HashMap<String, Held>>,
}

/// Which per-tenant limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantLimit {
    Requests(usize),
    Tokens(usize),
}

impl TenantUsage {
    pub fn new(limits: TenantLimits) -> Self {
        Self {
            limits,
            held: Mutex::default(),
        }
    }

    pub fn limits(&self) -> TenantLimits {
        self.limits
    }

    /// Takes a place for one request of `tenant` that may occupy `tokens`. A tenant that
    /// holds nothing is always let in, whatever `tokens` is: the token bound limits how
    /// much one tenant piles up, never which single request it may send (admission bounds
    /// that, by the context).
    pub fn acquire(self: &Arc<Self>, tenant: &str, tokens: usize) -> Result<Permit, TenantLimit> {
        // The map is updated only in whole steps, so a poisoned lock holds consistent data.
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let now = held.get(tenant).copied().unwrap_or_default();
        if let Some(max) = self.limits.max_requests {
            if now.requests >= max {
                return Err(TenantLimit::Requests(max));
            }
        }
        if let Some(max) = self.limits.max_tokens {
            if now.requests > 0 && now.tokens.saturating_add(tokens) > max {
                return Err(TenantLimit::Tokens(max));
            }
        }
        let entry = held.entry(tenant.to_owned()).or_default();
        entry.requests += 1;
        entry.tokens = entry.tokens.saturating_add(tokens);
        Ok(Permit {
            usage: self.clone(),
            tenant: tenant.to_owned(),
            tokens,
        })
    }

    /// Requests and tokens `tenant` holds now.
    pub fn held(&self, tenant: &str) -> (usize, usize) {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(tenant)
            .map(|h| (h.requests, h.tokens))
            .unwrap_or_default()
    }
}

/// One request's place in its tenant's limits; dropping it gives the place back.
#[derive(Debug)]
pub struct Permit {
    usage: Arc<TenantUsage>,
    tenant: String,
    tokens: usize,
}

impl Permit {
    /// Adds the tokens the request may occupy, now that they are known (prompt plus
    /// max_tokens). Refused when the tenant's other requests already hold tokens and these
    /// would take it past `--tenant-max-tokens`: as for [`TenantUsage::acquire`], a request
    /// alone is never refused by the token bound.
    pub fn add_tokens(&mut self, tokens: usize) -> Result<(), TenantLimit> {
        let mut held = self
            .usage
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = held.entry(self.tenant.clone()).or_default();
        if let Some(max) = self.usage.limits.max_tokens {
            let others = entry.tokens.saturating_sub(self.tokens);
            if others > 0 && others.saturating_add(self.tokens).saturating_add(tokens) > max {
                return Err(TenantLimit::Tokens(max));
            }
        }
        entry.tokens = entry.tokens.saturating_add(tokens);
        self.tokens = self.tokens.saturating_add(tokens);
        Ok(())
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut held = self
            .usage
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = held.get_mut(&self.tenant) {
            h.requests = h.requests.saturating_sub(1);
            h.tokens = h.tokens.saturating_sub(self.tokens);
            if h.requests == 0 {
                // No entry for an idle tenant: the map holds only tenants with requests.
                held.remove(&self.tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(max_requests: Option<usize>, max_tokens: Option<usize>) -> Arc<TenantUsage> {
        Arc::new(TenantUsage::new(TenantLimits {
            max_requests,
            max_tokens,
        }))
    }

    #[test]
    fn request_limit_is_per_tenant_and_released_on_drop() {
        let u = usage(Some(2), None);
        let a1 = u.acquire("a", 10).unwrap();
        let _a2 = u.acquire("a", 10).unwrap();
        let e = u.acquire("a", 10).unwrap_err();
        assert!(e == TenantLimit::Requests(2), "{e:?}");
        let answer = crate::error::ApiError::from(e);
        assert_eq!(answer.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(answer.retry_after(), Some(1));
        // Another tenant is not affected by a's flood.
        let _b = u.acquire("b", 10).unwrap();
        drop(a1);
        assert_eq!(u.held("a"), (1, 10));
        let _a3 = u.acquire("a", 10).unwrap();
    }

    #[test]
    fn token_limit_counts_held_tokens_but_never_refuses_a_lone_request() {
        let u = usage(None, Some(100));
        let big = u.acquire("a", 500).unwrap();
        let e = u.acquire("a", 1).unwrap_err();
        assert!(e == TenantLimit::Tokens(100), "{e:?}");
        drop(big);
        assert_eq!(u.held("a"), (0, 0));
        let _x = u.acquire("a", 60).unwrap();
        let _y = u.acquire("a", 40).unwrap();
        assert!(u.acquire("a", 1).is_err());
        assert!(u.acquire("b", 1).is_ok());
    }

    #[test]
    fn unlimited_by_default() {
        let u = Arc::new(TenantUsage::default());
        let permits: Vec<_> = (0..1000)
            .map(|_| u.acquire("a", usize::MAX).unwrap())
            .collect();
        assert_eq!(u.held("a"), (1000, usize::MAX));
        drop(permits);
        assert_eq!(u.held("a"), (0, 0));
    }

    #[test]
    fn tokens_added_later_count_as_if_taken_at_once() {
        let u = usage(Some(3), Some(100));
        let mut a = u.acquire("a", 0).unwrap();
        a.add_tokens(60).unwrap();
        let mut b = u.acquire("a", 0).unwrap();
        assert_eq!(u.held("a"), (2, 60));
        assert_eq!(b.add_tokens(41).unwrap_err(), TenantLimit::Tokens(100));
        // The refused request still holds its place until dropped, with no tokens.
        assert_eq!(u.held("a"), (2, 60));
        drop(a);
        // Alone: never refused by the token bound.
        b.add_tokens(500).unwrap();
        // A tenant already past its bound is refused before any work.
        assert_eq!(u.acquire("a", 0).unwrap_err(), TenantLimit::Tokens(100));
        drop(b);
        assert_eq!(u.held("a"), (0, 0));
    }
}
