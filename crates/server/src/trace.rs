//! The client's W3C `traceparent`, honoured: the request's root span continues the client's
//! trace. Only ids and timings go into spans (ARCHITECTURE.md, per-request state).

use axum::http::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The span of one API request, child of the client's span when it sent one.
pub(crate) fn request_span(endpoint: &'static str, headers: &HeaderMap) -> tracing::Span {
    let span = tracing::info_span!("request", endpoint, tenant = tracing::field::Empty);
    let parent = TraceContextPropagator::new().extract(&Headers(headers));
    // Fails only for a disabled span, which exports nothing anyway.
    let _ = span.set_parent(parent);
    span
}

static TENANT_ATTRIBUTE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The operator's choice (`--otlp-tenant-attribute`): the tenant's name on the request's
/// span. Off by default, since a trace store is often readable by more people than the
/// keys file.
pub fn record_tenant_names(on: bool) {
    TENANT_ATTRIBUTE.store(on, std::sync::atomic::Ordering::Relaxed);
}

pub(crate) fn record_tenant(tenant: &str) {
    if TENANT_ATTRIBUTE.load(std::sync::atomic::Ordering::Relaxed) {
        tracing::Span::current().record("tenant", tenant);
    }
}
