//! Which LoRA adapters a tenant may select, and how a request names one.
//!
//! A request selects an adapter by its `model` field (vLLM's convention) or by llama.cpp's
//! `lora` list of ids and scales; [`crate::validation`] resolves either through the
//! [`Catalog`] before any work. The catalog holds the served names, their ids (stable for
//! the process's life, so a llama.cpp client's id never comes to mean another adapter after
//! an unload) and who may use each; the weights, or on a router the references to them,
//! come from an [`AdapterSet`], which the backend provides.
//!
//! An adapter a tenant may not use answers exactly as one that does not exist
//! (`ApiError::ModelNotFound`): a tenant cannot learn another's adapter names by asking.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use engine::{AdapterInfo, AdapterRef, Adapters};

/// Where the catalog finds a selected adapter: the engine's registry (`serve`), or a
/// cluster's references to the adapters its nodes hold (`router`).
pub trait AdapterSet: Send + Sync + 'static {
    /// A reference for a new request, or `None` when `name` is not held (any more).
    fn get(&self, name: &str) -> Option<AdapterRef>;

    /// What is known of each adapter held (the operator API lists it).
    fn info(&self) -> Vec<AdapterInfo>;
}

impl AdapterSet for Adapters {
    fn get(&self, name: &str) -> Option<AdapterRef> {
        Adapters::get(self, name)
    }

    fn info(&self) -> Vec<AdapterInfo> {
        self.list()
    }
}

/// One served adapter as tenants see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its index for llama.cpp's `lora` field: the start set in name order (a router
    /// numbers its nodes' set the same way), then the order of hot loads; never reused.
    pub id: usize,
    pub name: String,
    /// The scale it was loaded at: the only one a request may ask for.
    pub scale: f32,
    /// The tenants that may use it; `None`: every tenant (no access file).
    pub tenants: Option<BTreeSet<String>>,
}

impl Entry {
    pub fn usable_by(&self, tenant: &str) -> bool {
        self.tenants.as_ref().is_none_or(|t| t.contains(tenant))
    }
}

/// Why the catalog refused an adapter.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CatalogError {
    #[error("adapter name {0:?}: use 1 to 128 characters of A-Z a-z 0-9 . _ - / :")]
    BadName(String),
    #[error("adapter name {0:?} is the served model's name")]
    BaseName(String),
    #[error("an adapter named {0:?} is already loaded")]
    Exists(String),
}

/// The adapters this server offers, in id order, with who may use each.
pub struct Catalog {
    base: String,
    set: Arc<dyn AdapterSet>,
    inner: RwLock<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: Vec<Entry>,
    next_id: usize,
    /// An access file was given: an adapter nobody was granted is usable by nobody.
    restricted: bool,
}

