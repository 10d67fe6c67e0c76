//! Odd shapes on synthetic models written as real GGUF files: the forward pass against a
//! plain f32 transcription of the llama architecture, and the invariances the engine relies
//! on (chunking and batching never change a row's result).

use gguf::{GgmlType, GgufFile};
use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::synth::{SynthArch, SynthSpec, GEMMA3_WINDOW};
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
    load_arch(spec, SynthArch::Llama)
}

fn load_arch(spec: &SynthSpec, arch: SynthArch) -> (GgufFile, Model) {
    let file = GgufFile::parse(spec.build_arch(arch).unwrap().to_bytes()).unwrap();
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

/// Logits for every position, from the straightforward f32 definition of a llama block
/// with each architecture's additions (llama.cpp's `src/models/{llama,qwen2,qwen3,gemma3}.cpp`):
/// optional Q/K/V biases, per-head Q/K RMSNorm, adjacent or NeoX rotary pairs, frequency
/// factors; for gemma3 scaled embeddings, post-attention and post-FFN norms, GeGLU, and
/// sliding-window layers (every second layer global) with RoPE base 10,000.
fn reference(file: &GgufFile, spec: &SynthSpec, arch: SynthArch, toks: &[u32]) -> Vec<Vec<f32>> {
    let t = |name: &str| file.tensor_f32(file.tensor(name).unwrap());
    let opt = |name: &str| file.tensor(name).map(|i| file.tensor_f32(i));
    let (d, hd) = (spec.dim, spec.head_dim(arch));
    let (kvd, qd) = (hd * spec.kv_heads, hd * spec.heads);
    let neox = arch != SynthArch::Llama && arch != SynthArch::Llama3;
    let gemma = arch == SynthArch::Gemma3;
    let layer_base = |l: usize| {
        if gemma && l.is_multiple_of(2) {
            10_000.0
        } else {
            arch.rope_base() as f64
        }
    };
    let window = |l: usize| {
        if gemma && l.is_multiple_of(2) {
            GEMMA3_WINDOW
        } else {
            usize::MAX
        }
    };
    let factors = opt("rope_freqs.weight");
    let linear = file
        .get(&format!("{}.rope.scaling.factor", arch.gguf_name()))
        .and_then(|v| v.as_f64())
        .unwrap_or(1.0);
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
    let rope = |x: &mut [f32], pos: usize, base: f64| {
        for head in x.chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let ff = factors.as_ref().map_or(1.0, |f| f[i] as f64);
                let theta = pos as f64 * base.powf(-2.0 * i as f64 / hd as f64) / ff / linear;
                let (i0, i1) = if neox {
                    (i, i + hd / 2)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (a, b) = (head[i0] as f64, head[i1] as f64);
                head[i0] = (a * theta.cos() - b * theta.sin()) as f32;
                head[i1] = (a * theta.sin() + b * theta.cos()) as f32;
            }
        }
    };
    let add = |x: &mut Vec<f32>, b: &Option<Vec<f32>>| {
        if let Some(b) = b {
            x.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    };
    let head_norm = |x: &mut Vec<f32>, w: &Option<Vec<f32>>| {
        if let Some(w) = w {
            *x = x.chunks(hd).flat_map(|h| norm(h, w)).collect();
        }
    };
    let embed = t("token_embd.weight");
    let mut xs: Vec<Vec<f32>> = toks
        .iter()
        .map(|&id| {
            let row = &embed[id as usize * d..(id as usize + 1) * d];
            let s = if gemma { (d as f32).sqrt() } else { 1.0 };
            row.iter().map(|v| v * s).collect()
        })
        .collect();
    for l in 0..spec.layers {
        let w = |n: &str| t(&format!("blk.{l}.{n}.weight"));
        let (wq, wk, wv, wo) = (w("attn_q"), w("attn_k"), w("attn_v"), w("attn_output"));
        let (wg, wu, wd) = (w("ffn_gate"), w("ffn_up"), w("ffn_down"));
        let (an, fnw) = (w("attn_norm"), w("ffn_norm"));
        let b = |n: &str| opt(&format!("blk.{l}.{n}.bias"));
        let (bq, bk, bv) = (b("attn_q"), b("attn_k"), b("attn_v"));
        let hn = |n: &str| opt(&format!("blk.{l}.{n}.weight"));
        let (qn, kn) = (hn("attn_q_norm"), hn("attn_k_norm"));
        let (pan, pfn) = (hn("post_attention_norm"), hn("post_ffw_norm"));
        let post = |x: Vec<f32>, w: &Option<Vec<f32>>| match w {
            Some(w) => norm(&x, w),
            None => x,
        };
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let xn = norm(x, &an);
            let mut q = matvec(&wq, &xn, qd);
            let mut k = matvec(&wk, &xn, kvd);
            let mut v = matvec(&wv, &xn, kvd);
            add(&mut q, &bq);
            add(&mut k, &bk);
            add(&mut v, &bv);
            head_norm(&mut q, &qn);
            head_norm(&mut k, &kn);
            rope(&mut q, pos, layer_base(l));
            rope(&mut k, pos, layer_base(l));
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for pos in 0..xs.len() {
            let mut att = vec![0f32; qd];
            for h in 0..spec.heads {
                let g = h / (spec.heads / spec.kv_heads);
                let q = &qs[pos][h * hd..(h + 1) * hd];
                let from = (pos + 1).saturating_sub(window(l));
                let scores: Vec<f64> = (from..=pos)
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
                for (j, w) in (from..=pos).zip(&e) {
                    for i in 0..hd {
                        att[h * hd + i] += (w / z * vs[j][g * hd + i] as f64) as f32;
                    }
                }
            }
            let o = post(matvec(&wo, &att, d), &pan);
            for (a, b) in xs[pos].iter_mut().zip(o) {
                *a += b;
            }
            let xn = norm(&xs[pos], &fnw);
            let gate = matvec(&wg, &xn, spec.ffn_dim);
            let up = matvec(&wu, &xn, spec.ffn_dim);
            let h: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| match gemma {
                    true => model::gemma3::gelu_tanh(*g) * u,
                    false => g / (1.0 + (-g).exp()) * u,
                })
                .collect();
            for (a, b) in xs[pos].iter_mut().zip(post(matvec(&wd, &h, d), &pfn)) {
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
        let toks = tokens(37, dim as u32);
        let got = all_logits(&model, KvDtype::F32, &toks);
        let want = reference(&file, &spec, SynthArch::Llama, &toks);
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
        GgmlType::IQ4_NL,
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
                    adapter: None,
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
                        adapter: None,
                    },
                    BatchItem {
                        kv: &mut chunked,
                        tokens: ra,
                        logits: LogitsWanted::Last,
                        adapter: None,
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
            adapter: None,
        },
        BatchItem {
            kv: &mut bad,
            tokens: &[1, 99_999],
            logits: LogitsWanted::Last,
            adapter: None,
        },
    ]);
    assert!(out[0].is_ok());
    assert!(matches!(
        out[1],
        Err(model::ModelError::TokenOutOfRange { id: 99_999, .. })
    ));
    assert_eq!(bad.len(), 0, "a failed item commits nothing");
}

