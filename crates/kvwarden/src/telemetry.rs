//! Logs to stderr, and with `--otlp-endpoint` the request spans of `server`, `router` and
//! `transfer` exported over OTLP/HTTP (protobuf). Spans only, never events: an event's
//! message may quote a request's content, and a trace store is read by more people than
//! the process's own log.

use axum::http::Uri;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

#[derive(clap::Args, Clone, Default)]
pub struct OtlpArgs {
    /// Export traces over OTLP/HTTP (protobuf) to this collector: the traces URL
    /// (http://HOST:4318/v1/traces), or its base (http://HOST:4318, to which /v1/traces is
    /// added). Plain http only (a collector beside the process). Spans carry ids and
    /// timings, never prompts, completions or keys.
    #[arg(long, value_name = "URL")]
    pub(crate) otlp_endpoint: Option<String>,
    /// Put the tenant's name on each request's span (off: traces do not say whose request
    /// it was).
    #[arg(long, requires = "otlp_endpoint")]
    pub(crate) otlp_tenant_attribute: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("--otlp-endpoint {0:?} is not a URL: {1}")]
    NotUrl(String, String),
    #[error(
        "--otlp-endpoint {0:?}: must be an http:// URL (plain HTTP to a collector beside the process: no TLS is built in)"
    )]
    Scheme(String),
    #[error("--otlp-endpoint: the OTLP exporter did not start: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// The traces URL the exporter posts to.
fn traces_url(endpoint: &str) -> Result<String, TelemetryError> {
    let uri: Uri = endpoint.parse().map_err(|e: axum::http::uri::InvalidUri| {
        TelemetryError::NotUrl(endpoint.into(), e.to_string())
    })?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(TelemetryError::Scheme(endpoint.into()));
    }
    Ok(match uri.path() {
        "" | "/" => format!(
            "http://{}/v1/traces",
            uri.authority().map_or("", |a| a.as_str())
        ),
        _ => endpoint.to_owned(),
    })
}

/// Flushes the spans still batched when dropped (the end of `main`, after a SIGTERM's
/// graceful shutdown).
pub struct Telemetry(Option<SdkTracerProvider>);

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take() {
            if let Err(e) = provider.shutdown() {
                eprintln!("warning: the last traces were not exported: {e}");
            }
        }
    }
}

/// A span of one request's path (`server`, `router`, `transfer`), not the transport's (h2,
/// hyper and tonic trace every frame).
fn request_span(meta: &tracing::Metadata<'_>) -> bool {
    let crate_name = meta.target().split("::").next().unwrap_or_default();
    matches!(crate_name, "server" | "router" | "transfer") && *meta.level() <= tracing::Level::INFO
}

pub fn init(otlp: Option<(&OtlpArgs, &str)>) -> Result<Telemetry, TelemetryError> {
    // The request spans are for traces: the log stays as it was without them (and a span's
    // tenant attribute never reaches it).
    let env = EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(env.and(filter_fn(|meta| !(meta.is_span() && request_span(meta)))));
    let Some((args, service)) = otlp.filter(|(a, _)| a.otlp_endpoint.is_some()) else {
        tracing_subscriber::registry().with(fmt).init();
        return Ok(Telemetry(None));
    };
    let url = traces_url(args.otlp_endpoint.as_deref().unwrap_or_default())?;
    let exporter = SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(service.to_owned())
                .build(),
        )
        .build();
    server::trace::record_tenant_names(args.otlp_tenant_attribute);
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("kvwarden"))
        .with_filter(filter_fn(|meta| meta.is_span() && request_span(meta)));
    tracing_subscriber::registry().with(fmt).with(otel).init();
    Ok(Telemetry(Some(provider)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_is_the_traces_url_or_its_base() {
        let full = "http://127.0.0.1:4318/v1/traces";
        assert_eq!(traces_url(full).unwrap(), full);
        assert_eq!(traces_url("http://127.0.0.1:4318").unwrap(), full);
        assert_eq!(traces_url("http://127.0.0.1:4318/").unwrap(), full);
        for refused in ["https://collector:4318", "collector:4318", "not a url", ""] {
            assert!(traces_url(refused).is_err(), "{refused:?} accepted");
        }
    }
}
