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

/// The golden completions through the command a user runs:
/// `kvwarden generate --prompt-tokens ... --max-tokens 32 --temperature 0 --json`.
#[test]
fn generate_reproduces_llama_cpp_greedy_tokens() {
    let model = model();
    let model = model.to_string_lossy();
    // llama.cpp's recorded output, kept in the repository (see tests/data/golden/README.md).
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/golden/completions.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("golden file {} is required: {e}", path.display()));
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    let cases = golden["cases"].as_array().cloned().unwrap_or_default();
    assert!(!cases.is_empty());
    for case in cases {
        let ids = |key: &str| -> Vec<u64> {
            case[key]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
                .unwrap_or_default()
        };
        let prompt: Vec<String> = ids("prompt_tokens").iter().map(u64::to_string).collect();
        let want = ids("completion_tokens");
        // The prefix whose llama.cpp top-2 margins are all at least 0.6 nats: the margin an
        // exact attention needs (model's tests/llama_references.rs says why).
        let decisive = case["top2_margin"]
            .as_array()
            .expect("top2_margin")
            .iter()
            .take_while(|m| m.as_f64().expect("margin") >= 0.6)
            .count();
        let (code, stdout, stderr) = kvwarden(&[
            "--threads",
            "2",
            "generate",
            "--model",
            &model,
            "--prompt-tokens",
            &prompt.join(","),
            "--max-tokens",
            "32",
            "--temperature",
            "0",
            "--json",
        ]);
        assert_eq!(code, Some(0), "{stderr}");
        let out: serde_json::Value =
            serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
        let got: Vec<u64> = out["tokens"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default();
        let n = decisive.min(want.len());
        assert!(
            got.len() >= n && got[..n] == want[..n],
            "{}: want {:?}, got {:?}",
            case["prompt"],
            &want[..n],
            got
        );
        assert_eq!(
            out["text"].as_str().map(str::is_empty),
            Some(got.is_empty())
        );
    }
}

/// A memory budget is turned into whole pages, and the promise is checked against them.
#[test]
fn serve_checks_the_context_against_a_memory_budget() {
    let model = model();
    let model = model.to_string_lossy();
    // 64 MiB holds 182 pages of 16 tokens (368,640 bytes each in f16): 2,912 tokens.
    let (code, _, stderr) = kvwarden(&[
        "serve",
        "--model",
        &model,
        "--port",
        "0",
        "--kv-pool-mib",
        "64",
        "--max-context",
        "4096",
    ]);
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {stderr}");
    assert!(
        stderr.contains("4096") && stderr.contains("2912"),
        "{stderr}"
    );
}

/// `synth-model --arch` writes a file of each architecture that `generate` loads and runs;
/// an unknown architecture or a weight type that does not fit the shape is refused.
#[test]
fn synth_model_writes_every_architecture() {
    let dir = std::env::temp_dir().join(format!("kvwarden-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (arch, ty) in [
        ("llama", "q4_1"),
        ("llama3", "q8_0"),
        ("qwen2", "q5_0"),
        ("qwen3", "q4_k"),
        ("gemma3", "q6_k"),
    ] {
        let path = dir.join(format!("{arch}.gguf"));
        let path = path.to_string_lossy();
        let (code, _, stderr) = kvwarden(&[
            "synth-model",
            "--arch",
            arch,
            "--weight-type",
            ty,
            "--dim",
            "256",
            "--heads",
            "4",
            "--ffn",
            "512",
            "-o",
            &path,
        ]);
        assert_eq!(code, Some(0), "{arch}: {stderr}");
        let (code, stdout, stderr) = kvwarden(&[
            "generate",
            "--model",
            &path,
            "--prompt",
            "Hi",
            "--max-tokens",
            "3",
            "--json",
        ]);
        assert_eq!(code, Some(0), "{arch}: {stderr}");
        assert!(stdout.contains("\"tokens\""), "{arch}: {stdout}");
    }
    let out = dir.join("x.gguf");
    let out = out.to_string_lossy();
    let (code, _, stderr) = kvwarden(&["synth-model", "--arch", "gemma4", "-o", &out]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains("\"gemma4\""), "{stderr}");
    let (code, _, stderr) = kvwarden(&["synth-model", "--weight-type", "q6_k", "-o", &out]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains("256"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_or_unavailable_kernel_path_is_refused_at_start() {
    for (value, want) in [
        ("bogus", "is not a kernel path"),
        ("AVX2 ", "is not a kernel path"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvwarden"))
            .args(["tokenize", "--text", "hi"])
            .env("KVWARDEN_CPU", value)
            .output()
            .expect("run kvwarden");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{value:?}: {stderr}");
        assert!(stderr.contains(want), "{value:?}: {stderr}");
    }
    // The AMX path where the CPU has AMX-INT8 (and Linux, which lists it, grants the tile
    // state), refused where not.
    let amx = std::fs::read_to_string("/proc/cpuinfo")
        .is_ok_and(|info| info.split_whitespace().any(|flag| flag == "amx_int8"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvwarden"))
        .args(["tokenize", "--text", "hi"])
        .env("KVWARDEN_CPU", "amx")
        .output()
        .expect("run kvwarden");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if amx {
        assert!(!stderr.contains("KVWARDEN_CPU"), "{stderr}");
    } else {
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("cannot run"), "{stderr}");
    }
    // The portable path runs on every CPU, so it is always accepted.
    let out = Command::new(env!("CARGO_BIN_EXE_kvwarden"))
        .args([
            "tokenize",
            "--model",
            model().to_str().expect("path"),
            "--text",
            "hi",
        ])
        .env("KVWARDEN_CPU", "portable")
        .output()
        .expect("run kvwarden");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
