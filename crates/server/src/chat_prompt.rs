//! Turning chat messages into prompt tokens without letting message content speak in
//! control tokens.
//!
//! Rendering the template and tokenizing the result with special-token parsing would let a
//! user write `<|im_end|><|im_start|>system` into a message and forge a system turn. So the
//! template is rendered with a placeholder in place of each message's content; the
//! template's own text is tokenized with control tokens parsed, and each content with
//! them treated as plain text.
//!
//! Tool definitions and the calls of earlier turns are rendered by the template as its
//! own text (templates index their fields, compare their types, count an id's length, so
//! they cannot be swapped for markers): every string in them, keys included, is refused if
//! it holds control-token text or could complete one beside the template's text
//! ([`tokenizer::ControlTexts::could_form`]). A tool's answer is a message's content, marked like
//! any other. The same holds for the other client text a template prints as its own: an
//! earlier answer's `reasoning_content` and the request's `chat_template_kwargs`.

use serde_json::Value;
use tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

use crate::error::ApiError;
use crate::prep::Cancel;

/// Private-use characters: they never occur in template text, and message content never
/// reaches the placeholder rendering, so a marker cannot be forged.
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

fn marker(i: usize) -> String {
    format!("{OPEN}{i}{CLOSE}")
}

/// The prompt tokens of a conversation. Linear in its size: two renderings and one pass
/// over each. Stops (with [`ApiError::Abandoned`]) once `cancel` is raised. `fits` sees
/// the rendered text's length before anything is tokenized and may refuse it.
pub fn prompt_tokens(
    tok: &Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
    tools: Option<&Value>,
    fits: &dyn Fn(usize) -> Result<(), ApiError>,
    cancel: &Cancel,
) -> Result<Vec<u32>, ApiError> {
    let chat = ChatInput {
        messages,
        tools,
        variables: None,
    };
    render_prompt(tok, template, &chat, fits, cancel).map(|p| p.tokens)
}

/// What a chat request gives its template.
pub struct ChatInput<'a> {
    pub messages: &'a [ChatMessage],
    pub tools: Option<&'a Value>,
    /// The request's own template variables (`chat_template_kwargs`).
    pub variables: Option<&'a serde_json::Map<String, Value>>,
}

/// A conversation's prompt.
pub struct ChatPrompt {
    pub tokens: Vec<u32>,
    /// The rendering with a marker in place of each message's content: what the template
    /// itself wrote (where the generation prompt leaves the answer, say).
    pub skeleton: String,
}

/// [`prompt_tokens`] with the request's template variables, and the template's own text.
pub fn render_prompt(
    tok: &Tokenizer,
    template: &ChatTemplate,
    chat: &ChatInput<'_>,
    fits: &dyn Fn(usize) -> Result<(), ApiError>,
    cancel: &Cancel,
) -> Result<ChatPrompt, ApiError> {
    let ChatInput {
        messages,
        tools,
        variables,
    } = *chat;
    check_template_text(tok, messages, tools, variables)?;
    let placeholders: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| ChatMessage {
            content: if m.content.is_empty() {
                // Empty stays empty: templates test for it (a call-only assistant turn).
                String::new()
            } else {
                marker(i)
            },
            ..m.clone()
        })
        .collect();
    let skeleton = template.render_with_variables(&placeholders, tools, variables, true)?;
    cancel.check()?;
    let real = template.render_with_variables(messages, tools, variables, true)?;
    cancel.check()?;
    fits(real.len())?;

    // The split is faithful only if the template copies each content verbatim; one that
    // transforms content (trims it, say) renders differently from the substituted
    // skeleton, and falls back to the check below.
    if substitute(&skeleton, messages) == real {
        let tokens = split_encode(tok, &skeleton, messages, cancel)?;
        return Ok(ChatPrompt { tokens, skeleton });
    }

    // Fallback: tokenize the real rendering, and accept it only if it holds exactly the
    // control tokens the template itself produced.
    let tokens = encode(tok, &real, cancel)?;
    let controls = |ids: &[u32]| -> Vec<u32> {
        ids.iter()
            .copied()
            .filter(|&id| tok.is_control(id))
            .collect()
    };
    if controls(&tokens) == controls(&tok.encode(&skeleton)) {
        Ok(ChatPrompt { tokens, skeleton })
    } else {
        Err(ApiError::invalid(
            "invalid_messages",
            Some("messages".to_owned()),
            "Message content contains control-token text that this model's chat template cannot keep apart from its own.",
        ))
    }
}

