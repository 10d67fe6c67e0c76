//! Single-stream throughput on the default model (or `BENCH_MODEL`), in llama-bench's terms:
//! prompt processing of N tokens (pp) and generation of M tokens (tg), one token per step
//! from an empty context as llama-bench measures it (or after `BENCH_DEPTH` positions, its
//! `-d`). `bench/serve.py` and `bench/quants.sh` run it next to llama.cpp's `llama-bench` on
//! the same file.
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
    let (np, ng, depth, batch) = (
        arg("BENCH_PP", 512),
        arg("BENCH_TG", 128),
        arg("BENCH_DEPTH", 0),
        arg("BENCH_BATCH", 1),
    );
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    // BENCH_MODEL: another file under models/ (bench/quants.sh measures the K-quant ones).
    let name =
        std::env::var("BENCH_MODEL").unwrap_or_else(|_| "SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let path = root.join("models").join(name);
    // BENCH_NO_MMAP: the file read into the process's memory, as `serve --no-mmap`.
    let load = if std::env::var_os("BENCH_NO_MMAP").is_some() {
        gguf::Load::Read
    } else {
        gguf::Load::Map
    };
    let file = gguf::GgufFile::open_with(&path, load).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run scripts/fetch-model.sh or scripts/fetch-quant-models.sh)",
            path.display()
        )
    });
    let model = Model::load(&file).expect("model");
    // BENCH_KV: the K/V element type, as `serve --kv-dtype` names it (llama-bench's -ctk/-ctv).
    let kv_name = std::env::var("BENCH_KV").unwrap_or_else(|_| "f16".into());
    let dtype = KvDtype::from_name(&kv_name)
        .unwrap_or_else(|| panic!("BENCH_KV={kv_name}: not one of f16, f32, q8_0, q4_0"));
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(16, dtype),
        pages: (np.max(depth + ng)).max(batch * (ng + 16)) / 16 + 2 * batch + 2,
        scrub: ScrubPolicy::Zero,
    });
    let mut best = (0f64, 0f64, 0f64);
    for rep in 0..3 {
        let owner = |id: u64| Owner {
            request: RequestId(id),
            domain: IsolationDomain::tenant("bench"),
        };
        let mut seq = SequenceKv::new(&pool, owner(2 * rep));
        seq.reserve(np).unwrap();
        let prompt: Vec<u32> = (0..np as u32).map(|i| 100 + (i * 37) % 5000).collect();
        let t0 = Instant::now();
        for chunk in prompt.chunks(512) {
            let mut items = [BatchItem {
                kv: &mut seq,
                tokens: chunk,
                logits: LogitsWanted::Last,
                adapter: None,
            }];
            model.forward(&mut items).pop().unwrap().unwrap();
        }
        let pp = np as f64 / t0.elapsed().as_secs_f64();
        drop(seq);
        // Generation as llama-bench measures it: one token per step from an empty context
        // (BENCH_DEPTH positions first, as its `-d`).
        let mut seq = SequenceKv::new(&pool, owner(2 * rep + 1));
        seq.reserve(depth + ng).unwrap();
        let mut logits = Vec::new();
        let context: Vec<u32> = (0..depth as u32).map(|i| 100 + (i * 53) % 5000).collect();
        for chunk in context.chunks(512) {
            let mut items = [BatchItem {
                kv: &mut seq,
                tokens: chunk,
                logits: LogitsWanted::Last,
                adapter: None,
            }];
            logits = model.forward(&mut items).pop().unwrap().unwrap();
        }
        let t1 = Instant::now();
        for step in 0..ng {
            let input = [if logits.is_empty() && step == 0 {
                1
            } else {
                argmax(&logits)
            }];
            let mut items = [BatchItem {
                kv: &mut seq,
                tokens: &input,
                logits: LogitsWanted::Last,
                adapter: None,
            }];
            logits = model.forward(&mut items).pop().unwrap().unwrap();
        }
        let tg = ng as f64 / t1.elapsed().as_secs_f64();
        drop(seq);
        // BENCH_BATCH > 1: that many sequences decoding together, one token each a step
        // (a server's batched decode), in tokens per second over all of them.
        let mut batched = 0f64;
        if batch > 1 {
            let mut seqs: Vec<SequenceKv> = (0..batch)
                .map(|b| {
                    let mut s = SequenceKv::new(&pool, owner(1000 * (rep + 1) + b as u64));
                    s.reserve(ng + 1).unwrap();
                    s
                })
                .collect();
            let t2 = Instant::now();
            for step in 0..ng {
                let input: Vec<[u32; 1]> =
                    (0..batch).map(|b| [(100 + 7 * b + step) as u32]).collect();
                let mut items: Vec<BatchItem> = seqs
                    .iter_mut()
                    .zip(&input)
                    .map(|(kv, t)| BatchItem {
                        kv,
                        tokens: t,
                        logits: LogitsWanted::Last,
                        adapter: None,
                    })
                    .collect();
                model.forward(&mut items);
            }
            batched = (batch * ng) as f64 / t2.elapsed().as_secs_f64();
        }
        best = (best.0.max(pp), best.1.max(tg), best.2.max(batched));
    }
    let at = if depth > 0 {
        format!("@d{depth}")
    } else {
        String::new()
    };
    let batched = if batch > 1 {
        format!(" batch{batch}_tg{ng}={:.1}", best.2)
    } else {
        String::new()
    };
    println!(
        "kvwarden pp{np}={:.1} tg{ng}{at}={:.1}{batched}",
        best.0, best.1
    );
}
