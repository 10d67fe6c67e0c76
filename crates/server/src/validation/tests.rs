//! Every check of `validation`, each refusal with its status, code and `param`, and the
//! order in which they run.

use super::*;
use crate::body::decode;

/// The vocabulary the parameters are checked against.
const VOCAB: usize = 1000;

fn chat(body: &str) -> Result<(Settings, Option<usize>), ApiError> {
    decode::<ChatRequest>(body.as_bytes())?.parameters(VOCAB)
}

fn completion(body: &str) -> Result<(Settings, Option<usize>), ApiError> {
    decode::<CompletionRequest>(body.as_bytes())?.parameters(VOCAB)
}

fn code(r: Result<(Settings, Option<usize>), ApiError>) -> (&'static str, Option<String>) {
    let e = r.unwrap_err();
    assert_eq!(e.status().as_u16(), 400, "{e}");
    (e.code(), e.param().map(str::to_owned))
}

const M: &str = r#""model":"m","messages":[{"role":"user","content":"hi"}]"#;

#[test]
fn chat_settings() {
    let (s, lp) = chat(&format!(
        r#"{{{M},"max_completion_tokens":7,"max_tokens":99,"temperature":0,"stop":"\n","stream":true,"stream_options":{{"include_usage":true}},"logprobs":true,"top_logprobs":3,"seed":-5}}"#
    ))
    .unwrap();
    assert_eq!(s.max_tokens, Some(7));
    assert_eq!(s.sampling.temperature, 0.0);
    assert_eq!(s.sampling.seed, (-5i64) as u64);
    assert_eq!(s.stops, vec!["\n".to_owned()]);
    assert!(s.stream && s.include_usage);
    assert_eq!(lp, Some(3));
    let (s, lp) = chat(&format!("{{{M}}}")).unwrap();
    assert_eq!(
        (s.max_tokens, lp, s.stream, s.include_usage),
        (None, None, false, false)
    );
    assert_eq!(s.sampling.temperature, 1.0);
}

