//! W3C trace context across the internal API: the router's outgoing calls carry their
//! span's `traceparent` in the gRPC metadata, and a node's handler span continues it, so one
//! request is one trace across router, prefill and decode. Only ids cross: a span's
//! attributes never hold prompt text, tokens, completions or keys.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct Inject<'a>(&'a mut MetadataMap);

impl Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct Extract<'a>(&'a MetadataMap);

impl Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        Vec::new()
    }
}

/// Puts `span`'s context on an outgoing call (nothing when no exporter is installed).
pub fn inject<T>(span: &tracing::Span, request: &mut tonic::Request<T>) {
    TraceContextPropagator::new()
        .inject_context(&span.context(), &mut Inject(request.metadata_mut()));
}

/// Makes `span` the child of the caller's span, when the call carried one.
pub fn continue_from<T>(span: &tracing::Span, request: &tonic::Request<T>) {
    let parent = TraceContextPropagator::new().extract(&Extract(request.metadata()));
    // Fails only when the span was already started or is disabled: it stays a root then.
    let _ = span.set_parent(parent);
}
