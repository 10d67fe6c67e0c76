//! The engine's invariants over a synthetic model of every supported architecture (llama
//! with Llama 3's RoPE factors, qwen2, qwen3, gemma3 with a sliding window shorter than the
//! prompts): batching, chunked prefill and preemption never
//! change a request's tokens, the prefix cache stays within a domain and reproduces the
//! uncached tokens, and every page comes back. `engine.rs` covers the plain llama model.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use engine::{
    EngineConfig, EngineHandle, Event, FinishReason, GenerateRequest, IsolationDomain,
    SamplingParams,
};
use gguf::GgmlType;
use kv::ScrubPolicy;
use model::synth::{SynthArch, SynthSpec};

const ARCHS: [SynthArch; 4] = [
    SynthArch::Llama3,
    SynthArch::Qwen2,
    SynthArch::Qwen3,
    SynthArch::Gemma3,
];

fn start(arch: SynthArch, config: EngineConfig) -> EngineHandle {
    let spec = SynthSpec {
        layers: 2,
        dim: 64,
        heads: 4,
        kv_heads: 2,
        ffn_dim: 128,
        vocab: 300,
        context: 4096,
        seed: 11,
        weight_type: GgmlType::Q4_1,
    };
    let file = gguf::GgufFile::parse(spec.build_arch(arch).unwrap().to_bytes()).unwrap();
    let model = model::Model::load(&file).unwrap();
    engine::start(model, config).unwrap()
}

fn request(domain: &str, prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        adapter: None,
        weight: 1,
        domain: IsolationDomain::tenant(domain),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        logprobs: Some(2),
        constraint: None,
    }
}

#[derive(Debug, PartialEq)]
struct Output {
    tokens: Vec<(u32, u32)>,
    finish: FinishReason,
    cached: usize,
}

fn collect(mut handle: engine::RequestHandle) -> Output {
    let mut tokens = Vec::new();
    loop {
        match handle.events.blocking_recv() {
            Some(Event::Token(t)) => tokens.push((t.id, t.logprob.unwrap().to_bits())),
            Some(Event::Finished { reason, usage }) => {
                return Output {
                    tokens,
                    finish: reason,
                    cached: usage.cached_tokens,
                }
            }
            Some(Event::Failed(e)) => panic!("request failed: {e}"),
            Some(Event::Prefilled(_)) => panic!("a client request ended as a prefill"),
            None => panic!("stream ended without a terminal event"),
        }
    }
}

fn submit(engine: &EngineHandle, req: GenerateRequest) -> engine::RequestHandle {
    engine
        .submit(engine.admission().admit(req).unwrap())
        .unwrap()
}

fn run(engine: &EngineHandle, req: GenerateRequest) -> Output {
    collect(submit(engine, req))
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 31 + seed * 17) % 250)
        .collect()
}

fn wait_for_no_leases(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.pool_counts().leased != 0 {
        assert!(
            Instant::now() < deadline,
            "pages still leased: {:?}",
            engine.pool_counts()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn batched_output_is_identical_to_solo_output_in_every_architecture() {
    for arch in ARCHS {
        let engine = start(
            arch,
            EngineConfig {
                pool_tokens: 4096,
                scrub: ScrubPolicy::Poison,
                prefix_cache: false,
                max_batch_tokens: 64,
                ..EngineConfig::default()
            },
        );
        let requests: Vec<_> = (0..10)
            .map(|i| request("t", prompt(i, 5 + 13 * i as usize), 10))
            .collect();
        let solo: Vec<Output> = requests.iter().map(|r| run(&engine, r.clone())).collect();
        let handles: Vec<_> = requests
            .iter()
            .rev()
            .map(|r| submit(&engine, r.clone()))
            .collect();
        let mut batched: Vec<Output> = handles.into_iter().map(collect).collect();
        batched.reverse();
        for (i, (a, b)) in solo.iter().zip(&batched).enumerate() {
            assert_eq!(a.tokens.len(), 10);
            assert_eq!(
                a, b,
                "{arch:?} request {i}: batched output differs from solo"
            );
        }
        wait_for_no_leases(&engine);
    }
}

#[test]
fn prefix_cache_is_scoped_and_exact_in_every_architecture() {
    for arch in ARCHS {
        let engine = start(
            arch,
            EngineConfig {
                pool_tokens: 2048,
                scrub: ScrubPolicy::Poison,
                ..EngineConfig::default()
            },
        );
        let p = prompt(3, 70);
        let first = run(&engine, request("alice", p.clone(), 8));
        assert_eq!(first.cached, 0);
        let again = run(&engine, request("alice", p.clone(), 8));
        assert_eq!(
            again.cached, 64,
            "{arch:?}: alice reuses her four full pages"
        );
        assert_eq!(
            first.tokens, again.tokens,
            "{arch:?}: cached K/V changed tokens"
        );
        let bob = run(&engine, request("bob", p, 8));
        assert_eq!(bob.cached, 0, "{arch:?}: bob must not hit alice's cache");
        assert_eq!(bob.tokens, first.tokens);
        let counts = engine.pool_counts();
        assert_eq!(counts.free + counts.leased + counts.cached, counts.total);
    }
}

#[test]
fn preemption_recomputes_to_the_same_tokens_in_every_architecture() {
    for arch in ARCHS {
        // Sixteen pages; each request grows to 144 positions (nine pages).
        let engine = start(
            arch,
            EngineConfig {
                pool_tokens: 256,
                max_context: Some(256),
                prefix_cache: false,
                scrub: ScrubPolicy::Poison,
                ..EngineConfig::default()
            },
        );
        let reqs: Vec<_> = (0..3)
            .map(|i| request("t", prompt(i + 20, 64), 80))
            .collect();
        let solo: Vec<Output> = reqs.iter().map(|r| run(&engine, r.clone())).collect();
        let handles: Vec<_> = reqs.iter().map(|r| submit(&engine, r.clone())).collect();
        let outs: Vec<Output> = handles.into_iter().map(collect).collect();
        assert_eq!(outs, solo, "{arch:?}: preemption changed the output");
        assert!(
            engine.metrics().preemptions.load(Ordering::Relaxed) > 0,
            "{arch:?}: the pool was meant to run dry"
        );
        wait_for_no_leases(&engine);
    }
}
