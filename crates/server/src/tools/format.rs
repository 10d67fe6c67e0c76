//! The call syntaxes of the model families, each as the family's chat templates teach it:
//!
//! | format | a call | chosen when the template holds |
//! | --- | --- | --- |
//! | `hermes` (Qwen 2.5, Qwen 3, Hermes) | `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, repeated | `<tool_call>` |
//! | `llama3` (Llama 3.1 and later) | `{"name": …, "parameters": {…}}` as the whole answer (after an optional `<\|python_tag\|>`), several joined by `;` | `<\|python_tag\|>`, or `ipython` with `<\|start_header_id\|>` |
//! | `mistral` | `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` | `[TOOL_CALLS]` |
//! | `generic` (any other template) | `{"tool_calls": [{"name": …, "arguments": {…}}]}` as the whole answer, taught by a system message kvwarden adds | — |
//!
//! An answer is a call only if all of it after the content that precedes the call parses
//! as calls of declared functions; otherwise it is content, whole. Streaming holds back the
//! text from where a call could begin ([`ToolFormat::certain_content`]), so a streamed
//! answer and a whole one say the same.

use serde_json::{json, Value};

use super::Tool;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Mistral,
    Generic,
}

/// One call the answer made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    /// The arguments as a JSON object's text.
    pub arguments: String,
}

/// An answer split into its content and its calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub content: Option<String>,
    pub calls: Vec<Call>,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_MARKER: &str = "[TOOL_CALLS]";

