//! Adapter files: a synthetic adapter written for a synthetic base model loads back to the
//! values written; every malformed or mismatched file is refused naming what is wrong; the
//! fingerprint follows what the adapter computes and the checksum the file's bytes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use gguf::{GgmlType, GgufFile, GgufWriter, MetaValue};
use model::lora::synth::{write_synthetic_lora, LoraSpec, SynthPair};
use model::lora::{lora_factor, LoraAdapter, LoraError, LoraPair, Target};
use model::synth::SynthSpec;
use model::Model;

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvwarden-lora-{}-{name}", std::process::id()))
}

/// The shared small base: 2 layers, dim 64, q 64, kv 32, ffn 128, vocab 300, its output
/// tied to its embeddings.
fn base_writer(own_output: bool) -> GgufWriter {
    let spec = SynthSpec::small(11, GgmlType::Q8_0, 256);
    let mut w = spec.build().unwrap();
    if own_output {
        let vals: Vec<f32> = (0..spec.vocab * spec.dim)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 400.0)
            .collect();
        w.tensor_f32(
            "output.weight",
            &[spec.dim as u64, spec.vocab as u64],
            GgmlType::Q8_0,
            &vals,
        );
    }
    w
}

struct Base {
    path: PathBuf,
    file: GgufFile,
    model: Model,
}

impl Drop for Base {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn base(own_output: bool) -> Base {
    // Tests run at once in one process: each base has a file of its own.
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let bytes = base_writer(own_output).to_bytes();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = temp(&format!("base-{n}.gguf"));
    std::fs::write(&path, &bytes).unwrap();
    let file = GgufFile::parse(bytes).unwrap();
    let model = Model::load(&file).unwrap();
    assert_eq!(model.has_own_output(), own_output);
    Base { path, file, model }
}

fn load_bytes(bytes: Vec<u8>, model: &Model, scale: f32) -> Result<LoraAdapter, LoraError> {
    let checksum = xxhash_rust::xxh3::xxh3_128(&bytes);
    let file = GgufFile::parse(bytes)?;
    LoraAdapter::load(&file, checksum, &model.lora_base(), scale)
}

fn site(pair: &SynthPair) -> (Option<usize>, Option<Target>) {
    if pair.base == "output.weight" {
        return (None, None);
    }
    let rest = pair.base.strip_prefix("blk.").unwrap();
    let (l, name) = rest.split_once('.').unwrap();
    let name = name.strip_suffix(".weight").unwrap();
    let t = Target::ALL
        .into_iter()
        .find(|t| t.tensor() == name)
        .unwrap();
    (Some(l.parse().unwrap()), Some(t))
}

fn loaded<'a>(adapter: &'a LoraAdapter, pair: &SynthPair) -> &'a LoraPair {
    match site(pair) {
        (Some(l), Some(t)) => adapter.pair(l, t),
        _ => adapter.output_pair(),
    }
    .unwrap_or_else(|| panic!("{} not loaded", pair.base))
}

/// What storing `values` as `ty` and reading them back by the reference dequantization gives.
fn stored(ty: GgmlType, values: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    ty.dequantize(&ty.quantize(values), &mut out);
    out
}