/// Logits of every position of `toks` from one forward pass.
fn all_logits(model: &Model, dtype: KvDtype, toks: &[u32]) -> Vec<f32> {
    let pool = pool(model, dtype);
    let mut s = seq(&pool, 1, toks.len());
    model
        .forward(&mut [BatchItem {
            kv: &mut s,
            tokens: toks,
            logits: LogitsWanted::All,
            adapter: None,
        }])
        .pop()
        .unwrap()
        .unwrap()
}

fn worst_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn every_architecture_matches_its_f32_definition() {
    for arch in [
        SynthArch::Llama3,
        SynthArch::Qwen2,
        SynthArch::Qwen3,
        SynthArch::Gemma3,
    ] {
        for (dim, heads, kv_heads) in [(96, 3, 1), (128, 8, 2), (64, 2, 2)] {
            let spec = spec(dim, heads, kv_heads, GgmlType::F32);
            let (file, model) = load_arch(&spec, arch);
            assert_eq!(model.config.head_dim, spec.head_dim(arch));
            // Long enough that the slowest rotary pairs have turned (positions past 64).
            let toks = tokens(70, dim as u32 + heads as u32);
            let got = all_logits(&model, KvDtype::F32, &toks);
            let want = reference(&file, &spec, arch, &toks);
            for (pos, row) in want.iter().enumerate() {
                let worst = worst_diff(row, &got[pos * spec.vocab..(pos + 1) * spec.vocab]);
                assert!(
                    worst < 1e-2,
                    "{arch:?} {dim}/{heads}/{kv_heads} position {pos}: max |diff| {worst}"
                );
            }
        }
    }
}

