//! Reading and decoding request bodies. axum's `Json` extractor answers type errors with
//! 422 and plain text; here every failure becomes a 400 (or 413) in OpenAI's shape, naming
//! the offending field.

use axum::body::{Body, Bytes};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Reads the whole body, refusing it once it grows past `limit` bytes.
pub async fn read(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let inner = e.into_inner();
        if inner
            .downcast_ref::<http_body_util::LengthLimitError>()
            .is_some()
        {
            ApiError::PayloadTooLarge { limit }
        } else {
            ApiError::invalid(
                "invalid_body",
                None,
                format!("Could not read the request body: {inner}"),
            )
        }
    })
}

/// Decodes a JSON object, mapping each serde failure to a typed 400.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(
            "invalid_json",
            None,
            "The request body is empty; expected a JSON object.",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| from_path_error(&e))?;
    // Trailing bytes after the object are a malformed body, not something to ignore.
    de.end().map_err(|e| invalid_json(&e))?;
    Ok(value)
}

fn invalid_json(e: &serde_json::Error) -> ApiError {
    ApiError::invalid(
        "invalid_json",
        None,
        format!("We could not parse the JSON body of your request: {e}."),
    )
}

fn from_path_error(e: &serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let inner = e.inner();
    if !inner.is_data() {
        return invalid_json(inner);
    }
    let path = e.path().to_string();
    let at = if path == "." { None } else { Some(path) };
    let msg = inner.to_string();
    if let Some(field) = msg
        .strip_prefix("missing field `")
        .and_then(|r| r.split('`').next())
    {
        let param = match &at {
            Some(p) => format!("{p}.{field}"),
            None => field.to_owned(),
        };
        return ApiError::invalid(
            "missing_required_parameter",
            Some(param.clone()),
            format!("Missing required parameter: '{param}'."),
        );
    }
    let code = if msg.starts_with("invalid value") || msg.starts_with("invalid length") {
        "invalid_value"
    } else {
        "invalid_type"
    };
    let message = match &at {
        Some(p) => format!("Invalid value for '{p}': {msg}."),
        None => format!("Invalid request body: {msg}."),
    };
    ApiError::invalid(code, at, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Req {
        model: String,
        max_tokens: Option<u32>,
        messages: Vec<Msg>,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Msg {
        role: String,
    }

    fn err(body: &str) -> (u16, &'static str, Option<String>) {
        let e = decode::<Req>(body.as_bytes()).unwrap_err();
        (e.status().as_u16(), e.code(), e.param().map(str::to_owned))
    }

    #[test]
    fn maps_serde_failures_to_400s() {
        assert_eq!(err("{\"model\": "), (400, "invalid_json", None));
        assert_eq!(err("not json"), (400, "invalid_json", None));
        assert_eq!(err(""), (400, "invalid_json", None));
        assert_eq!(
            err("{\"model\":\"m\",\"messages\":[]} x"),
            (400, "invalid_json", None)
        );
        assert_eq!(
            err("{\"model\":\"m\"}"),
            (400, "missing_required_parameter", Some("messages".into()))
        );
        assert_eq!(
            err("{\"model\":\"m\",\"messages\":[{}]}"),
            (
                400,
                "missing_required_parameter",
                Some("messages[0].role".into())
            )
        );
        assert_eq!(
            err("{\"model\":\"m\",\"messages\":[],\"max_tokens\":\"5\"}"),
            (400, "invalid_type", Some("max_tokens".into()))
        );
        assert_eq!(
            err("{\"model\":\"m\",\"messages\":[],\"max_tokens\":-1}"),
            (400, "invalid_value", Some("max_tokens".into()))
        );
        assert_eq!(err("\"text\""), (400, "invalid_type", None));
    }

    #[test]
    fn accepts_a_valid_body() {
        let r: Req =
            decode(b" {\"model\":\"m\",\"messages\":[{\"role\":\"user\"}],\"extra\":1} ").unwrap();
        assert_eq!(r.messages.len(), 1);
    }
}
