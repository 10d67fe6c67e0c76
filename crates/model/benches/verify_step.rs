//! What a speculative verification step costs: one sequence at a 512-token context scoring
//! its last token plus `k` draft tokens in one forward step (all `k + 1` rows' logits), for
//! `k` from 0 (plain decoding) to 12, and the same with a batch of eight such sequences
//! (ratios against the first length measured).
//! The engine's speculation policy (`engine::speculation`) rests on these ratios.
//! `BENCH_MODEL` picks another file (default: the default model), `DRAFTS=1,2,7` the draft
//! lengths (default 0 to 12).
use std::time::Instant;

use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::{BatchItem, LogitsWanted, Model};

const CONTEXT: usize = 512;
const REPS: usize = 30;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = std::env::var("BENCH_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let file = gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-model.sh)", path.display()));
    let model = Model::load(&file).expect("model");
    let page = 16;
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(page, KvDtype::F16),
        pages: 8 * (CONTEXT + 64) / page + 8,
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
            s.reserve(CONTEXT + 32).unwrap();
            let prompt: Vec<u32> = (0..CONTEXT as u32)
                .map(|t| 100 + (t * 37 + i as u32 * 101) % 5000)
                .collect();
            model.forward(&mut [BatchItem {
                kv: &mut s,
                tokens: &prompt,
                logits: LogitsWanted::None,
                adapter: None,
            }]);
            s
        })
        .collect();
    let tokens: Vec<u32> = (0..13).map(|t| 300 + t * 7).collect();
    for batch in [1usize, 8] {
        let mut base = 0.0;
        let drafts: Vec<usize> = std::env::var("DRAFTS")
            .ok()
            .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
            .unwrap_or_else(|| (0..=12).collect());
        for k in drafts {
            let mut times = Vec::new();
            for _ in 0..REPS {
                let t = Instant::now();
                let mut items: Vec<BatchItem<'_>> = seqs[..batch]
                    .iter_mut()
                    .map(|s| BatchItem {
                        kv: s,
                        tokens: &tokens[..k + 1],
                        logits: LogitsWanted::All,
                        adapter: None,
                    })
                    .collect();
                model.forward(&mut items);
                times.push(t.elapsed().as_secs_f64() * 1e3);
                for s in &mut seqs[..batch] {
                    s.rollback(CONTEXT).expect("rollback");
                }
            }
            let ms = median(times);
            if base == 0.0 {
                base = ms;
            }
            println!(
                "batch {batch}, draft {k:2}: {ms:7.2} ms per step ({:.2}x plain; plain at {:.2} ms per token, this at best {:.2})",
                ms / base,
                base,
                ms / (k + 1) as f64
            );
        }
    }
}