/// Each architecture's own part of the block matters: the same weights read as plain llama
/// give different logits (so the reference comparison above would catch its omission).
#[test]
fn each_architectures_additions_change_the_output() {
    let spec = spec(64, 4, 2, GgmlType::F32);
    let toks = tokens(20, 5);
    let (_, llama) = load_arch(&spec, SynthArch::Llama);
    let base = all_logits(&llama, KvDtype::F32, &toks);
    for arch in [
        SynthArch::Llama3,
        SynthArch::Qwen2,
        SynthArch::Qwen3,
        SynthArch::Gemma3,
    ] {
        let (_, m) = load_arch(&spec, arch);
        let other = all_logits(&m, KvDtype::F32, &toks);
        assert!(
            worst_diff(&base, &other) > 0.05,
            "{arch:?} computes the same logits as llama"
        );
    }
}

#[test]
fn chunking_and_batching_never_change_a_row_in_any_architecture() {
    for arch in [
        SynthArch::Llama3,
        SynthArch::Qwen2,
        SynthArch::Qwen3,
        SynthArch::Gemma3,
    ] {
        for (ty, dtype, dim, heads) in [
            (GgmlType::Q4_1, KvDtype::F16, 96, 6),
            (GgmlType::Q8_0, KvDtype::F32, 96, 6),
            // Block K/V (Q8_0, Q4_0) needs heads of whole 32-value blocks.
            (GgmlType::Q4_1, KvDtype::Q8_0, 256, 4),
            (GgmlType::Q4_1, KvDtype::Q4_0, 256, 4),
            // The k-quants need rows of whole 256-element super-blocks.
            (GgmlType::Q4_K, KvDtype::F16, 256, 4),
            (GgmlType::Q6_K, KvDtype::F16, 256, 4),
            (GgmlType::Q2_K, KvDtype::F16, 256, 4),
            (GgmlType::Q3_K, KvDtype::F16, 256, 4),
        ] {
            let spec = spec(dim, heads, 2, ty);
            let (_, model) = load_arch(&spec, arch);
            let pool = pool(&model, dtype);
            let a = tokens(45, 1);
            let b = tokens(23, 2);
            let mut whole = seq(&pool, 1, a.len());
            let ref_logits = model
                .forward(&mut [BatchItem {
                    kv: &mut whole,
                    tokens: &a,
                    logits: LogitsWanted::Last,
                    adapter: None,
                }])
                .pop()
                .unwrap()
                .unwrap();
            let mut chunked = seq(&pool, 2, a.len());
            let mut other = seq(&pool, 3, b.len());
            let mut last = Vec::new();
            let (mut ia, mut ib) = (0, 0);
            for (ca, cb) in [(7, 3), (1, 20), (30, 0), (7, 0)] {
                let (ra, rb) = (&a[ia..ia + ca], &b[ib..ib + cb]);
                let mut out = model.forward(&mut [
                    BatchItem {
                        kv: &mut other,
                        tokens: rb,
                        logits: LogitsWanted::Last,
                        adapter: None,
                    },
                    BatchItem {
                        kv: &mut chunked,
                        tokens: ra,
                        logits: LogitsWanted::Last,
                        adapter: None,
                    },
                ]);
                last = out.pop().unwrap().unwrap();
                ia += ca;
                ib += cb;
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&last),
                bits(&ref_logits),
                "{arch:?} {ty:?} {dtype:?}: chunked/batched row differs"
            );
        }
    }
}

