//! Gemma 3 270M's SentencePiece vocabulary and the Gemma turn template
//! (`templates/gemma3.jinja`, the file has no template of its own) against llama.cpp's
//! answers recorded in `tests/data/gemma3/references.json` (see its README).

use std::path::PathBuf;
use std::process::Command;

use tokenizer::{ChatMessage, Tokenizer};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The file, fetched by the project's script when missing; fails loudly, never skips.
fn gemma3() -> Tokenizer {
    let path = root().join("models/gemma-3-270m-q4_k_m.gguf");
    if !path.exists() {
        let status = Command::new("bash")
            .arg(root().join("scripts/fetch-gemma3.sh"))
            .status()
            .expect("running scripts/fetch-gemma3.sh");
        assert!(status.success(), "scripts/fetch-gemma3.sh failed");
    }
    let file = gguf::GgufFile::open(&path).expect("the Gemma 3 file parses");
    Tokenizer::from_gguf(&file).expect("its vocabulary loads")
}

fn references() -> serde_json::Value {
    let path = root().join("tests/data/gemma3/references.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{} is required: {e}", path.display()));
    serde_json::from_str(&text).expect("references JSON")
}

#[test]
fn gemma3_tokenizes_as_llama_cpp() {
    let tok = gemma3();
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(
        (tok.bos_id(), tok.eos_id(), tok.add_bos()),
        (Some(2), Some(1), true)
    );
    let refs = references();
    let cases = refs["tokenize"].as_array().unwrap();
    assert!(cases.len() >= 5);
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text);
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, llama.cpp {want:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_gemma_turn_template_renders_as_llama_cpp_renders_it() {
    let tok = gemma3();
    let source = std::fs::read_to_string(root().join("templates/gemma3.jinja")).unwrap();
    let template = tok.compile_template_source(&source).unwrap();
    let chat = &references()["chat"];
    let messages: Vec<ChatMessage> = chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    let ours = template.render(&messages, true).unwrap();
    // llama.cpp's /apply-template shows the prompt without the BOS text the template puts
    // first (its tokenizer adds the BOS back); kvwarden keeps it and does not add another.
    let theirs = chat["prompt"].as_str().unwrap();
    assert_eq!(ours, format!("<bos>{theirs}"));
    assert_eq!(
        tok.with_bos(tok.encode(&ours)),
        tok.with_bos(tok.encode(theirs))
    );
    // A system message goes to the start of the first user turn; other roles are refused.
    let sys = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
    ];
    assert_eq!(
        template.render(&sys, true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    let tool = [ChatMessage::new("tool", "42")];
    let e = template.render(&tool, true).unwrap_err().to_string();
    assert!(e.contains("role tool"), "{e}");
}
