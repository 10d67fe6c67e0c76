//! API keys and the tenant they authenticate. The tenant, never a client-chosen string,
//! decides a request's isolation domain.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use axum::http::{header, HeaderMap};
use engine::IsolationDomain;
use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::error::ApiError;

/// The tenant of every request when no key file is configured.
pub const DEFAULT_TENANT: &str = "default";

#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("cannot read API key file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("API key file line {line}: expected `KEY TENANT` or `KEY TENANT WEIGHT`")]
    Malformed { line: usize },
    #[error("API key file line {line}: the weight must be a whole number from 1 to {MAX_WEIGHT}")]
    Weight { line: usize },
    #[error("API key file line {line}: tenant {tenant} has weight {weight} on line {first}; one tenant has one weight")]
    ConflictingWeight {
        line: usize,
        tenant: String,
        weight: u32,
        first: usize,
    },
    #[error("API key file line {line}: this key already appears on line {first}")]
    Duplicate { line: usize, first: usize },
    #[error("API key file has no keys: every request would be refused")]
    Empty,
}

/// Who may call the API.
#[derive(Debug)]
pub enum Auth {
    /// No key file: one tenant, no authentication (meant for a loopback listener).
    Open,
    Keys(ApiKeys),
}

#[derive(Debug)]
pub struct ApiKeys {
    entries: Vec<(Vec<u8>, String)>,
    /// Tenants given a weight other than 1, with the line that gave it.
    weights: HashMap<String, (u32, usize)>,
}

/// The largest tenant weight: a tenant of this weight against one of weight 1 takes all
/// but a hundredth of what they compete for.
pub const MAX_WEIGHT: u32 = 100;

impl ApiKeys {
    pub fn load(path: &Path) -> Result<Self, KeysError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeysError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Lines of `KEY TENANT [WEIGHT]`; blank lines and `#` comments are skipped. A tenant's
    /// weight (1 unless given; the same on each of its keys' lines that gives one) sets its
    /// share of the engine when tenants compete (`engine::GenerateRequest::weight`).
    pub fn parse(text: &str) -> Result<Self, KeysError> {
        let mut entries: Vec<(Vec<u8>, String)> = Vec::new();
        let mut weights: HashMap<String, (u32, usize)> = HashMap::new();
        let mut lines_of: Vec<usize> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.trim();
            if content.is_empty() || content.starts_with('#') {
                continue;
            }
            let mut fields = content.split_whitespace();
            let (Some(key), Some(tenant), weight, None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return Err(KeysError::Malformed { line });
            };
            if let Some(weight) = weight {
                let weight = weight
                    .parse::<u32>()
                    .ok()
                    .filter(|w| (1..=MAX_WEIGHT).contains(w))
                    .ok_or(KeysError::Weight { line })?;
                match weights.get(tenant) {
                    Some(&(w, first)) if w != weight => {
                        return Err(KeysError::ConflictingWeight {
                            line,
                            tenant: tenant.to_owned(),
                            weight: w,
                            first,
                        })
                    }
                    Some(_) => {}
                    None => {
                        weights.insert(tenant.to_owned(), (weight, line));
                    }
                }
            }
            if let Some(pos) = entries.iter().position(|(k, _)| k == key.as_bytes()) {
                return Err(KeysError::Duplicate {
                    line,
                    first: lines_of.get(pos).copied().unwrap_or(0),
                });
            }
            entries.push((key.as_bytes().to_vec(), tenant.to_owned()));
            lines_of.push(line);
        }
        if entries.is_empty() {
            return Err(KeysError::Empty);
        }
        Ok(Self { entries, weights })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The tenant of `presented`. Compares against every key, whatever matches, so the
    /// time taken does not reveal which key (or how much of one) was right.
    pub fn tenant_of(&self, presented: &[u8]) -> Option<&str> {
        let mut found = subtle::Choice::from(0);
        let mut index = 0u64;
        for (i, (key, _)) in self.entries.iter().enumerate() {
            let eq = ct_eq_padded(key, presented);
            index.conditional_assign(&(i as u64), eq);
            found |= eq;
        }
        if bool::from(found) {
            self.entries
                .get(index as usize)
                .map(|(_, tenant)| tenant.as_str())
        } else {
            None
        }
    }
}

/// Constant-time equality whose running time depends on the configured key's length only
/// (subtle's slice comparison returns early on a length mismatch).
pub(crate) fn ct_eq_padded(key: &[u8], presented: &[u8]) -> subtle::Choice {
    let mut eq = (key.len() as u64).ct_eq(&(presented.len() as u64));
    for (i, k) in key.iter().enumerate() {
        let p = presented.get(i).copied().unwrap_or(0);
        eq &= k.ct_eq(&p);
    }
    eq
}

impl Auth {
    /// The weight of `tenant` (`ApiKeys::parse`); 1 without a key file.
    pub fn weight_of(&self, tenant: &str) -> u32 {
        match self {
            Auth::Open => 1,
            Auth::Keys(keys) => keys.weights.get(tenant).map_or(1, |&(w, _)| w),
        }
    }

    /// Whether some request can be `tenant`'s: a key maps to it, or it is the one tenant
    /// without a key file.
    pub fn has_tenant(&self, tenant: &str) -> bool {
        match self {
            Auth::Open => tenant == DEFAULT_TENANT,
            Auth::Keys(keys) => keys.entries.iter().any(|(_, t)| t == tenant),
        }
    }

