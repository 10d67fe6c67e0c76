//! The forward pass against llama.cpp's greedy output on the default model: greedy tokens
//! equal over each case's prefix whose llama.cpp top-2 margins are all at least
//! [`GREEDY_MARGIN`] (the files' own `decisive_prefix` uses 0.05 nats, which held while the
//! attention was llama.cpp's bit for bit; `tests/llama_references.rs` says why the margin is
//! now the one an exact attention needs).
mod common;

/// Nats; the real files' greedy margin in `tests/llama_references.rs`.
const GREEDY_MARGIN: f64 = 0.6;

use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::{sampling::argmax, BatchItem, LogitsWanted, Model};

#[test]
fn greedy_tokens_match_llama_cpp_over_decisive_prefix() {
    check_cases(&common::golden("completions.json"));
}

/// More prompts of the same kind (plain and chat-formatted), recorded from llama.cpp with the
/// settings of the shared goldens (see tests/data/README.md).
#[test]
fn held_out_prompts_match_llama_cpp_over_decisive_prefix() {
    let path = common::workspace_root().join("crates/model/tests/data/heldout_completions.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    check_cases(&serde_json::from_str(&text).unwrap());
}

fn check_cases(golden: &serde_json::Value) {
    let file = gguf::GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(16, KvDtype::F16),
        pages: 64,
        scrub: ScrubPolicy::Poison,
    });
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    let mut failures = Vec::new();
    let mut compared = 0;
    for (ci, case) in cases.iter().enumerate() {
        let prompt: Vec<u32> = case["prompt_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let want: Vec<u32> = case["completion_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let decisive = case["top2_margin"]
            .as_array()
            .expect("top2_margin")
            .iter()
            .take_while(|m| m.as_f64().expect("margin") >= GREEDY_MARGIN)
            .count();
        compared += decisive.min(want.len());
        let mut seq = SequenceKv::new(
            &pool,
            Owner {
                request: RequestId(ci as u64),
                domain: IsolationDomain::tenant("t"),
            },
        );
        seq.reserve(prompt.len() + want.len()).unwrap();
        let mut got = Vec::new();
        let mut input = prompt.clone();
        for _ in 0..want.len() {
            let mut items = [BatchItem {
                kv: &mut seq,
                tokens: &input,
                logits: LogitsWanted::Last,
                adapter: None,
            }];
            let logits = model.forward(&mut items).pop().unwrap().unwrap();
            let next = argmax(&logits);
            got.push(next);
            if next == 2 {
                break;
            }
            input = vec![next];
        }
        let n = decisive.min(want.len());
        if got.len() < n || got[..n] != want[..n] {
            failures.push(format!(
                "case {ci} {:?}: want {:?}, got {:?} (decisive {decisive})",
                case["prompt"],
                &want[..n],
                &got[..n.min(got.len())]
            ));
        }
        eprintln!(
            "case {ci}: matched {} of 32 (decisive {decisive})",
            got.iter().zip(&want).take_while(|(a, b)| a == b).count()
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(compared >= 20, "only {compared} tokens compared");
}
