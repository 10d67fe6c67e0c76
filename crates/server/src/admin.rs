//! The operator API: LoRA adapters loaded, listed and unloaded while the server runs.
//!
//! It has a listener of its own ([`serve_admin`]) and a token of its own ([`AdminToken`]):
//! no route of the tenants' API reaches it, and no tenant's key opens it. An unload takes
//! the adapter out of the catalog at once (new requests get 404) and answers once no
//! request holds it any more: requests already running finish under it, since each holds
//! its weights until it ends (`engine::Unloading`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::adapters::{Catalog, CatalogError, Entry};
use crate::error::ApiError;
use crate::{body, ConnectionLimits};

/// Loads adapter files against the served model: the process that holds the model knows
/// how (this crate holds no weights).
pub trait AdapterLoader: Send + Sync + 'static {
    /// Reads and checks the adapter at `path` at `scale`, and puts it in the engine's set
    /// under `name`. Blocking (reads the file, widens the weights): run off the async
    /// threads.
    fn load(&self, name: &str, path: &Path, scale: f32) -> Result<(), LoadError>;
}

/// Why a hot load failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The loader's own account of what is wrong with the file.
    #[error("{0}")]
    Refused(String),
    #[error("an adapter named {0:?} is already loaded")]
    Exists(String),
}

/// Why the operator token could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read --admin-token-file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--admin-token-file {path} is empty: the operator API needs a token")]
    Empty { path: PathBuf },
}

/// The operator's bearer token.
pub struct AdminToken(Vec<u8>);

impl AdminToken {
    /// The file's content without surrounding whitespace (a trailing newline is not part
    /// of the token).
    pub fn load(path: &Path) -> Result<Self, TokenError> {
        let text = std::fs::read(path).map_err(|source| TokenError::Io {
            path: path.to_owned(),
            source,
        })?;
        let token = text.trim_ascii();
        if token.is_empty() {
            return Err(TokenError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Self(token.to_vec()))
    }

    pub fn new(token: &[u8]) -> Option<Self> {
        let token = token.trim_ascii();
        (!token.is_empty()).then(|| Self(token.to_vec()))
    }

    /// 401 unless the request carries `Authorization: Bearer TOKEN`, compared in constant
    /// time.
    fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return Err(ApiError::Unauthorized(
                "The operator API needs `Authorization: Bearer TOKEN` (the --admin-token-file token), sent once.",
            ));
        };
        let bytes = value.as_bytes();
        let presented = match bytes.get(..7) {
            Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => {
                bytes.get(7..).unwrap_or_default().trim_ascii()
            }
            _ => {
                return Err(ApiError::Unauthorized(
                    "The Authorization header must have the form `Bearer TOKEN`.",
                ))
            }
        };
        if bool::from(crate::auth::ct_eq_padded(&self.0, presented)) {
            Ok(())
        } else {
            Err(ApiError::Unauthorized("Incorrect operator token."))
        }
    }
}

/// What the operator API works on.
pub struct Admin {
    pub token: AdminToken,
    /// The tenants' view: names, ids, access (shared with the API's `AppState`).
    pub catalog: Arc<Catalog>,
    /// The weights the engine computes with.
    pub adapters: Arc<engine::Adapters>,
    pub loader: Arc<dyn AdapterLoader>,
    /// How long an unload waits for the requests using the adapter before it answers 202.
    pub unload_wait: Duration,
    pub max_body_bytes: usize,
    pub body_timeout: Duration,
}

impl Admin {
    pub fn new(
        token: AdminToken,
        catalog: Arc<Catalog>,
        adapters: Arc<engine::Adapters>,
        loader: Arc<dyn AdapterLoader>,
    ) -> Self {
        Self {
            token,
            catalog,
            adapters,
            loader,
            unload_wait: Duration::from_secs(600),
            max_body_bytes: 64 * 1024,
            body_timeout: Duration::from_secs(30),
        }
    }
}

pub fn admin_router(admin: Arc<Admin>) -> Router {
    Router::new()
        .route("/v1/adapters", get(list).post(load))
        // Adapter names may hold `/`.
        .route("/v1/adapters/{*name}", delete(unload))
        .fallback(crate::routes::not_found)
        .method_not_allowed_fallback(crate::routes::method_not_allowed)
        .with_state(admin)
}

/// Serves the operator API until `shutdown` resolves.
pub async fn serve_admin(
    listener: tokio::net::TcpListener,
    admin: Arc<Admin>,
    limits: ConnectionLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    crate::conn::serve_router(listener, admin_router(admin), limits, shutdown).await
}

fn describe(entry: &Entry, info: Option<&engine::AdapterInfo>) -> Value {
    json!({
        "id": entry.id,
        "name": entry.name,
        "scale": entry.scale,
        "rank": info.map(|i| i.rank),
        "fingerprint": info.map(|i| format!("{:032x}", i.fingerprint)),
        "file_checksum": info.map(|i| format!("{:032x}", i.file_checksum)),
        // null: every tenant (no access file).
        "tenants": entry.tenants,
    })
}

fn described(admin: &Admin, entry: &Entry) -> Value {
    let infos = admin.adapters.list();
    describe(entry, infos.iter().find(|i| i.name == entry.name))
}

