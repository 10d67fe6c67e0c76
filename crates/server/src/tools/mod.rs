//! Tool calling: a request's `tools`, `tool_choice` and `parallel_tool_calls` checked in
//! full before any work ([`requested`]), the model family's call syntax and the grammar
//! that forces a call ([`mod@format`]), and the stream that holds call text back until it can
//! be sent as OpenAI's `tool_calls` deltas ([`stream`]).
//!
//! Everything here is the request's own: its declared tools, its choice and the text its
//! own generation produced. Nothing is kept between requests, so no tool definition, call
//! or argument of one tenant can reach another's prompt, grammar or answer.

pub mod format;
pub mod stream;

use serde_json::{json, Value};

use crate::error::ApiError;
use crate::structured::{invalid, only};
pub use format::{Call, Parsed, ToolFormat};

/// Most tools one request may declare (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Longest function name (OpenAI's limit), of letters, digits, `_` and `-`.
pub const MAX_NAME_CHARS: usize = 64;

/// Which calls the answer may or must make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// The model decides; its answer is parsed for calls.
    Auto,
    /// At least one call of a declared function, forced by a grammar.
    Required,
    /// A call of this function, forced by a grammar.
    Named(String),
}

/// One declared function.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// Its `parameters` schema (`{"type": "object"}` where none was given).
    pub parameters: Value,
}

/// A request's tool calling, checked.
#[derive(Debug, Clone)]
pub struct ToolCalling {
    pub tools: Vec<Tool>,
    /// The `tools` array as the request sent it, which the chat template renders.
    pub declared: Value,
    pub choice: Choice,
    pub parallel: bool,
    pub format: ToolFormat,
}

/// A function name as OpenAI allows it.
pub fn check_name(name: &str, param: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.chars().count() <= MAX_NAME_CHARS
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            param,
            format!("'{param}' must be 1 to {MAX_NAME_CHARS} letters, digits, '_' or '-'."),
        ))
    }
}

fn tool(v: &Value, i: usize) -> Result<Tool, ApiError> {
    let p = format!("tools[{i}]");
    let obj = v
        .as_object()
        .ok_or_else(|| invalid(&p, format!("'{p}' must be an object.")))?;
    only(obj, &p, &["type", "function"])?;
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                &format!("{p}.type"),
                format!("Tools of type '{other}' are not supported; only 'function'."),
            ))
        }
        None => {
            return Err(invalid(
                &format!("{p}.type"),
                format!("'{p}.type' is required."),
            ))
        }
    }
    let fp = format!("{p}.function");
    let f = obj
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(&fp, format!("'{fp}' must be an object.")))?;
    only(f, &fp, &["name", "description", "parameters", "strict"])?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(&format!("{fp}.name"), format!("'{fp}.name' is required.")))?;
    check_name(name, &format!("{fp}.name"))?;
    if let Some(d) = f.get("description").filter(|d| !d.is_null()) {
        if !d.is_string() {
            return Err(invalid(
                &format!("{fp}.description"),
                format!("'{fp}.description' must be a string."),
            ));
        }
    }
    if let Some(s) = f.get("strict").filter(|s| !s.is_null()) {
        if !s.is_boolean() {
            return Err(invalid(
                &format!("{fp}.strict"),
                format!("'{fp}.strict' must be a boolean."),
            ));
        }
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object"}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(invalid(
                &format!("{fp}.parameters"),
                format!("'{fp}.parameters' must be a JSON schema object."),
            ))
        }
    };
    Ok(Tool {
        name: name.to_owned(),
        parameters,
    })
}

