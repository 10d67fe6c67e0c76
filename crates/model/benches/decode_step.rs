//! Decode-step cost on the default model: one sequence and a batch of eight, each at a
//! 512-token context. Run by `bench/kv-checks.sh` twice, with the KV read checks and with
//! the benchmark-only unchecked baseline, to measure what the checks cost; and reports how
//! long scrubbing a released page takes next to a decode step.
use std::time::Instant;

use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::{sampling::argmax, BatchItem, LogitsWanted, Model};

const CONTEXT: usize = 512;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let file = gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-model.sh)", path.display()));
    let model = Model::load(&file).expect("model");
    let steps: usize = std::env::var("BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(48);
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(16, KvDtype::F16),
        pages: 9 * (CONTEXT + steps + 16) / 16,
        scrub: ScrubPolicy::None,
    });
    let mut seqs: Vec<SequenceKv> = (0..8)
        .map(|i| {
            let mut s = SequenceKv::new(
                &pool,
                Owner {
                    request: RequestId(i),
                    domain: IsolationDomain::tenant("bench"),
                },
            );
            s.reserve(CONTEXT + steps + 8).unwrap();
            s
        })
        .collect();
    let mut next = Vec::new();
    for (i, s) in seqs.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..CONTEXT as u32)
            .map(|t| 100 + (t * 37 + i as u32 * 101) % 5000)
            .collect();
        let logits = model
            .forward(&mut [BatchItem {
                kv: s,
                tokens: &prompt,
                logits: LogitsWanted::Last,
                adapter: None,
            }])
            .pop()
            .unwrap()
            .unwrap();
        next.push(argmax(&logits));
    }

    let mut single = Vec::new();
    for _ in 0..steps / 2 {
        let tok = [next[0]];
        let t = Instant::now();
        let logits = model
            .forward(&mut [BatchItem {
                kv: &mut seqs[0],
                tokens: &tok,
                logits: LogitsWanted::Last,
                adapter: None,
            }])
            .pop()
            .unwrap()
            .unwrap();
        single.push(t.elapsed().as_secs_f64() * 1e3);
        next[0] = argmax(&logits);
    }
    let mut batch = Vec::new();
    for _ in 0..steps / 2 {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let t = Instant::now();
        let mut items: Vec<BatchItem<'_>> = seqs
            .iter_mut()
            .zip(&toks)
            .map(|(s, tok)| BatchItem {
                kv: s,
                tokens: tok,
                logits: LogitsWanted::Last,
                adapter: None,
            })
            .collect();
        let out = model.forward(&mut items);
        batch.push(t.elapsed().as_secs_f64() * 1e3);
        for (n, l) in next.iter_mut().zip(out) {
            *n = argmax(&l.unwrap());
        }
    }
    // The read path alone, where the checks live: one decode step's worth of `runs` calls
    // (every layer of every sequence in the batch of eight), repeated to be measurable.
    let reps = 2000;
    let t = Instant::now();
    let mut pages = 0usize;
    for _ in 0..reps {
        for s in &seqs {
            for layer in 0..model.config.n_layers {
                pages += s.runs(layer, s.len()).map(|r| r.len()).unwrap_or(0);
            }
        }
    }
    let runs_ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
    assert!(pages > 0);
    let checks = if kv::CHECKS_ENABLED { "on" } else { "off" };
    println!(
        "kv_checks={checks} decode_step_ms single={:.3} batch8={:.3} reads_per_batch8_step_ms={runs_ms:.5}",
        median(single),
        median(batch)
    );

    // Scrubbing: the cost of zeroing one released page, next to one decode step.
    let layout = model.kv_layout(16, KvDtype::F16);
    let scrub_pool = KvPool::new(PoolConfig {
        layout,
        pages: 64,
        scrub: ScrubPolicy::Zero,
    });
    let t = Instant::now();
    for _ in 0..20 {
        drop(scrub_pool.allocate(RequestId(1), 64).unwrap());
    }
    let per_page_ms = t.elapsed().as_secs_f64() * 1e3 / (20.0 * 64.0);
    println!(
        "scrub_zero_ms_per_page={per_page_ms:.4} page_bytes={}",
        layout.page_bytes()
    );
}
