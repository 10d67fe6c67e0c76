use serde_json::json;

use super::*;

fn weather() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

fn tools() -> Vec<Tool> {
    requested(Some(&weather()), None, None, ToolFormat::Hermes)
        .unwrap()
        .unwrap()
        .tools
}

fn param_of(e: ApiError) -> Option<String> {
    e.param().map(str::to_owned)
}

#[test]
fn each_bad_tool_field_is_refused_by_name() {
    let req = |tools: Value, choice: Option<Value>| {
        requested(Some(&tools), choice.as_ref(), None, ToolFormat::Hermes)
    };
    let bad = [
        (json!({}), "tools"),
        (json!([]), "tools"),
        (json!([{"type": "code_interpreter"}]), "tools[0].type"),
        (
            json!([{"type": "function", "function": {"name": "a b"}}]),
            "tools[0].function.name",
        ),
        (
            json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
            "tools[0].function.parameters",
        ),
        (
            json!([{"type": "function", "function": {"name": "f", "extra": 1}}]),
            "tools[0].function.extra",
        ),
        (
            json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
            "tools[1].function.name",
        ),
    ];
    for (tools, param) in bad {
        assert_eq!(
            param_of(req(tools.clone(), None).unwrap_err()).as_deref(),
            Some(param),
            "{tools}"
        );
    }
    let many: Vec<Value> = (0..=MAX_TOOLS)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    assert!(req(Value::Array(many), None).is_err());
    let e = req(
        weather(),
        Some(json!({"type": "function", "function": {"name": "other"}})),
    )
    .unwrap_err();
    assert_eq!(param_of(e).as_deref(), Some("tool_choice.function.name"));
    assert!(req(weather(), Some(json!("sometimes"))).is_err());
    let e = requested(None, Some(&json!("required")), None, ToolFormat::Hermes).unwrap_err();
    assert_eq!(param_of(e).as_deref(), Some("tool_choice"));
    assert!(requested(
        Some(&weather()),
        None,
        Some(&json!("yes")),
        ToolFormat::Hermes
    )
    .is_err());
    // `none` means the tools play no part.
    assert!(req(weather(), Some(json!("none"))).unwrap().is_none());
}

#[test]
fn each_family_parses_its_own_calls_and_nothing_else() {
    let t = tools();
    let args = r#"{"city":"Paris"}"#;
    let cases = [
        (ToolFormat::Hermes, "Let me look.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", Some("Let me look."), 1),
        (ToolFormat::Hermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}\n</tool_call>", None, 2),
        (ToolFormat::Llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", None, 1),
        (ToolFormat::Llama3, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", None, 2),
        (ToolFormat::Mistral, "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]", None, 1),
        (ToolFormat::Generic, "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]}", None, 1),
    ];
    for (format, text, content, n) in cases {
        let parsed = format.parse(text, &t);
        assert_eq!(parsed.content.as_deref(), content, "{format:?} {text}");
        assert_eq!(parsed.calls.len(), n, "{format:?} {text}");
        for c in &parsed.calls {
            assert_eq!(
                (c.name.as_str(), c.arguments.as_str()),
                ("get_weather", args)
            );
        }
    }
    // Not calls: an undeclared function, text after the calls, broken JSON, prose.
    let not_calls = [
        (
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",
        ),
        (
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call> and then",
        ),
        (
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"argu",
        ),
        (ToolFormat::Llama3, "The weather is {fine}"),
        (ToolFormat::Generic, "{\"answer\": 1}"),
        (ToolFormat::Mistral, "[TOOL_CALLS] nothing"),
    ];
    for (format, text) in not_calls {
        let parsed = format.parse(text, &t);
        assert!(parsed.calls.is_empty(), "{format:?} {text}");
        assert_eq!(parsed.content.as_deref(), Some(text));
    }
}

#[test]
fn a_stream_split_anywhere_says_what_the_whole_answer_says() {
    let t = tools();
    let texts = [
        (ToolFormat::Hermes, "Sure. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
        (ToolFormat::Hermes, "No call here, only a < and <tool_ca"),
        (ToolFormat::Llama3, "  {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"),
        (ToolFormat::Llama3, "<|python_ta is not a call"),
        (ToolFormat::Generic, "plain words"),
    ];
    for (format, text) in texts {
        let whole = format.parse(text, &t);
        let calling = std::sync::Arc::new(ToolCalling {
            tools: t.clone(),
            declared: weather(),
            choice: Choice::Auto,
            parallel: true,
            format,
        });
        for step in 1..=7 {
            let mut s = stream::ToolStream::new(calling.clone());
            let mut content = String::new();
            let chars: Vec<char> = text.chars().collect();
            let mut chunks = chars.chunks(step).map(|c| c.iter().collect::<String>());
            let last = chunks.next_back().unwrap_or_default();
            for c in chunks {
                content.push_str(&s.push(&c));
            }
            let (rest, calls) = s.finish(&last, true);
            content.push_str(&rest);
            assert_eq!(calls, whole.calls, "{format:?} by {step}: {text}");
            assert_eq!(
                Some(content).filter(|c| !c.is_empty()),
                whole.content,
                "{format:?} by {step}"
            );
        }
    }
}

#[test]
fn forced_grammars_compile_and_name_only_the_chosen_function() {
    let two = json!([
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "b"}}
    ]);
    for format in [
        ToolFormat::Hermes,
        ToolFormat::Llama3,
        ToolFormat::Mistral,
        ToolFormat::Generic,
    ] {
        let named = requested(
            Some(&two),
            Some(&json!({"type": "function", "function": {"name": "b"}})),
            None,
            format,
        )
        .unwrap()
        .unwrap();
        let g = named.forced_grammar(None).unwrap();
        assert!(g.contains("\"b\"") && !g.contains("\"a\""), "{g}");
        let required = requested(Some(&two), Some(&json!("required")), None, format)
            .unwrap()
            .unwrap();
        let g = required.forced_grammar(Some(7)).unwrap();
        assert!(g.contains("\"a\"") && g.contains("\"b\""), "{g}");
        constraint::ConstraintSpec::Lark(g).check_size().unwrap();
        let auto = requested(Some(&two), None, None, format).unwrap().unwrap();
        assert!(auto.forced_grammar(None).is_none());
    }
}

#[test]
fn history_calls_take_arguments_as_objects_and_refuse_bad_ones() {
    let v = history_calls(&json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]), 2).unwrap();
    assert_eq!(v[0]["function"]["arguments"], json!({"x": 1}));
    let kept = history_calls(
        &json!([{"id": "c1", "function": {"name": "f", "arguments": "not json"}}]),
        0,
    )
    .unwrap();
    assert_eq!(kept[0]["function"]["arguments"], json!("not json"));
    let e = history_calls(
        &json!([{"id": "c1", "function": {"name": "f", "arguments": 5}}]),
        3,
    )
    .unwrap_err();
    assert_eq!(
        param_of(e).as_deref(),
        Some("messages[3].tool_calls[0].function.arguments")
    );
    assert!(history_calls(&json!({"id": "c1"}), 0).is_err());
}