impl Catalog {
    /// An empty catalog over `set`, for the served model `base`.
    pub fn new(base: &str, set: Arc<dyn AdapterSet>) -> Self {
        Self {
            base: base.to_owned(),
            set,
            inner: RwLock::default(),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set(&self) -> &Arc<dyn AdapterSet> {
        &self.set
    }

    pub fn is_empty(&self) -> bool {
        self.read().entries.is_empty()
    }

    /// Whether `name` may name an adapter here (before anything is loaded under it).
    pub fn check_name(&self, name: &str) -> Result<(), CatalogError> {
        if !Adapters::valid_name(name) {
            return Err(CatalogError::BadName(name.to_owned()));
        }
        if name == self.base {
            return Err(CatalogError::BaseName(name.to_owned()));
        }
        if self.read().entries.iter().any(|e| e.name == name) {
            return Err(CatalogError::Exists(name.to_owned()));
        }
        Ok(())
    }

    /// Offers `name` (already in the set) to `tenants`; `None`: every tenant unless an
    /// access file restricts the catalog, then nobody until granted. Returns its id.
    pub fn add(
        &self,
        name: &str,
        scale: f32,
        tenants: Option<BTreeSet<String>>,
    ) -> Result<usize, CatalogError> {
        self.check_name(name)?;
        let mut inner = self.write();
        // Checked again under the lock: two hot loads of one name race to here.
        if inner.entries.iter().any(|e| e.name == name) {
            return Err(CatalogError::Exists(name.to_owned()));
        }
        let tenants = match tenants {
            Some(t) => Some(t),
            None if inner.restricted => Some(BTreeSet::new()),
            None => None,
        };
        let id = inner.next_id;
        inner.next_id += 1;
        inner.entries.push(Entry {
            id,
            name: name.to_owned(),
            scale,
            tenants,
        });
        Ok(id)
    }

    /// Takes `name` out of the catalog: new requests for it get 404 from now on. False
    /// when no such adapter was offered.
    pub fn remove(&self, name: &str) -> bool {
        let mut inner = self.write();
        let before = inner.entries.len();
        inner.entries.retain(|e| e.name != name);
        inner.entries.len() != before
    }

    /// Applies an access file: from now on each adapter is usable only by the tenants it
    /// lists. Returns the adapters no line grants to anyone. A line naming an adapter that
    /// is not offered fails, naming the line.
    pub fn restrict(&self, access: &AccessList) -> Result<Vec<String>, AccessError> {
        let mut inner = self.write();
        for line in &access.lines {
            if !inner.entries.iter().any(|e| e.name == line.adapter) {
                return Err(AccessError::UnknownAdapter {
                    line: line.line,
                    adapter: line.adapter.clone(),
                });
            }
        }
        let granted = access.grants();
        inner.restricted = true;
        let mut unlisted = Vec::new();
        for entry in &mut inner.entries {
            let tenants = granted.get(&entry.name).cloned().unwrap_or_default();
            if tenants.is_empty() {
                unlisted.push(entry.name.clone());
            }
            entry.tenants = Some(tenants);
        }
        Ok(unlisted)
    }

    /// The adapters `tenant` may use, in id order.
    pub fn visible(&self, tenant: &str) -> Vec<Entry> {
        self.read()
            .entries
            .iter()
            .filter(|e| e.usable_by(tenant))
            .cloned()
            .collect()
    }

    /// Every adapter offered, in id order (the operator's view).
    pub fn entries(&self) -> Vec<Entry> {
        self.read().entries.clone()
    }

    /// The adapter `name` for a request of `tenant`: `None` when it is not offered, not
    /// granted to `tenant`, or no longer held, which the caller answers alike.
    pub fn select(&self, tenant: &str, name: &str) -> Option<(Entry, AdapterRef)> {
        let entry = self
            .read()
            .entries
            .iter()
            .find(|e| e.name == name && e.usable_by(tenant))
            .cloned()?;
        let adapter = self.set.get(name)?;
        Some((entry, adapter))
    }

    /// As [`Catalog::select`], by llama.cpp's id.
    pub fn select_id(&self, tenant: &str, id: u64) -> Option<(Entry, AdapterRef)> {
        let name = self
            .read()
            .entries
            .iter()
            .find(|e| e.id as u64 == id && e.usable_by(tenant))
            .map(|e| e.name.clone())?;
        self.select(tenant, &name)
    }
}

/// Why an access file was refused.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("cannot read LoRA access file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("LoRA access file line {line}: expected `ADAPTER TENANT [TENANT ...]`")]
    Malformed { line: usize },
    #[error("LoRA access file line {line}: no adapter named {adapter:?} is loaded (--lora)")]
    UnknownAdapter { line: usize, adapter: String },
}

/// One line of an access file.
#[derive(Debug, Clone, PartialEq)]
pub struct AccessLine {
    pub line: usize,
    pub adapter: String,
    pub tenants: Vec<String>,
}

/// `--lora-access`: which tenants may use which adapters.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AccessList {
    pub lines: Vec<AccessLine>,
}

