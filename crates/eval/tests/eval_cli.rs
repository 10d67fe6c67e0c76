//! `kvwarden eval` end to end on small synthetic models: its own files read back, the same
//! bits however the windows are fed, and every mismatched or broken input refused naming
//! what is wrong. (Against llama.cpp's files on the real models: scripts/eval-references.py,
//! which scripts/test.sh runs.)

use std::path::{Path, PathBuf};

use clap::Parser;
use eval::{evaluate, EvalArgs, EvalError, Report};
use gguf::GgmlType;
use model::lora::synth::{write_synthetic_lora, LoraSpec};
use model::synth::SynthSpec;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: EvalArgs,
}

fn run(args: &[&str]) -> Result<Report, EvalError> {
    let cli = Cli::try_parse_from(std::iter::once("eval").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("arguments {args:?}: {e}"));
    evaluate(&cli.args)
}

fn err(args: &[&str]) -> String {
    match run(args) {
        Ok(r) => panic!("{args:?} was accepted: {}", r.table()),
        Err(e) => e.to_string(),
    }
}

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvwarden-eval-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_model(dir: &Dir, name: &str, vocab: usize) -> String {
    let mut spec = SynthSpec::small(7, GgmlType::Q8_0, 4096);
    spec.vocab = vocab;
    let path = dir.path(name);
    spec.build()
        .expect("synthetic model")
        .write_to(Path::new(&path))
        .expect("write model");
    path
}

/// Runs `model` over `tokens` in windows of 64 and writes its distributions to `base`.
fn write_base(model: &str, tokens: &str, base: &str) -> Report {
    run(&[
        "--model",
        model,
        "--tokens",
        tokens,
        "--ctx",
        "64",
        "--write-base",
        base,
    ])
    .unwrap_or_else(|e| panic!("{model} over {tokens}: {e}"))
}

/// Deterministic ids past the control tokens, as a JSON array.
fn write_tokens(dir: &Dir, name: &str, n: usize, vocab: u32) -> String {
    let ids: Vec<u32> = (0..n as u32)
        .map(|i| 3 + (i * 7919 + i / 5) % (vocab - 3))
        .collect();
    let path = dir.path(name);
    std::fs::write(&path, serde_json::to_string(&ids).expect("json")).expect("write tokens");
    path
}

#[test]
fn own_reference_reads_back_and_feeding_does_not_change_a_bit() {
    let dir = Dir::new("feeding");
    let model = write_model(&dir, "m.gguf", 300);
    let tokens = write_tokens(&dir, "t.json", 200, 300);
    let base = dir.path("base.kld");
    let whole = write_base(&model, &tokens, &base);
    assert_eq!((whole.shape.n_chunk, whole.shape.n_ctx), (3, 64));
    assert_eq!(whole.summary.tokens_scored, 3 * 31);
    assert!(whole.summary.ppl.is_finite() && whole.summary.ppl > 1.0);
    let bytes = std::fs::read(&base).expect("base written");
    assert_eq!(bytes.len(), 20 + 3 * 64 * 4 + 3 * 31 * (300 + 4) * 2);

    // Against its own file: every row identical, only the 16-bit storage's rounding left.
    let own = run(&["--model", &model, "--kl-base", &base]).expect("against own file");
    let b = own.summary.base.as_ref().expect("base figures");
    assert_eq!(b.identical_rows, own.summary.tokens_scored);
    assert_eq!(b.same_top, 1.0);
    assert!(
        b.kld_mean.abs() < 1e-4 && b.kld_max < 1e-3,
        "{}",
        own.table()
    );
    assert_eq!(own.summary.ppl, whole.summary.ppl);

    for (name, feeding) in [
        ("chunked", ["--prefill-chunk", "5"]),
        ("batched", ["--batch", "2"]),
        ("chunked-batched", ["--prefill-chunk", "17"]),
    ] {
        let out = dir.path(&format!("{name}.kld"));
        let mut args = vec!["--model", &model, "--kl-base", &base, "--write-base", &out];
        args.extend(feeding);
        if name == "chunked-batched" {
            args.extend(["--batch", "3"]);
        }
        let r = run(&args).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            std::fs::read(&out).expect("written"),
            bytes,
            "{name}: another file than the whole windows'"
        );
        let b = r.summary.base.as_ref().expect("base figures");
        assert_eq!(b.identical_rows, r.summary.tokens_scored, "{name}");
        let files = run(&["--logits", &out, "--kl-base", &base]).expect("file against file");
        let fb = files.summary.base.as_ref().expect("base figures");
        assert_eq!(fb.kld_mean, 0.0, "{name}");
        assert_eq!(fb.kld_max, 0.0, "{name}");
        assert_eq!(fb.identical_rows, files.summary.tokens_scored);
    }
}

