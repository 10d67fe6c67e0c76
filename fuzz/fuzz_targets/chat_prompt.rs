//! Hostile message contents through the real vocabulary and chat template
//! (`server::chat_prompt`). Whatever the contents, the prompt holds exactly the control
//! tokens the template itself puts there, and plain-text tokenization round-trips. With a
//! tool definition and an earlier call holding hostile text, through a template that
//! renders them as its own text, the prompt is refused or holds exactly the control tokens
//! it holds with harmless text there.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use server::chat_prompt;
use server::prep::Cancel;
use server::validation;
use tokenizer::ChatMessage;

#[derive(Debug, Arbitrary)]
struct Input {
    messages: Vec<(String, String)>,
    tool_text: Option<String>,
}

/// A template in the style of Qwen 2.5's that renders tools and calls as its own text.
const TOOL_TEMPLATE: &str = "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n";

fn tool_template() -> &'static tokenizer::ChatTemplate {
    static T: std::sync::OnceLock<tokenizer::ChatTemplate> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        tokenizer::ChatTemplate::new(TOOL_TEMPLATE).expect("the tool template compiles")
    })
}

fn tools_with(text: &str) -> serde_json::Value {
    serde_json::json!([{"type": "function", "function": {"name": "f", "description": text}}])
}

fn call_with(text: &str) -> ChatMessage {
    let mut m = ChatMessage::new("assistant", "");
    m.tool_calls = Some(serde_json::json!([{"id": "c", "type": "function",
        "function": {"name": "f", "arguments": {"q": text, text: 1}}}]));
    m
}

fuzz_target!(|input: Input| {
    let (tok, template) = kvwarden_fuzz::real_tokenizer();
    if input.messages.is_empty() || input.messages.len() > 64 {
        return;
    }
    let mut messages = Vec::new();
    for (role, content) in &input.messages {
        // Unknown roles are refused by the route before they get here; a role the fuzzer
        // cannot spell becomes "user".
        let role = validation::normalize_role(role).unwrap_or("user");
        messages.push(ChatMessage::new(role, content.clone()));
    }
    if validation::check_message_count(messages.len(), 8192).is_err() {
        return;
    }
    let (template, tools, benign_tools) = match &input.tool_text {
        None => (template, None, None),
        Some(text) => {
            messages.push(call_with(text));
            (
                tool_template(),
                Some(tools_with(text)),
                Some(tools_with("x")),
            )
        }
    };
    let Ok(tokens) = chat_prompt::prompt_tokens(
        tok,
        template,
        &messages,
        tools.as_ref(),
        &|_| Ok(()),
        &Cancel::never(),
    ) else {
        return;
    };
    let benign: Vec<ChatMessage> = messages
        .iter()
        .map(|m| match m.tool_calls {
            Some(_) => call_with("x"),
            None => ChatMessage::new(m.role.clone(), "x"),
        })
        .collect();
    let skeleton = template
        .render_with_tools(&benign, benign_tools.as_ref(), true)
        .unwrap_or_else(|e| panic!("the template renders plain messages: {e}"));
    let controls = |ids: &[u32]| -> Vec<u32> {
        ids.iter()
            .copied()
            .filter(|&id| tok.is_control(id))
            .collect()
    };
    assert_eq!(
        controls(&tokens),
        controls(&tok.encode(&skeleton)),
        "message content changed the prompt's control tokens"
    );
    for m in &messages {
        let ids = tok.encode_ordinary(&m.content);
        assert!(
            ids.iter().all(|&id| !tok.is_control(id)),
            "plain text became a control token"
        );
        // Not an exact round trip: like llama.cpp, the tokenizer drops bytes the vocabulary
        // has no token for (SmolLM2 lacks 0x04, for one; see `bpe.rs`). What comes out is
        // the content with some bytes left out, never bytes that were not there.
        let mut rest = m.content.as_bytes().iter();
        for id in &ids {
            let bytes = tok
                .token_bytes(*id)
                .unwrap_or_else(|| panic!("token {id} outside the vocabulary"));
            for b in bytes {
                assert!(
                    rest.any(|c| c == b),
                    "tokenizing {:?} produced bytes that are not in it",
                    m.content
                );
            }
        }
    }
});
