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

/// Private-use characters: they never occur in template text, and message content never
/// reaches the placeholder rendering, so a marker cannot be forged.
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

fn marker(i: usize) -> String {
    format!("{OPEN}{i}{CLOSE}")
}

/// The roles a message may have. Roles are rendered into the prompt verbatim, so anything
/// else (e.g. a role containing control-token text) is refused.
pub fn normalize_role(role: &str) -> Option<&'static str> {
    match role {
        "system" | "developer" => Some("system"),
        "user" => Some("user"),
        "assistant" => Some("assistant"),
        _ => None,
    }
}

pub fn prompt_tokens(
    tok: &Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
) -> Result<Vec<u32>, ApiError> {
    let placeholders: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| ChatMessage::new(m.role.clone(), marker(i)))
        .collect();
    let skeleton = template.render(&placeholders, true)?;
    let real = template.render(messages, true)?;

    // The split is faithful only if the template copies each content verbatim; one that
    // transforms content (trims it, say) renders differently from the substituted
    // skeleton, and falls back to the check below.
    let mut substituted = skeleton.clone();
    for (i, m) in messages.iter().enumerate() {
        substituted = substituted.replace(&marker(i), &m.content);
    }
    if substituted == real {
        return Ok(split_encode(tok, &skeleton, messages));
    }

    // Fallback: tokenize the real rendering, and accept it only if it holds exactly the
    // control tokens the template itself produced.
    let tokens = tok.encode(&real);
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

fn split_encode(tok: &Tokenizer, skeleton: &str, messages: &[ChatMessage]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut rest = skeleton;
    while let Some(open) = rest.find(OPEN) {
        let (literal, tail) = rest.split_at(open);
        out.extend(tok.encode(literal));
        let after_open = &tail[OPEN.len_utf8()..];
        let parsed = after_open
            .find(CLOSE)
            .and_then(|close| Some((after_open[..close].parse::<usize>().ok()?, close)));
        match parsed.and_then(|(i, close)| Some((messages.get(i)?, close))) {
            Some((m, close)) => {
                out.extend(tok.encode_ordinary(&m.content));
                rest = &after_open[close + CLOSE.len_utf8()..];
            }
            None => {
                // Not one of our markers (cannot happen: the skeleton holds no user text);
                // keep the character as plain text rather than guess.
                out.extend(tok.encode_ordinary(&tail[..OPEN.len_utf8()]));
                rest = after_open;
            }
        }
    }
    out.extend(tok.encode(rest));
    out
}
