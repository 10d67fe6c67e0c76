//! Single-stream throughput on the default model (or `BENCH_MODEL`), in llama-bench's terms: prompt processing
//! of N tokens (pp) and generation of M tokens (tg). `bench/serve.py` runs it next to
//! llama.cpp's `llama-bench` on the same file and reports the ratios.
use std::time::Instant;

use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::{sampling::argmax, BatchItem, LogitsWanted, Model};

fn main() {
    let arg = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (np, ng) = (arg("BENCH_PP", 512), arg("BENCH_TG", 128));
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    // BENCH_MODEL compares another GGUF file (e.g. a K-quant) with llama-bench on the same.
    let path = std::env::var_os("BENCH_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let file = gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-model.sh)", path.display()));
    let model = Model::load(&file).expect("model");
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(16, KvDtype::F16),
        pages: (np + ng) / 16 + 2,
        scrub: ScrubPolicy::Zero,
    });
    let mut best = (0f64, 0f64);
    for rep in 0..3 {
        let mut seq = SequenceKv::new(
            &pool,
            Owner {
                request: RequestId(rep),
                domain: IsolationDomain::tenant("bench"),
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
        let pp = np as f64 / t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for _ in 0..ng {
            let input = [argmax(&logits)];
            let mut items = [BatchItem {
                kv: &mut seq,
                tokens: &input,
                logits: LogitsWanted::Last,
            }];
            logits = model.forward(&mut items).pop().unwrap().unwrap();
        }
        let tg = ng as f64 / t1.elapsed().as_secs_f64();
        best = (best.0.max(pp), best.1.max(tg));
    }
    println!("kvwarden pp{np}={:.1} tg{ng}={:.1}", best.0, best.1);
}
