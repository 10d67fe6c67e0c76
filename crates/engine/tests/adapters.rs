//! LoRA adapters in the engine: rows under different adapters (and none) share a batch
//! and each gets exactly its tokens alone; an adapter's K/V is cached for that adapter
//! only; an engine refuses an adapter it holds no weights for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{
    AdapterRef, EngineConfig, EngineHandle, Event, GenerateRequest, IsolationDomain, Rejection,
    SamplingParams,
};
use gguf::GgmlType;
use model::lora::{LoraAdapter, LoraPair, Target};
use model::synth::SynthSpec;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

fn pair(seed: &mut u64, rank: usize, n_in: usize, n_out: usize) -> LoraPair {
    let a = (0..rank * n_in)
        .map(|_| lcg(seed) / (n_in as f32).sqrt())
        .collect();
    let b = (0..n_out * rank)
        .map(|_| lcg(seed) / (rank as f32).sqrt())
        .collect();
    LoraPair {
        rank,
        n_in,
        n_out,
        a,
        b,
        factor: 2.0,
    }
}

/// A deterministic random adapter on every weight of every layer of `model`.
fn adapter(model: &model::Model, seed: u64) -> Arc<LoraAdapter> {
    let c = &model.config;
    let mut s = seed;
    let layers = (0..c.n_layers)
        .map(|_| {
            Target::ALL.map(|t| {
                let (n_in, n_out) = match t {
                    Target::Q => (c.dim, c.q_dim()),
                    Target::K | Target::V => (c.dim, c.kv_dim()),
                    Target::O => (c.q_dim(), c.dim),
                    Target::Gate | Target::Up => (c.dim, c.ffn_dim),
                    Target::Down => (c.ffn_dim, c.dim),
                };
                Some(pair(&mut s, 8, n_in, n_out))
            })
        })
        .collect();
    Arc::new(LoraAdapter::from_pairs(layers, None, 1.0, 0.0, u128::from(seed)).unwrap())
}

fn request(adapter: Option<&AdapterRef>, prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        adapter: adapter.cloned(),
        weight: 1,
        domain: IsolationDomain::tenant("alice"),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        logprobs: Some(1),
        constraint: None,
    }
}

#[derive(Debug, PartialEq, Clone)]
struct Output {
    tokens: Vec<(u32, u32)>,
    cached: usize,
}

fn submit(engine: &EngineHandle, req: GenerateRequest) -> engine::RequestHandle {
    engine
        .submit(engine.admission().admit(req).unwrap())
        .unwrap()
}

fn collect(mut handle: engine::RequestHandle) -> Output {
    let mut tokens = Vec::new();
    loop {
        match handle.events.blocking_recv() {
            Some(Event::Token(t)) => tokens.push((t.id, t.logprob.unwrap().to_bits())),
            Some(Event::Finished { usage, .. }) => {
                return Output {
                    tokens,
                    cached: usage.cached_tokens,
                }
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 31 + seed * 17) % 250)
        .collect()
}

fn wait_for_no_leases(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.pool_counts().leased != 0 {
        assert!(Instant::now() < deadline, "{:?}", engine.pool_counts());
        std::thread::sleep(Duration::from_millis(5));
    }
}

struct Setup {
    engine: EngineHandle,
    a: AdapterRef,
    b: AdapterRef,
}

fn setup(prefix_cache: bool) -> Setup {
    let model = SynthSpec::small(7, GgmlType::Q4_1, 4096).load().unwrap();
    let a = AdapterRef::local("a", adapter(&model, 1));
    let b = AdapterRef::local("b", adapter(&model, 2));
    let engine = engine::start(
        model,
        EngineConfig {
            pool_tokens: 4096,
            max_batch_tokens: 48,
            prefix_cache,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    Setup { engine, a, b }
}

#[test]
fn mixed_batches_give_each_adapter_its_own_tokens_bit_for_bit() {
    let Setup { engine, a, b } = setup(false);
    let choices = [None, Some(&a), Some(&b)];
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(i, 20 + 13 * i as usize)).collect();
    let alone: Vec<Vec<Output>> = prompts
        .iter()
        .map(|p| {
            choices
                .iter()
                .map(|c| collect(submit(&engine, request(*c, p.clone(), 12))))
                .collect()
        })
        .collect();
    for (i, outs) in alone.iter().enumerate() {
        assert_ne!(
            outs[0].tokens, outs[1].tokens,
            "prompt {i}: adapter a = base"
        );
        assert_ne!(
            outs[0].tokens, outs[2].tokens,
            "prompt {i}: adapter b = base"
        );
        assert_ne!(outs[1].tokens, outs[2].tokens, "prompt {i}: a = b");
    }
    // Everything at once, so prompts of every adapter share steps with each other's
    // decode rows.
    let handles: Vec<Vec<engine::RequestHandle>> = prompts
        .iter()
        .map(|p| {
            choices
                .iter()
                .map(|c| submit(&engine, request(*c, p.clone(), 12)))
                .collect()
        })
        .collect();
    for (i, hs) in handles.into_iter().enumerate() {
        for (j, h) in hs.into_iter().enumerate() {
            assert_eq!(
                collect(h),
                alone[i][j],
                "prompt {i}, choice {j}: batched != alone"
            );
        }
    }
    wait_for_no_leases(&engine);
}

#[test]
fn an_adapters_prefix_is_cached_for_that_adapter_alone() {
    let Setup { engine, a, b } = setup(true);
    let p = prompt(9, 200);
    let first = collect(submit(&engine, request(Some(&a), p.clone(), 4)));
    assert_eq!(first.cached, 0);
    let again = collect(submit(&engine, request(Some(&a), p.clone(), 4)));
    assert!(again.cached > 0, "the adapter's own prefix is reused");
    assert_eq!(again.tokens, first.tokens);
    let under_b = collect(submit(&engine, request(Some(&b), p.clone(), 4)));
    assert_eq!(under_b.cached, 0, "adapter b read adapter a's K/V");
    let base = collect(submit(&engine, request(None, p.clone(), 4)));
    assert_eq!(base.cached, 0, "the base model read adapter a's K/V");
    let base_again = collect(submit(&engine, request(None, p, 4)));
    assert!(base_again.cached > 0);
    assert_eq!(base_again.tokens, base.tokens);
    wait_for_no_leases(&engine);
}

#[test]
fn admission_names_the_adapter_in_the_domain_and_refuses_references_without_weights() {
    let Setup { engine, a, .. } = setup(false);
    let admitted = engine
        .admission()
        .admit(request(Some(&a), prompt(1, 8), 4))
        .unwrap();
    assert_eq!(admitted.request().domain.adapter(), Some(a.fingerprint()));
    let plain = engine
        .admission()
        .admit(request(None, prompt(1, 8), 4))
        .unwrap();
    assert_eq!(plain.request().domain.adapter(), None);
    let remote = AdapterRef::remote("a", a.fingerprint(), a.file_checksum());
    let refused = engine
        .admission()
        .admit(request(Some(&remote), prompt(1, 8), 4))
        .unwrap_err();
    assert_eq!(
        refused,
        Rejection::AdapterNotLoaded {
            name: "a".to_string()
        }
    );
}
