//! Every way a request can fail, mapped to HTTP in exactly one place ([`ApiError`]'s
//! `IntoResponse`), in OpenAI's error shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use engine::{EngineError, QueueFull, Rejection};
use serde_json::{json, Value};

/// A failed request. Client mistakes are 4xx and never reach the engine; engine failures
/// after admission are 5xx and never turn into a 200.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something this server does not do.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
        code: &'static str,
    },
    /// The engine's admission refused the request before any resource existed.
    #[error("{rejection}")]
    Rejected {
        rejection: Rejection,
        /// The request field holding the input ("messages" or "prompt").
        input_param: &'static str,
    },
    #[error("The model `{0}` does not exist or you do not have access to it.")]
    ModelNotFound(String),
    /// llama.cpp's `lora` named an id that does not exist or that the tenant may not use:
    /// the same answer either way.
    #[error("The LoRA adapter with id {id} does not exist or you do not have access to it.")]
    AdapterIdNotFound { id: u64, param: String },
    #[error("{0}")]
    Unauthorized(&'static str),
    /// The operator API: an adapter of this name is already loaded.
    #[error("An adapter named `{0}` is already loaded; unload it first or choose another name.")]
    AdapterExists(String),
    #[error("The request body exceeds the limit of {limit} bytes.")]
    PayloadTooLarge { limit: usize },
    #[error("Unknown request URL: {method} {path}.")]
    RouteNotFound { method: String, path: String },
    #[error("Method {method} is not allowed for {path}.")]
    MethodNotAllowed { method: String, path: String },
    #[error("Request bodies must be JSON, sent with `Content-Type: application/json`{}.", got.as_ref().map(|g| format!(" (got '{g}')")).unwrap_or_default())]
    UnsupportedMediaType { got: Option<String> },
    /// A transfer coding other than a single `chunked`: decoding `chunked` and ignoring
    /// the rest would read the body as something other than what the client sent.
    #[error("Transfer-Encoding '{got}' is not supported; send the body as is or with `Transfer-Encoding: chunked` alone.")]
    UnsupportedTransferEncoding { got: String },
    #[error("{}", engine_message(.0))]
    Engine(#[from] EngineError),
    /// The engine holds as many requests as it may, or as many as this tenant may while
    /// others could need the rest; the client should retry shortly.
    #[error("{}", queue_full_message(.0))]
    QueueFull(#[from] QueueFull),
    /// The tenant already holds as many requests (or tokens) as `--tenant-max-requests`
    /// (`--tenant-max-tokens`) allow; other tenants are not affected.
    #[error("{}", tenant_limit_message(.0))]
    TenantLimit(crate::tenants::TenantLimit),
    /// The connection cap is reached; this connection is answered and closed.
    #[error("The server has {limit} connections open, its limit; retry shortly.")]
    TooManyConnections { limit: usize },
    /// This peer address already holds its share of the connection cap.
    #[error("Your address has {limit} connections open, the most one address may; close one or retry shortly.")]
    TooManyConnectionsFromAddress { limit: usize },
    /// The request body did not arrive in time.
    #[error("The request body did not arrive within {secs} seconds.")]
    BodyTimeout { secs: u64 },
    /// What the HTTP layer answers by itself when it cannot parse a request.
    #[error("{}", http_message(*.status))]
    Http { status: StatusCode },
    /// The client went away while its prompt was being prepared; nobody reads this.
    #[error("The client closed the connection before its prompt was ready.")]
    Abandoned,
    /// The engine thread is not running (it stopped, or died of a fault).
    #[error("The inference engine is not running; this server cannot answer generation requests.")]
    EngineUnavailable,
    /// A server-side fault unrelated to the request's content (a broken chat template, a
    /// token the tokenizer cannot decode).
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<crate::tenants::TenantLimit> for ApiError {
    fn from(limit: crate::tenants::TenantLimit) -> Self {
        ApiError::TenantLimit(limit)
    }
}

fn tenant_limit_message(limit: &crate::tenants::TenantLimit) -> String {
    match limit {
        crate::tenants::TenantLimit::Requests(n) => format!(
            "Your API key already has {n} requests in progress, its limit; retry once one ends."
        ),
        crate::tenants::TenantLimit::Tokens(n) => format!(
            "Your API key's requests in progress already hold up to {n} tokens (prompt plus max_tokens), its limit; retry once one ends."
        ),
    }
}

fn http_message(status: StatusCode) -> &'static str {
    match status.as_u16() {
        408 => "The request did not arrive in time.",
        413 => "The request is too large.",
        414 => "The request URL is too long.",
        431 => "The request's headers are too large.",
        _ => "The request is not valid HTTP/1.1 (its request line, a header or its Content-Length could not be parsed).",
    }
}

fn queue_full_message(full: &QueueFull) -> String {
    match *full {
        QueueFull::Full { limit } => {
            format!("The server is at capacity ({limit} requests running or queued); retry shortly.")
        }
        QueueFull::TenantShare { limit, held, reserve } => format!(
            "Your requests hold {held} of the server's {limit} places for requests; the last {reserve} are kept for other tenants. Retry when one of yours has finished."
        ),
    }
}

/// What a client is told about an engine failure. Never the engine error's own text: a
/// `KvError` names internal request numbers (for a foreign lease, another request's),
/// which would undo the opaque response ids. The server logs the detail instead
/// ([`ApiError::detail`]).
fn engine_message(e: &EngineError) -> &'static str {
    match e {
        EngineError::Isolation(_) => "A KV-cache isolation check stopped this request before it could read memory it does not own. Nothing was read; the server logged the details.",
        EngineError::Model(_) => "The model failed while processing this request; the server logged the details.",
        EngineError::Shutdown => "The engine is shutting down; retry later.",
        EngineError::Constraint(_) => CONSTRAINT_FAILED,
        EngineError::Remote { reason, .. } => match remote_kind(reason) {
            RemoteKind::Verification => "The prompt's KV cache failed verification between the prefill and decode nodes; the request was stopped before any token was decoded from it.",
            RemoteKind::Timeout => "A prefill or decode node did not answer in time.",
            RemoteKind::Unavailable => "A prefill or decode node is unavailable; retry later.",
            RemoteKind::Capacity => "The nodes hold as many requests as they may; retry later.",
            RemoteKind::Isolation => "A KV-cache isolation check stopped this request before it could read memory it does not own. Nothing was read; the server logged the details.",
            RemoteKind::Model => "The model failed while processing this request; the server logged the details.",
            RemoteKind::Constraint => CONSTRAINT_FAILED,
        },
    }
}

const CONSTRAINT_FAILED: &str = "The structured output's schema or grammar failed while generating: it needed more work for one token than the limits allow (see the README's structured outputs). Simplify it.";

/// How a failure on another node reaches the client.
enum RemoteKind {
    /// The handoff was refused: checksum, coverage, manifest, protocol, authentication.
    Verification,
    Timeout,
    /// Node gone or shutting down.
    Unavailable,
    /// The request's own constraint failed on the node.
    Constraint,
    /// A node's queue is full (its `QueueFull`).
    Capacity,
    Isolation,
    Model,
}

fn remote_kind(reason: &str) -> RemoteKind {
    match reason {
        "timeout" => RemoteKind::Timeout,
        "peer_gone" | "shutdown" => RemoteKind::Unavailable,
        "capacity" => RemoteKind::Capacity,
        "isolation" => RemoteKind::Isolation,
        "model" => RemoteKind::Model,
        "constraint" => RemoteKind::Constraint,
        _ => RemoteKind::Verification,
    }
}

impl ApiError {
    /// The full account of a failure, for the server's log only: unlike the client-facing
    /// message it may name internal request numbers.
    pub fn detail(&self) -> String {
        match self {
            ApiError::Engine(e) => e.to_string(),
            other => other.to_string(),
        }
    }

    pub fn invalid(
        code: &'static str,
        param: impl Into<Option<String>>,
        message: impl Into<String>,
    ) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: param.into(),
            code,
        }
    }

    /// A parameter or value this server deliberately does not implement.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self::invalid("unsupported_parameter", Some(param.to_owned()), message)
    }

    /// Admission's refusal as the client sees it. An adapter the node or engine does not
    /// hold is answered exactly as a model that does not exist (404 `model_not_found`),
    /// as `validation::select_model` answers one the tenant may not use.
    pub fn rejected(rejection: Rejection, input_param: &'static str) -> Self {
        match rejection {
            Rejection::AdapterNotLoaded { name } => ApiError::ModelNotFound(name),
            rejection => ApiError::Rejected {
                rejection,
                input_param,
            },
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::Rejected { .. } | ApiError::Abandoned => {
                StatusCode::BAD_REQUEST
            }
            ApiError::ModelNotFound(_)
            | ApiError::AdapterIdNotFound { .. }
            | ApiError::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::AdapterExists(_) => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UnsupportedMediaType { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::UnsupportedTransferEncoding { .. } => StatusCode::NOT_IMPLEMENTED,
            ApiError::Engine(EngineError::Remote { reason, .. }) => match remote_kind(reason) {
                RemoteKind::Verification => StatusCode::BAD_GATEWAY,
                RemoteKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
                RemoteKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                RemoteKind::Capacity => StatusCode::TOO_MANY_REQUESTS,
                RemoteKind::Isolation | RemoteKind::Model => StatusCode::INTERNAL_SERVER_ERROR,
                RemoteKind::Constraint => StatusCode::BAD_REQUEST,
            },
            ApiError::Engine(EngineError::Constraint(_)) => StatusCode::BAD_REQUEST,
            ApiError::QueueFull(_) | ApiError::TenantLimit(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::TooManyConnections { .. }
            | ApiError::TooManyConnectionsFromAddress { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::Http { status } => *status,
            ApiError::Engine(EngineError::Shutdown) | ApiError::EngineUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Engine(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A stable machine-readable code; also the `reason` label of the rejection metric.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { code, .. } => code,
            ApiError::Rejected { rejection, .. } => rejection.code(),
            ApiError::ModelNotFound(_) | ApiError::AdapterIdNotFound { .. } => "model_not_found",
            ApiError::Unauthorized(_) => "invalid_api_key",
            ApiError::AdapterExists(_) => "adapter_exists",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::RouteNotFound { .. } => "not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::UnsupportedMediaType { .. } => "unsupported_media_type",
            ApiError::UnsupportedTransferEncoding { .. } => "unsupported_transfer_encoding",
            ApiError::Engine(EngineError::Isolation(_)) => "isolation_check_failed",
            ApiError::Engine(EngineError::Model(_)) => "model_error",
            ApiError::Engine(EngineError::Constraint(_)) => "constraint_failed",
            ApiError::Engine(EngineError::Shutdown) => "service_unavailable",
            ApiError::Engine(EngineError::Remote { reason, .. }) => match remote_kind(reason) {
                RemoteKind::Verification => "kv_handoff_failed",
                RemoteKind::Timeout => "upstream_timeout",
                RemoteKind::Unavailable => "service_unavailable",
                RemoteKind::Capacity => "queue_full",
                RemoteKind::Isolation => "isolation_check_failed",
                RemoteKind::Model => "model_error",
                RemoteKind::Constraint => "constraint_failed",
            },
            ApiError::QueueFull(_) => "queue_full",
            // OpenAI's code for a per-key limit.
            ApiError::TenantLimit(_) => "rate_limit_exceeded",
            ApiError::TooManyConnections { .. }
            | ApiError::TooManyConnectionsFromAddress { .. } => "too_many_connections",
            ApiError::BodyTimeout { .. } => "request_timeout",
            ApiError::Http { status } => match status.as_u16() {
                408 => "request_timeout",
                413 => "payload_too_large",
                414 => "uri_too_long",
                431 => "request_header_fields_too_large",
                _ => "invalid_http_request",
            },
            ApiError::Abandoned => "client_closed_request",
            ApiError::EngineUnavailable => "engine_unavailable",
            ApiError::Internal(_) => "internal_error",
        }
    }

    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.as_deref(),
            ApiError::Rejected {
                rejection,
                input_param,
            } => Some(match rejection {
                Rejection::ZeroMaxTokens => "max_tokens",
                // The prompt fits on its own: it is the completion budget that does not.
                Rejection::ContextLengthExceeded {
                    limit,
                    prompt_tokens,
                    ..
                } if prompt_tokens < limit => "max_tokens",
                _ => input_param,
            }),
            ApiError::ModelNotFound(_) => Some("model"),
            ApiError::AdapterIdNotFound { param, .. } => Some(param),
            _ => None,
        }
    }

    /// Seconds after which a retry may succeed, sent as `Retry-After`.
    pub fn retry_after(&self) -> Option<u32> {
        match self {
            ApiError::QueueFull(_)
            | ApiError::TenantLimit(_)
            | ApiError::TooManyConnections { .. }
            | ApiError::TooManyConnectionsFromAddress { .. } => Some(1),
            ApiError::Engine(EngineError::Remote { reason, .. })
                if matches!(remote_kind(reason), RemoteKind::Capacity) =>
            {
                Some(1)
            }
            _ => None,
        }
    }

    pub fn error_type(&self) -> &'static str {
        if self.status() == StatusCode::TOO_MANY_REQUESTS {
            // Not the request's fault: the same request may succeed on retry.
            "rate_limit_error"
        } else if self.status().is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        }
    }

    /// The JSON body, also used as the payload of an SSE error event.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.to_string(),
                "type": self.error_type(),
                "param": self.param(),
                "code": self.code(),
            }
        })
    }
}

