//! Reading and decoding request bodies. axum's `Json` extractor answers type errors with
//! 422 and plain text; here every failure becomes a 400 (or 413) in OpenAI's shape, naming
//! the offending field.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Reads the whole body, refusing it once it grows past `limit` bytes or takes longer than
/// `timeout` to arrive (a Content-Length larger than what is sent, or a body trickled a
/// byte at a time, would otherwise hold the connection for ever).
pub async fn read(body: Body, limit: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    let read = axum::body::to_bytes(body, limit);
    let Ok(read) = tokio::time::timeout(timeout, read).await else {
        return Err(ApiError::BodyTimeout {
            secs: timeout.as_secs(),
        });
    };
    read.map_err(|e| {
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

/// Refuses a body that is not declared JSON. A web page can make a browser POST
/// `text/plain` (or a form) to any address without a preflight, so accepting bodies
/// regardless of their type would let any site a user visits drive an unauthenticated
/// loopback server; it cannot send `application/json` cross-origin without the server's
/// consent (CORS, which this server never grants).
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let value = headers.get(header::CONTENT_TYPE);
    let is_json = value
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
    if is_json {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType {
            got: value.map(|v| {
                String::from_utf8_lossy(v.as_bytes())
                    .chars()
                    .take(100)
                    .collect()
            }),
        })
    }
}

/// Refuses a `Transfer-Encoding` other than one `chunked` (hyper decodes a final
/// `chunked` and would pass over a `gzip` before it). RFC 9112 answers an unknown coding
/// with 501.
pub fn require_known_transfer_encoding(headers: &HeaderMap) -> Result<(), ApiError> {
    let mut codings = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty());
    let only_chunked = match (codings.next(), codings.next()) {
        (None, _) => true,
        (Some(c), None) => c.eq_ignore_ascii_case(b"chunked"),
        _ => false,
    };
    if only_chunked {
        return Ok(());
    }
    let got = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect::<Vec<_>>()
        .join(", ");
    Err(ApiError::UnsupportedTransferEncoding {
        got: got.chars().take(100).collect(),
    })
}

/// Decodes a JSON object, mapping each serde failure to a typed 400.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let Some(&first) = bytes.iter().find(|b| !b.is_ascii_whitespace()) else {
        return Err(ApiError::invalid(
            "invalid_json",
            None,
            "The request body is empty; expected a JSON object.",
        ));
    };
    if first != b'{' {
        // serde would accept a JSON array as the positional form of a struct
        // (`["model", [...]]`); the API takes objects only. Anything else that parses is the
        // wrong type, anything that does not is malformed JSON.
        return Err(
            match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
                Ok(_) => ApiError::invalid(
                    "invalid_type",
                    None,
                    format!(
                        "The request body must be a JSON object, not {}.",
                        json_kind(first)
                    ),
                ),
                Err(e) => invalid_json(&e),
            },
        );
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| from_path_error(&e))?;
    // Trailing bytes after the object are a malformed body, not something to ignore.
    de.end().map_err(|e| invalid_json(&e))?;
    Ok(value)
}

fn json_kind(first: u8) -> &'static str {
    match first {
        b'[' => "an array",
        b'"' => "a string",
        b't' | b'f' => "a boolean",
        b'n' => "null",
        _ => "a number",
    }
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
    if let Some(field) = msg
        .strip_prefix("unknown field `")
        .and_then(|r| r.split('`').next())
    {
        // A field kvwarden does not know is refused by name, never ignored (see
        // `crate::request`). Client-chosen: only a bounded prefix is echoed.
        let field: String = field.chars().take(64).collect();
        let param = match &at {
            Some(p) if p.ends_with(&field) => p.clone(),
            Some(p) => format!("{p}.{field}"),
            None => field,
        };
        return ApiError::unsupported(
            &param,
            format!("Unrecognized request argument supplied: {param}."),
        );
    }
    let code = if msg.starts_with("invalid value") || msg.starts_with("invalid length") {
        "invalid_value"
    } else {
        "invalid_type"
    };
    let msg = in_api_terms(&msg);
    let message = match &at {
        Some(p) => format!("Invalid value for '{p}': {msg}."),
        None => format!("Invalid request body: {msg}."),
    };
    ApiError::invalid(code, at, message)
}

/// serde describes what it expected in Rust's terms (`u64`, `struct Message`, `untagged
/// enum Prompt`, `a sequence`); clients speak JSON. Rewrites those descriptions, keeping
/// serde's account of what it found and where.
fn in_api_terms(msg: &str) -> String {
    let (main, location) = match msg.rfind(" at line ") {
        Some(i) => msg.split_at(i),
        None => (msg, ""),
    };
    let main =
        if let Some(name) = main.strip_prefix("data did not match any variant of untagged enum ") {
            format!("expected {}", untagged_shape(name))
        } else if let Some((found, expected)) = main.split_once(", expected ") {
            let found = found
                .replace("invalid type: map", "invalid type: object")
                .replace("invalid type: sequence", "invalid type: array");
            format!("{found}, expected {}", expected_in_json(expected))
        } else {
            main.to_owned()
        };
    format!("{main}{location}")
}

