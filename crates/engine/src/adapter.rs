//! A request's LoRA adapter, and the set of adapters a node holds.
//!
//! A request names its adapter by an [`AdapterRef`]: the name the operator gave it, the
//! fingerprint of its arithmetic and the checksum of its file, and, on a node that
//! computes, its weights. A router holds no weights: its references name the adapter for
//! the nodes, which each resolve the name in their own [`Adapters`] and refuse one whose
//! fingerprint differs. Admission narrows the request's domain by the fingerprint, so K/V
//! computed under an adapter stays in (tenant, salt, adapter).
//!
//! The weights are shared by `Arc`: a request holds its adapter until it ends, so an
//! unload ([`Adapters::remove`]) never changes an answer mid-way, and the memory is freed
//! when the last request using it ends ([`Unloading::wait`] tells the operator when).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use model::lora::LoraAdapter;

/// The adapter a request runs under.
#[derive(Clone)]
pub struct AdapterRef {
    name: Arc<str>,
    fingerprint: u128,
    file_checksum: u128,
    weights: Option<Arc<LoraAdapter>>,
}

impl AdapterRef {
    /// A reference with the weights, on a node that computes.
    pub fn local(name: &str, weights: Arc<LoraAdapter>) -> Self {
        Self {
            name: name.into(),
            fingerprint: weights.fingerprint(),
            file_checksum: weights.file_checksum(),
            weights: Some(weights),
        }
    }

    /// A reference by name and identity only (a router's; a request off the wire before
    /// its node resolves it).
    pub fn remote(name: &str, fingerprint: u128, file_checksum: u128) -> Self {
        Self {
            name: name.into(),
            fingerprint,
            file_checksum,
            weights: None,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn fingerprint(&self) -> u128 {
        self.fingerprint
    }

    pub fn file_checksum(&self) -> u128 {
        self.file_checksum
    }

    /// The weights, where this process holds them.
    pub fn weights(&self) -> Option<&LoraAdapter> {
        self.weights.as_deref()
    }
}

impl std::fmt::Debug for AdapterRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterRef")
            .field("name", &self.name)
            .field("fingerprint", &format_args!("{:032x}", self.fingerprint))
            .field("local", &self.weights.is_some())
            .finish()
    }
}

/// What a process knows of one loaded adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    pub name: String,
    pub fingerprint: u128,
    pub file_checksum: u128,
    pub rank: usize,
    pub scale: f32,
}

/// Why an adapter could not be added.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AdapterSetError {
    #[error("an adapter named {0:?} is already loaded")]
    Exists(String),
    #[error("adapter name {0:?}: use 1 to 128 characters of A-Z a-z 0-9 . _ - / : and not the base model's name")]
    BadName(String),
}

/// The adapters a process serves, by name. Cheap to read on every request.
#[derive(Default)]
pub struct Adapters {
    by_name: RwLock<BTreeMap<String, Arc<LoraAdapter>>>,
}

impl Adapters {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `name` can name an adapter (the model ids clients send).
    pub fn valid_name(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= 128
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-/:".contains(&b))
    }

    pub fn insert(&self, name: &str, adapter: Arc<LoraAdapter>) -> Result<(), AdapterSetError> {
        if !Self::valid_name(name) {
            return Err(AdapterSetError::BadName(name.to_string()));
        }
        let mut map = self.by_name.write().unwrap_or_else(|e| e.into_inner());
        if map.contains_key(name) {
            return Err(AdapterSetError::Exists(name.to_string()));
        }
        map.insert(name.to_string(), adapter);
        Ok(())
    }

    /// The adapter `name`, for a new request.
    pub fn get(&self, name: &str) -> Option<AdapterRef> {
        let map = self.by_name.read().unwrap_or_else(|e| e.into_inner());
        map.get(name).map(|a| AdapterRef::local(name, a.clone()))
    }

    /// Takes `name` out of service: no new request gets it; the ones holding it finish
    /// with it. `None` when no such adapter is loaded.
    pub fn remove(&self, name: &str) -> Option<Unloading> {
        let mut map = self.by_name.write().unwrap_or_else(|e| e.into_inner());
        map.remove(name).map(|a| Unloading {
            weights: Arc::downgrade(&a),
        })
    }

    pub fn list(&self) -> Vec<AdapterInfo> {
        let map = self.by_name.read().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .map(|(name, a)| AdapterInfo {
                name: name.clone(),
                fingerprint: a.fingerprint(),
                file_checksum: a.file_checksum(),
                rank: a.rank(),
                scale: a.scale(),
            })
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }
}

/// An adapter taken out of service, until the last request using it ends.
pub struct Unloading {
    weights: Weak<LoraAdapter>,
}

impl Unloading {
    /// Requests still holding the adapter.
    pub fn users(&self) -> usize {
        self.weights.strong_count()
    }

    /// Waits (polling; an unload is rare) until no request holds the adapter, so its
    /// weights are freed. False if `limit` passed first.
    pub async fn wait(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while self.users() > 0 {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }
}
