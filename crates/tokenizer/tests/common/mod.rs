//! Shared by the integration tests: locating the model and the golden files.
// Each test binary compiles its own copy and uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use tokenizer::Tokenizer;

pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The default model, fetched with the workspace's script when absent. Fails the test
/// (never skips) when it cannot be had.
pub fn model_path() -> PathBuf {
    let root = workspace_root();
    let path = root.join("models").join(MODEL_FILE);
    if !path.exists() {
        let script = root.join("scripts/fetch-model.sh");
        let status = Command::new("bash")
            .arg(&script)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "model missing at {}; cannot run {}: {e}",
                    path.display(),
                    script.display()
                )
            });
        assert!(
            status.success(),
            "model missing at {} and {} failed ({status})",
            path.display(),
            script.display()
        );
        assert!(
            path.exists(),
            "{} succeeded but {} is still missing",
            script.display(),
            path.display()
        );
    }
    path
}

pub fn model() -> &'static gguf::GgufFile {
    static FILE: OnceLock<gguf::GgufFile> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = model_path();
        gguf::GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
    })
}

pub fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_gguf(model()).unwrap_or_else(|e| panic!("loading tokenizer: {e}"))
    })
}

/// A file of llama.cpp's recorded output, kept in the repository (`tests/data/golden/`, see
/// its README for provenance). Fails loudly if missing.
pub fn golden(name: &str) -> serde_json::Value {
    let path = workspace_root().join("tests/data/golden").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "golden file {} is missing or unreadable ({e}); it is part of the repository",
            path.display()
        )
    });
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("golden file {} is not JSON: {e}", path.display()))
}

/// Token ids of vocabulary entries given in the vocabulary's byte-level spelling.
pub fn ids(tok: &Tokenizer, entries: &[&str]) -> Vec<u32> {
    entries
        .iter()
        .map(|e| {
            tok.token_id(e)
                .unwrap_or_else(|| panic!("{e:?} is not a vocabulary entry"))
        })
        .collect()
}

/// llama.cpp's tokenizer vocabularies and chat-template corpus (`templates/`), fetched by
/// `scripts/fetch-llama-vocabs.sh` when absent (never skipped).
pub fn llama_cpp_models_dir() -> PathBuf {
    let root = workspace_root();
    let script = root.join("scripts/fetch-llama-vocabs.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed ({}): {}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = String::from_utf8(out.stdout).expect("script prints a UTF-8 path");
    PathBuf::from(dir.trim())
}