#[test]
fn a_synthetic_adapter_loads_to_the_values_written() {
    let tied = base(false);
    let own = base(true);
    for (ty, rank, b, output) in [
        (GgmlType::F32, 16, &tied, false),
        (GgmlType::F16, 8, &tied, false),
        (GgmlType::BF16, 4, &tied, false),
        (GgmlType::Q8_0, 32, &tied, false),
        (GgmlType::F32, 16, &own, true),
    ] {
        let mut spec = LoraSpec {
            rank,
            alpha: 24.0,
            seed: 5,
            tensor_type: ty,
            ..LoraSpec::default()
        };
        if output {
            spec.set_targets("q,down,output").unwrap();
        }
        let out = temp(&format!("adapter-{ty:?}-{output}.gguf"));
        write_synthetic_lora(&b.path, &out, &spec).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let adapter = LoraAdapter::load_path(&out, &b.model.lora_base(), 0.75).unwrap();
        std::fs::remove_file(&out).unwrap();

        assert_eq!(adapter.file_checksum(), xxhash_rust::xxh3::xxh3_128(&bytes));
        assert_eq!(adapter.rank(), rank);
        assert_eq!((adapter.alpha(), adapter.scale()), (24.0, 0.75));
        let pairs = spec.pairs(&b.file).unwrap();
        let layer_targets = if output { 2 } else { 7 };
        assert_eq!(pairs.len(), 2 * layer_targets + usize::from(output));
        let mut bytes_held = 0;
        for p in &pairs {
            let got = loaded(&adapter, p);
            assert_eq!((got.rank, got.n_in, got.n_out), (p.rank, p.n_in, p.n_out));
            assert_eq!(got.factor, 0.75 * 24.0 / rank as f32, "{}", p.base);
            if ty == GgmlType::F32 {
                assert_eq!(got.a, p.a, "{} a", p.base);
                assert_eq!(got.b, transposed(&p.b, p.n_out, p.rank), "{} b", p.base);
            } else {
                assert_eq!(got.a, stored(ty, &p.a), "{} a", p.base);
                let b = stored(ty, &p.b);
                assert_eq!(got.b, transposed(&b, p.n_out, p.rank), "{} b", p.base);
            }
            // The values are not degenerate: both halves are random.
            assert!(got.b.iter().any(|v| *v != 0.0) && got.a.iter().any(|v| *v != 0.0));
            bytes_held += 4 * (got.a.len() + got.b.len());
        }
        assert_eq!(adapter.bytes(), bytes_held);
        // Nothing else was loaded.
        for l in 0..2 {
            for t in Target::ALL {
                let want = spec.targets.contains(&t);
                assert_eq!(adapter.pair(l, t).is_some(), want, "layer {l} {t:?}");
            }
        }
        assert_eq!(adapter.output_pair().is_some(), output);
    }
}

#[test]
fn the_factor_is_llama_cpps() {
    let b = base(false);
    for (alpha, scale, rank) in [(32.0, 1.0, 16), (0.0, 0.5, 16), (8.0, -1.0, 4)] {
        let spec = LoraSpec {
            rank,
            alpha,
            ..LoraSpec::default()
        };
        let adapter = load_bytes(spec.build(&b.file).unwrap().to_bytes(), &b.model, scale).unwrap();
        let want = if alpha == 0.0 {
            scale
        } else {
            scale * alpha / rank as f32
        };
        assert_eq!(lora_factor(scale, alpha, rank), want);
        assert_eq!(adapter.pair(1, Target::V).unwrap().factor, want);
    }
    // Absent alpha reads as 0, as in llama.cpp: the factor is the scale.
    let w = crafted(&[], &[q_pair(8)], &["adapter.lora.alpha"]);
    let adapter = load_bytes(w.to_bytes(), &b.model, 0.25).unwrap();
    assert_eq!(adapter.alpha(), 0.0);
    assert_eq!(adapter.pair(0, Target::Q).unwrap().factor, 0.25);
}

type Tensor = (String, Vec<u64>, GgmlType, Vec<f32>);

fn tensor(name: &str, dims: &[u64], ty: GgmlType) -> Tensor {
    let n = dims.iter().product::<u64>() as usize;
    let values = (0..n).map(|i| ((i % 13) as f32 - 6.0) / 50.0).collect();
    (name.to_string(), dims.to_vec(), ty, values)
}

/// A valid pair for layer 0's Q (base weight [64, 64]).
fn q_pair(rank: u64) -> [Tensor; 2] {
    [
        tensor("blk.0.attn_q.weight.lora_a", &[64, rank], GgmlType::F32),
        tensor("blk.0.attn_q.weight.lora_b", &[rank, 64], GgmlType::F32),
    ]
}