async fn list(State(admin): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if let Err(e) = admin.token.check(&headers) {
        return e.into_response();
    }
    let infos = admin.adapters.list();
    let data: Vec<Value> = admin
        .catalog
        .entries()
        .iter()
        .map(|e| describe(e, infos.iter().find(|i| i.name == e.name)))
        .collect();
    Json(json!({ "object": "list", "data": data })).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadRequest {
    name: String,
    path: PathBuf,
    scale: Option<f64>,
    /// Who may use it; absent: every tenant, unless an access file restricts the server
    /// (then nobody until listed).
    tenants: Option<Vec<String>>,
}

async fn load(State(admin): State<Arc<Admin>>, headers: HeaderMap, body: Body) -> Response {
    match load_adapter(&admin, &headers, body).await {
        Ok(entry) => (StatusCode::CREATED, Json(described(&admin, &entry))).into_response(),
        Err(e) => e.into_response(),
    }
}

fn catalog_error(e: CatalogError) -> ApiError {
    match e {
        CatalogError::Exists(name) => ApiError::AdapterExists(name),
        other => ApiError::invalid("invalid_value", Some("name".to_owned()), other.to_string()),
    }
}

async fn load_adapter(
    admin: &Arc<Admin>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Entry, ApiError> {
    admin.token.check(headers)?;
    body::require_json(headers)?;
    let bytes = body::read(body, admin.max_body_bytes, admin.body_timeout).await?;
    let req: LoadRequest = body::decode(&bytes)?;
    admin.catalog.check_name(&req.name).map_err(catalog_error)?;
    let scale = req.scale.unwrap_or(1.0);
    if !scale.is_finite() {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("scale".to_owned()),
            "'scale' must be a finite number.",
        ));
    }
    let scale = scale as f32;
    let tenants: Option<BTreeSet<String>> = match req.tenants {
        None => None,
        Some(list) => {
            if let Some(bad) = list
                .iter()
                .find(|t| t.is_empty() || t.chars().any(char::is_whitespace))
            {
                return Err(ApiError::invalid(
                    "invalid_value",
                    Some("tenants".to_owned()),
                    format!("{bad:?} is not a tenant name (as the API key file names them)."),
                ));
            }
            Some(list.into_iter().collect())
        }
    };
    let loader = admin.loader.clone();
    let (name, path) = (req.name.clone(), req.path.clone());
    let loaded = tokio::task::spawn_blocking(move || loader.load(&name, &path, scale))
        .await
        .map_err(|e| ApiError::Internal(format!("the adapter loader failed: {e}")))?;
    match loaded {
        Ok(()) => {}
        Err(LoadError::Exists(name)) => return Err(ApiError::AdapterExists(name)),
        Err(LoadError::Refused(reason)) => {
            return Err(ApiError::invalid(
                "adapter_refused",
                Some("path".to_owned()),
                format!("The adapter {} was refused: {reason}", req.path.display()),
            ))
        }
    }
    match admin.catalog.add(&req.name, scale, tenants) {
        Ok(_) => {}
        Err(e) => {
            // Another load of this name got into the catalog first: this one's weights go.
            admin.adapters.remove(&req.name);
            return Err(catalog_error(e));
        }
    }
    tracing::info!(adapter = %req.name, "LoRA adapter loaded by the operator API");
    let entry = admin
        .catalog
        .entries()
        .into_iter()
        .find(|e| e.name == req.name)
        .ok_or_else(|| ApiError::Internal("the adapter was unloaded as it loaded".into()))?;
    Ok(entry)
}

async fn unload(
    State(admin): State<Arc<Admin>>,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = admin.token.check(&headers) {
        return e.into_response();
    }
    // Out of the catalog first: from here no new request selects it; one that selected it
    // just before holds its weights, and the wait below counts it.
    if !admin.catalog.remove(&name) {
        return ApiError::ModelNotFound(name).into_response();
    }
    let Some(unloading) = admin.adapters.remove(&name) else {
        return Json(json!({ "name": name, "unloaded": true, "in_use": 0 })).into_response();
    };
    tracing::info!(adapter = %name, users = unloading.users(), "LoRA adapter unloading");
    if unloading.wait(admin.unload_wait).await {
        Json(json!({ "name": name, "unloaded": true, "in_use": 0 })).into_response()
    } else {
        (
            StatusCode::ACCEPTED,
            Json(json!({ "name": name, "unloaded": false, "in_use": unloading.users() })),
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_token_is_the_files_content_and_nothing_else() {
        let token = AdminToken::new(b"  s3cret\n").unwrap();
        assert!(token.check(&headers(&["Bearer s3cret"])).is_ok());
        assert!(token.check(&headers(&["bearer s3cret "])).is_ok());
        for bad in [
            &[][..],
            &["Bearer s3cre"][..],
            &["Bearer s3crett"][..],
            &["s3cret"][..],
            &["Bearer "][..],
            &["Bearer s3cret", "Bearer s3cret"][..],
        ] {
            let e = token.check(&headers(bad)).unwrap_err();
            assert_eq!(e.status().as_u16(), 401, "{bad:?}");
        }
        assert!(AdminToken::new(b" \n").is_none());
    }
}