fn load_err(w: &gguf::GgufWriter) -> String {
    let file = GgufFile::parse(w.to_bytes()).unwrap();
    match Model::load(&file) {
        Ok(_) => panic!("the model loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_architectures_and_tensors_are_refused_by_name() {
    let mut w = gguf::GgufWriter::new();
    w.meta(
        "general.architecture",
        gguf::MetaValue::String("gemma4".into()),
    );
    let e = load_err(&w);
    assert!(e.contains("\"gemma4\"") && e.contains("gemma3"), "{e}");

    // A tensor the forward pass would not read (here an output bias) is never ignored.
    let spec = spec(64, 4, 2, GgmlType::F32);
    let mut w = spec.build_arch(SynthArch::Qwen2).unwrap();
    w.tensor_f32("output.bias", &[320], GgmlType::F32, &[0.5; 320]);
    let e = load_err(&w);
    assert!(e.contains("output.bias") && e.contains("qwen2"), "{e}");

    // Frequency factors belong to the llama graph only; qwen3 without its head norms fails.
    let mut w = spec.build_arch(SynthArch::Qwen3).unwrap();
    w.tensor_f32("rope_freqs.weight", &[16], GgmlType::F32, &[1.0; 16]);
    assert!(load_err(&w).contains("rope_freqs.weight"));
    // Frequency factors of the wrong length, or ones that would make angles infinite.
    for factors in [vec![1.0f32; 7], vec![0.0f32; 8], vec![f32::NAN; 8]] {
        let mut w = spec.build_arch(SynthArch::Llama).unwrap();
        w.tensor_f32(
            "rope_freqs.weight",
            &[factors.len() as u64],
            GgmlType::F32,
            &factors,
        );
        let e = load_err(&w);
        assert!(e.contains("rope_freqs.weight"), "{e}");
    }

    // Metadata that changes llama.cpp's graph in ways not implemented here.
    for (key, value) in [
        ("llama.expert_count", gguf::MetaValue::U32(8)),
        ("llama.attention.scale", gguf::MetaValue::F32(0.5)),
        ("llama.attention.clamp_kqv", gguf::MetaValue::F32(8.0)),
    ] {
        let mut w = spec.build_arch(SynthArch::Llama).unwrap();
        w.meta(key, value);
        let e = load_err(&w);
        assert!(e.contains(key), "{e}");
    }

    // RoPE scalings whose arithmetic is not implemented.
    for (arch, key) in [
        (SynthArch::Llama3, "llama.rope.scaling.type"),
        (SynthArch::Qwen2, "qwen2.rope.scaling.type"),
    ] {
        let mut w = spec.build_arch(arch).unwrap();
        w.meta(key, gguf::MetaValue::String("yarn".into()));
        let e = load_err(&w);
        assert!(e.contains("yarn"), "{e}");
    }
}

/// Linear RoPE scaling (`rope.scaling.factor` f) turns every pair at 1/f of its angle.
#[test]
fn linear_rope_scaling_divides_the_angles() {
    let spec = spec(64, 4, 2, GgmlType::F32);
    let mut w = spec.build_arch(SynthArch::Qwen2).unwrap();
    w.meta(
        "qwen2.rope.scaling.type",
        gguf::MetaValue::String("linear".into()),
    );
    w.meta("qwen2.rope.scaling.factor", gguf::MetaValue::F32(4.0));
    let file = GgufFile::parse(w.to_bytes()).unwrap();
    let model = Model::load(&file).unwrap();
    assert_eq!(model.config.rope_freq_scale, 0.25);
    let toks = tokens(40, 9);
    let got = all_logits(&model, KvDtype::F32, &toks);
    let want = reference(&file, &spec, SynthArch::Qwen2, &toks);
    let unscaled = all_logits(&load_arch(&spec, SynthArch::Qwen2).1, KvDtype::F32, &toks);
    let v = spec.vocab;
    for (pos, row) in want.iter().enumerate() {
        let worst = worst_diff(row, &got[pos * v..(pos + 1) * v]);
        assert!(worst < 1e-2, "position {pos}: max |diff| {worst}");
    }
    assert!(worst_diff(&got[v..], &unscaled[v..]) > 1e-3);
}

/// A small qwen3 file of `ty` written to a temporary path named by `tag` (the caller
/// removes it), and its spec.
fn qwen3_file(tag: &str, ty: GgmlType) -> (SynthSpec, std::path::PathBuf) {
    let mut spec = spec(256, 4, 2, ty);
    spec.vocab = 512;
    let path =
        std::env::temp_dir().join(format!("kvwarden-{tag}-{}-{ty:?}.gguf", std::process::id()));
    std::fs::write(&path, spec.build_arch(SynthArch::Qwen3).unwrap().to_bytes()).unwrap();
    (spec, path)
}

/// A mapped file's matrices are used where they lie, for the formats stored as in the file
/// (Q4_K and Q6_K only where the CPU lacks the rows-in-lanes kernel: elsewhere they are
/// repacked into tiles of sixteen rows), and give the bits of the same file read into
/// memory. (A tensor widened in several slices, the default model's 30 MB Q8_0 embedding,
/// is checked bit for bit by golden_completions, which maps its file.)
#[test]
fn a_mapped_model_computes_what_the_read_one_does() {
    for (ty, layers_mapped) in [
        (GgmlType::Q5_K, true),
        (GgmlType::Q6_K, !model::kernels::wide_available()),
        (GgmlType::Q4_K, !model::kernels::wide_available()),
        (GgmlType::Q4_1, false),
    ] {
        let (spec, path) = qwen3_file("mapped", ty);
        let run = |load: gguf::Load| {
            let file = GgufFile::open_with(&path, load).unwrap();
            assert_eq!(file.is_mapped(), load != gguf::Load::Read);
            let model = Model::load(&file).unwrap();
            // The matrices hold what they need of the file: it can go.
            drop(file);
            let logits = all_logits(&model, KvDtype::F16, &tokens(21, 5));
            (model.mapped_matrices(), logits)
        };
        let ((mapped, all), from_map) = run(gguf::Load::Map);
        let ((read_mapped, _), from_read) = run(gguf::Load::Read);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            read_mapped, 0,
            "{ty:?}: a file read into memory maps nothing"
        );
        // The 7 matrices of each of the 2 layers are of the spec's type (the embedding is
        // the writer's choice).
        let layer_matrices = 7 * spec.layers;
        assert_eq!(
            mapped >= layer_matrices,
            layers_mapped,
            "{ty:?}: {mapped} of {all} mapped"
        );
        assert!(
            mapped <= all - usize::from(!layers_mapped) * layer_matrices,
            "{ty:?}: {mapped} of {all}"
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&from_map),
            bits(&from_read),
            "{ty:?}: mapped and read differ"
        );
    }
}