/// An adapter file for the base's `llama`, with `meta` set over the usual keys (`drop`
/// removes keys), and `pairs` as its tensors.
fn crafted(meta: &[(&str, MetaValue)], pairs: &[[Tensor; 2]], drop: &[&str]) -> GgufWriter {
    let tensors: Vec<Tensor> = pairs.iter().flatten().cloned().collect();
    crafted_tensors(meta, &tensors, drop)
}

fn crafted_tensors(meta: &[(&str, MetaValue)], tensors: &[Tensor], drop: &[&str]) -> GgufWriter {
    let s = |v: &str| MetaValue::String(v.into());
    let mut keys = vec![
        ("general.architecture", s("llama")),
        ("general.type", s("adapter")),
        ("adapter.type", s("lora")),
        ("adapter.lora.alpha", MetaValue::F32(16.0)),
    ];
    for (k, v) in meta {
        match keys.iter_mut().find(|(key, _)| key == k) {
            Some(slot) => slot.1 = v.clone(),
            None => keys.push((k, v.clone())),
        }
    }
    let mut w = GgufWriter::new();
    for (k, v) in keys {
        if !drop.contains(&k) {
            w.meta(k, v);
        }
    }
    for (name, dims, ty, values) in tensors {
        w.tensor_f32(name, dims, *ty, values);
    }
    w
}

/// Loading `w` against `model` is refused, and the message names each of `names`.
#[track_caller]
fn refused(w: &GgufWriter, model: &Model, names: &[&str]) -> LoraError {
    let err = match load_bytes(w.to_bytes(), model, 1.0) {
        Ok(_) => panic!("loaded; expected a refusal naming {names:?}"),
        Err(e) => e,
    };
    let msg = err.to_string();
    for n in names {
        assert!(msg.contains(n), "{msg:?} does not name {n:?}");
    }
    err
}

#[test]
fn metadata_that_is_not_a_lora_adapter_for_this_model_is_refused() {
    let b = base(false);
    let m = &b.model;
    let s = |v: &str| MetaValue::String(v.into());
    let p = [q_pair(8)];
    assert!(load_bytes(crafted(&[], &p, &[]).to_bytes(), m, 1.0).is_ok());

    let e = refused(
        &crafted(&[("general.type", s("model"))], &p, &[]),
        m,
        &["general.type", "model"],
    );
    assert!(matches!(e, LoraError::Metadata { .. }));
    refused(
        &crafted(&[], &p, &["general.type"]),
        m,
        &["general.type", "missing"],
    );
    refused(
        &crafted(&[("general.type", MetaValue::U32(1))], &p, &[]),
        m,
        &["general.type"],
    );
    refused(
        &crafted(&[("adapter.type", s("ia3"))], &p, &[]),
        m,
        &["adapter.type", "ia3"],
    );
    refused(&crafted(&[], &p, &["adapter.type"]), m, &["adapter.type"]);
    let e = refused(
        &crafted(&[("general.architecture", s("qwen2"))], &p, &[]),
        m,
        &["qwen2", "llama"],
    );
    assert!(matches!(e, LoraError::Architecture { .. }));
    refused(
        &crafted(&[], &p, &["general.architecture"]),
        m,
        &["general.architecture"],
    );
    for alpha in [-1.0, f32::NAN, f32::INFINITY] {
        let meta = [("adapter.lora.alpha", MetaValue::F32(alpha))];
        refused(&crafted(&meta, &p, &[]), m, &["adapter.lora.alpha"]);
    }
    // llama.cpp reads alpha as a 32-bit float only.
    for v in [MetaValue::F64(16.0), MetaValue::U32(16), s("16")] {
        let meta = [("adapter.lora.alpha", v)];
        refused(&crafted(&meta, &p, &[]), m, &["adapter.lora.alpha"]);
    }
    // An activated LoRA would be switched on mid-sequence by llama.cpp.
    let tokens = MetaValue::Array(vec![MetaValue::U32(5), MetaValue::U32(6)]);
    let meta = [("adapter.alora.invocation_tokens", tokens)];
    refused(
        &crafted(&meta, &p, &[]),
        m,
        &["adapter.alora.invocation_tokens"],
    );
    // A non-finite scale, whatever the file.
    let bytes = crafted(&[], &p, &[]).to_bytes();
    for scale in [f32::NAN, f32::NEG_INFINITY] {
        let e = load_bytes(bytes.clone(), m, scale).err();
        assert!(matches!(e, Some(LoraError::Scale(_))), "{e:?}");
    }
    // A scale that overflows with alpha.
    let e = load_bytes(bytes.clone(), m, 3e38).err();
    assert!(matches!(e, Some(LoraError::Metadata { .. })), "{e:?}");
    // An adapter with no pairs.
    let e = refused(&crafted(&[], &[], &[]), m, &["no LoRA pairs"]);
    assert!(matches!(e, LoraError::Empty));
    // Not a GGUF file at all.
    let e = load_bytes(b"GGML not an adapter".to_vec(), m, 1.0).err();
    assert!(matches!(e, Some(LoraError::Gguf(_))), "{e:?}");
}

