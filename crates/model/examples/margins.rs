//! Diagnostic: teacher-forces each golden completion and compares our top-2 margins with
//! llama.cpp's (where our top-1 agrees), to size numeric differences.
use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::{sampling::log_softmax, BatchItem, LogitsWanted, Model};

fn main() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let file = gguf::GgufFile::open(root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let model = Model::load(&file).unwrap();
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(16, KvDtype::F16),
        pages: 64,
        scrub: ScrubPolicy::Poison,
    });
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("../shared/golden/completions.json")).unwrap(),
    )
    .unwrap();
    let (mut tot, mut cnt, mut worst) = (0f64, 0, 0f32);
    for (ci, case) in golden["cases"].as_array().unwrap().iter().enumerate() {
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
        let margins: Vec<f32> = case["top2_margin"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut seq = SequenceKv::new(
            &pool,
            Owner {
                request: RequestId(ci as u64),
                domain: IsolationDomain::tenant("t"),
            },
        );
        seq.reserve(prompt.len() + want.len()).unwrap();
        let mut input = prompt.clone();
        let mut line = String::new();
        for (step, &w) in want.iter().enumerate() {
            let mut items = [BatchItem {
                kv: &mut seq,
                tokens: &input,
                logits: LogitsWanted::Last,
            }];
            let logits = model.forward(&mut items).pop().unwrap().unwrap();
            let lp = log_softmax(&logits);
            let mut idx: Vec<usize> = (0..lp.len()).collect();
            idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
            let mine = lp[idx[0]] - lp[idx[1]];
            if idx[0] as u32 == w {
                let d = (mine - margins[step]).abs();
                tot += d as f64;
                cnt += 1;
                worst = worst.max(d);
                line += &format!("{:+.3} ", mine - margins[step]);
            } else {
                line += &format!(
                    "[X {:.3} vs {:.3}] ",
                    lp[idx[0]] - lp[w as usize],
                    margins[step]
                );
            }
            input = vec![w];
        }
        println!("case {ci}: {line}");
    }
    if let Ok(bytes) = std::fs::read("/tmp/ref_logits.bin") {
        let refl: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        for (ci, case) in golden["cases"].as_array().unwrap().iter().enumerate() {
            let prompt: Vec<u32> = case["prompt_tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let mut seq = SequenceKv::new(
                &pool,
                Owner {
                    request: RequestId(100 + ci as u64),
                    domain: IsolationDomain::tenant("t"),
                },
            );
            seq.reserve(prompt.len()).unwrap();
            let mut items = [BatchItem {
                kv: &mut seq,
                tokens: &prompt,
                logits: LogitsWanted::Last,
            }];
            let logits = model.forward(&mut items).pop().unwrap().unwrap();
            let r = &refl[ci * 49152..(ci + 1) * 49152];
            let maxd = logits
                .iter()
                .zip(r)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let meand = logits
                .iter()
                .zip(r)
                .map(|(a, b)| (a - b).abs() as f64)
                .sum::<f64>()
                / 49152.0;
            println!("prompt logits case {ci}: max |diff| {maxd:.5} mean {meand:.6}");
        }
    }
    println!(
        "mean |margin diff| {:.4} over {cnt}, worst {:.4}",
        tot / cnt as f64,
        worst
    );
}