/// A model whose repacks are deferred (`Model::load_deferring_repack`, what `serve` does)
/// gives the bits of one repacked at load: before its repacks run (the file's rows), while
/// they run on another thread beside forward passes, and after. Prompts of 21 and 40
/// tokens take the decode-sized and the prefill-sized kernels.
#[test]
fn a_deferred_repack_changes_no_bit_before_during_or_after() {
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        let (spec, path) = qwen3_file("deferred", ty);
        let file = GgufFile::open_with(&path, gguf::Load::Map).unwrap();
        let prompts = [tokens(21, 5), tokens(40, 6)];
        let logits = |model: &Model| -> Vec<Vec<u32>> {
            prompts
                .iter()
                .map(|p| {
                    let l = all_logits(model, KvDtype::F16, p);
                    l.iter().map(|x| x.to_bits()).collect()
                })
                .collect()
        };
        let at_load = logits(&Model::load(&file).unwrap());
        let (model, pending) = Model::load_deferring_repack(&file).unwrap();
        drop(file);
        std::fs::remove_file(&path).unwrap();
        // 7 matrices a layer, and the embedding where it is of the type.
        assert_eq!(
            pending.len() >= 7 * spec.layers,
            model::kernels::wide_available(),
            "{ty:?}: {} repacks deferred",
            pending.len()
        );
        assert!(logits(&model) == at_load, "{ty:?}: the file's rows differ");
        let repacking = std::thread::spawn(move || pending.run());
        let mut during = 0;
        while !repacking.is_finished() {
            assert!(logits(&model) == at_load, "{ty:?}: differs while repacking");
            during += 1;
        }
        assert!(repacking.join().unwrap() > 0 || !model::kernels::wide_available());
        assert!(logits(&model) == at_load, "{ty:?}: the tiles differ");
        eprintln!("{ty:?}: {during} passes while the repack ran");
    }
}