/// What each untagged enum of the request types accepts, as JSON.
fn untagged_shape(name: &str) -> &'static str {
    match name.trim() {
        "Prompt" => "a string, an array of strings, an array of token ids or an array of arrays of token ids",
        "Stop" => "a string or an array of strings",
        "Content" => "a string or an array of content parts",
        _ => "a value of another shape",
    }
}

fn expected_in_json(expected: &str) -> String {
    let e = expected.trim();
    match e {
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a non-negative integer".into(),
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "an integer".into(),
        "f32" | "f64" => "a number".into(),
        "a sequence" => "an array".into(),
        "a map" => "an object".into(),
        "a borrowed string" | "a string" => "a string".into(),
        "a boolean" => "a boolean".into(),
        _ if e.starts_with("struct ") => "an object".into(),
        _ if e.starts_with("enum ") || e.contains("variant") => "one of the allowed values".into(),
        _ if e.chars().any(|c| c == '_' || c.is_ascii_uppercase()) => {
            "a value of another type".into()
        }
        _ => e.to_owned(),
    }
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
        // serde's positional form of a struct: an array is not an object.
        assert_eq!(
            err("[\"m\", 5, [{\"role\": \"user\"}]]"),
            (400, "invalid_type", None)
        );
        assert_eq!(err(" [1, 2"), (400, "invalid_json", None));
        assert_eq!(err("null"), (400, "invalid_type", None));
    }

    /// Messages speak JSON, never Rust: no type names, no `struct`, `enum` or `u64`.
    #[test]
    fn messages_name_no_rust_types() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Full {
            prompt: crate::request::Prompt,
            stop: Option<crate::request::Stop>,
            messages: Option<Vec<crate::request::Message>>,
            n: Option<u64>,
            seed: Option<i64>,
            temperature: Option<f64>,
            stream: Option<bool>,
        }
        let bodies = [
            r#"{"prompt": {"a": 1}}"#,
            r#"{"prompt": "x", "stop": 5}"#,
            r#"{"prompt": "x", "messages": [5]}"#,
            r#"{"prompt": "x", "messages": [{"role": "user", "content": 5}]}"#,
            r#"{"prompt": "x", "messages": {"role": "user"}}"#,
            r#"{"prompt": "x", "n": "5"}"#,
            r#"{"prompt": "x", "n": -1}"#,
            r#"{"prompt": "x", "n": 1.5}"#,
            r#"{"prompt": "x", "seed": "x"}"#,
            r#"{"prompt": "x", "temperature": []}"#,
            r#"{"prompt": "x", "stream": 1}"#,
            r#"{"prompt": [[1, -2]]}"#,
        ];
        for body in bodies {
            let e = decode::<Full>(body.as_bytes()).unwrap_err();
            let msg = e.to_string();
            assert_eq!(e.status().as_u16(), 400, "{body}: {msg}");
            for rust in [
                "struct", "enum", "u64", "i64", "f64", "u32", "sequence", " map", "Prompt", "Stop",
                "Message", "Content",
            ] {
                assert!(!msg.contains(rust), "{body}: {msg:?} mentions {rust:?}");
            }
        }
        let e = decode::<Full>(br#"{"prompt": {"a": 1}}"#).unwrap_err();
        assert!(e.to_string().contains("array of token ids"), "{e}");
    }

    #[test]
    fn only_json_bodies_are_read() {
        let with = |v: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(v) = v {
                h.insert(header::CONTENT_TYPE, v.parse().unwrap());
            }
            require_json(&h).map_err(|e| (e.status().as_u16(), e.code()))
        };
        assert_eq!(with(Some("application/json")), Ok(()));
        assert_eq!(with(Some("Application/JSON; charset=utf-8")), Ok(()));
        for bad in [
            None,
            Some("text/plain"),
            Some("text/plain;charset=UTF-8"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some("application/jsonp"),
        ] {
            assert_eq!(with(bad), Err((415, "unsupported_media_type")), "{bad:?}");
        }
    }

    #[test]
    fn accepts_a_valid_body() {
        let r: Req =
            decode(b" {\"model\":\"m\",\"messages\":[{\"role\":\"user\"}],\"extra\":1} ").unwrap();
        assert_eq!(r.messages.len(), 1);
    }

    #[test]
    fn only_a_single_chunked_transfer_coding_passes() {
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::TRANSFER_ENCODING, v.parse().unwrap());
            }
            require_known_transfer_encoding(&h)
        };
        assert!(with(&[]).is_ok());
        assert!(with(&["chunked"]).is_ok());
        assert!(with(&["Chunked "]).is_ok());
        for bad in [
            &["gzip, chunked"][..],
            &["gzip", "chunked"],
            &["chunked, chunked"],
            &["identity"],
        ] {
            let e = with(bad).unwrap_err();
            assert_eq!(
                (e.status().as_u16(), e.code()),
                (501, "unsupported_transfer_encoding"),
                "{bad:?}"
            );
        }
    }
}