/// The request's tool calling, or `None` when it declares no tools or `tool_choice` is
/// `none` (the tools are then neither rendered nor parsed for). Every field is checked
/// here; a schema's compilation waits for the prompt workers.
pub fn requested(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel: Option<&Value>,
    format: ToolFormat,
) -> Result<Option<ToolCalling>, ApiError> {
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(invalid(
                "parallel_tool_calls",
                "'parallel_tool_calls' must be a boolean.",
            ))
        }
    };
    let choice = tool_choice.filter(|v| !v.is_null());
    let Some(declared) = tools.filter(|v| !v.is_null()) else {
        return match choice {
            None => Ok(None),
            Some(Value::String(s)) if s == "none" => Ok(None),
            Some(_) => Err(invalid(
                "tool_choice",
                "'tool_choice' is only allowed when 'tools' are specified.",
            )),
        };
    };
    let list = declared
        .as_array()
        .ok_or_else(|| invalid("tools", "'tools' must be an array."))?;
    if list.is_empty() || list.len() > MAX_TOOLS {
        return Err(invalid(
            "tools",
            format!(
                "'tools' must hold 1 to {MAX_TOOLS} tools; got {}.",
                list.len()
            ),
        ));
    }
    let tools: Vec<Tool> = list
        .iter()
        .enumerate()
        .map(|(i, t)| tool(t, i))
        .collect::<Result<_, _>>()?;
    for (i, t) in tools.iter().enumerate() {
        if tools[..i].iter().any(|u| u.name == t.name) {
            return Err(invalid(
                &format!("tools[{i}].function.name"),
                format!("Two tools are named '{}'.", t.name),
            ));
        }
    }
    let choice = match choice {
        None => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!("'tool_choice' '{other}' is not one of none, auto, required, or a named function."),
                ))
            }
        },
        Some(Value::Object(o)) => {
            only(o, "tool_choice", &["type", "function"])?;
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return Err(invalid(
                    "tool_choice.type",
                    "'tool_choice.type' must be 'function'.",
                ));
            }
            let f = o
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| invalid("tool_choice.function", "'tool_choice.function' must be an object."))?;
            only(f, "tool_choice.function", &["name"])?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                invalid(
                    "tool_choice.function.name",
                    "'tool_choice.function.name' is required.",
                )
            })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(invalid(
                    "tool_choice.function.name",
                    format!("'tool_choice' names '{}', which 'tools' does not declare.", name.chars().take(64).collect::<String>()),
                ));
            }
            Choice::Named(name.to_owned())
        }
        Some(_) => {
            return Err(invalid(
                "tool_choice",
                "'tool_choice' must be a string or an object.",
            ))
        }
    };
    Ok(Some(ToolCalling {
        tools,
        declared: declared.clone(),
        choice,
        parallel,
        format,
    }))
}

impl ToolCalling {
    /// The grammar a `required` or named choice forces the answer into (llguidance's Lark,
    /// each call's arguments under its function's schema); `None` for `auto`.
    /// `marker_token` is the vocabulary's control token for the family's call marker, if
    /// it has one (the grammar must then produce that token, not its spelling).
    pub fn forced_grammar(&self, marker_token: Option<u32>) -> Option<String> {
        let tools: Vec<&Tool> = match &self.choice {
            Choice::Auto => return None,
            Choice::Required => self.tools.iter().collect(),
            Choice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
        };
        let parallel = self.parallel && self.choice == Choice::Required;
        Some(self.format.grammar(&tools, parallel, marker_token))
    }

    /// kvwarden's own instructions for a template that does not render tools (the generic
    /// form): the tools and the answer's shape, as a system message's text.
    pub fn generic_instructions(&self) -> String {
        let mut text = String::from(
            "You may call these functions. To call one or more, answer with only a JSON object \
             {\"tool_calls\": [{\"name\": <function name>, \"arguments\": <arguments object>}]} \
             and nothing else; otherwise answer normally.\nFunctions:\n",
        );
        for t in self.declared.as_array().into_iter().flatten() {
            if let Some(f) = t.get("function") {
                text.push_str(&f.to_string());
                text.push('\n');
            }
        }
        text
    }
}

/// An assistant message's `tool_calls` as the chat template takes them: each call's
/// `arguments` string parsed into the object templates index (kept as a string where it
/// is not one), every field checked.
pub fn history_calls(v: &Value, index: usize) -> Result<Value, ApiError> {
    let p = format!("messages[{index}].tool_calls");
    let list = v
        .as_array()
        .ok_or_else(|| invalid(&p, format!("'{p}' must be an array.")))?;
    if list.len() > MAX_TOOLS {
        return Err(invalid(
            &p,
            format!("'{p}' holds more than {MAX_TOOLS} calls."),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (j, call) in list.iter().enumerate() {
        let cp = format!("{p}[{j}]");
        let obj = call
            .as_object()
            .ok_or_else(|| invalid(&cp, format!("'{cp}' must be an object.")))?;
        only(obj, &cp, &["id", "type", "function", "index"])?;
        let id = obj.get("id").and_then(Value::as_str).unwrap_or_default();
        if obj
            .get("type")
            .is_some_and(|t| t.as_str() != Some("function"))
        {
            return Err(invalid(
                &format!("{cp}.type"),
                format!("'{cp}.type' must be 'function'."),
            ));
        }
        let fp = format!("{cp}.function");
        let f = obj
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(&fp, format!("'{fp}' must be an object.")))?;
        only(f, &fp, &["name", "arguments"])?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(&format!("{fp}.name"), format!("'{fp}.name' is required.")))?;
        check_name(name, &format!("{fp}.name"))?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(o @ Value::Object(_)) => o,
                _ => Value::String(s.clone()),
            },
            Some(o @ Value::Object(_)) => o.clone(),
            Some(_) => {
                return Err(invalid(
                    &format!("{fp}.arguments"),
                    format!("'{fp}.arguments' must be a JSON string."),
                ))
            }
        };
        out.push(json!({
            "id": id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests;