#[test]
fn tensors_the_model_cannot_apply_are_refused_by_name() {
    let tied = base(false);
    let own = base(true);
    let m = &tied.model;
    let f32 = GgmlType::F32;
    let pair = |base: &str, a: &[u64], b: &[u64], ty: GgmlType| {
        [
            tensor(&format!("{base}.lora_a"), a, ty),
            tensor(&format!("{base}.lora_b"), b, ty),
        ]
    };
    let one = |p: [Tensor; 2]| crafted(&[], &[p], &[]);

    // Names that are no weight an adapter may change.
    for base in [
        "token_embd.weight",
        "blk.0.attn_norm.weight",
        "blk.0.attn_qkv.weight",
        "blk.0.attn_q.bias",
        "output_norm.weight",
        "blk.01.attn_q.weight",
        "blk.+1.attn_q.weight",
        "blk..attn_q.weight",
        "attn_q.weight",
    ] {
        let e = refused(&one(pair(base, &[64, 8], &[8, 64], f32)), m, &[base]);
        assert!(matches!(e, LoraError::Tensor { .. }), "{e}");
    }
    // Not a LoRA half at all (llama.cpp skips norms; here nothing is skipped).
    let norm = tensor("blk.0.attn_norm.weight", &[64], f32);
    refused(
        &crafted_tensors(&[], &[norm], &[]),
        m,
        &["blk.0.attn_norm.weight", ".lora_a"],
    );
    let stray = tensor("blk.0.attn_q.weight.lora_c", &[64, 8], f32);
    refused(
        &crafted_tensors(&[], &[stray], &[]),
        m,
        &["blk.0.attn_q.weight.lora_c"],
    );
    // A layer past the base model's two.
    refused(
        &one(pair("blk.2.attn_q.weight", &[64, 8], &[8, 64], f32)),
        m,
        &["blk.2.attn_q.weight.lora_a", "layer 2"],
    );
    // The output projection of a model that ties it to its embeddings; fine where it has its own.
    let out = pair("output.weight", &[64, 8], &[8, 300], f32);
    refused(&one(out.clone()), m, &["output.weight.lora_a", "ties"]);
    let adapter = load_bytes(one(out).to_bytes(), &own.model, 1.0).unwrap();
    assert_eq!(adapter.output_pair().unwrap().n_out, 300);

    // A half without the other.
    let [a, b] = q_pair(8);
    refused(
        &crafted_tensors(&[], std::slice::from_ref(&a), &[]),
        m,
        &["blk.0.attn_q.weight.lora_a", "without its lora_b"],
    );
    refused(
        &crafted_tensors(&[], std::slice::from_ref(&b), &[]),
        m,
        &["blk.0.attn_q.weight.lora_b", "without its lora_a"],
    );
    // The same tensor twice: the reader refuses the file, naming it.
    let w = crafted_tensors(&[], &[a.clone(), b, a], &[]);
    refused(&w, m, &["blk.0.attn_q.weight.lora_a"]);

    // Shapes (ggml dims: lora_a [n_in, rank], lora_b [rank, n_out]).
    let q = "blk.0.attn_q.weight";
    let k = "blk.1.attn_k.weight"; // [64, 32]
    let o = "blk.0.attn_output.weight"; // [64, 64]
    let down = "blk.1.ffn_down.weight"; // [128, 64]
    for (base, a, b, named) in [
        (q, &[32u64, 8][..], &[8u64, 64][..], "lora_a"),
        (q, &[64, 8], &[8, 32], "lora_b"),
        (k, &[64, 8], &[8, 64], "lora_b"),
        (down, &[64, 8], &[8, 128], "lora_a"),
        // lora_a stored as [rank, n_in] (not transposed).
        (down, &[8, 128], &[8, 64], "lora_a"),
        // The two ranks differ.
        (o, &[64, 8], &[16, 64], "lora_b"),
        // Rank past min(n_in, n_out).
        (k, &[64, 48], &[48, 32], "rank 48"),
        (q, &[64, 0], &[0, 64], "rank 0"),
        // Not a matrix.
        (q, &[64, 8, 1], &[8, 64], "lora_a"),
    ] {
        let named = if named.starts_with("lora") {
            format!("{base}.{named}")
        } else {
            named.to_string()
        };
        refused(&one(pair(base, a, b, f32)), m, &[&named, base]);
    }

    // Types: F32, F16, BF16 and Q8_0 only.
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::IQ4_NL] {
        let w = one(pair("blk.0.ffn_gate.weight", &[64, 32], &[32, 128], ty));
        let e = refused(&w, m, &["blk.0.ffn_gate.weight.lora_a", &format!("{ty:?}")]);
        assert!(matches!(e, LoraError::TensorType { .. }), "{e}");
    }
    // Q8_0 rows are blocks of 32: a rank of 16 cannot be lora_b's row (the reader refuses it).
    let w = one(pair(q, &[64, 16], &[16, 64], GgmlType::Q8_0));
    refused(&w, m, &["blk.0.attn_q.weight.lora_b", "block"]);
    let adapter = load_bytes(
        one(pair(q, &[64, 32], &[32, 64], GgmlType::Q8_0)).to_bytes(),
        m,
        1.0,
    );
    assert_eq!(
        adapter
            .ok()
            .and_then(|a| a.pair(0, Target::Q).map(|p| p.rank)),
        Some(32)
    );
    // Non-finite values, in either half and either float width.
    let mut p = q_pair(8);
    p[1].3[17] = f32::NAN;
    refused(&one(p), m, &["blk.0.attn_q.weight.lora_b", "not finite"]);
    let mut p = pair(q, &[64, 8], &[8, 64], GgmlType::F16);
    p[0].3[3] = 1.0e6; // past f16's range: stored as infinity
    refused(&one(p), m, &["blk.0.attn_q.weight.lora_a", "not finite"]);
}

