//! llama.cpp's own tokenizer conformance cases (`tests/test-tokenizer-0.cpp`): every
//! `ggml-vocab-*.gguf` that llama.cpp ships, with its `.inp`/`.out` pairs, fetched by
//! `scripts/fetch-llama-vocabs.sh`. A vocabulary kvwarden claims must pass every case; one
//! it does not must be refused at load with an error naming what is unsupported. A file
//! missing from the table below fails the test, so no vocabulary goes untested.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tokenizer::Tokenizer;

enum Expect {
    /// Loads, and tokenizes every case exactly as llama.cpp does.
    Pass,
    /// Loads; llama.cpp ships no cases for it.
    Loads,
    /// Refused at load; the error message contains this text.
    Refused(&'static str),
}

/// Every vocabulary in llama.cpp's test set, by file stem (`ggml-vocab-<stem>.gguf`).
const VOCABS: &[(&str, Expect)] = &[
    // gpt2 model without a `tokenizer.ggml.pre`: llama.cpp guesses "default" and warns that
    // generation quality will be degraded; kvwarden refuses.
    ("aquila", Expect::Refused("no tokenizer.ggml.pre")),
    ("baichuan", Expect::Loads),
    ("bert-bge", Expect::Refused("\"bert\"")),
    ("command-r", Expect::Pass),
    ("deepseek-coder", Expect::Pass),
    ("deepseek-llm", Expect::Pass),
    ("falcon", Expect::Pass),
    ("gemma-4", Expect::Refused("\"gemma4\"")),
    ("gpt-2", Expect::Pass),
    ("gpt-neox", Expect::Refused("no tokenizer.ggml.pre")),
    ("llama-bpe", Expect::Pass),
    ("llama-spm", Expect::Pass),
    ("mpt", Expect::Pass),
    ("nomic-bert-moe", Expect::Refused("\"t5\"")),
    ("phi-3", Expect::Pass),
    ("qwen2", Expect::Pass),
    ("qwen35", Expect::Pass),
    ("refact", Expect::Pass),
    ("starcoder", Expect::Pass),
];

/// Reads the cases the way test-tokenizer-0.cpp does: inputs separated by
/// `"\n__ggml_vocab_test__\n"`, one output line of space-separated ids per input, and a map
/// keyed by input (a repeated input keeps its last expected output).
fn read_cases(gguf: &Path) -> BTreeMap<String, Vec<u32>> {
    let read = |ext: &str| {
        let path = PathBuf::from(format!("{}.{ext}", gguf.display()));
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
    };
    let raw = read("inp");
    let outputs: Vec<String> = read("out").lines().map(str::to_owned).collect();
    const SEP: &str = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut rest = raw.as_str();
    while !rest.is_empty() {
        match rest.find(SEP) {
            Some(at) => {
                inputs.push(&rest[..at]);
                rest = &rest[at + SEP.len()..];
            }
            None => {
                inputs.push(rest);
                rest = "";
            }
        }
    }
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{}: input and output files have different numbers of cases",
        gguf.display()
    );
    let mut cases = BTreeMap::new();
    for (input, output) in inputs.into_iter().zip(outputs) {
        let ids = output
            .split_ascii_whitespace()
            .map(|t| t.parse().expect("token ids are integers"))
            .collect();
        cases.insert(input.to_owned(), ids);
    }
    cases
}

fn describe(tok: &Tokenizer) -> String {
    tok.pre_tokenizer()
        .map_or("SentencePiece".to_owned(), |p| format!("BPE, {p:?}"))
}