#[test]
fn another_model_is_measured_apart() {
    let dir = Dir::new("apart");
    let a = write_model(&dir, "a.gguf", 300);
    let mut spec = SynthSpec::small(8, GgmlType::Q8_0, 4096);
    spec.vocab = 300;
    let b = dir.path("b.gguf");
    spec.build()
        .expect("model")
        .write_to(Path::new(&b))
        .expect("write");
    let tokens = write_tokens(&dir, "t.json", 130, 300);
    let base = dir.path("a.kld");
    write_base(&a, &tokens, &base);
    let other = run(&["--model", &b, "--kl-base", &base]).expect("b against a");
    let o = other.summary.base.as_ref().expect("figures");
    assert!(o.kld_mean > 1e-3, "{}", other.table());
    assert!(o.identical_rows < other.summary.tokens_scored);
}

#[test]
fn mismatched_and_broken_inputs_are_refused_naming_why() {
    let dir = Dir::new("refused");
    let model = write_model(&dir, "m.gguf", 300);
    let wide = write_model(&dir, "wide.gguf", 320);
    let tokens = write_tokens(&dir, "t.json", 150, 300);
    let base = dir.path("base.kld");
    write_base(&model, &tokens, &base);

    // A reference for another vocabulary.
    let e = err(&["--model", &wide, "--kl-base", &base]);
    assert!(e.contains("vocabulary of 300") && e.contains("320"), "{e}");

    // A truncated reference, and one with bytes after its end.
    let bytes = std::fs::read(&base).expect("base");
    let cut = dir.path("cut.kld");
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).expect("write");
    let e = err(&["--model", &model, "--kl-base", &cut]);
    assert!(e.contains("truncated") && e.contains("cut.kld"), "{e}");
    let long = dir.path("long.kld");
    std::fs::write(&long, [&bytes[..], &[0u8; 2]].concat()).expect("write");
    assert!(err(&["--model", &model, "--kl-base", &long]).contains("trailing bytes"));
    let junk = dir.path("junk.kld");
    std::fs::write(&junk, b"GGUF and then nothing useful").expect("write");
    assert!(err(&["--model", &model, "--kl-base", &junk]).contains("_logits_"));
    let mut hostile = bytes[..20].to_vec();
    hostile[12..16].copy_from_slice(&i32::MAX.to_le_bytes());
    let huge = dir.path("huge.kld");
    std::fs::write(&huge, &hostile).expect("write");
    assert!(err(&["--model", &model, "--kl-base", &huge]).contains("vocabulary"));

    // A text shorter than two windows.
    let short = write_tokens(&dir, "short.json", 100, 300);
    let e = err(&["--model", &model, "--tokens", &short, "--ctx", "64"]);
    assert!(e.contains("100 tokens") && e.contains("128"), "{e}");

    // Another text against the reference.
    let other = write_tokens(&dir, "other.json", 150, 290);
    let e = err(&["--model", &model, "--tokens", &other, "--kl-base", &base]);
    assert!(e.contains("other tokens") && e.contains("token "), "{e}");

    // A window other than the reference's.
    let e = err(&["--model", &model, "--kl-base", &base, "--ctx", "32"]);
    assert!(e.contains("64") && e.contains("32"), "{e}");

    // Token ids outside the vocabulary, and a window past the model's context.
    let bad = dir.path("bad.json");
    std::fs::write(&bad, "[1, 2, 300]").expect("write");
    assert!(err(&["--model", &model, "--tokens", &bad]).contains("below 300"));
    let e = err(&["--model", &model, "--tokens", &tokens, "--ctx", "8192"]);
    assert!(
        e.contains("twice the window") || e.contains("context"),
        "{e}"
    );
}

/// A rank-8 synthetic adapter for the model at `model` (every layer weight adapted).
fn write_lora(dir: &Dir, name: &str, model: &str, seed: u64) -> String {
    let spec = LoraSpec {
        rank: 8,
        seed,
        ..LoraSpec::default()
    };
    let path = dir.path(name);
    write_synthetic_lora(Path::new(model), Path::new(&path), &spec).expect("write adapter");
    path
}

