//! kvwarden's model against llama.cpp on real GGUF files: for each file, the prompts that
//! `scripts/record-llama-references.py` gave llama.cpp's server (as token ids), replayed with
//! llama.cpp's greedy tokens fed back step by step, and compared on
//!
//! (a) every top-n log-probability llama.cpp reported (ours: log_softmax of our logits at the
//!     same ids), within the tolerances below (absolute, and measured from the step's top-1,
//!     which cancels the normalization);
//! (b) the greedy token, over the decisive prefix: up to the first step whose llama.cpp top-2
//!     margin is under 0.05 nats (two correct implementations may pick differently after a
//!     near-tie; before it, a different token is a bug).
//!
//! The references live in `tests/data/llama-refs/<file>.json` (committed, with their
//! provenance); the files in `models/` are made by the scripts the references name
//! (`scripts/fetch-quant-models.sh`, which `scripts/test.sh` runs first). A missing file fails.
//!
//! Adding a file: one `reference_test!` line below, after one line in the recording script.
mod common;

use std::collections::BTreeMap;

use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::sampling::{argmax, log_softmax};
use model::{BatchItem, LogitsWanted, Model};
use serde_json::Value;

/// Below this top-2 margin (nats) at a step, greedy tokens are no longer compared.
const DECISIVE_MARGIN: f32 = 0.05;

/// Tolerances of one file, in nats, over every id llama.cpp reported at every step.
struct Tolerance {
    /// |our logprob − llama.cpp's|.
    abs: f32,
    /// The same, each measured from its step's top-1 logprob (the logits' own difference).
    rel: f32,
}

/// Every kernel reproduces llama.cpp's arithmetic (its AVX2 float order, `model::quant`,
/// `model::quant::low_kquants`): the logits are llama.cpp's to the last bit, so the relative error
/// is the 1e-6 rounding of the recorded values (measured: 1.9e-6), and the absolute one adds
/// llama.cpp's f32 normalization over the vocabulary (measured: up to 3.2e-4).
const EXACT: Tolerance = Tolerance {
    abs: 1e-3,
    rel: 1e-5,
};

/// Decode steps where llama.cpp itself computed attention differently. Its CPU flash
/// attention splits a single query's keys into one chunk per thread, and merges the chunks'
/// partial softmax sums, once its KV view (used cells padded to 256) reaches 512
/// (`use_split_kv_path` in ggml-cpu `ops.cpp`); that sum's order depends on its thread count,
/// not on the model, so no batch-invariant engine reproduces it. kvwarden keeps the
/// one-pass order it uses below that length. Only the synthetic files' longest prompt
/// (444 byte-level tokens) gets there; on those steps the measured drift is up to 0.085
/// nats (0.12 from the top-1), and every other step of every file is exact.
const LLAMA_SPLIT_KV: Tolerance = Tolerance {
    abs: 0.15,
    rel: 0.2,
};

/// Whether llama.cpp's step `step` of a case with a `prompt`-token prompt ran its split-KV
/// decode: a single new token, with more than 256 cells used (so a padded view of 512).
fn llama_split_kv(prompt: usize, step: usize) -> bool {
    step >= 1 && prompt + step > 256
}

/// One test per file: `(test name, file name under models/ without .gguf, tolerance)`.
macro_rules! reference_test {
    ($test:ident, $file:literal, $tol:expr) => {
        #[test]
        fn $test() {
            check_file($file, &$tol);
        }
    };
}