#[test]
fn chat_refusals() {
    assert_eq!(
        code(chat(&format!(r#"{{{M},"n":17}}"#))),
        ("invalid_value", Some("n".into()))
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"top_logprobs":2}}"#))).0,
        "invalid_value"
    );
    assert_eq!(
        code(chat(&format!(
            r#"{{{M},"logprobs":true,"top_logprobs":21}}"#
        )))
        .0,
        "invalid_value"
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"temperature":2.5}}"#))),
        ("invalid_value", Some("temperature".into()))
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"top_p":0}}"#))).0,
        "invalid_value"
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"stop":["a","b","c","d","e"]}}"#))).1,
        Some("stop".into())
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"stop":[""]}}"#))).1,
        Some("stop".into())
    );
    // A stop string at the limit passes; one byte more (here a two-byte character
    // straddling it) is refused, for both endpoints.
    let at_limit = "a".repeat(MAX_STOP_BYTES);
    assert!(chat(&format!(r#"{{{M},"stop":["{at_limit}"]}}"#)).is_ok());
    let over = format!("{}é", "a".repeat(MAX_STOP_BYTES - 1));
    assert_eq!(
        code(chat(&format!(r#"{{{M},"stop":["x","{over}"]}}"#))),
        ("invalid_value", Some("stop".into()))
    );
    assert_eq!(
        code(completion(&format!(
            r#"{{"model":"m","prompt":"hi","stop":"{over}"}}"#
        )))
        .1,
        Some("stop".into())
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"functions":[{{}}]}}"#))).1,
        Some("functions".into())
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"presence_penalty":2.5}}"#))),
        ("invalid_value", Some("presence_penalty".into()))
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"cache_salt":""}}"#))).1,
        Some("cache_salt".into())
    );
    assert_eq!(
        code(chat(&format!(r#"{{{M},"top_k":-2}}"#))).1,
        Some("top_k".into())
    );
    assert_eq!(
        code(chat(r#"{"model":"m"}"#)),
        ("missing_required_parameter", Some("messages".into()))
    );
    assert_eq!(
        code(chat(r#"{"model":"m","messages":"hi"}"#)),
        ("invalid_type", Some("messages".into()))
    );
    assert_eq!(
        code(chat(r#"{"messages":[]}"#)),
        ("missing_required_parameter", Some("model".into()))
    );
    assert_eq!(
        code(chat(r#"{"model":"m","messages":[],"max_tokens":"5"}"#)),
        ("invalid_type", Some("max_tokens".into()))
    );
    assert_eq!(
        code(chat(r#"{"model":"m","messages":[],"stream":1}"#)),
        ("invalid_type", Some("stream".into()))
    );
}

/// However long the salt, the domain key is 32 hex digits; salts stay distinct.
#[test]
fn cache_salt_becomes_a_fixed_size_key() {
    let salted = |salt: &str| {
        let body = serde_json::json!({"model": "m", "prompt": "x", "cache_salt": salt});
        completion(&body.to_string()).unwrap().0.cache_salt.unwrap()
    };
    let huge = "s".repeat(2 << 20);
    let key = salted(&huge);
    assert_eq!(key.len(), 32);
    assert!(key.bytes().all(|b| b.is_ascii_hexdigit()), "{key}");
    assert_eq!(salted("project-x").len(), 32);
    assert_eq!(salted("project-x"), salted("project-x"));
    assert_ne!(salted("project-x"), salted("project-y"));
    assert_ne!(salted(&huge), salted(&huge[1..]));
}

#[test]
fn completion_refusals_and_prompts() {
    assert_eq!(
        code(completion(r#"{"model":"m","prompt":"x","echo":true}"#)).1,
        Some("echo".into())
    );
    assert_eq!(
        code(completion(r#"{"model":"m","prompt":"x","best_of":3}"#)).1,
        Some("best_of".into())
    );
    assert_eq!(
        code(completion(r#"{"model":"m","prompt":"x","logprobs":21}"#)).1,
        Some("logprobs".into())
    );
    assert_eq!(
        code(completion(r#"{"model":"m","prompt":{"a":1}}"#)),
        ("invalid_type", Some("prompt".into()))
    );
    let req: CompletionRequest = decode(br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
    assert_eq!(
        req.single_prompt().err().map(|e| e.code()),
        Some("unsupported_parameter")
    );
    let req: CompletionRequest = decode(br#"{"model":"m","prompt":[[1,2]]}"#).unwrap();
    assert_eq!(
        req.single_prompt().ok(),
        Some(PromptInput::Tokens(vec![1, 2]))
    );
    let req: CompletionRequest = decode(br#"{"model":"m","prompt":[3,4],"logprobs":2}"#).unwrap();
    assert_eq!(
        req.single_prompt().ok(),
        Some(PromptInput::Tokens(vec![3, 4]))
    );
    assert_eq!(req.parameters(VOCAB).unwrap().1, Some(2));
}

#[test]
fn message_content_forms() {
    let req: ChatRequest = decode(
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"assistant","content":null},{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
    )
    .unwrap();
    assert_eq!(req.messages[0].text(0).unwrap(), "ab");
    assert_eq!(req.messages[1].text(1).unwrap(), "");
    assert_eq!(
        req.messages[2].text(2).unwrap_err().code(),
        "unsupported_parameter"
    );
}

/// The whole validation of each endpoint, and which of two errors a request gets first.
#[test]
fn checks_run_in_order() {
    let template =
        Arc::new(ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}").unwrap());
    let catalog = Catalog::new("m", Arc::new(engine::Adapters::new()));
    let served = ServedModel {
        name: "m",
        tenant: "t",
        adapters: &catalog,
        max_context: 3,
        vocab_size: VOCAB,
        template: Some(&template),
        tool_format: crate::tools::ToolFormat::Hermes,
        tool_marker: None,
    };
    let no_template = ServedModel {
        template: None,
        ..served
    };
    let chat_err = |served: &ServedModel, body: &str| {
        let req: ChatRequest = decode(body.as_bytes()).unwrap();
        let e = super::chat(&req, served).unwrap_err();
        (e.status().as_u16(), e.code(), e.param().map(str::to_owned))
    };
    let completion_err = |body: &str| {
        let req: CompletionRequest = decode(body.as_bytes()).unwrap();
        let e = super::completion(&req, &served).unwrap_err();
        (e.status().as_u16(), e.code(), e.param().map(str::to_owned))
    };
    // The model name before the parameters.
    assert_eq!(
        chat_err(&served, r#"{"model":"x","messages":[],"n":17}"#),
        (404, "model_not_found", Some("model".into()))
    );
    assert_eq!(
        completion_err(r#"{"model":"x","prompt":["a","b"],"echo":true}"#).1,
        "model_not_found"
    );
    // The parameters before the prompt, and before the messages.
    assert_eq!(
        completion_err(r#"{"model":"m","prompt":["a","b"],"echo":true}"#).2,
        Some("echo".into())
    );
    assert_eq!(
        completion_err(r#"{"model":"m","prompt":["a","b"]}"#).2,
        Some("prompt".into())
    );
    assert_eq!(
        chat_err(&served, r#"{"model":"m","messages":[],"n":17}"#).2,
        Some("n".into())
    );
    assert_eq!(
        chat_err(&served, r#"{"model":"m","messages":[]}"#),
        (400, "invalid_value", Some("messages".into()))
    );
    // More messages than the context has tokens, before any role is looked at.
    let many = r#"{"model":"m","messages":[{"role":"x"},{"role":"x"},{"role":"x"},{"role":"x"}]}"#;
    assert_eq!(
        chat_err(&served, many),
        (400, "context_length_exceeded", Some("messages".into()))
    );
    // Message by message: the role, then the content.
    let both = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]},{"role":"x"}]}"#;
    assert_eq!(
        chat_err(&served, both).2,
        Some("messages[0].content[0].type".into())
    );
    let both = r#"{"model":"m","messages":[{"role":"x","content":[{"type":"image_url"}]}]}"#;
    assert_eq!(chat_err(&served, both).2, Some("messages[0].role".into()));
    // The template last.
    let ok = r#"{"model":"m","messages":[{"role":"developer","content":"hi"}]}"#;
    assert_eq!(
        chat_err(&no_template, ok),
        (400, "unsupported_endpoint", None)
    );
    assert_eq!(
        chat_err(&no_template, both).2,
        Some("messages[0].role".into())
    );
    let req: ChatRequest = decode(ok.as_bytes()).unwrap();
    let valid = super::chat(&req, &served).unwrap();
    assert_eq!(
        (
            valid.messages[0].role.as_str(),
            valid.messages[0].content.as_str()
        ),
        ("system", "hi")
    );
    let req: CompletionRequest = decode(br#"{"model":"m","prompt":"hi"}"#).unwrap();
    assert_eq!(
        super::completion(&req, &served).unwrap().prompt,
        PromptInput::Text("hi".into())
    );
}

#[test]
fn penalties_bias_and_min_p_become_sampling_settings() {
    let (s, _) = completion(
        r#"{"model":"m","prompt":"x","presence_penalty":0.5,"frequency_penalty":-1,"repeat_penalty":1.3,"repeat_last_n":-1,"min_p":0.1,"logit_bias":{"17":-100,"3":2.5,"999":0}}"#,
    )
    .unwrap();
    let p = s.sampling.penalties;
    assert_eq!((p.presence, p.frequency, p.repetition), (0.5, -1.0, 1.3));
    assert_eq!(p.repeat_last_n, usize::MAX);
    assert_eq!(s.sampling.min_p, 0.1);
    assert_eq!(
        &s.sampling.logit_bias[..],
        &[(3, 2.5), (17, -100.0), (999, 0.0)]
    );
    // vLLM's name for the same setting; llama.cpp's window by default.
    let (s, _) = chat(&format!(r#"{{{M},"repetition_penalty":1.1}}"#)).unwrap();
    assert_eq!(s.sampling.penalties.repetition, 1.1);
    assert_eq!(s.sampling.penalties.repeat_last_n, 64);
    let (s, _) = chat(&format!("{{{M}}}")).unwrap();
    assert_eq!(
        s.sampling,
        SamplingParams {
            seed: s.sampling.seed,
            temperature: 1.0,
            ..Default::default()
        }
    );
}

#[test]
fn penalty_bias_and_min_p_refusals() {
    for (body, param) in [
        (r#""frequency_penalty":-2.01"#, "frequency_penalty"),
        (r#""min_p":1.5"#, "min_p"),
        (r#""repetition_penalty":0"#, "repetition_penalty"),
        (r#""repeat_penalty":2.5"#, "repeat_penalty"),
        (
            r#""repetition_penalty":1.1,"repeat_penalty":1.2"#,
            "repeat_penalty",
        ),
        (r#""repeat_last_n":-2"#, "repeat_last_n"),
        (r#""logit_bias":{"1000":1}"#, "logit_bias"),
        (r#""logit_bias":{"-1":1}"#, "logit_bias"),
        (r#""logit_bias":{"word":1}"#, "logit_bias"),
        (r#""logit_bias":{"5":101}"#, "logit_bias"),
        (r#""logit_bias":{"5":"1"}"#, "logit_bias"),
        (r#""logit_bias":{"7":1,"07":2}"#, "logit_bias"),
    ] {
        assert_eq!(
            code(chat(&format!("{{{M},{body}}}"))),
            ("invalid_value", Some(param.into())),
            "{body}"
        );
    }
    let many: serde_json::Map<String, Value> = (0..=MAX_LOGIT_BIAS)
        .map(|i| (i.to_string(), Value::from(1)))
        .collect();
    let body = serde_json::json!({"model": "m", "prompt": "x", "logit_bias": many});
    let e = decode::<CompletionRequest>(body.to_string().as_bytes())
        .unwrap()
        .parameters(1 << 20)
        .unwrap_err();
    assert_eq!(e.param(), Some("logit_bias"));
}

/// vLLM's `stop_token_ids` (ids of this vocabulary, at most [`MAX_STOP_TOKEN_IDS`], sorted
/// and each once for the engine) and `min_tokens` (at most `max_tokens`, never beside a
/// structured output, which ends when it is complete).
#[test]
fn stop_token_ids_and_min_tokens() {
    let (s, _) = chat(&format!(
        r#"{{{M},"stop_token_ids":[9,3,9],"min_tokens":4,"max_tokens":4}}"#
    ))
    .unwrap();
    assert_eq!(&*s.sampling.stop_tokens, &[3, 9]);
    assert_eq!(s.sampling.min_tokens, 4);
    let (s, _) = completion(r#"{"model":"m","prompt":"x"}"#).unwrap();
    assert!(s.sampling.stop_tokens.is_empty() && s.sampling.min_tokens == 0);
    let many: Vec<usize> = (0..=MAX_STOP_TOKEN_IDS).collect();
    for (body, code_and_param) in [
        (
            r#""stop_token_ids":[1000]"#.to_owned(),
            ("invalid_value", "stop_token_ids"),
        ),
        (
            format!(r#""stop_token_ids":{many:?}"#),
            ("invalid_value", "stop_token_ids"),
        ),
        (
            r#""stop_token_ids":[-1]"#.to_owned(),
            ("invalid_value", "stop_token_ids[0]"),
        ),
        (
            r#""min_tokens":5,"max_tokens":4"#.to_owned(),
            ("invalid_value", "min_tokens"),
        ),
        (
            r#""min_tokens":2,"response_format":{"type":"json_object"}"#.to_owned(),
            ("invalid_value", "min_tokens"),
        ),
    ] {
        let (code, param) = code(chat(&format!("{{{M},{body}}}")));
        assert_eq!(
            (code, param.as_deref()),
            (code_and_param.0, Some(code_and_param.1)),
            "{body}"
        );
    }
}

/// Nothing is accepted and ignored: an unknown field is a 400 that names it, at any depth
/// a client writes; the two accepted without effect are accepted.
#[test]
fn unknown_fields_are_refused_by_name() {
    for (body, param) in [
        (format!(r#"{{{M},"guided_regex":"a+"}}"#), "guided_regex"),
        (format!(r#"{{{M},"mirostat":2}}"#), "mirostat"),
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi","weight":1}]}"#.to_owned(),
            "messages[0].weight",
        ),
        (
            format!(
                r#"{{{M},"stream":true,"stream_options":{{"include_usage":true,"continuous_usage_stats":true}}}}"#
            ),
            "stream_options.continuous_usage_stats",
        ),
    ] {
        let e = chat(&body).unwrap_err();
        assert_eq!(
            (e.status().as_u16(), e.code(), e.param()),
            (400, "unsupported_parameter", Some(param)),
            "{body}"
        );
        assert!(e.to_string().contains(param), "{e}");
    }
    let e = completion(r#"{"model":"m","prompt":"x","typical_p":0.9}"#).unwrap_err();
    assert_eq!(e.param(), Some("typical_p"));
    assert!(chat(&format!(r#"{{{M},"user":"u1","cache_prompt":false}}"#)).is_ok());
    assert!(completion(r#"{"model":"m","prompt":"x","cache_prompt":true}"#).is_ok());
}

/// A model with a plain chat template, Hermes tool calls and no adapters.
struct ChatModel {
    template: Arc<ChatTemplate>,
    catalog: Catalog,
}

impl ChatModel {
    fn new() -> Self {
        Self {
            template: Arc::new(
                ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}").unwrap(),
            ),
            catalog: Catalog::new("m", Arc::new(engine::Adapters::new())),
        }
    }

    fn served(&self) -> ServedModel<'_> {
        ServedModel {
            name: "m",
            tenant: "t",
            adapters: &self.catalog,
            max_context: 100,
            vocab_size: VOCAB,
            template: Some(&self.template),
            tool_format: crate::tools::ToolFormat::Hermes,
            tool_marker: None,
        }
    }
}

/// Tool calls belong to assistant turns and call ids to tool turns: elsewhere they are
/// refused, never dropped; an earlier answer's message sent back as OpenAI returns it
/// (refusal null) is accepted.
#[test]
fn tool_fields_of_a_message_are_taken_only_where_their_role_carries_them() {
    let chat_model = ChatModel::new();
    let served = chat_model.served();
    let run = |body: &str| {
        let req: ChatRequest = decode(body.as_bytes()).unwrap();
        super::chat(&req, &served).map(|_| ())
    };
    let e = run(r#"{"model":"m","messages":[{"role":"user","content":"hi","tool_calls":[]}]}"#)
        .unwrap_err();
    assert_eq!(e.param(), Some("messages[0].tool_calls"));
    assert_eq!(e.code(), "unsupported_parameter");
    let e = run(r#"{"model":"m","messages":[{"role":"user","content":"hi","tool_call_id":"c1"}]}"#)
        .unwrap_err();
    assert_eq!(e.param(), Some("messages[0].tool_call_id"));
    let e = run(r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1"}]}]}"#).unwrap_err();
    assert_eq!(e.param(), Some("messages[1].tool_calls[0].function"));
    let e = run(r#"{"model":"m","messages":[{"role":"assistant","content":null,"function_call":{"name":"f"}}]}"#).unwrap_err();
    assert_eq!(e.param(), Some("messages[0].function_call"));
    assert!(run(r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo","refusal":null,"tool_calls":null}]}"#).is_ok());
    assert!(run(r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}]}"#).is_ok());
    let e = run(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required","stop":["x"]}"#).unwrap_err();
    assert_eq!(e.param(), Some("stop"));
    let e = run(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required","response_format":{"type":"json_object"}}"#).unwrap_err();
    assert_eq!(e.param(), Some("response_format"));
    assert!(chat(&format!(r#"{{{M},"parallel_tool_calls":false}}"#)).is_ok());
    let e = chat(&format!(r#"{{{M},"functions":[]}}"#)).unwrap_err();
    assert_eq!(e.param(), Some("functions"));
}

/// `chat_template_kwargs`: an object of identifier names the renderer does not define, at
/// most [`MAX_TEMPLATE_VARIABLES`]; an assistant turn may carry its earlier thoughts, no
/// other turn.
#[test]
fn template_variables_and_earlier_thoughts_are_checked() {
    let chat_model = ChatModel::new();
    let served = chat_model.served();
    let run = |extra: &str| {
        let body = format!(r#"{{{M}{extra}}}"#);
        let req: ChatRequest = decode(body.as_bytes()).unwrap();
        super::chat(&req, &served)
    };
    let ok = run(r#","chat_template_kwargs":{"enable_thinking":false,"_x9":{"a":[1]}}"#).unwrap();
    let vars = ok.template_variables.expect("variables kept");
    assert_eq!(vars["enable_thinking"], Value::Bool(false));
    assert_eq!(vars.len(), 2);
    assert!(run(r#","chat_template_kwargs":null"#)
        .unwrap()
        .template_variables
        .is_none());
    let refused = |extra: &str| {
        let e = run(extra).map(|_| ()).unwrap_err();
        assert_eq!(e.status().as_u16(), 400, "{extra}");
        (e.code(), e.param().map(str::to_owned))
    };
    let p = Some("chat_template_kwargs".to_owned());
    assert_eq!(
        refused(r#","chat_template_kwargs":[]"#),
        ("invalid_type", p.clone())
    );
    assert_eq!(
        refused(r#","chat_template_kwargs":"x""#),
        ("invalid_type", p.clone())
    );
    for name in ["1a", "a-b", "", "é", &"a".repeat(65)] {
        let extra = format!(r#","chat_template_kwargs":{{"{name}":1}}"#);
        assert_eq!(refused(&extra), ("invalid_value", p.clone()), "{name:?}");
    }
    for name in ChatTemplate::RENDERER_VARIABLES {
        let extra = format!(r#","chat_template_kwargs":{{"{name}":1}}"#);
        assert_eq!(
            refused(&extra),
            (
                "invalid_value",
                Some(format!("chat_template_kwargs.{name}"))
            )
        );
    }
    let many: Vec<String> = (0..=MAX_TEMPLATE_VARIABLES)
        .map(|i| format!(r#""v{i}":1"#))
        .collect();
    let extra = format!(r#","chat_template_kwargs":{{{}}}"#, many.join(","));
    assert_eq!(refused(&extra), ("invalid_value", p));

    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo","reasoning_content":"they greet"}]}"#;
    let req: ChatRequest = decode(body.as_bytes()).unwrap();
    let ok = super::chat(&req, &served).unwrap();
    assert_eq!(
        ok.messages[1].reasoning_content.as_deref(),
        Some("they greet")
    );
    let body =
        r#"{"model":"m","messages":[{"role":"user","content":"hi","reasoning_content":"x"}]}"#;
    let req: ChatRequest = decode(body.as_bytes()).unwrap();
    let e = super::chat(&req, &served).unwrap_err();
    assert_eq!(
        (e.code(), e.param()),
        (
            "unsupported_parameter",
            Some("messages[0].reasoning_content")
        )
    );
    let body =
        r#"{"model":"m","messages":[{"role":"assistant","content":"hi","reasoning_content":7}]}"#;
    let req: ChatRequest = decode(body.as_bytes()).unwrap();
    let e = super::chat(&req, &served).unwrap_err();
    assert_eq!(
        (e.code(), e.param()),
        ("invalid_type", Some("messages[0].reasoning_content"))
    );
}

/// An adapter set of references by name (a router's kind: no weights needed to select).
struct Named(Vec<&'static str>);

impl crate::adapters::AdapterSet for Named {
    fn get(&self, name: &str) -> Option<engine::AdapterRef> {
        let i = self.0.iter().position(|n| *n == name)?;
        Some(engine::AdapterRef::remote(name, i as u128 + 1, 0))
    }

    fn info(&self) -> Vec<engine::AdapterInfo> {
        Vec::new()
    }
}

/// `model` names the base or an adapter the tenant may use; llama.cpp's `lora` names one by
/// id at its loaded scale; anything the tenant may not use answers as what does not exist.
#[test]
fn a_request_selects_an_adapter_by_model_or_lora() {
    let catalog = Catalog::new("m", Arc::new(Named(vec!["A", "B", "half"])));
    catalog.add("A", 1.0, None).unwrap();
    catalog.add("B", 1.0, None).unwrap();
    catalog.add("half", 0.5, None).unwrap();
    let access = crate::adapters::AccessList::parse("A alice\nB bob\nhalf alice\n").unwrap();
    assert!(catalog.restrict(&access).unwrap().is_empty());
    let served = |tenant| ServedModel {
        name: "m",
        tenant,
        adapters: &catalog,
        max_context: 100,
        vocab_size: VOCAB,
        template: None,
        tool_format: crate::tools::ToolFormat::Hermes,
        tool_marker: None,
    };
    let select = |tenant: &'static str, body: &str| {
        let req: CompletionRequest = decode(body.as_bytes()).unwrap();
        super::completion(&req, &served(tenant))
            .map(|v| v.settings.adapter.map(|a| a.name().to_owned()))
    };
    let refusal = |tenant: &'static str, body: &str| {
        let e = select(tenant, body).unwrap_err();
        (
            e.status().as_u16(),
            e.code(),
            e.param().map(str::to_owned),
            e.body().to_string(),
        )
    };
    assert_eq!(
        select("alice", r#"{"model":"m","prompt":"x"}"#).unwrap(),
        None
    );
    assert_eq!(
        select("alice", r#"{"model":"A","prompt":"x"}"#).unwrap(),
        Some("A".into())
    );
    assert_eq!(
        select("bob", r#"{"model":"B","prompt":"x"}"#).unwrap(),
        Some("B".into())
    );
    // Another tenant's adapter: the very answer of a name nobody has.
    let theirs = refusal("alice", r#"{"model":"B","prompt":"x"}"#);
    let nothing = refusal("alice", r#"{"model":"Z","prompt":"x"}"#);
    assert_eq!((theirs.0, theirs.1), (404, "model_not_found"));
    assert_eq!(theirs.3.replace("`B`", "`Z`"), nothing.3);
    // By id: ids follow the catalog's order; scale 0 entries are left out.
    let lora = |tenant, list: &str| {
        select(
            tenant,
            &format!(r#"{{"model":"m","prompt":"x","lora":{list}}}"#),
        )
    };
    assert_eq!(
        lora("alice", r#"[{"id":0,"scale":1}]"#).unwrap(),
        Some("A".into())
    );
    assert_eq!(
        lora("alice", r#"[{"id":0,"scale":0},{"id":2,"scale":0.5}]"#).unwrap(),
        Some("half".into())
    );
    assert_eq!(
        lora("alice", r#"[{"id":0,"scale":0},{"id":1,"scale":0}]"#).unwrap(),
        None
    );
    assert_eq!(lora("alice", "null").unwrap(), None);
    assert_eq!(lora("alice", "[]").unwrap(), None);
    let by_id = |tenant, list: &str| {
        refusal(
            tenant,
            &format!(r#"{{"model":"m","prompt":"x","lora":{list}}}"#),
        )
    };
    let theirs = by_id("alice", r#"[{"id":1,"scale":1}]"#);
    let nothing = by_id("alice", r#"[{"id":9,"scale":1}]"#);
    assert_eq!(
        (theirs.0, theirs.1, theirs.2.as_deref()),
        (404, "model_not_found", Some("lora[0].id"))
    );
    assert_eq!(theirs.3.replace("id 1", "id 9"), nothing.3);
    for (list, param) in [
        (r#"[{"id":0,"scale":0.5}]"#, "lora[0].scale"),
        (r#"[{"id":2,"scale":1}]"#, "lora[0].scale"),
        (r#"[{"id":0,"scale":1},{"id":2,"scale":0.5}]"#, "lora"),
        (r#"{"id":0,"scale":1}"#, "lora"),
        (r#"[7]"#, "lora[0]"),
        (r#"[{"id":"0","scale":1}]"#, "lora[0].id"),
        (r#"[{"id":0}]"#, "lora[0].scale"),
        (r#"[{"id":0,"scale":1,"path":"x"}]"#, "lora[0].path"),
    ] {
        let (status, _, p, _) = by_id("alice", list);
        assert_eq!((status, p.as_deref()), (400, Some(param)), "{list}");
    }
    let e = refusal(
        "alice",
        r#"{"model":"A","prompt":"x","lora":[{"id":0,"scale":1}]}"#,
    );
    assert_eq!((e.0, e.2.as_deref()), (400, Some("lora")));
    // The model is checked first: an unknown model with a bad lora list is a 404.
    assert_eq!(
        refusal("alice", r#"{"model":"Z","prompt":"x","lora":7}"#).0,
        404
    );
    // The chat endpoint selects the same way.
    let req: ChatRequest =
        decode(br#"{"model":"A","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
    let e = super::chat(&req, &served("bob")).unwrap_err();
    assert_eq!(e.code(), "model_not_found");
}
