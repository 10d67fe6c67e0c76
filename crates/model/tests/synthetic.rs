//! Odd shapes on synthetic models written as real GGUF files: the forward pass against a
//! plain f32 transcription of the llama architecture, and the invariances the engine relies
//! on (chunking and batching never change a row's result).

use gguf::{GgmlType, GgufFile};
use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::synth::SynthSpec;
use model::{BatchItem, LogitsWanted, Model};

fn spec(dim: usize, heads: usize, kv_heads: usize, ty: GgmlType) -> SynthSpec {
    SynthSpec {
        layers: 2,
        dim,
        heads,
        kv_heads,
        ffn_dim: 2 * dim,
        vocab: 320,
        context: 1 << 20,
        seed: dim as u64 * 31 + heads as u64,
        weight_type: ty,
    }
}

fn load(spec: &SynthSpec) -> (GgufFile, Model) {
    let file = GgufFile::parse(spec.build().unwrap().to_bytes()).unwrap();
    let model = Model::load(&file).unwrap();
    (file, model)
}

fn pool(model: &Model, dtype: KvDtype) -> KvPool {
    KvPool::new(PoolConfig {
        layout: model.kv_layout(16, dtype),
        pages: 64,
        scrub: ScrubPolicy::Poison,
    })
}

fn seq(pool: &KvPool, id: u64, len: usize) -> SequenceKv {
    let mut s = SequenceKv::new(
        pool,
        Owner {
            request: RequestId(id),
            domain: IsolationDomain::tenant("t"),
        },
    );
    s.reserve(len).unwrap();
    s
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 53 + seed * 7) % 300)
        .collect()
}

