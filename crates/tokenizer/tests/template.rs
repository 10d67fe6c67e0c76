//! Chat-template rendering beyond the goldens.

mod common;

use tokenizer::{ChatMessage, ChatTemplate, TemplateError};

/// A multi-line template in the style of Llama/Mistral templates, exercising trim_blocks,
/// lstrip_blocks, the dropped trailing newline, slicing, filters, Python string methods
/// and raise_exception. The expected output was produced by Python jinja2 configured as
/// Hugging Face transformers does (ImmutableSandboxedEnvironment, trim_blocks=True,
/// lstrip_blocks=True); llama.cpp's minja uses the same settings.
const MULTILINE: &str = "{{ bos_token }}\n{% if messages[0]['role'] == 'system' %}\n    {% set system = messages[0]['content'] | trim %}\n    {% set loop_messages = messages[1:] %}\n{% else %}\n    {% set system = 'Default system.' %}\n    {% set loop_messages = messages %}\n{% endif %}\n<<SYS>>{{ system }}<</SYS>>\n{% for message in loop_messages %}\n    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n    {% endif %}\n    [{{ message['role'] | upper }}] {{ message['content'].strip() }}\n    {% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n[ASSISTANT]\n{% endif %}\n";

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "  Be brief.  "),
        ChatMessage::new("user", " Hi "),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::new("user", "{{ 7*7 }}"),
    ]
}

#[test]
fn multiline_template_matches_jinja2() {
    let t = ChatTemplate::new(MULTILINE)
        .expect("compiles")
        .with_special_tokens("<s>", "</s>");
    let msgs = conversation();
    assert_eq!(
        t.render(&msgs, true).expect("renders"),
        "<s>\n<<SYS>>Be brief.<</SYS>>\n    [USER] Hi\n    [ASSISTANT] Hello!\n</s>    [USER] {{ 7*7 }}\n[ASSISTANT]\n"
    );
    assert_eq!(
        t.render(&msgs[1..2], false).expect("renders"),
        "<s>\n<<SYS>>Default system.<</SYS>>\n    [USER] Hi\n"
    );
}

#[test]
fn message_content_is_data_not_template() {
    // The "{{ 7*7 }}" above stays literal; so does anything else a user sends.
    let t =
        ChatTemplate::new("{% for m in messages %}{{ m.content }}|{% endfor %}").expect("compiles");
    let msgs = [
        ChatMessage::new("user", "{% raise_exception('x') %}"),
        ChatMessage::new("user", "{{ messages }}"),
    ];
    assert_eq!(
        t.render(&msgs, false).expect("renders"),
        "{% raise_exception('x') %}|{{ messages }}|"
    );
}

#[test]
fn raise_exception_is_an_error_not_a_panic() {
    let t = ChatTemplate::new(MULTILINE).expect("compiles");
    let msgs = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    match t.render(&msgs, true) {
        Err(TemplateError::Raised(msg)) => {
            assert_eq!(
                msg,
                "Conversation roles must alternate user/assistant/user/assistant/..."
            )
        }
        other => panic!("expected a raised error, got {other:?}"),
    }

    let t = ChatTemplate::new("{{ raise_exception('no system role') }}").expect("compiles");
    let err = t.render(&[], false).expect_err("raises");
    assert!(
        matches!(&err, TemplateError::Raised(m) if m == "no system role"),
        "{err:?}"
    );
    assert!(err.to_string().contains("no system role"));
}

#[test]
fn broken_templates_are_errors() {
    assert!(matches!(
        ChatTemplate::new("{% for m in messages %}"),
        Err(TemplateError::Compile(_))
    ));
    assert!(matches!(
        ChatTemplate::new("{{ 1 + }}"),
        Err(TemplateError::Compile(_))
    ));
    // Failing at render time, not because the template raised.
    let t = ChatTemplate::new("{{ messages[0]['content'] + 1 }}").expect("compiles");
    let err = t
        .render(&[ChatMessage::new("user", "x")], false)
        .expect_err("str + int fails");
    assert!(matches!(err, TemplateError::Render(_)), "{err:?}");
}

#[test]
fn python_methods_and_loop_controls() {
    let src = "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\
               {{ m.content.lstrip().startswith('x') }},{{ m.content.split(',')|length }},\
               {{ m.items()|list|length }};{% endfor %}";
    let t = ChatTemplate::new(src).expect("compiles");
    let msgs = [
        ChatMessage::new("user", "  x,y"),
        ChatMessage::new("skip", "ignored"),
        ChatMessage::new("assistant", "z"),
    ];
    assert_eq!(
        t.render(&msgs, false).expect("renders"),
        "True,2,2;False,1,2;"
    );
}

#[test]
fn model_template_binds_its_bos_and_eos() {
    let tok = common::tokenizer();
    let t = tok
        .compile_chat_template()
        .expect("compiles")
        .expect("present");
    let t2 = ChatTemplate::new("{{ bos_token }}|{{ eos_token }}").expect("compiles");
    assert_eq!(t2.render(&[], false).expect("renders"), "|");
    let debug = format!("{t:?}");
    assert!(
        debug.contains("<|im_start|>") && debug.contains("<|im_end|>"),
        "{debug}"
    );
    // Without a system message the model's template adds its default one.
    let out = t
        .render(&[ChatMessage::new("user", "Hi")], false)
        .expect("renders");
    assert!(out.starts_with("<|im_start|>system\n"), "{out}");
    assert!(out.ends_with("<|im_start|>user\nHi<|im_end|>\n"), "{out}");
}

/// A request's own variables (`chat_template_kwargs`) reach the template and override the
/// renderer's defaults (`enable_thinking`), but never what the renderer defines itself: the
/// conversation, the special tokens and its functions.
#[test]
fn request_variables_set_defaults_but_never_the_renderers_own() {
    let source = "{{ bos_token }}{% if enable_thinking %}think{% else %}plain{% endif %}|{{ style }}|{{ messages | length }}|{% if raise_exception is string %}shadowed{% else %}fn{% endif %}";
    let t = ChatTemplate::new(source)
        .expect("compiles")
        .with_special_tokens("<s>", "</s>");
    let msgs = vec![ChatMessage::new("user", "Hi")];
    let vars = |v: serde_json::Value| v.as_object().cloned().expect("an object");
    assert_eq!(
        t.render(&msgs, true).expect("renders"),
        "<s>think||1|fn",
        "without variables thinking is on and unknown names are undefined"
    );
    let off = vars(serde_json::json!({"enable_thinking": false, "style": "terse"}));
    assert_eq!(
        t.render_with_variables(&msgs, None, Some(&off), true)
            .expect("renders"),
        "<s>plain|terse|1|fn"
    );
    let hostile = vars(serde_json::json!({
        "messages": [1, 2, 3],
        "bos_token": "<evil>",
        "raise_exception": "not a function",
    }));
    assert_eq!(
        t.render_with_variables(&msgs, None, Some(&hostile), true)
            .expect("renders"),
        "<s>think||1|fn",
        "a request's variable replaced one the renderer defines"
    );
}
