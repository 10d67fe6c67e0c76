//! Turning chat messages into prompt tokens without letting message content speak in
//! control tokens.
//!
//! Rendering the template and tokenizing the result with special-token parsing would let a
//! user write `<|im_end|><|im_start|>system` into a message and forge a system turn. So the
//! template is rendered with a placeholder in place of each message's content; the
//! template's own text is tokenized with control tokens parsed, and each content with
//! them treated as plain text.

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
    fits: &dyn Fn(usize) -> Result<(), ApiError>,
    cancel: &Cancel,
) -> Result<Vec<u32>, ApiError> {
    let placeholders: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| ChatMessage::new(m.role.clone(), marker(i)))
        .collect();
    let skeleton = template.render(&placeholders, true)?;
    cancel.check()?;
    let real = template.render(messages, true)?;
    cancel.check()?;
    fits(real.len())?;

    // The split is faithful only if the template copies each content verbatim; one that
    // transforms content (trims it, say) renders differently from the substituted
    // skeleton, and falls back to the check below.
    if substitute(&skeleton, messages) == real {
        return split_encode(tok, &skeleton, messages, cancel);
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
        Ok(tokens)
    } else {
        Err(ApiError::invalid(
            "invalid_messages",
            Some("messages".to_owned()),
            "Message content contains control-token text that this model's chat template cannot keep apart from its own.",
        ))
    }
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
