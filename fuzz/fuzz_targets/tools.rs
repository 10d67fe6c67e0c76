//! Hostile tool requests and model answers: `tools`, `tool_choice` and an assistant
//! turn's `tool_calls` are refused with an error or checked; a forced choice's grammar is
//! refused or compiles; an answer parsed in any family's syntax yields only calls of
//! declared functions with JSON-object arguments, and the same answer streamed, split at
//! any points, gives the same content and calls.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use server::tools::{self, stream::ToolStream, ToolFormat};

#[derive(Debug, Arbitrary)]
struct Input {
    tools: String,
    choice: String,
    format: u8,
    answer: String,
    /// Chunk lengths (in characters) the answer is streamed in.
    splits: Vec<u8>,
}

const FORMATS: [ToolFormat; 4] = [
    ToolFormat::Hermes,
    ToolFormat::Llama3,
    ToolFormat::Mistral,
    ToolFormat::Generic,
];

fn json_or_string(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

fuzz_target!(|input: Input| {
    let format = FORMATS[input.format as usize % FORMATS.len()];
    let declared = json_or_string(&input.tools);
    let choice = json_or_string(&input.choice);
    let _ = tools::history_calls(&declared, 0);
    let default_tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
    let calling = match tools::requested(Some(&declared), Some(&choice), None, format) {
        Ok(Some(c)) => c,
        _ => tools::requested(Some(&default_tools), None, None, format)
            .expect("a plain tool list is accepted")
            .expect("auto keeps the tools"),
    };
    if let Some(grammar) = calling.forced_grammar(None) {
        let spec = constraint::ConstraintSpec::Lark(grammar);
        if spec.check_size().is_ok() {
            let _ = kvwarden_fuzz::byte_vocabulary().compile(&spec);
        }
    }
    let whole = format.parse(&input.answer, &calling.tools);
    for call in &whole.calls {
        assert!(calling.tools.iter().any(|t| t.name == call.name));
        assert!(matches!(
            serde_json::from_str::<Value>(&call.arguments),
            Ok(Value::Object(_))
        ));
    }
    let mut stream = ToolStream::new(Arc::new(calling));
    let chars: Vec<char> = input.answer.chars().collect();
    let (mut at, mut content) = (0, String::new());
    for &n in input.splits.iter().take(64) {
        let end = (at + n as usize).min(chars.len());
        content.push_str(&stream.push(&chars[at..end].iter().collect::<String>()));
        at = end;
    }
    let (rest, calls) = stream.finish(&chars[at..].iter().collect::<String>(), true);
    content.push_str(&rest);
    assert_eq!(calls, whole.calls);
    assert_eq!(content, whole.content.unwrap_or_default());
});