#[test]
fn fingerprints_follow_the_arithmetic_and_checksums_the_bytes() {
    let b = base(false);
    let load = |seed: u64, scale: f32, alpha: f32| {
        let spec = LoraSpec {
            seed,
            alpha,
            ..LoraSpec::default()
        };
        let bytes = spec.build(&b.file).unwrap().to_bytes();
        let adapter = load_bytes(bytes.clone(), &b.model, scale).unwrap();
        (adapter, bytes)
    };
    let (a1, bytes1) = load(1, 1.0, 32.0);
    let (a1_again, bytes1_again) = load(1, 1.0, 32.0);
    assert_eq!(bytes1, bytes1_again, "the writer is deterministic");
    assert_eq!(a1.fingerprint(), a1_again.fingerprint());
    assert_eq!(a1.file_checksum(), a1_again.file_checksum());
    assert_eq!(a1.file_checksum(), xxhash_rust::xxh3::xxh3_128(&bytes1));

    let (a2, _) = load(2, 1.0, 32.0);
    assert_ne!(a1.fingerprint(), a2.fingerprint(), "another seed");
    assert_ne!(a1.file_checksum(), a2.file_checksum());
    // The scale is no part of the file but is of the arithmetic.
    let (a1_half, _) = load(1, 0.5, 32.0);
    assert_eq!(a1.file_checksum(), a1_half.file_checksum());
    assert_ne!(a1.fingerprint(), a1_half.fingerprint(), "another scale");
    let (a1_alpha, _) = load(1, 1.0, 16.0);
    assert_ne!(a1.fingerprint(), a1_alpha.fingerprint(), "another alpha");
    // Scale and alpha that give the same factors compute the same: one fingerprint.
    let (a1_same, _) = load(1, 2.0, 16.0);
    assert_eq!(a1.fingerprint(), a1_same.fingerprint());

    // from_pairs over the loaded pairs gives the loader's fingerprint; a pair moved to
    // another weight of the same shape does not.
    let layers = |swap: bool| -> Vec<[Option<LoraPair>; 7]> {
        (0..2)
            .map(|l| {
                std::array::from_fn(|i| {
                    let t = Target::ALL[i];
                    let t = match (swap, t) {
                        (true, Target::Gate) => Target::Up,
                        (true, Target::Up) => Target::Gate,
                        _ => t,
                    };
                    a1.pair(l, t).cloned()
                })
            })
            .collect()
    };
    let rebuilt = LoraAdapter::from_pairs(layers(false), None, 1.0, 32.0, 7).unwrap();
    assert_eq!(rebuilt.fingerprint(), a1.fingerprint());
    assert_eq!(rebuilt.file_checksum(), 7);
    assert_eq!((rebuilt.rank(), rebuilt.bytes()), (a1.rank(), a1.bytes()));
    let swapped = LoraAdapter::from_pairs(layers(true), None, 1.0, 32.0, 7).unwrap();
    assert_ne!(swapped.fingerprint(), a1.fingerprint());
    // The factor is part of what a pair computes.
    let mut ls = layers(false);
    if let Some(p) = ls[0][0].as_mut() {
        p.factor *= 2.0;
    }
    let doubled = LoraAdapter::from_pairs(ls, None, 1.0, 32.0, 7).unwrap();
    assert_ne!(doubled.fingerprint(), a1.fingerprint());
    assert_eq!(doubled.pair(0, Target::Q).unwrap().factor, 4.0);
}

