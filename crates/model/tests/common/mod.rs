#![allow(dead_code)]
use std::path::PathBuf;

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The default model, fetched by the project's own script when missing. Fails loudly.
pub fn default_model() -> PathBuf {
    let root = workspace_root();
    let path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        let status = std::process::Command::new("bash")
            .arg(root.join("scripts/fetch-model.sh"))
            .status()
            .expect("running scripts/fetch-model.sh");
        assert!(
            status.success(),
            "scripts/fetch-model.sh failed; the default model is required"
        );
    }
    path
}

/// A file of llama.cpp's recorded output, kept in the repository (`tests/data/golden/`, see
/// its README for provenance); missing is a failure, not a skip.
pub fn golden(name: &str) -> serde_json::Value {
    let path = workspace_root().join("tests/data/golden").join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("golden file {} is required: {e}", path.display()));
    serde_json::from_str(&text).expect("golden JSON")
}

/// Gemma 3 270M (Q4_K_M), fetched by `scripts/fetch-gemma3.sh` when missing. Fails loudly.
pub fn gemma3_model() -> PathBuf {
    let root = workspace_root();
    let path = root.join("models/gemma-3-270m-q4_k_m.gguf");
    if !path.exists() {
        let status = std::process::Command::new("bash")
            .arg(root.join("scripts/fetch-gemma3.sh"))
            .status()
            .expect("running scripts/fetch-gemma3.sh");
        assert!(
            status.success(),
            "scripts/fetch-gemma3.sh failed; the Gemma 3 file is required"
        );
    }
    path
}

/// llama.cpp's recorded answers on Gemma 3 270M (`tests/data/gemma3/`, see its README).
pub fn gemma3_references() -> serde_json::Value {
    let path = workspace_root().join("tests/data/gemma3/references.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{} is required: {e}", path.display()));
    serde_json::from_str(&text).expect("references JSON")
}

/// llama.cpp's recorded output on a real file (`tests/data/llama-refs/<name>.json`, written by
/// `scripts/record-llama-references.py`); missing is a failure, not a skip.
pub fn reference(name: &str) -> serde_json::Value {
    let path = workspace_root()
        .join("tests/data/llama-refs")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reference file {} is required (scripts/record-llama-references.py {name}): {e}",
            path.display()
        )
    });
    serde_json::from_str(&text).expect("reference JSON")
}