#[test]
fn llama_cpp_vocabularies() {
    let dir = common::llama_cpp_models_dir();
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let stem = name.strip_prefix("ggml-vocab-")?.strip_suffix(".gguf")?;
            Some(stem.to_owned())
        })
        .collect();
    on_disk.sort();
    let listed: Vec<&str> = VOCABS.iter().map(|(stem, _)| *stem).collect();
    for stem in &on_disk {
        assert!(
            listed.contains(&stem.as_str()),
            "ggml-vocab-{stem}.gguf is not in this test's table: say whether it passes or is refused"
        );
    }

    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (stem, expect) in VOCABS {
        let path = dir.join(format!("ggml-vocab-{stem}.gguf"));
        let file = gguf::GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let loaded = Tokenizer::from_gguf(&file);
        match (expect, loaded) {
            (Expect::Refused(needle), Err(e)) => {
                let msg = e.to_string();
                if !msg.contains(needle) {
                    failures.push(format!("{stem}: refused with {msg:?}, expected {needle:?}"));
                }
                report.push(format!("{stem:>15}: refused ({msg})"));
            }
            (Expect::Refused(_), Ok(_)) => {
                failures.push(format!("{stem}: loaded, but this test expects a refusal"));
            }
            (Expect::Pass | Expect::Loads, Err(e)) => {
                failures.push(format!("{stem}: refused: {e}"))
            }
            (Expect::Loads, Ok(tok)) => {
                report.push(format!("{stem:>15}: loads, no cases ({})", describe(&tok)))
            }
            (Expect::Pass, Ok(tok)) => {
                let cases = read_cases(&path);
                let mut passed = 0;
                for (text, want) in &cases {
                    // test-tokenizer-0: add_special = false, parse_special = false.
                    let got = tok.encode_ordinary(text);
                    if &got == want {
                        passed += 1;
                    } else {
                        failures.push(format!(
                            "{stem}: encode({text:?})\n  got  {got:?}\n  want {want:?}"
                        ));
                    }
                }
                report.push(format!(
                    "{stem:>15}: {passed}/{} cases ({})",
                    cases.len(),
                    describe(&tok)
                ));
            }
        }
    }
    println!("{}", report.join("\n"));
    assert!(
        failures.is_empty(),
        "{} failures:\n{}\n\nsummary:\n{}",
        failures.len(),
        failures.join("\n"),
        report.join("\n")
    );
}

fn load(stem: &str) -> Tokenizer {
    let path = common::llama_cpp_models_dir().join(format!("ggml-vocab-{stem}.gguf"));
    let file = gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{stem}: {e}"))
}

#[test]
fn sentencepiece_spaces_and_special_tokens() {
    let tok = load("phi-3");
    // Text that starts the input, or follows a special token, gets SentencePiece's space.
    let hi = tok.encode_ordinary("Hi");
    assert_eq!(tok.decode(&hi).expect("decodes"), " Hi");
    // Phi-3's special tokens swallow the whitespace after them (llama.cpp's RSTRIP), except
    // <s>, <unk> and <|endoftext|>.
    let user = tok.token_id("<|user|>").expect("phi-3 has <|user|>");
    let mut want = vec![user];
    want.extend(&hi);
    assert_eq!(tok.encode("<|user|>\n \tHi"), want);
    let bos = tok.token_id("<s>").expect("phi-3 has <s>");
    assert_ne!(tok.encode("<s>\nHi").get(1), hi.first());
    assert_eq!(tok.encode("<s>Hi"), [&[bos][..], &hi].concat());

    // Bytes with no token of their own are spelled with <0xXX> tokens and decode back.
    let llama = load("llama-spm");
    let text = "\u{1F980} crab";
    let ids = llama.encode_ordinary(text);
    assert!(ids
        .iter()
        .any(|&i| llama.token_type(i) == Some(tokenizer::TokenType::Byte)));
    assert_eq!(llama.decode(&ids).expect("decodes"), format!(" {text}"));
}

/// Whether each vocabulary asks for a BOS before prompts, against what llama.cpp decides for
/// it (`llama_vocab::impl::load`: SentencePiece and the Llama 3 pre-tokenizers default to
/// yes, other BPE vocabularies to no, and `tokenizer.ggml.add_bos_token` overrides both).
#[test]
fn add_bos_follows_llama_cpp() {
    let dir = common::llama_cpp_models_dir();
    for (stem, add_bos) in [
        ("llama-spm", true),
        ("llama-bpe", true),
        ("qwen2", false),
        ("gpt-2", false),
        ("starcoder", false),
        ("deepseek-llm", true),
        ("command-r", true),
        ("phi-3", true),
    ] {
        let path = dir.join(format!("ggml-vocab-{stem}.gguf"));
        let file = gguf::GgufFile::open(&path).expect("vocabulary parses");
        let tok = Tokenizer::from_gguf(&file).expect("vocabulary loads");
        assert_eq!(tok.add_bos(), add_bos, "{stem}");
        let bos = tok.bos_id();
        let with = tok.with_bos(tok.encode("Hello"));
        assert_eq!(with.first() == bos.as_ref(), add_bos, "{stem}: {with:?}");
        // A prompt that already starts with BOS (a template rendered it) gets no second one.
        assert_eq!(tok.with_bos(with.clone()), with, "{stem}");
    }
}