#[test]
fn from_pairs_refuses_inconsistent_pairs() {
    let pair = |rank: usize, n_in: usize, n_out: usize, a: usize, b: usize| LoraPair {
        rank,
        n_in,
        n_out,
        a: vec![0.5; a],
        b: vec![0.25; b],
        factor: 1.0,
    };
    let one = |p: LoraPair| {
        let mut l: [Option<LoraPair>; 7] = Default::default();
        l[2] = Some(p);
        LoraAdapter::from_pairs(vec![l], None, 1.0, 0.0, 0)
    };
    assert!(one(pair(2, 4, 3, 8, 6)).is_ok());
    assert!(matches!(
        one(pair(2, 4, 3, 7, 6)),
        Err(LoraError::Invalid(_))
    ));
    assert!(matches!(
        one(pair(2, 4, 3, 8, 5)),
        Err(LoraError::Invalid(_))
    ));
    assert!(matches!(
        one(pair(0, 4, 3, 0, 0)),
        Err(LoraError::Invalid(_))
    ));
    let mut nan = pair(2, 4, 3, 8, 6);
    nan.b[1] = f32::NAN;
    assert!(matches!(one(nan), Err(LoraError::Invalid(_))));
    assert!(matches!(
        LoraAdapter::from_pairs(vec![Default::default()], None, 1.0, 0.0, 0),
        Err(LoraError::Empty)
    ));
    // Output only is an adapter too.
    let out = LoraAdapter::from_pairs(Vec::new(), Some(pair(1, 2, 2, 2, 2)), 1.0, 0.0, 0).unwrap();
    assert_eq!(out.rank(), 1);
    // A factor that is not finite.
    let mut inf = pair(1, 2, 2, 2, 2);
    inf.factor = f32::INFINITY;
    let refused = LoraAdapter::from_pairs(Vec::new(), Some(inf), 1.0, 0.0, 0);
    assert!(matches!(refused, Err(LoraError::Invalid(_))));
}