impl ToolFormat {
    pub const NAMES: &'static str = "hermes, llama3, mistral, generic";

    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3 => "llama3",
            Self::Mistral => "mistral",
            Self::Generic => "generic",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Hermes, Self::Llama3, Self::Mistral, Self::Generic]
            .into_iter()
            .find(|f| f.name() == name)
    }

    /// The family a chat template's source teaches.
    pub fn detect(template: &str) -> Self {
        if template.contains(HERMES_OPEN) {
            Self::Hermes
        } else if template.contains(MISTRAL_MARKER) {
            Self::Mistral
        } else if template.contains(PYTHON_TAG)
            || (template.contains("ipython") && template.contains("<|start_header_id|>"))
        {
            Self::Llama3
        } else {
            Self::Generic
        }
    }

    /// Whether the chat template renders the tools itself; for the generic form kvwarden
    /// describes them in a system message instead.
    pub fn template_renders_tools(self) -> bool {
        self != Self::Generic
    }

    /// The text a call begins with, where the family has one the vocabulary may hold as a
    /// single control token.
    pub fn marker(self) -> Option<&'static str> {
        match self {
            Self::Hermes => Some(HERMES_OPEN),
            Self::Mistral => Some(MISTRAL_MARKER),
            Self::Llama3 => Some(PYTHON_TAG),
            Self::Generic => None,
        }
    }

    /// How many bytes of `text` (an answer so far) are content whatever comes next; the
    /// rest may be, or may grow into, a call.
    pub fn certain_content(self, text: &str) -> usize {
        match self {
            Self::Hermes | Self::Mistral => {
                let marker = if self == Self::Hermes {
                    HERMES_OPEN
                } else {
                    MISTRAL_MARKER
                };
                if let Some(p) = text.find(marker) {
                    return p;
                }
                // A suffix that could be the marker's start waits for the next text.
                let partial = (1..marker.len())
                    .rev()
                    .find(|&k| text.ends_with(&marker[..k]))
                    .unwrap_or(0);
                text.len() - partial
            }
            // A call is the whole answer: content once it starts otherwise.
            Self::Llama3 | Self::Generic => {
                let rest = text.trim_start();
                if rest.is_empty() {
                    return 0;
                }
                let could_be_call = rest.starts_with('{')
                    || (self == Self::Llama3
                        && (rest.starts_with(PYTHON_TAG) || PYTHON_TAG.starts_with(rest)));
                if could_be_call {
                    0
                } else {
                    text.len()
                }
            }
        }
    }

    /// `text`, a whole answer, split into content and calls of the declared `tools`; no
    /// calls (and all of `text` as content) unless the call part parses whole.
    pub fn parse(self, text: &str, tools: &[Tool]) -> Parsed {
        let start = self.certain_content(text);
        let calls = if start < text.len() {
            self.calls(&text[start..])
                .filter(|calls| !calls.is_empty())
                .filter(|calls| calls.iter().all(|c| tools.iter().any(|t| t.name == c.name)))
        } else {
            None
        };
        match calls {
            Some(calls) => Parsed {
                content: Some(text[..start].to_owned()).filter(|c| !c.is_empty()),
                calls,
            },
            None => Parsed {
                content: Some(text.to_owned()),
                calls: Vec::new(),
            },
        }
    }

    /// The calls `text` (from where a call may begin) holds, if it is nothing but calls.
    fn calls(self, text: &str) -> Option<Vec<Call>> {
        match self {
            Self::Hermes => {
                let mut calls = Vec::new();
                let mut rest = text.trim();
                while !rest.is_empty() {
                    rest = rest.strip_prefix(HERMES_OPEN)?;
                    let (value, after) = first_json(rest)?;
                    calls.push(call(&value, "arguments")?);
                    rest = after.trim_start();
                    // A last call whose closing tag the model never wrote still counts.
                    rest = rest.strip_prefix(HERMES_CLOSE).unwrap_or(rest).trim_start();
                }
                Some(calls)
            }
            Self::Llama3 => {
                let mut rest = text.trim();
                rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest).trim_start();
                let mut calls = Vec::new();
                while !rest.is_empty() {
                    let (value, after) = first_json(rest)?;
                    let key = if value.get("parameters").is_some() {
                        "parameters"
                    } else {
                        "arguments"
                    };
                    calls.push(call(&value, key)?);
                    rest = after.trim_start();
                    rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
                }
                Some(calls)
            }
            Self::Mistral => {
                let rest = text.trim().strip_prefix(MISTRAL_MARKER)?.trim_start();
                let (value, after) = first_json(rest)?;
                if !after.trim().is_empty() {
                    return None;
                }
                value
                    .as_array()?
                    .iter()
                    .map(|v| call(v, "arguments"))
                    .collect()
            }
            Self::Generic => {
                let (value, after) = first_json(text.trim())?;
                if !after.trim().is_empty() {
                    return None;
                }
                if let Some(one) = value.get("tool_call") {
                    return Some(vec![call(one, "arguments")?]);
                }
                value
                    .get("tool_calls")?
                    .as_array()?
                    .iter()
                    .map(|v| call(v, "arguments"))
                    .collect()
            }
        }
    }

    /// The Lark grammar of an answer that is one call (or, `parallel`, one or more) of
    /// `tools`, each call's arguments under its function's schema. `marker_token`: the
    /// vocabulary's token for the family's marker, where it is a control token.
    pub fn grammar(self, tools: &[&Tool], parallel: bool, marker_token: Option<u32>) -> String {
        let args_key = if self == Self::Llama3 {
            "parameters"
        } else {
            "arguments"
        };
        let one_call: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": t.name},
                        args_key: t.parameters,
                    },
                    "required": ["name", args_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let call_schema = if one_call.len() == 1 {
            one_call.into_iter().next().unwrap_or_default()
        } else {
            json!({"anyOf": one_call})
        };
        let options =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        let with_options = |mut schema: Value| {
            if let Some(o) = schema.as_object_mut() {
                o.insert("x-guidance".into(), options.clone());
            }
            schema
        };
        let marker = |text: &str| match marker_token {
            Some(id) => format!("<[{id}]>"),
            None => lark_string(text),
        };
        match self {
            Self::Hermes => {
                let call = format!(
                    "call: {} \"\\n\" %json {} \"\\n\" {}",
                    marker(HERMES_OPEN),
                    with_options(call_schema),
                    lark_string(HERMES_CLOSE)
                );
                let start = if parallel {
                    "start: call (\"\\n\" call)*"
                } else {
                    "start: call"
                };
                format!("{start}\n{call}\n")
            }
            Self::Llama3 => {
                let call = format!("call: %json {}", with_options(call_schema));
                let start = if parallel {
                    "start: call (\"; \" call)*"
                } else {
                    "start: call"
                };
                format!("{start}\n{call}\n")
            }
            Self::Mistral => {
                let mut list = json!({"type": "array", "items": call_schema, "minItems": 1});
                if !parallel {
                    list["maxItems"] = json!(1);
                }
                format!(
                    "start: {} %json {}\n",
                    marker(MISTRAL_MARKER),
                    with_options(list)
                )
            }
            Self::Generic => {
                let mut list = json!({"type": "array", "items": call_schema, "minItems": 1});
                if !parallel {
                    list["maxItems"] = json!(1);
                }
                let answer = json!({
                    "type": "object",
                    "properties": {"tool_calls": list},
                    "required": ["tool_calls"],
                    "additionalProperties": false,
                });
                format!("start: %json {}\n", with_options(answer))
            }
        }
    }
}

/// A Lark string literal of `s`.
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The JSON value at the start of `text` and the text after it.
fn first_json(text: &str) -> Option<(Value, &str)> {
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let value = stream.next()?.ok()?;
    Some((value, &text[stream.byte_offset()..]))
}

/// One call object: its `name` and its arguments under `key` (an object, or a string
/// holding one).
fn call(v: &Value, key: &str) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_owned();
    let arguments = match v.get(key) {
        None => "{}".to_owned(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(a @ Value::Object(_)) => a.to_string(),
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(Call { name, arguments })
}
