//! llama.cpp's `/tokenize` and `/detokenize`, which clients use to count and cut prompts,
//! behind the same API keys as generation. Tokenizing is prompt work: it runs on the
//! prompt workers in the caller's tenant's share, holding a place in that tenant's limits,
//! and a text that could not fit the context is refused before it is tokenized, as a
//! prompt is.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::{body, AppState};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub content: String,
    /// Put the model's BOS in front when it expects one (llama.cpp's default: no).
    pub add_special: Option<bool>,
    /// Match control-token text as control tokens (llama.cpp's default: yes).
    pub parse_special: Option<bool>,
    /// Each token with its text (a string, or its bytes when they are not UTF-8).
    pub with_pieces: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

async fn read<R: serde::de::DeserializeOwned>(
    app: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(engine::IsolationDomain, R), ApiError> {
    let tenant = app.auth.authenticate(headers)?;
    body::require_json(headers)?;
    body::require_known_transfer_encoding(headers)?;
    let bytes = body::read(body, app.max_body_bytes, app.body_timeout).await?;
    Ok((tenant, body::decode(&bytes)?))
}

pub async fn tokenize(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match tokens_of(&app, &headers, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => crate::routes::refuse(&app, e),
    }
}

async fn tokens_of(app: &AppState, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    let (tenant, req) = read::<TokenizeRequest>(app, headers, body).await?;
    let _permit = app.tenants.acquire(tenant.tenant_name(), 0)?;
    app.backend
        .admission()
        .check_text_length(req.content.len(), app.max_bytes_per_token, None)
        .map_err(|rejection| ApiError::rejected(rejection, "content"))?;
    let tok = app.tokenizer.clone();
    let parse_special = req.parse_special.unwrap_or(true);
    let add_special = req.add_special.unwrap_or(false);
    let text = req.content;
    let tokens = app
        .prompt_workers
        .run(tenant.tenant_name(), move |cancel| {
            let cancelled = || cancel.is_cancelled();
            let tokens = if parse_special {
                tok.encode_cancellable(&text, &cancelled)
            } else {
                tok.encode_ordinary_cancellable(&text, &cancelled)
            };
            let tokens = tokens.ok_or(ApiError::Abandoned)?;
            Ok(if add_special {
                tok.with_bos(tokens)
            } else {
                tokens
            })
        })
        .await?;
    if !req.with_pieces.unwrap_or(false) {
        return Ok(json!({ "tokens": tokens }));
    }
    let pieces: Vec<Value> = tokens
        .iter()
        .map(|&id| {
            let bytes = app.tokenizer.token_bytes(id).unwrap_or_default();
            let piece = match std::str::from_utf8(bytes) {
                Ok(s) => Value::from(s),
                Err(_) => Value::from(bytes.to_vec()),
            };
            json!({ "id": id, "piece": piece })
        })
        .collect();
    Ok(json!({ "tokens": pieces }))
}

pub async fn detokenize(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match text_of(&app, &headers, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => crate::routes::refuse(&app, e),
    }
}

async fn text_of(app: &AppState, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    let (_, req) = read::<DetokenizeRequest>(app, headers, body).await?;
    // Linear in the body, which its limit bounds: no worker needed.
    let content = app.tokenizer.decode(&req.tokens).map_err(|e| {
        ApiError::invalid(
            "invalid_token",
            Some("tokens".to_owned()),
            format!("Invalid 'tokens': {e}."),
        )
    })?;
    Ok(json!({ "content": content }))
}
