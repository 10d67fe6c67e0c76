//! Structured outputs as clients ask for them, in the four shapes servers take: OpenAI's
//! `response_format`, llama.cpp's `json_schema` and `grammar`, and vLLM's
//! `structured_outputs`. Each becomes one [`ConstraintSpec`]; a request gives at most one,
//! and every key of these objects is understood or refused by name, never ignored.

use constraint::ConstraintSpec;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::request::Common;

/// A request's constraint and the field it came from (which its errors name).
#[derive(Debug, Clone)]
pub struct Requested {
    pub spec: ConstraintSpec,
    pub param: &'static str,
}

/// Whether a constraint describes only the answer (a JSON schema or object, or the call a
/// `tool_choice` forces), so a thinking model's thoughts may come before it; a regular
/// expression, a choice or a grammar describes the whole text.
pub fn describes_answer_only(requested: &Requested) -> bool {
    requested.param == "tools"
        || matches!(
            requested.spec,
            ConstraintSpec::JsonObject | ConstraintSpec::JsonSchema(_)
        )
}

/// A 400 `invalid_value` naming `param`.
pub(crate) fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid("invalid_value", Some(param.to_owned()), message)
}

fn object<'a>(v: &'a Value, param: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object()
        .ok_or_else(|| invalid(param, format!("'{param}' must be an object.")))
}

/// Refuses any key of `obj` outside `known`, naming it.
pub(crate) fn only(obj: &Map<String, Value>, param: &str, known: &[&str]) -> Result<(), ApiError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(ApiError::unsupported(
            &format!("{param}.{k}"),
            format!("'{param}.{k}' is not supported."),
        )),
    }
}

fn schema_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::Object(_) => Ok(v.to_string()),
        // vLLM takes a schema as a JSON string too.
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(inner @ Value::Object(_)) => Ok(inner.to_string()),
            _ => Err(invalid(
                param,
                format!("'{param}' must be a JSON schema object."),
            )),
        },
        _ => Err(invalid(
            param,
            format!("'{param}' must be a JSON schema object."),
        )),
    }
}

fn string<'a>(v: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    v.as_str()
        .ok_or_else(|| invalid(param, format!("'{param}' must be a string.")))
}

/// GBNF unless it announces llguidance's Lark (llama.cpp's `%llguidance` convention).
fn grammar(text: &str) -> ConstraintSpec {
    if text.trim_start().starts_with("%llguidance") {
        ConstraintSpec::Lark(text.to_owned())
    } else {
        ConstraintSpec::Gbnf(text.to_owned())
    }
}

fn response_format(v: &Value) -> Result<Option<ConstraintSpec>, ApiError> {
    const P: &str = "response_format";
    let obj = object(v, P)?;
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => {
            only(obj, P, &["type"])?;
            Ok(None)
        }
        Some("json_object") => {
            // llama.cpp's extension: a json_object with its schema.
            only(obj, P, &["type", "schema"])?;
            Ok(Some(match obj.get("schema") {
                None | Some(Value::Null) => ConstraintSpec::JsonObject,
                Some(s) => ConstraintSpec::JsonSchema(schema_text(s, "response_format.schema")?),
            }))
        }
        Some("json_schema") => {
            only(obj, P, &["type", "json_schema"])?;
            const J: &str = "response_format.json_schema";
            let js = object(obj.get("json_schema").unwrap_or(&Value::Null), J)?;
            only(js, J, &["name", "description", "schema", "strict"])?;
            Ok(Some(ConstraintSpec::JsonSchema(match js.get("schema") {
                // OpenAI's schema is optional: any JSON value then.
                None | Some(Value::Null) => "{}".to_owned(),
                Some(s) => schema_text(s, "response_format.json_schema.schema")?,
            })))
        }
        Some(other) => Err(ApiError::unsupported(
            "response_format.type",
            format!("response_format of type '{other}' is not supported; use text, json_object or json_schema."),
        )),
        None => Err(invalid(
            "response_format.type",
            "'response_format.type' is required.",
        )),
    }
}

/// vLLM's `structured_outputs`: exactly one of its kinds.
fn structured_outputs(v: &Value) -> Result<Option<ConstraintSpec>, ApiError> {
    const P: &str = "structured_outputs";
    let obj = object(v, P)?;
    only(
        obj,
        P,
        &["json", "regex", "choice", "grammar", "json_object"],
    )?;
    let mut found = Vec::new();
    for (key, value) in obj {
        let spec = match (key.as_str(), value) {
            (_, Value::Null) => continue,
            ("json_object", Value::Bool(false)) => continue,
            ("json_object", Value::Bool(true)) => ConstraintSpec::JsonObject,
            ("json", s) => ConstraintSpec::JsonSchema(schema_text(s, "structured_outputs.json")?),
            ("regex", s) => {
                ConstraintSpec::Regex(string(s, "structured_outputs.regex")?.to_owned())
            }
            ("grammar", s) => {
                let text = string(s, "structured_outputs.grammar")?;
                // vLLM's grammars are GBNF (xgrammar) or Lark (guidance): GBNF defines
                // rules with `::=`, which Lark never contains.
                if text.contains("::=") {
                    ConstraintSpec::Gbnf(text.to_owned())
                } else {
                    ConstraintSpec::Lark(text.to_owned())
                }
            }
            ("choice", Value::Array(items)) => ConstraintSpec::Choice(
                items
                    .iter()
                    .map(|i| i.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        invalid("structured_outputs.choice", "Each choice must be a string.")
                    })?,
            ),
            (key, _) => {
                return Err(invalid(
                    &format!("{P}.{key}"),
                    format!("'{P}.{key}' has the wrong type."),
                ))
            }
        };
        found.push(spec);
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(invalid(
            P,
            "Give one of structured_outputs' json, regex, choice, grammar or json_object.",
        )),
    }
}

/// The request's constraint, if it asks for one: each shape parsed, sizes checked against
/// [`constraint::limits`] (compiling waits for the prompt workers).
pub fn requested(c: &Common<'_>) -> Result<Option<Requested>, ApiError> {
    let mut found: Vec<Requested> = Vec::new();
    let mut add = |param: &'static str, spec: Option<ConstraintSpec>| {
        if let Some(spec) = spec {
            found.push(Requested { spec, param });
        }
    };
    if let Some(v) = c.response_format.filter(|v| !v.is_null()) {
        add("response_format", response_format(v)?);
    }
    if let Some(v) = c.json_schema.filter(|v| !v.is_null()) {
        add(
            "json_schema",
            Some(ConstraintSpec::JsonSchema(schema_text(v, "json_schema")?)),
        );
    }
    if let Some(v) = c.grammar.filter(|v| !v.is_null()) {
        let text = string(v, "grammar")?;
        if !text.trim().is_empty() {
            add("grammar", Some(grammar(text)));
        }
    }
    if let Some(v) = c.structured_outputs.filter(|v| !v.is_null()) {
        add("structured_outputs", structured_outputs(v)?);
    }
    if found.len() > 1 {
        return Err(invalid(
            found[1].param,
            format!(
                "'{}' and '{}' both constrain the answer; give one.",
                found[0].param, found[1].param
            ),
        ));
    }
    let Some(requested) = found.pop() else {
        return Ok(None);
    };
    requested
        .spec
        .check_size()
        .map_err(|e| compile_error(requested.param, &e))?;
    Ok(Some(requested))
}

/// A constraint that cannot be compiled (or is over a limit): a 400 naming its field.
pub fn compile_error(param: &str, e: &constraint::ConstraintError) -> ApiError {
    invalid(param, format!("Invalid '{param}': {e}"))
}