impl From<tokenizer::TemplateError> for ApiError {
    fn from(e: tokenizer::TemplateError) -> Self {
        match e {
            // The template's own `raise_exception`: the conversation, not the server, is wrong.
            tokenizer::TemplateError::Raised(msg) => {
                ApiError::invalid("invalid_messages", Some("messages".to_owned()), msg)
            }
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(code = self.code(), "request failed: {}", self.detail());
        }
        let mut response = (status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after() {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(e: &ApiError) -> (u16, String, Option<String>, String) {
        let body = e.body();
        let err = &body["error"];
        (
            e.status().as_u16(),
            err["code"].as_str().unwrap_or_default().to_owned(),
            err["param"].as_str().map(str::to_owned),
            err["type"].as_str().unwrap_or_default().to_owned(),
        )
    }

    #[test]
    fn over_length_is_400_with_limit_and_count() {
        let e = ApiError::Rejected {
            rejection: Rejection::ContextLengthExceeded {
                limit: 64,
                prompt_tokens: 64,
                max_tokens: 1,
                total: 65,
            },
            input_param: "messages",
        };
        assert_eq!(
            shape(&e),
            (
                400,
                "context_length_exceeded".into(),
                Some("messages".into()),
                "invalid_request_error".into()
            )
        );
        let msg = e.body()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            msg.contains("64 tokens") && msg.contains("65 tokens"),
            "{msg}"
        );
    }

    #[test]
    fn a_completion_budget_that_does_not_fit_names_max_tokens() {
        let rejected = |prompt_tokens, max_tokens| ApiError::Rejected {
            rejection: Rejection::ContextLengthExceeded {
                limit: 64,
                prompt_tokens,
                max_tokens,
                total: prompt_tokens + max_tokens,
            },
            input_param: "prompt",
        };
        assert_eq!(shape(&rejected(10, 55)).2.as_deref(), Some("max_tokens"));
        assert_eq!(shape(&rejected(63, 2)).2.as_deref(), Some("max_tokens"));
        assert_eq!(shape(&rejected(64, 1)).2.as_deref(), Some("prompt"));
        assert_eq!(shape(&rejected(100, 0)).2.as_deref(), Some("prompt"));
    }

    /// Error bodies name no internal request number: a KvError about a foreign lease
    /// carries another request's, and ids must not tell tenants about each other.
    #[test]
    fn engine_errors_name_no_internal_ids() {
        let errors = [
            EngineError::Isolation(kv::KvError::ForeignLease {
                request: kv::RequestId(7_001),
                owner: kv::RequestId(8_002),
            }),
            EngineError::Isolation(kv::KvError::UnwrittenRead {
                request: kv::RequestId(7_001),
                layer: 3,
                position: 9,
                written: 4,
            }),
            EngineError::Isolation(kv::KvError::ForeignPage {
                request: kv::RequestId(7_001),
            }),
            EngineError::Model("expected 300 logits for req-7001".into()),
        ];
        for e in errors {
            let api = ApiError::from(e.clone());
            let body = api.body().to_string();
            for leak in ["7001", "7_001", "8002", "req-"] {
                assert!(!body.contains(leak), "{body} names {leak}");
            }
            // The log still has the whole story.
            assert!(api.detail().contains("req-7001"), "{}", api.detail());
        }
    }

    #[test]
    fn zero_max_tokens_points_at_max_tokens() {
        let e = ApiError::Rejected {
            rejection: Rejection::ZeroMaxTokens,
            input_param: "prompt",
        };
        assert_eq!(shape(&e).2.as_deref(), Some("max_tokens"));
        assert_eq!(shape(&e).1, "invalid_max_tokens");
    }

    #[test]
    fn engine_errors_are_server_errors() {
        let iso = ApiError::from(EngineError::Isolation(kv::KvError::ForeignPage {
            request: kv::RequestId(7),
        }));
        assert_eq!(
            shape(&iso),
            (
                500,
                "isolation_check_failed".into(),
                None,
                "server_error".into()
            )
        );
        let down = ApiError::from(EngineError::Shutdown);
        assert_eq!(shape(&down).0, 503);
        assert_eq!(
            shape(&ApiError::from(EngineError::Model("x".into()))).0,
            500
        );
    }

    #[test]
    fn an_adapter_admission_does_not_hold_is_an_unknown_model() {
        let e = ApiError::rejected(
            Rejection::AdapterNotLoaded {
                name: "lora-x".into(),
            },
            "prompt",
        );
        let unknown = ApiError::ModelNotFound("lora-x".into());
        assert_eq!(shape(&e), shape(&unknown));
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        let other = ApiError::rejected(Rejection::ZeroMaxTokens, "prompt");
        assert_eq!(other.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn client_errors_have_stable_codes() {
        let cases = [
            (
                ApiError::ModelNotFound("gpt-9".into()),
                404,
                "model_not_found",
            ),
            (ApiError::Unauthorized("no key"), 401, "invalid_api_key"),
            (
                ApiError::PayloadTooLarge { limit: 10 },
                413,
                "payload_too_large",
            ),
            (
                ApiError::RouteNotFound {
                    method: "GET".into(),
                    path: "/x".into(),
                },
                404,
                "not_found",
            ),
            (
                ApiError::unsupported("n", "n must be 1"),
                400,
                "unsupported_parameter",
            ),
        ];
        for (e, status, code) in cases {
            let (s, c, _, ty) = shape(&e);
            assert_eq!(
                (s, c.as_str(), ty.as_str()),
                (status, code, "invalid_request_error"),
                "{e:?}"
            );
        }
    }

    #[test]
    fn template_raise_is_the_clients_fault() {
        let e = ApiError::from(tokenizer::TemplateError::Raised(
            "roles must alternate".into(),
        ));
        assert_eq!(shape(&e).0, 400);
    }

    #[test]
    fn a_full_queue_is_429_with_retry_after() {
        let e = ApiError::from(QueueFull::Full { limit: 3 });
        assert_eq!(
            shape(&e),
            (429, "queue_full".into(), None, "rate_limit_error".into())
        );
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            r.headers().get(axum::http::header::RETRY_AFTER),
            Some(&axum::http::HeaderValue::from_static("1"))
        );
    }

    #[test]
    fn response_status_matches() {
        let r = ApiError::ModelNotFound("m".into()).into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
    }
}