impl AccessList {
    pub fn load(path: &Path) -> Result<Self, AccessError> {
        let text = std::fs::read_to_string(path).map_err(|source| AccessError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Lines of `ADAPTER TENANT [TENANT ...]`; blank lines and `#` comments are skipped.
    /// An adapter on several lines is granted to the tenants of all of them.
    pub fn parse(text: &str) -> Result<Self, AccessError> {
        let mut lines = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.trim();
            if content.is_empty() || content.starts_with('#') {
                continue;
            }
            let mut fields = content.split_whitespace();
            let (Some(adapter), tenants) = (fields.next(), fields.map(str::to_owned).collect())
            else {
                return Err(AccessError::Malformed { line });
            };
            let tenants: Vec<String> = tenants;
            if tenants.is_empty() {
                return Err(AccessError::Malformed { line });
            }
            lines.push(AccessLine {
                line,
                adapter: adapter.to_owned(),
                tenants,
            });
        }
        Ok(Self { lines })
    }

    /// Adapter to the tenants granted it.
    pub fn grants(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for l in &self.lines {
            out.entry(l.adapter.clone())
                .or_default()
                .extend(l.tenants.iter().cloned());
        }
        out
    }

    /// Every tenant the file names.
    pub fn tenants(&self) -> BTreeSet<&str> {
        self.lines
            .iter()
            .flat_map(|l| l.tenants.iter().map(String::as_str))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A set of references by name, as a router's would be.
    #[derive(Default)]
    struct Names(Mutex<Vec<String>>);

    impl AdapterSet for Names {
        fn get(&self, name: &str) -> Option<AdapterRef> {
            let names = self.0.lock().unwrap();
            names
                .iter()
                .position(|n| n == name)
                .map(|i| AdapterRef::remote(name, i as u128 + 1, 0))
        }

        fn info(&self) -> Vec<AdapterInfo> {
            Vec::new()
        }
    }

    fn catalog(names: &[&str]) -> Catalog {
        let set = Arc::new(Names(Mutex::new(
            names.iter().map(|n| n.to_string()).collect(),
        )));
        let c = Catalog::new("base", set);
        for n in names {
            c.add(n, 1.0, None).unwrap();
        }
        c
    }

    #[test]
    fn access_file_lines() {
        let list = AccessList::parse("# who\n\nA alice\n  B bob carol \nA dave\n").unwrap();
        assert_eq!(list.lines.len(), 3);
        assert_eq!(list.lines[1].line, 4);
        assert_eq!(list.lines[1].tenants, ["bob", "carol"]);
        let grants = list.grants();
        assert_eq!(
            grants["A"].iter().map(String::as_str).collect::<Vec<_>>(),
            ["alice", "dave"]
        );
        assert_eq!(list.tenants().len(), 4);
        assert!(matches!(
            AccessList::parse("A alice\nB\n"),
            Err(AccessError::Malformed { line: 2 })
        ));
        assert_eq!(AccessList::parse("# none\n").unwrap().lines, vec![]);
    }

    #[test]
    fn without_an_access_file_every_tenant_uses_every_adapter() {
        let c = catalog(&["A", "B"]);
        assert_eq!(c.visible("anyone").len(), 2);
        assert!(c.select("anyone", "B").is_some());
        assert_eq!(c.select_id("x", 1).map(|(e, _)| e.name), Some("B".into()));
        assert!(c.select("anyone", "C").is_none());
        assert!(c.select_id("x", 2).is_none());
    }

    #[test]
    fn an_access_file_grants_only_what_it_lists() {
        let c = catalog(&["A", "B", "C"]);
        let list = AccessList::parse("A alice\nB bob\nB alice\n").unwrap();
        assert_eq!(c.restrict(&list).unwrap(), vec!["C".to_string()]);
        let names = |t: &str| c.visible(t).into_iter().map(|e| e.name).collect::<Vec<_>>();
        assert_eq!(names("alice"), ["A", "B"]);
        assert_eq!(names("bob"), ["B"]);
        assert!(names("carol").is_empty());
        assert!(c.select("bob", "A").is_none());
        assert!(c.select_id("bob", 0).is_none());
        assert!(c.select("bob", "C").is_none());
        // A hot load without tenants is nobody's under an access file.
        c.add("D", 1.0, None).unwrap();
        assert!(c.select("alice", "D").is_none());
        c.add("E", 1.0, Some(["bob".to_string()].into())).unwrap();
        assert!(c.select("bob", "E").is_none(), "not in the set yet");
        assert_eq!(names("bob"), ["B", "E"]);
    }

    #[test]
    fn an_access_line_for_an_unknown_adapter_names_its_line() {
        let c = catalog(&["A"]);
        let list = AccessList::parse("A alice\n\nZ bob\n").unwrap();
        match c.restrict(&list) {
            Err(AccessError::UnknownAdapter { line: 3, adapter }) => assert_eq!(adapter, "Z"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn names_ids_and_removal() {
        let c = catalog(&["A", "B"]);
        assert_eq!(c.add("A", 1.0, None), Err(CatalogError::Exists("A".into())));
        assert_eq!(
            c.add("base", 1.0, None),
            Err(CatalogError::BaseName("base".into()))
        );
        assert_eq!(
            c.add("a b", 1.0, None),
            Err(CatalogError::BadName("a b".into()))
        );
        assert!(c.remove("A"));
        assert!(!c.remove("A"));
        assert!(c.select("t", "A").is_none());
        // Ids are never reused: B keeps 1, a new adapter gets 2.
        assert_eq!(c.select_id("t", 1).map(|(e, _)| e.name), Some("B".into()));
        assert_eq!(c.add("A", 1.0, None), Ok(2));
    }
}
