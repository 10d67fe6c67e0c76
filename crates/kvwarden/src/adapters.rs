//! `serve --lora NAME=PATH[,SCALE]`: the LoRA adapters loaded at start, the catalog the
//! API selects them from, and the loader the operator API uses for adapters loaded later.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Result};
use model::lora::LoraAdapter;
use server::admin::{AdapterLoader, LoadError};

/// One `--lora` flag.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraFlag {
    pub name: String,
    pub path: PathBuf,
    pub scale: f32,
}

impl std::fmt::Display for LoraFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "--lora {}={}", self.name, self.path.display())
    }
}

/// `NAME=PATH[,SCALE]`. The scale is what follows the last comma when it is a number, so a
/// path may hold commas (`a,b.gguf`) as long as it does not end in `,NUMBER`.
pub fn parse_lora_flag(value: &str) -> Result<LoraFlag, String> {
    let Some((name, rest)) = value.split_once('=') else {
        return Err(format!("{value:?}: expected NAME=PATH[,SCALE]"));
    };
    if !engine::Adapters::valid_name(name) {
        return Err(format!(
            "{name:?} cannot name an adapter: use 1 to 128 characters of A-Z a-z 0-9 . _ - / :"
        ));
    }
    let (path, scale) = match rest.rsplit_once(',') {
        Some((path, scale)) if scale.trim().parse::<f32>().is_ok() => {
            (path, scale.trim().parse::<f32>().unwrap_or(1.0))
        }
        _ => (rest, 1.0),
    };
    if path.is_empty() {
        return Err(format!("{value:?}: the adapter file's path is missing"));
    }
    check_scale(scale)?;
    Ok(LoraFlag {
        name: name.to_owned(),
        path: PathBuf::from(path),
        scale,
    })
}

/// A scale an adapter may be loaded at: finite, and not 0 (llama.cpp's `lora` field
/// leaves out the adapters it gives scale 0, so one loaded at 0 could never be chosen).
pub fn check_scale(scale: f32) -> Result<(), String> {
    if !scale.is_finite() || scale == 0.0 {
        return Err(format!(
            "the scale {scale} must be a finite number other than 0"
        ));
    }
    Ok(())
}

/// The names must differ from each other and from the served model's.
pub fn check_names(flags: &[LoraFlag], model_name: &str) -> Result<()> {
    for (i, flag) in flags.iter().enumerate() {
        if flag.name == model_name {
            bail!(
                "{flag}: {:?} is the served model's name (--served-model-name); an adapter needs a name of its own",
                flag.name
            );
        }
        if let Some(first) = flags[..i].iter().find(|f| f.name == flag.name) {
            bail!(
                "{flag}: the name {:?} is already given to {first}",
                flag.name
            );
        }
    }
    Ok(())
}

/// Loads every `--lora` adapter against `model`, in the flags' order; a refused file
/// fails start naming the flag, the path and the reason.
pub fn load_all(flags: &[LoraFlag], model: &model::Model) -> Result<Arc<engine::Adapters>> {
    let set = Arc::new(engine::Adapters::new());
    for flag in flags {
        let adapter = LoraAdapter::load_path(&flag.path, &model.lora_base(), flag.scale)
            .map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
        tracing::info!(
            adapter = %flag.name,
            rank = adapter.rank(),
            scale = flag.scale,
            mib = adapter.bytes() >> 20,
            "LoRA adapter loaded"
        );
        set.insert(&flag.name, Arc::new(adapter))
            .map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    }
    Ok(set)
}

/// The tenants' catalog of the loaded adapters: ids in the names' order (as a router
/// numbers its nodes' set, so an id means the same adapter monolithic or split), every
/// tenant allowed until `--lora-access` restricts it (`EdgeArgs::configure`).
pub fn catalog(
    model_name: &str,
    set: Arc<engine::Adapters>,
    flags: &[LoraFlag],
) -> Result<server::adapters::Catalog> {
    let catalog = server::adapters::Catalog::new(model_name, set);
    let mut by_name: Vec<&LoraFlag> = flags.iter().collect();
    by_name.sort_by(|a, b| a.name.cmp(&b.name));
    for flag in by_name {
        catalog
            .add(&flag.name, flag.scale, None)
            .map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    }
    Ok(catalog)
}

/// The operator API's loader: an adapter file checked against the served model's shapes
/// (kept from start: the model itself moved into the engine), into the engine's set.
pub struct FileLoader {
    base: model::lora::LoraBase,
    set: Arc<engine::Adapters>,
    one_at_a_time: std::sync::Mutex<()>,
}

impl FileLoader {
    pub fn new(served: &model::Model, set: Arc<engine::Adapters>) -> Self {
        Self {
            base: served.lora_base(),
            set,
            one_at_a_time: std::sync::Mutex::new(()),
        }
    }
}

impl AdapterLoader for FileLoader {
    fn load(&self, name: &str, path: &Path, scale: f32) -> Result<(), LoadError> {
        check_scale(scale).map_err(LoadError::Refused)?;
        let _one = self.one_at_a_time.lock().unwrap_or_else(|e| e.into_inner());
        let adapter = LoraAdapter::load_path(path, &self.base, scale)
            .map_err(|e| LoadError::Refused(e.to_string()))?;
        self.set
            .insert(name, Arc::new(adapter))
            .map_err(|e| match e {
                engine::AdapterSetError::Exists(name) => LoadError::Exists(name),
                other => LoadError::Refused(other.to_string()),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_flags() {
        assert_eq!(
            parse_lora_flag("a=x.gguf").unwrap(),
            LoraFlag {
                name: "a".into(),
                path: "x.gguf".into(),
                scale: 1.0
            }
        );
        let f = parse_lora_flag("org/a:v2=/tmp/x,y.gguf,0.5").unwrap();
        assert_eq!(
            (f.name.as_str(), f.path.to_str(), f.scale),
            ("org/a:v2", Some("/tmp/x,y.gguf"), 0.5)
        );
        let f = parse_lora_flag("a=/tmp/x,y.gguf").unwrap();
        assert_eq!((f.path.to_str(), f.scale), (Some("/tmp/x,y.gguf"), 1.0));
        assert_eq!(parse_lora_flag("a=x.gguf,-2").unwrap().scale, -2.0);
        for bad in [
            "x.gguf",
            "=x.gguf",
            "a b=x.gguf",
            "a=",
            "a=,1",
            "a=x.gguf,0",
            "a=x.gguf,nan",
            "a=x.gguf,inf",
        ] {
            assert!(parse_lora_flag(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_must_differ() {
        let flags = |names: &[&str]| -> Vec<LoraFlag> {
            names
                .iter()
                .map(|n| parse_lora_flag(&format!("{n}=x.gguf")).unwrap())
                .collect()
        };
        assert!(check_names(&flags(&["a", "b"]), "base").is_ok());
        let e = check_names(&flags(&["a", "base"]), "base").unwrap_err();
        assert!(e.to_string().contains("served model's name"), "{e}");
        let e = check_names(&flags(&["a", "b", "a"]), "base").unwrap_err();
        assert!(
            e.to_string().contains("already given to --lora a=x.gguf"),
            "{e}"
        );
    }
}
