//! What a client asked its answer to match, as source text, and its translation into the
//! grammar llguidance compiles.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

use crate::limits::{MAX_CHOICES, MAX_SOURCE_BYTES};
use crate::{gbnf_to_lark, ConstraintError};

/// One request's constraint. Text forms are kept as the client sent them (a schema as
/// JSON text), which is also their form on the node protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConstraintSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema, as JSON text.
    JsonSchema(String),
    /// A regular expression the whole answer matches (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// llguidance's Lark dialect.
    Lark(String),
    /// llama.cpp's GBNF, translated into Lark ([`gbnf_to_lark`]).
    Gbnf(String),
    /// A reasoning model's answer: free thoughts in a `<think>…</think>` block first
    /// (`opened`: the prompt already opened it; otherwise the block is optional), then
    /// whitespace, then `answer`, which the constraint holds from there on.
    AfterThoughts {
        opened: bool,
        answer: Box<ConstraintSpec>,
    },
}

/// Thoughts up to and including the first closing tag, and nothing after it: a lexeme that
/// ends exactly where the block does, whatever the thoughts hold.
const THOUGHTS_TO_CLOSE: &str = r"/(?s:.*)<\/think>/ & ~/(?s:.*)<\/think>(?s:.+)/";

impl ConstraintSpec {
    /// The name this form has on the node protocol and in errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonObject => "json_object",
            Self::JsonSchema(_) => "json_schema",
            Self::Regex(_) => "regex",
            Self::Choice(_) => "choice",
            Self::Lark(_) => "lark",
            Self::Gbnf(_) => "gbnf",
            Self::AfterThoughts { .. } => "after_thoughts",
        }
    }

    /// `(kind, text)` for the node protocol; [`Self::from_parts`] reads it back.
    pub fn to_parts(&self) -> (&'static str, String) {
        let text = match self {
            Self::JsonObject => String::new(),
            Self::JsonSchema(s) | Self::Regex(s) | Self::Lark(s) | Self::Gbnf(s) => s.clone(),
            Self::Choice(c) => Value::from(c.clone()).to_string(),
            Self::AfterThoughts { opened, answer } => {
                let (kind, text) = answer.to_parts();
                json!({"opened": opened, "kind": kind, "text": text}).to_string()
            }
        };
        (self.kind(), text)
    }

    pub fn from_parts(kind: &str, text: &str) -> Result<Self, ConstraintError> {
        let spec = match kind {
            "json_object" => Self::JsonObject,
            "json_schema" => Self::JsonSchema(text.to_string()),
            "regex" => Self::Regex(text.to_string()),
            "lark" => Self::Lark(text.to_string()),
            "gbnf" => Self::Gbnf(text.to_string()),
            "choice" => Self::Choice(
                serde_json::from_str(text)
                    .map_err(|e| ConstraintError::Invalid(format!("choice list: {e}")))?,
            ),
            "after_thoughts" => {
                let invalid = || ConstraintError::Invalid("an after_thoughts constraint".into());
                let v: Value = serde_json::from_str(text).map_err(|_| invalid())?;
                let (Some(opened), Some(kind), Some(text)) = (
                    v["opened"].as_bool(),
                    v["kind"].as_str(),
                    v["text"].as_str(),
                ) else {
                    return Err(invalid());
                };
                if kind == "after_thoughts" {
                    return Err(invalid());
                }
                Self::AfterThoughts {
                    opened,
                    answer: Box::new(Self::from_parts(kind, text)?),
                }
            }
            other => {
                return Err(ConstraintError::Invalid(format!(
                    "unknown constraint kind {other:?}"
                )))
            }
        };
        spec.check_size()?;
        Ok(spec)
    }

    /// The bounds on source text ([`crate::limits`]); no parsing yet.
    pub fn check_size(&self) -> Result<(), ConstraintError> {
        let bytes = match self {
            Self::JsonObject => 0,
            Self::JsonSchema(s) | Self::Regex(s) | Self::Lark(s) | Self::Gbnf(s) => s.len(),
            Self::Choice(c) => {
                if c.is_empty() {
                    return Err(ConstraintError::Invalid(
                        "a choice list needs at least one entry".into(),
                    ));
                }
                if c.len() > MAX_CHOICES {
                    return Err(ConstraintError::TooLarge(format!(
                        "a choice list holds at most {MAX_CHOICES} entries, not {}",
                        c.len()
                    )));
                }
                c.iter().map(String::len).sum()
            }
            Self::AfterThoughts { answer, .. } => {
                if matches!(**answer, Self::AfterThoughts { .. }) {
                    return Err(ConstraintError::Invalid(
                        "thoughts come once, before the answer".into(),
                    ));
                }
                return answer.check_size();
            }
        };
        if bytes > MAX_SOURCE_BYTES {
            return Err(ConstraintError::TooLarge(format!(
                "a {} constraint is at most {MAX_SOURCE_BYTES} bytes, not {bytes}",
                self.kind()
            )));
        }
        Ok(())
    }

    /// The grammar llguidance compiles. JSON is generated compactly (`", "` and `": "`
    /// between items, no other whitespace): small models otherwise fill an answer with
    /// newlines that the schema allows.
    pub(crate) fn to_grammar(&self) -> Result<TopLevelGrammar, ConstraintError> {
        self.check_size()?;
        let schema = |mut schema: Value| -> Result<TopLevelGrammar, ConstraintError> {
            let Some(obj) = schema.as_object_mut() else {
                return Err(ConstraintError::Invalid(
                    "a JSON schema must be a JSON object".into(),
                ));
            };
            obj.insert(
                "x-guidance".into(),
                json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
            );
            Ok(TopLevelGrammar::from_json_schema(schema))
        };
        match self {
            Self::JsonObject => schema(json!({"type": "object"})),
            Self::JsonSchema(text) => {
                schema(serde_json::from_str(text).map_err(|e| {
                    ConstraintError::Invalid(format!("the schema is not JSON: {e}"))
                })?)
            }
            Self::Regex(rx) => Ok(TopLevelGrammar::from_regex(rx)),
            Self::Choice(choices) => {
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| Value::from(c.as_str()).to_string())
                    .collect();
                Ok(TopLevelGrammar::from_lark(format!(
                    "start: {}",
                    alternatives.join(" | ")
                )))
            }
            Self::Lark(src) => Ok(TopLevelGrammar::from_lark(src.clone())),
            Self::Gbnf(src) => Ok(TopLevelGrammar::from_lark(gbnf_to_lark(src)?)),
            Self::AfterThoughts { opened, answer } => {
                // The answer's grammars follow this one, which refers to the first by name.
                let mut inner = answer.to_grammar()?;
                let Some(first) = inner.grammars.first_mut() else {
                    return Err(ConstraintError::Invalid("an empty answer grammar".into()));
                };
                first.name = Some("answer".into());
                let start = match opened {
                    true => "start: THOUGHTS GAP? @answer",
                    false => "start: \"<think>\" THOUGHTS GAP? @answer | @answer",
                };
                let lark =
                    format!("{start}\nTHOUGHTS: {THOUGHTS_TO_CLOSE}\nGAP: /[ \\t\\r\\n]+/\n");
                let mut grammars = vec![llguidance::api::GrammarWithLexer::from_lark(lark)];
                grammars.append(&mut inner.grammars);
                Ok(TopLevelGrammar {
                    grammars,
                    max_tokens: inner.max_tokens,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_round_trip() {
        for spec in [
            ConstraintSpec::JsonObject,
            ConstraintSpec::JsonSchema(r#"{"type":"string"}"#.into()),
            ConstraintSpec::Regex("[a-z]+".into()),
            ConstraintSpec::Choice(vec!["yes".into(), "no \"quoted\"".into()]),
            ConstraintSpec::Lark("start: \"x\"".into()),
            ConstraintSpec::Gbnf("root ::= \"x\"".into()),
        ] {
            let (kind, text) = spec.to_parts();
            assert_eq!(ConstraintSpec::from_parts(kind, &text).unwrap(), spec);
        }
        assert!(ConstraintSpec::from_parts("python", "").is_err());
    }

    #[test]
    fn limits_are_checked_before_compiling() {
        let big = ConstraintSpec::Regex("a".repeat(MAX_SOURCE_BYTES + 1));
        assert!(matches!(
            big.check_size(),
            Err(ConstraintError::TooLarge(_))
        ));
        let many = ConstraintSpec::Choice(vec!["x".into(); MAX_CHOICES + 1]);
        assert!(matches!(
            many.check_size(),
            Err(ConstraintError::TooLarge(_))
        ));
        assert!(ConstraintSpec::Choice(vec![]).check_size().is_err());
        let not_object = ConstraintSpec::JsonSchema("true".into());
        assert!(matches!(
            not_object.to_grammar(),
            Err(ConstraintError::Invalid(_))
        ));
    }
}
