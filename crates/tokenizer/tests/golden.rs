//! The reference outputs of llama.cpp on the default model, reproduced exactly.

mod common;

use tokenizer::{ChatMessage, ChatTemplate};

#[test]
fn tokenizer_goldens() {
    let tok = common::tokenizer();
    let golden = common::golden("tokenizer.json");
    let cases = golden["cases"]
        .as_array()
        .expect("tokenizer.json has a cases array");
    assert!(!cases.is_empty(), "tokenizer.json has no cases");
    let mut failures = Vec::new();
    let mut roundtrips = 0;
    for case in cases {
        let text = case["text"].as_str().expect("case text is a string");
        let want: Vec<u32> = case["tokens"]
            .as_array()
            .expect("case tokens is an array")
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .expect("token ids are u32")
            })
            .collect();
        let got = tok.encode(text);
        if got != want {
            failures.push(format!("encode({text:?})\n  got  {got:?}\n  want {want:?}"));
        }
        if case["roundtrip"].as_bool() == Some(true) {
            roundtrips += 1;
            match tok.decode(&want) {
                Ok(back) if back == text => {}
                other => failures.push(format!("decode of {text:?} gave {other:?}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} golden failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(roundtrips > 0, "no golden case checked decoding");
}

#[test]
fn chat_template_goldens() {
    let tok = common::tokenizer();
    let source = tok.chat_template().expect("the model has a chat template");
    let template = tok
        .compile_chat_template()
        .expect("template compiles")
        .expect("template present");
    let bare = ChatTemplate::new(source).expect("template compiles");
    let golden = common::golden("chat_template.json");
    let cases = golden["cases"]
        .as_array()
        .expect("chat_template.json has a cases array");
    assert!(!cases.is_empty(), "chat_template.json has no cases");
    for case in cases {
        let messages: Vec<ChatMessage> =
            serde_json::from_value(case["messages"].clone()).expect("messages deserialize");
        let want = case["prompt"].as_str().expect("prompt is a string");
        assert_eq!(
            template.render(&messages, true).expect("renders"),
            want,
            "messages {messages:?}"
        );
        // This template does not use bos/eos, so binding them must not change anything.
        assert_eq!(bare.render(&messages, true).expect("renders"), want);
    }
}

#[test]
fn golden_prompt_tokenizes_to_control_tokens() {
    // The rendered prompt goes through encode(); the chat markers must become the control
    // tokens the model was trained with, not their spelling.
    let tok = common::tokenizer();
    let golden = common::golden("chat_template.json");
    let prompt = golden["cases"][0]["prompt"].as_str().expect("prompt");
    let ids = tok.encode(prompt);
    let im_start = tok.token_id("<|im_start|>").expect("im_start");
    let im_end = tok.token_id("<|im_end|>").expect("im_end");
    assert_eq!(im_start, 1);
    assert_eq!(im_end, 2);
    assert_eq!(ids.iter().filter(|&&i| i == im_start).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == im_end).count(), 2);
    assert_eq!(ids[0], im_start);
    assert_eq!(tok.decode(&ids).expect("decodes"), prompt);
}