#[test]
fn the_synthetic_writer_refuses_what_it_cannot_write() {
    let tied = base(false);
    let f = &tied.file;
    let spec = |f: fn(&mut LoraSpec)| {
        let mut s = LoraSpec::default();
        f(&mut s);
        s
    };
    // Q8_0 rows are blocks of 32: lora_b's rows are rank long.
    assert!(spec(|s| s.tensor_type = GgmlType::Q8_0).build(f).is_err());
    assert!(spec(|s| s.output = true).build(f).is_err(), "tied output");
    assert!(spec(|s| s.rank = 0).build(f).is_err());
    assert!(spec(|s| s.rank = 33).build(f).is_err(), "past kv width 32");
    assert!(spec(|s| s.alpha = -1.0).build(f).is_err());
    assert!(spec(|s| s.tensor_type = GgmlType::Q4_0).build(f).is_err());
    let mut s = LoraSpec::default();
    assert!(s.set_targets("q,x").is_err());
    assert!(s.set_targets("").is_err());
    s.set_targets("down, q ,q,output").unwrap();
    assert_eq!(
        (s.targets.as_slice(), s.output),
        (&[Target::Q, Target::Down][..], true)
    );
    // One weight's pair is the same whatever else the adapter holds.
    let all = LoraSpec::default().pairs(f).unwrap();
    let mut only_up = LoraSpec::default();
    only_up.set_targets("up").unwrap();
    let up = only_up.pairs(f).unwrap();
    assert_eq!(up.len(), 2);
    for p in &up {
        assert_eq!(all.iter().find(|q| q.base == p.base), Some(p));
    }
}

/// The loader holds `lora_b` (`n_out` rows of `rank`) transposed.
fn transposed(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| m[r * cols + c]))
        .collect()
}

/// An adapter only runs on the model shapes it was loaded for: one loaded for a base with
/// its own output projection does not fit the tied one, and a forward pass refuses that
/// sequence alone (the others in the step are computed) instead of leaving updates out.
#[test]
fn an_adapter_for_other_shapes_is_refused_by_the_forward_pass() {
    use kv::SequenceKv;
    use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy};
    use model::{BatchItem, LogitsWanted, ModelError};

    let (tied, own) = (base(false), base(true));
    let mut spec = LoraSpec {
        rank: 4,
        seed: 3,
        ..LoraSpec::default()
    };
    spec.set_targets("q,output").unwrap();
    let out = temp("adapter-own-output.gguf");
    write_synthetic_lora(&own.path, &out, &spec).unwrap();
    let adapter = LoraAdapter::load_path(&out, &own.model.lora_base(), 1.0).unwrap();
    std::fs::remove_file(&out).unwrap();
    assert!(adapter.fits(&own.model.lora_base()));
    assert!(!adapter.fits(&tied.model.lora_base()));

    let pool = KvPool::new(PoolConfig {
        layout: tied.model.kv_layout(16, KvDtype::F16),
        pages: 16,
        scrub: ScrubPolicy::Poison,
    });
    let seq = |id| {
        let mut s = SequenceKv::new(
            &pool,
            Owner {
                request: RequestId(id),
                domain: IsolationDomain::tenant("t"),
            },
        );
        s.reserve(8).unwrap();
        s
    };
    let (mut a, mut b) = (seq(1), seq(2));
    let tokens = [5u32, 6, 7, 8];
    let results = tied.model.forward(&mut [
        BatchItem {
            kv: &mut a,
            tokens: &tokens,
            logits: LogitsWanted::Last,
            adapter: Some(&adapter),
        },
        BatchItem {
            kv: &mut b,
            tokens: &tokens,
            logits: LogitsWanted::Last,
            adapter: None,
        },
    ]);
    assert!(
        matches!(results[0], Err(ModelError::AdapterDoesNotFit)),
        "{:?}",
        results[0].as_ref().err()
    );
    assert!(results[1].is_ok());
    assert_eq!(a.len(), 0, "a refused sequence commits nothing");
}