/// Logits for every position, from the straightforward f32 definition of a llama block.
fn reference(file: &GgufFile, spec: &SynthSpec, toks: &[u32]) -> Vec<Vec<f32>> {
    let t = |name: &str| file.tensor_f32(file.tensor(name).unwrap());
    let (d, hd) = (spec.dim, spec.dim / spec.heads);
    let kvd = hd * spec.kv_heads;
    let matvec = |w: &[f32], x: &[f32], rows: usize| -> Vec<f32> {
        (0..rows)
            .map(|r| {
                w[r * x.len()..(r + 1) * x.len()]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>() as f32
            })
            .collect()
    };
    let norm = |x: &[f32], w: &[f32]| -> Vec<f32> {
        let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + 1e-5).sqrt();
        x.iter()
            .zip(w)
            .map(|(v, w)| (*v as f64 * s) as f32 * w)
            .collect()
    };
    let rope = |x: &mut [f32], pos: usize| {
        for head in x.chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let theta = pos as f64 * 10000f64.powf(-2.0 * i as f64 / hd as f64);
                let (a, b) = (head[2 * i] as f64, head[2 * i + 1] as f64);
                head[2 * i] = (a * theta.cos() - b * theta.sin()) as f32;
                head[2 * i + 1] = (a * theta.sin() + b * theta.cos()) as f32;
            }
        }
    };
    let embed = t("token_embd.weight");
    let mut xs: Vec<Vec<f32>> = toks
        .iter()
        .map(|&id| embed[id as usize * d..(id as usize + 1) * d].to_vec())
        .collect();
    for l in 0..spec.layers {
        let w = |n: &str| t(&format!("blk.{l}.{n}.weight"));
        let (wq, wk, wv, wo) = (w("attn_q"), w("attn_k"), w("attn_v"), w("attn_output"));
        let (wg, wu, wd) = (w("ffn_gate"), w("ffn_up"), w("ffn_down"));
        let (an, fnw) = (w("attn_norm"), w("ffn_norm"));
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let xn = norm(x, &an);
            let mut q = matvec(&wq, &xn, d);
            let mut k = matvec(&wk, &xn, kvd);
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&wv, &xn, kvd));
        }
        for pos in 0..xs.len() {
            let mut att = vec![0f32; d];
            for h in 0..spec.heads {
                let g = h / (spec.heads / spec.kv_heads);
                let q = &qs[pos][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][g * hd..(g + 1) * hd])
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, w) in e.iter().enumerate() {
                    for i in 0..hd {
                        att[h * hd + i] += (w / z * vs[j][g * hd + i] as f64) as f32;
                    }
                }
            }
            let o = matvec(&wo, &att, d);
            for (a, b) in xs[pos].iter_mut().zip(o) {
                *a += b;
            }
            let xn = norm(&xs[pos], &fnw);
            let gate = matvec(&wg, &xn, spec.ffn_dim);
            let up = matvec(&wu, &xn, spec.ffn_dim);
            let h: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            for (a, b) in xs[pos].iter_mut().zip(matvec(&wd, &h, d)) {
                *a += b;
            }
        }
    }
    // The tied output layer is Q8_0, whose product takes activations quantized to 8 bits
    // (scale amax / 127 stored as f16); apply the same quantization here.
    let q8 = |x: &[f32]| -> Vec<f32> {
        x.chunks(32)
            .flat_map(|b| {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = half::f16::from_f32(amax / 127.0).to_f32();
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                b.iter()
                    .map(move |v| (v * id).round_ties_even() * d)
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let on = t("output_norm.weight");
    xs.iter()
        .map(|x| matvec(&embed, &q8(&norm(x, &on)), spec.vocab))
        .collect()
}

#[test]
fn odd_shapes_match_the_f32_definition() {
    // (dim, heads, kv_heads): head dims 32, 8, 16, 64; group sizes 3, 1, 4, 2.
    for (dim, heads, kv_heads) in [(96, 3, 1), (64, 8, 8), (128, 8, 2), (128, 2, 1)] {
        let spec = spec(dim, heads, kv_heads, GgmlType::F32);
        let (file, model) = load(&spec);
        assert_eq!(model.config.context_length, 1 << 20);
        let pool = pool(&model, KvDtype::F32);
        let toks = tokens(37, dim as u32);
        let mut s = seq(&pool, 1, toks.len());
        let got = model
            .forward(&mut [BatchItem {
                kv: &mut s,
                tokens: &toks,
                logits: LogitsWanted::All,
            }])
            .pop()
            .unwrap()
            .unwrap();
        let want = reference(&file, &spec, &toks);
        for (pos, row) in want.iter().enumerate() {
            let ours = &got[pos * spec.vocab..(pos + 1) * spec.vocab];
            let worst = row
                .iter()
                .zip(ours)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // A rounding flip in the output layer's 8-bit activations moves a logit by about
            // 4e-3; a wrong head mapping or rotation moves them by whole units.
            assert!(
                worst < 1e-2,
                "shape {dim}/{heads}/{kv_heads} position {pos}: max |diff| {worst}"
            );
        }
    }
}

#[test]
fn chunking_and_batching_never_change_a_row() {
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::F16,
    ] {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let spec = spec(96, 6, 2, ty);
            let (_, model) = load(&spec);
            let pool = pool(&model, dtype);
            let a = tokens(45, 1);
            let b = tokens(23, 2);
            // All of `a` at once.
            let mut whole = seq(&pool, 1, a.len());
            let ref_logits = model
                .forward(&mut [BatchItem {
                    kv: &mut whole,
                    tokens: &a,
                    logits: LogitsWanted::Last,
                }])
                .pop()
                .unwrap()
                .unwrap();
            // `a` in uneven chunks, batched with `b` in other chunks.
            let mut chunked = seq(&pool, 2, a.len());
            let mut other = seq(&pool, 3, b.len());
            let mut last = Vec::new();
            let (mut ia, mut ib) = (0, 0);
            for (ca, cb) in [(7, 3), (1, 20), (30, 0), (7, 0)] {
                let (ra, rb) = (&a[ia..ia + ca], &b[ib..ib + cb]);
                let mut items = vec![
                    BatchItem {
                        kv: &mut other,
                        tokens: rb,
                        logits: LogitsWanted::Last,
                    },
                    BatchItem {
                        kv: &mut chunked,
                        tokens: ra,
                        logits: LogitsWanted::Last,
                    },
                ];
                let mut out = model.forward(&mut items);
                last = out.pop().unwrap().unwrap();
                ia += ca;
                ib += cb;
            }
            assert_eq!(ia, a.len());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&last),
                bits(&ref_logits),
                "{ty:?} {dtype:?}: chunked/batched row differs"
            );
        }
    }
}

#[test]
fn a_token_outside_the_vocabulary_fails_only_its_own_item() {
    let spec = spec(64, 4, 2, GgmlType::Q8_0);
    let (_, model) = load(&spec);
    let pool = pool(&model, KvDtype::F16);
    let mut good = seq(&pool, 1, 8);
    let mut bad = seq(&pool, 2, 8);
    let ok = tokens(5, 3);
    let out = model.forward(&mut [
        BatchItem {
            kv: &mut good,
            tokens: &ok,
            logits: LogitsWanted::Last,
        },
        BatchItem {
            kv: &mut bad,
            tokens: &[1, 99_999],
            logits: LogitsWanted::Last,
        },
    ]);
    assert!(out[0].is_ok());
    assert!(matches!(
        out[1],
        Err(model::ModelError::TokenOutOfRange { id: 99_999, .. })
    ));
    assert_eq!(bad.len(), 0, "a failed item commits nothing");
}