// Found with these references: with the same products summed in another float order
// (kvwarden's kernels before they took llama.cpp's), a file that differed from the Q8_0 one
// only in `blk.0.ffn_down` moved by up to 0.4 nats against llama.cpp on "Once upon a time,
// ..." from its fifth token on, enough to change greedy tokens at margins of 0.17 nats; so
// for this model nothing short of llama.cpp's order passes at the 0.05-nat decisive margin.
reference_test!(default_q4_1, "SmolLM2-135M-Instruct.Q4_1", EXACT);
reference_test!(requantized_q8_0, "SmolLM2-135M-Instruct.Q8_0", EXACT);
reference_test!(requantized_q6_k, "SmolLM2-135M-Instruct.Q6_K", EXACT);
reference_test!(requantized_q5_k_m, "SmolLM2-135M-Instruct.Q5_K_M", EXACT);
reference_test!(requantized_q4_k_m, "SmolLM2-135M-Instruct.Q4_K_M", EXACT);
reference_test!(requantized_q3_k_m, "SmolLM2-135M-Instruct.Q3_K_M", EXACT);
reference_test!(requantized_q2_k, "SmolLM2-135M-Instruct.Q2_K", EXACT);
reference_test!(
    requantized_q2_k_pure,
    "SmolLM2-135M-Instruct.Q2_K-pure",
    EXACT
);
reference_test!(gemma3_270m_q4_k_m, "gemma-3-270m-q4_k_m", EXACT);
// Random weights (scripts/make-synthetic-models.sh): the architectures no small real file
// exists for (qwen2's QKV biases, qwen3's Q/K norms, Llama 3's RoPE frequency factors), as
// exact as the real files except where llama.cpp switched its own attention
// ([`LLAMA_SPLIT_KV`]).
reference_test!(synthetic_qwen2_q4_k, "synth-qwen2-q4_k", EXACT);
reference_test!(synthetic_qwen3_q6_k, "synth-qwen3-q6_k", EXACT);
reference_test!(synthetic_llama3_q5_k, "synth-llama3-q5_k", EXACT);

/// What one file's replay found.
#[derive(Default)]
struct Report {
    steps: usize,
    logprobs: usize,
    max_err: f32,
    worst: String,
    /// The largest error of a logprob measured from its step's top-1 logprob.
    max_rel_err: f32,
    worst_rel: String,
    decisive_steps: usize,
    greedy_failures: Vec<String>,
    /// The same over llama.cpp's split-KV decode steps, kept apart.
    split_kv_steps: usize,
    split_kv_max_err: f32,
    split_kv_max_rel_err: f32,
}

fn check_file(name: &str, tol: &Tolerance) {
    let refs = common::reference(name);
    let meta = &refs["meta"];
    let fetch = meta["model"].as_str().unwrap_or("its fetch script");
    let path = common::workspace_root().join(format!("models/{name}.gguf"));
    assert!(
        path.is_file(),
        "{} is missing: the references were recorded on {fetch}; run that script \
         (scripts/test.sh runs scripts/fetch-quant-models.sh before the tests)",
        path.display()
    );
    let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    assert_eq!(
        Some(bytes),
        meta["bytes"].as_u64(),
        "{} is not the file the references were recorded on ({fetch}, sha256 {}): re-run \
         that script, or re-record with scripts/record-llama-references.py",
        path.display(),
        meta["sha256"]
    );
    let file = gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut types = BTreeMap::new();
    for t in file.tensors() {
        *types.entry(format!("{:?}", t.ty)).or_insert(0u64) += 1;
    }
    let want_types: BTreeMap<String, u64> = meta["tensor_types"]
        .as_object()
        .expect("tensor_types")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().expect("count")))
        .collect();
    assert_eq!(
        types, want_types,
        "{name}: tensor types differ from the recording"
    );

    let model = Model::load(&file).unwrap_or_else(|e| panic!("{name}: {e}"));
    let report = replay(&model, &refs);
    eprintln!(
        "{name}: {} cases, {} steps, {} logprobs; max |logprob error| {:.2e} ({}), from the \
         top-1 {:.2e} ({}); greedy equal over {} decisive steps; {} steps where llama.cpp \
         split the KV: max error {:.2e}, from the top-1 {:.2e}",
        refs["cases"].as_array().map_or(0, Vec::len),
        report.steps,
        report.logprobs,
        report.max_err,
        report.worst,
        report.max_rel_err,
        report.worst_rel,
        report.decisive_steps,
        report.split_kv_steps,
        report.split_kv_max_err,
        report.split_kv_max_rel_err
    );
    assert!(
        report.greedy_failures.is_empty(),
        "{name}: greedy token differs inside the decisive prefix:\n{}",
        report.greedy_failures.join("\n")
    );
    assert!(
        report.max_err <= tol.abs && report.max_rel_err <= tol.rel,
        "{name}: max |logprob error| {:.2e} ({}), from the top-1 {:.2e} ({}); tolerances \
         {:.0e} and {:.0e}",
        report.max_err,
        report.worst,
        report.max_rel_err,
        report.worst_rel,
        tol.abs,
        tol.rel
    );
    assert!(
        report.split_kv_max_err <= LLAMA_SPLIT_KV.abs
            && report.split_kv_max_rel_err <= LLAMA_SPLIT_KV.rel,
        "{name}: on llama.cpp's split-KV steps, max |logprob error| {:.2e}, from the top-1 \
         {:.2e}; tolerances {:.0e} and {:.0e}",
        report.split_kv_max_err,
        report.split_kv_max_rel_err,
        LLAMA_SPLIT_KV.abs,
        LLAMA_SPLIT_KV.rel
    );
    // The comparison compared something.
    assert!(
        report.steps >= 20 && report.logprobs >= 200,
        "{name}: too few steps compared"
    );
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token id list")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("token id")).expect("token id"))
        .collect()
}