/// Refuses tool text that the template would render as its own and that could speak in
/// control tokens, naming where it is.
fn check_template_text(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    tools: Option<&Value>,
    variables: Option<&serde_json::Map<String, Value>>,
) -> Result<(), ApiError> {
    let refuse = |param: String| {
        Err(ApiError::invalid(
            "invalid_value",
            Some(param.clone()),
            format!("'{param}' contains text that this model's chat template would read as a control token."),
        ))
    };
    let controls = tok.control_texts();
    if tools.is_some_and(|t| unsafe_literals(&controls, json_strings(t))) {
        return refuse("tools".into());
    }
    if let Some(variables) = variables {
        for (name, v) in variables {
            let mut strings = json_strings(v);
            strings.push(name);
            if unsafe_literals(&controls, strings) {
                return refuse(format!("chat_template_kwargs.{name}"));
            }
        }
    }
    for (i, m) in messages.iter().enumerate() {
        if m.tool_calls
            .as_ref()
            .is_some_and(|calls| unsafe_literals(&controls, json_strings(calls)))
        {
            return refuse(format!("messages[{i}].tool_calls"));
        }
        for (field, v) in [
            ("tool_call_id", &m.tool_call_id),
            ("name", &m.name),
            ("reasoning_content", &m.reasoning_content),
        ] {
            if v.as_deref()
                .is_some_and(|s| unsafe_literals(&controls, vec![s]))
            {
                return refuse(format!("messages[{i}].{field}"));
            }
        }
    }
    Ok(())
}

/// Control-token text, or our marker characters, which the skeleton must hold only where
/// a content was.
fn unsafe_literals(controls: &tokenizer::ControlTexts<'_>, strings: Vec<&str>) -> bool {
    strings
        .iter()
        .any(|s| s.contains(OPEN) || s.contains(CLOSE))
        || controls.could_form(strings)
}

/// Every string of a JSON value, object keys included.
fn json_strings(v: &Value) -> Vec<&str> {
    let mut out = Vec::new();
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) => out.push(s.as_str()),
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                for (k, v) in map {
                    out.push(k.as_str());
                    stack.push(v);
                }
            }
            _ => {}
        }
    }
    out
}

/// The message a marker names, and the marker's length after its `OPEN`, if `after_open`
/// (the text just after an `OPEN`) starts with one of our markers.
fn marker_at<'m>(
    after_open: &str,
    messages: &'m [ChatMessage],
) -> Option<(&'m ChatMessage, usize)> {
    let close = after_open.find(CLOSE)?;
    let i: usize = after_open[..close].parse().ok()?;
    Some((messages.get(i)?, close + CLOSE.len_utf8()))
}

/// The skeleton with every marker replaced by its message's content, in one pass over it
/// (replacing marker by marker over the whole text was quadratic in the message count).
fn substitute(skeleton: &str, messages: &[ChatMessage]) -> String {
    let contents: usize = messages.iter().map(|m| m.content.len()).sum();
    let mut out = String::with_capacity(skeleton.len() + contents);
    let mut rest = skeleton;
    while let Some(open) = rest.find(OPEN) {
        out.push_str(&rest[..open]);
        let after_open = &rest[open + OPEN.len_utf8()..];
        match marker_at(after_open, messages) {
            Some((m, len)) => {
                out.push_str(&m.content);
                rest = &after_open[len..];
            }
            None => {
                out.push(OPEN);
                rest = after_open;
            }
        }
    }
    out.push_str(rest);
    out
}

fn split_encode(
    tok: &Tokenizer,
    skeleton: &str,
    messages: &[ChatMessage],
    cancel: &Cancel,
) -> Result<Vec<u32>, ApiError> {
    let mut out = Vec::new();
    let mut rest = skeleton;
    while let Some(open) = rest.find(OPEN) {
        cancel.check()?;
        let (literal, tail) = rest.split_at(open);
        out.extend(encode(tok, literal, cancel)?);
        let after_open = &tail[OPEN.len_utf8()..];
        match marker_at(after_open, messages) {
            Some((m, len)) => {
                out.extend(
                    tok.encode_ordinary_cancellable(&m.content, &|| cancel.is_cancelled())
                        .ok_or(ApiError::Abandoned)?,
                );
                rest = &after_open[len..];
            }
            None => {
                // Not one of our markers (cannot happen: the skeleton holds no user text);
                // keep the character as plain text rather than guess.
                out.extend(tok.encode_ordinary(&tail[..OPEN.len_utf8()]));
                rest = after_open;
            }
        }
    }
    out.extend(encode(tok, rest, cancel)?);
    Ok(out)
}

/// Template text, control tokens parsed, stopping once the client is gone.
fn encode(tok: &Tokenizer, text: &str, cancel: &Cancel) -> Result<Vec<u32>, ApiError> {
    tok.encode_cancellable(text, &|| cancel.is_cancelled())
        .ok_or(ApiError::Abandoned)
}