    /// The isolation domain of the request's tenant, or 401.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<IsolationDomain, ApiError> {
        // Proxies and servers disagree on which of two keys counts; the request is refused
        // rather than guessed, with or without keys configured.
        let presented = headers.get_all(header::AUTHORIZATION).iter().count();
        if presented > 1 {
            return Err(ApiError::invalid(
                "duplicate_header",
                None,
                format!("Send one Authorization header; this request has {presented}."),
            ));
        }
        let keys = match self {
            Auth::Open => return Ok(IsolationDomain::tenant(DEFAULT_TENANT)),
            Auth::Keys(keys) => keys,
        };
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(ApiError::Unauthorized(
                "You didn't provide an API key. Send it in the Authorization header as `Bearer KEY`.",
            ));
        };
        let bytes = value.as_bytes();
        let key = match bytes.get(..7) {
            Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => {
                bytes.get(7..).unwrap_or_default().trim_ascii()
            }
            _ => {
                return Err(ApiError::Unauthorized(
                    "The Authorization header must have the form `Bearer KEY`.",
                ))
            }
        };
        keys.tenant_of(key)
            .map(IsolationDomain::tenant)
            .ok_or(ApiError::Unauthorized("Incorrect API key provided."))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const FILE: &str = "# tenants\n\nsk-alpha alice\n  sk-beta   bob  \n";

    #[test]
    fn parses_keys_and_finds_tenants() {
        let keys = ApiKeys::parse(FILE).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.tenant_of(b"sk-alpha"), Some("alice"));
        assert_eq!(keys.tenant_of(b"sk-beta"), Some("bob"));
        assert_eq!(keys.tenant_of(b"sk-alph"), None);
        assert_eq!(keys.tenant_of(b"sk-alphaa"), None);
        assert_eq!(keys.tenant_of(b""), None);
    }

    #[test]
    fn weights_are_per_tenant_and_default_to_one() {
        let auth = Auth::Keys(ApiKeys::parse("a alice 3\nb alice\nc bob\nd carol 1\n").unwrap());
        assert_eq!(auth.weight_of("alice"), 3);
        assert_eq!(auth.weight_of("bob"), 1);
        assert_eq!(auth.weight_of("carol"), 1);
        assert_eq!(auth.weight_of("nobody"), 1);
        assert_eq!(Auth::Open.weight_of(DEFAULT_TENANT), 1);
    }

    #[test]
    fn rejects_bad_files() {
        assert!(matches!(
            ApiKeys::parse("k\n"),
            Err(KeysError::Malformed { line: 1 })
        ));
        assert!(matches!(
            ApiKeys::parse("k t 2 extra\n"),
            Err(KeysError::Malformed { line: 1 })
        ));
        for bad in ["k t extra\n", "k t 0\n", "k t 101\n", "k t -1\n"] {
            assert!(
                matches!(ApiKeys::parse(bad), Err(KeysError::Weight { line: 1 })),
                "{bad}"
            );
        }
        assert!(matches!(
            ApiKeys::parse("a t 3\nb t\nc t 2\n"),
            Err(KeysError::ConflictingWeight {
                line: 3,
                weight: 3,
                first: 1,
                ..
            })
        ));
        assert!(matches!(
            ApiKeys::parse("a t\n# c\na u\n"),
            Err(KeysError::Duplicate { line: 3, first: 1 })
        ));
        assert!(matches!(
            ApiKeys::parse("# nothing\n\n"),
            Err(KeysError::Empty)
        ));
    }

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn bearer_header_maps_to_tenant_domain() {
        let auth = Auth::Keys(ApiKeys::parse(FILE).unwrap());
        let d = auth.authenticate(&headers(Some("Bearer sk-beta"))).unwrap();
        assert_eq!(d, IsolationDomain::tenant("bob"));
        let d = auth
            .authenticate(&headers(Some("bearer sk-alpha")))
            .unwrap();
        assert_eq!(d.tenant_name(), "alice");
        for bad in [
            None,
            Some("Bearer nope"),
            Some("Basic sk-alpha"),
            Some("Bearer"),
            Some("sk-alpha"),
        ] {
            let e = auth.authenticate(&headers(bad)).unwrap_err();
            assert_eq!(
                (e.status().as_u16(), e.code()),
                (401, "invalid_api_key"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn two_authorization_headers_are_refused_whichever_is_valid() {
        let keyed = Auth::Keys(ApiKeys::parse(FILE).unwrap());
        for auth in [&keyed, &Auth::Open] {
            for pair in [
                ["Bearer sk-alpha", "Bearer sk-beta"],
                ["Bearer nope", "Bearer sk-beta"],
            ] {
                let mut h = headers(Some(pair[0]));
                h.append(
                    header::AUTHORIZATION,
                    HeaderValue::from_str(pair[1]).unwrap(),
                );
                let e = auth.authenticate(&h).unwrap_err();
                assert_eq!((e.status().as_u16(), e.code()), (400, "duplicate_header"));
            }
        }
    }

    #[test]
    fn open_auth_is_one_default_tenant() {
        let d = Auth::Open
            .authenticate(&headers(Some("Bearer anything")))
            .unwrap();
        assert_eq!(d, IsolationDomain::tenant(DEFAULT_TENANT));
    }
}