/// A step paused between layers (`Model::forward_yielding`) for a nested step on another
/// sequence: both give the bits they give alone, and a batch's output projection in
/// vocabulary slices (from 8 sampled rows) gives what a smaller batch's gives unsliced.
#[test]
fn a_paused_step_and_the_step_nested_in_it_give_their_own_bits() {
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let spec = spec(96, 6, 2, ty);
        let (_, model) = load(&spec);
        let pool = pool(&model, KvDtype::F16);
        let a = tokens(45, 1);
        let b = tokens(23, 2);
        // `a` in chunks of 7 (7 sampled rows each: the output projection in one piece).
        let mut chunked = seq(&pool, 1, a.len());
        let mut unsliced = Vec::new();
        for chunk in a.chunks(7) {
            let mut out = model.forward(&mut [BatchItem {
                kv: &mut chunked,
                tokens: chunk,
                logits: LogitsWanted::All,
                adapter: None,
            }]);
            unsliced.extend(out.pop().unwrap().unwrap());
        }
        let mut alone = seq(&pool, 2, b.len());
        let b_alone = model
            .forward(&mut [BatchItem {
                kv: &mut alone,
                tokens: &b,
                logits: LogitsWanted::Last,
                adapter: None,
            }])
            .pop()
            .unwrap()
            .unwrap();
        // `a` whole, paused at its third pause point for `b`.
        let mut whole = seq(&pool, 3, a.len());
        let mut nested = seq(&pool, 4, b.len());
        let mut calls = 0;
        let mut b_nested = None;
        let a_paused = model
            .forward_yielding(
                &mut [BatchItem {
                    kv: &mut whole,
                    tokens: &a,
                    logits: LogitsWanted::All,
                    adapter: None,
                }],
                &mut || {
                    calls += 1;
                    if calls == 3 {
                        b_nested = model
                            .forward(&mut [BatchItem {
                                kv: &mut nested,
                                tokens: &b,
                                logits: LogitsWanted::Last,
                                adapter: None,
                            }])
                            .pop();
                    }
                },
            )
            .pop()
            .unwrap()
            .unwrap();
        // One pause point per layer, one before the K/V is committed, one per slice.
        assert_eq!(calls, model.config.n_layers + 1 + 4, "{ty:?}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a_paused), bits(&unsliced), "{ty:?}: the paused step");
        let b_nested = b_nested.expect("the nested step ran").unwrap();
        assert_eq!(bits(&b_nested), bits(&b_alone), "{ty:?}: the nested step");
    }
}
