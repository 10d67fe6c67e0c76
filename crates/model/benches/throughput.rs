//! Rough throughput check: prefill of N tokens, then greedy decode of M tokens, one sequence.
use std::time::Instant;

use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::{sampling::argmax, BatchItem, LogitsWanted, Model};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let (np, ng) = (
        args.first().copied().unwrap_or(512),
        args.get(1).copied().unwrap_or(128),
    );
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let file = gguf::GgufFile::open(root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let model = Model::load(&file).unwrap();
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(16, KvDtype::F16),
        pages: (np + ng) / 16 + 2,
        scrub: ScrubPolicy::Zero,
    });
    let mut seq = SequenceKv::new(
        &pool,
        Owner {
            request: RequestId(1),
            domain: IsolationDomain::tenant("t"),
        },
    );
    seq.reserve(np + ng).unwrap();
    let prompt: Vec<u32> = (0..np as u32).map(|i| 100 + (i * 37) % 5000).collect();
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(512) {
        let mut items = [BatchItem {
            kv: &mut seq,
            tokens: chunk,
            logits: LogitsWanted::Last,
        }];
        logits = model.forward(&mut items).pop().unwrap().unwrap();
    }
    let pp = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..ng {
        let input = vec![argmax(&logits)];
        let mut items = [BatchItem {
            kv: &mut seq,
            tokens: &input,
            logits: LogitsWanted::Last,
        }];
        logits = model.forward(&mut items).pop().unwrap().unwrap();
    }
    let tg = t1.elapsed().as_secs_f64();
    println!(
        "pp{np}: {:.1} tok/s   tg{ng}: {:.1} tok/s",
        np as f64 / pp,
        ng as f64 / tg
    );
}