fn replay(model: &Model, refs: &Value) -> Report {
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(16, KvDtype::F16),
        pages: 64,
        scrub: ScrubPolicy::Poison,
    });
    let mut report = Report::default();
    let cases = refs["cases"].as_array().expect("cases");
    for (ci, case) in cases.iter().enumerate() {
        let prompt = ids(&case["prompt_tokens"]);
        let steps = case["steps"].as_array().expect("steps");
        let mut seq = SequenceKv::new(
            &pool,
            Owner {
                request: RequestId(ci as u64),
                domain: IsolationDomain::tenant("refs"),
            },
        );
        seq.reserve(prompt.len() + steps.len())
            .expect("pool holds the case");
        let prompt_len = prompt.len();
        let mut input = prompt;
        let mut decisive = true;
        for (si, step) in steps.iter().enumerate() {
            let mut items = [BatchItem {
                kv: &mut seq,
                tokens: &input,
                logits: LogitsWanted::Last,
            }];
            let logits = model
                .forward(&mut items)
                .pop()
                .expect("one item")
                .expect("forward");
            let ours = log_softmax(&logits);
            let want = step["token"].as_u64().expect("token") as u32;
            let top: Vec<(usize, f32)> = step["top"]
                .as_array()
                .expect("top")
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().expect("id") as usize,
                        p[1].as_f64().expect("logprob") as f32,
                    )
                })
                .collect();
            // llama.cpp normalizes in f32 over the whole vocabulary, which shifts all of a
            // step's logprobs by the same ~1e-4; measured against the step's top-1 that
            // shift cancels and what remains is the difference of the logits themselves.
            let (top1, top1_lp) = top[0];
            let split_kv = llama_split_kv(prompt_len, si);
            for &(id, lp) in &top {
                let err = (ours[id] - lp).abs();
                let rel = ((ours[id] - ours[top1]) - (lp - top1_lp)).abs();
                if split_kv {
                    report.split_kv_max_err = report.split_kv_max_err.max(err);
                    report.split_kv_max_rel_err = report.split_kv_max_rel_err.max(rel);
                    continue;
                }
                if err > report.max_err {
                    report.max_err = err;
                    report.worst = format!("case {ci} step {si} id {id}: {} vs {lp}", ours[id]);
                }
                if rel > report.max_rel_err {
                    report.max_rel_err = rel;
                    report.worst_rel = format!("case {ci} step {si} id {id}");
                }
                report.logprobs += 1;
            }
            if split_kv {
                report.split_kv_steps += 1;
            } else {
                report.steps += 1;
            }
            if std::env::var_os("KVWARDEN_REFS_VERBOSE").is_some() {
                let e = top
                    .iter()
                    .map(|&(id, lp)| (ours[id] - lp).abs())
                    .fold(0f32, f32::max);
                eprintln!("case {ci} step {si}: max |logprob error| {e:.2e}");
            }
            decisive &= top.len() >= 2 && top[0].1 - top[1].1 >= DECISIVE_MARGIN;
            if decisive {
                report.decisive_steps += 1;
                let got = argmax(&logits);
                if got != want {
                    report.greedy_failures.push(format!(
                        "case {ci} step {si}: llama.cpp {want}, kvwarden {got} ({:?})",
                        case["prompt"]
                    ));
                    decisive = false;
                }
            }
            // llama.cpp's token goes in next, so every step compares the same context.
            input = vec![want];
        }
    }
    report
}