#[test]
fn an_adapter_moves_the_scores_and_feeding_under_it_does_not_change_a_bit() {
    let dir = Dir::new("lora");
    let model = write_model(&dir, "m.gguf", 300);
    let tokens = write_tokens(&dir, "t.json", 200, 300);
    let lora = write_lora(&dir, "a.gguf", &model, 3);
    let base = dir.path("base.kld");
    write_base(&model, &tokens, &base);

    // Under the adapter the distributions move away from the base model's.
    let under = dir.path("under.kld");
    let r = run(&[
        "--model",
        &model,
        "--tokens",
        &tokens,
        "--lora",
        &lora,
        "--kl-base",
        &base,
        "--write-base",
        &under,
    ])
    .expect("under the adapter");
    let used = r.adapter.as_ref().expect("the report names the adapter");
    assert_eq!((used.scale, used.alpha, used.rank), (1.0, 32.0, 8));
    assert_eq!(r.json()["lora"]["path"].as_str(), Some(lora.as_str()));
    let b = r.summary.base.as_ref().expect("figures");
    assert!(
        b.kld_mean > 1e-3 && b.identical_rows == 0,
        "the adapter changed nothing: {}",
        r.table()
    );
    assert!(r.table().contains("under LoRA adapter"));

    // At scale 0 the low-rank update adds nothing: the base model's rows exactly.
    let zero = run(&[
        "--model",
        &model,
        "--lora",
        &format!("{lora},0"),
        "--kl-base",
        &base,
    ])
    .expect("scale 0");
    let z = zero.summary.base.as_ref().expect("figures");
    assert_eq!(
        z.identical_rows,
        zero.summary.tokens_scored,
        "{}",
        zero.table()
    );
    // Another scale is another distribution.
    let twice = run(&[
        "--model",
        &model,
        "--lora",
        &format!("{lora},2"),
        "--kl-base",
        &under,
    ])
    .expect("scale 2");
    assert_eq!(twice.adapter.as_ref().map(|a| a.scale), Some(2.0));
    assert!(twice.summary.base.as_ref().expect("figures").kld_mean > 1e-4);

    // Chunked and batched under the adapter: the same file, bit for bit.
    let bytes = std::fs::read(&under).expect("written");
    for (name, feeding) in [
        ("chunked", vec!["--prefill-chunk", "7"]),
        ("batched", vec!["--batch", "2"]),
        (
            "chunked-batched",
            vec!["--prefill-chunk", "19", "--batch", "3"],
        ),
    ] {
        let out = dir.path(&format!("{name}.kld"));
        let mut args = vec!["--model", &model, "--lora", &lora, "--kl-base", &under];
        args.extend(["--write-base", &out]);
        args.extend(feeding);
        run(&args).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            std::fs::read(&out).expect("written"),
            bytes,
            "{name}: another file than the whole windows' under the adapter"
        );
    }
}

#[test]
fn a_bad_adapter_is_refused_naming_why() {
    let dir = Dir::new("lora-refused");
    let model = write_model(&dir, "m.gguf", 300);
    let tokens = write_tokens(&dir, "t.json", 150, 300);
    let mut wide = SynthSpec::small(7, GgmlType::Q8_0, 4096);
    wide.dim = 128;
    let wide_path = dir.path("wide.gguf");
    wide.build()
        .expect("model")
        .write_to(Path::new(&wide_path))
        .expect("write");
    let lora = write_lora(&dir, "a.gguf", &model, 3);
    let args = |spec: &str| -> Vec<String> {
        [
            "--model", &model, "--tokens", &tokens, "--ctx", "64", "--lora", spec,
        ]
        .map(String::from)
        .to_vec()
    };
    let refused = |args: Vec<String>| err(&args.iter().map(String::as_str).collect::<Vec<_>>());

    let missing = dir.path("missing.gguf");
    let e = refused(args(&missing));
    assert!(e.contains("missing.gguf"), "{e}");
    let e = refused(args(&format!("{lora},inf")));
    assert!(e.contains("not finite"), "{e}");
    let e = refused(args(",2"));
    assert!(e.contains("no adapter path"), "{e}");
    // An adapter made for another model's shapes.
    let mut other = args(&lora);
    other[1] = wide_path;
    let e = refused(other);
    assert!(e.contains("lora"), "{e}");
    // A file that is not an adapter at all (the model itself).
    let e = refused(args(&model));
    assert!(!e.is_empty());
}
