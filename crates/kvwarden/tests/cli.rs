//! The binary's refusals, run as a user would. (Building this test also makes `cargo test`
//! build `target/debug/kvwarden`, which the end-to-end suite in tests/python drives.)

use std::path::PathBuf;
use std::process::Command;

fn model() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model.sh",
        path.display()
    );
    path
}

fn kvwarden(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvwarden"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run kvwarden: {e}"));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn serve_refuses_a_context_the_pool_cannot_hold() {
    let model = model();
    let model = model.to_string_lossy();
    let (code, _, stderr) = kvwarden(&[
        "serve",
        "--model",
        &model,
        "--port",
        "0",
        "--max-context",
        "8192",
        "--kv-pool-tokens",
        "4096",
    ]);
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {stderr}");
    assert!(
        stderr.contains("8192") && stderr.contains("4096"),
        "{stderr}"
    );
    assert!(!stderr.contains("listening"), "{stderr}");
}

#[test]
fn serve_refuses_a_malformed_key_file() {
    let dir = std::env::temp_dir().join(format!("kvwarden-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let keys = dir.join("keys");
    std::fs::write(&keys, "# tenants\nkey-only\n").unwrap_or_else(|e| panic!("{e}"));
    let (code, _, stderr) = kvwarden(&[
        "serve",
        "--port",
        "0",
        "--api-keys",
        &keys.to_string_lossy(),
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {stderr}");
    assert!(stderr.contains("line 2"), "{stderr}");
}

#[test]
fn tokenize_prints_llama_cpp_ids() {
    let model = model();
    let (code, stdout, stderr) = kvwarden(&[
        "tokenize",
        "--model",
        &model.to_string_lossy(),
        "--text",
        "Hello world",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout.trim(), r#"{"tokens":[19556,905]}"#);
}
