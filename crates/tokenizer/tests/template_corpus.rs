//! llama.cpp's chat-template corpus (`models/templates/*.jinja` of the PyPI sdist
//! llama-cpp-python==0.3.36, fetched by `scripts/fetch-llama-vocabs.sh`) through kvwarden's
//! renderer, against what llama.cpp's own server rendered for the same conversation
//! (`tests/data/llama-templates.json`, written by `scripts/record-template-references.py`).
//!
//! Every template must either render exactly llama.cpp's prompt, or fail with an error that
//! says what it does not support; a different prompt is a failure. The counts are printed.

mod common;

use tokenizer::{ChatMessage, ChatTemplate};

/// Templates whose rendering differs from llama.cpp's for a known reason, kept listed so a
/// new difference (or one of these fixed) fails the test. llama.cpp's server decides per
/// template family whether to pass `enable_thinking` (its `common_chat_templates_apply`
/// special-cases families); kvwarden passes `enable_thinking = true` to every template, as
/// a template's own default is for most reasoning models.
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[
    (
        "Apertus-8B-Instruct.jinja",
        "llama.cpp renders it with deliberation disabled (no enable_thinking)",
    ),
    (
        "deepseek-ai-DeepSeek-V4.jinja",
        "llama.cpp passes thinking off for this family; its history turns differ",
    ),
    ("deepseek-ai-DeepSeek-V4-Flash-0731.jinja", "as DeepSeek-V4"),
];

#[test]
fn llama_cpp_templates_render_as_llama_cpp_or_refuse_by_name() {
    let path = common::workspace_root().join("tests/data/llama-templates.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{} is required (scripts/record-template-references.py): {e}",
            path.display()
        )
    });
    let refs: serde_json::Value = serde_json::from_str(&text).expect("references JSON");
    let meta = &refs["meta"];
    let messages: Vec<ChatMessage> =
        serde_json::from_value(meta["messages"].clone()).expect("recorded conversation");
    ChatTemplate::pin_now(meta["recorded_at_unix"].as_i64().expect("recording time"));
    let tok = common::tokenizer();
    let dir = common::llama_cpp_models_dir().join("templates");
    let templates = refs["templates"].as_object().expect("templates");
    assert!(
        templates.len() >= 20,
        "the recording holds too few templates"
    );

    let (mut equal, mut refused, mut both_refuse) = (Vec::new(), Vec::new(), Vec::new());
    let (mut different, mut unverified, mut known) = (Vec::new(), Vec::new(), Vec::new());
    for (name, theirs) in templates {
        let source = std::fs::read_to_string(dir.join(name))
            .unwrap_or_else(|e| panic!("{name} is in the recording but not the corpus: {e}"));
        let ours = tok
            .compile_template_source(&source)
            .and_then(|t| t.render(&messages, true));
        match (ours, theirs["prompt"].as_str()) {
            (Ok(ours), Some(prompt)) if ours == prompt => equal.push(name.clone()),
            (Ok(_), Some(_)) if KNOWN_DIFFERENCES.iter().any(|(n, _)| n == name) => {
                known.push(name.clone())
            }
            (Ok(ours), Some(prompt)) => different.push(format!(
                "{name}: differs from llama.cpp's\n--- kvwarden\n{ours}\n--- llama.cpp\n{prompt}"
            )),
            // Nothing to compare with: llama.cpp's server would not load it.
            (Ok(_), None) => unverified.push(name.clone()),
            (Err(e), prompt) => {
                let message = e.to_string();
                assert!(
                    message.len() > "chat template".len(),
                    "{name}: an error that says nothing: {message:?}"
                );
                if prompt.is_some() {
                    refused.push(format!("{name}: {message}"));
                } else {
                    both_refuse.push(name.clone());
                }
            }
        }
    }
    eprintln!(
        "{} templates: {} render exactly as llama.cpp, {} refused by kvwarden with an error \
         (llama.cpp renders them), {} refused by both, {} rendered where llama.cpp refused, \
         {} known differences, {} different",
        templates.len(),
        equal.len(),
        refused.len(),
        both_refuse.len(),
        unverified.len(),
        known.len(),
        different.len()
    );
    for r in &refused {
        eprintln!("  refused: {r}");
    }
    assert!(different.is_empty(), "{}", different.join("\n\n"));
    assert_eq!(
        known.len(),
        KNOWN_DIFFERENCES.len(),
        "a known difference now matches llama.cpp (or is no longer in the corpus): shorten \
         KNOWN_DIFFERENCES; differing now: {known:?}"
    );
    // Most of the corpus must work: a renderer that refused everything would pass the
    // checks above. Measured when recorded: see the closing note of the change.
    assert!(
        equal.len() * 2 > templates.len(),
        "only {} of {} templates render as llama.cpp does",
        equal.len(),
        templates.len()
    );
}

/// The reasoning switch of real templates, as a request's `chat_template_kwargs` sets it:
/// Qwen3's generation prompt holds an empty thinking block when it is off and none when it
/// is on; DeepSeek-R1's distillation opens the block itself, and closes it again when off.
#[test]
fn request_variables_switch_real_templates_thinking() {
    let tok = common::tokenizer();
    let dir = common::llama_cpp_models_dir().join("templates");
    let messages = vec![ChatMessage::new("user", "Why?")];
    let off = serde_json::json!({"enable_thinking": false});
    let off = off.as_object().unwrap();
    let render = |name: &str, variables| {
        let source = std::fs::read_to_string(dir.join(name))
            .unwrap_or_else(|e| panic!("{name} is not in the corpus: {e}"));
        tok.compile_template_source(&source)
            .and_then(|t| t.render_with_variables(&messages, None, variables, true))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let qwen3 = "Qwen-Qwen3-0.6B.jinja";
    assert!(render(qwen3, None).ends_with("<|im_start|>assistant\n"));
    assert!(render(qwen3, Some(off)).ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    let r1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja";
    assert!(render(r1, None).ends_with("<think>\n"));
    assert!(render(r1, Some(off)).ends_with("<think>\n</think>"));
}
