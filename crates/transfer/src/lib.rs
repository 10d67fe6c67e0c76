//! The internal API of the disaggregated mode: a router and prefill and decode nodes talk
//! gRPC (tonic) over mutually authenticated TLS. The router carries control; K/V pages go
//! straight from the prefill node to the decode node, which verifies them
//! (`engine::handoff`) before it decodes.
#![forbid(unsafe_code)]

pub mod certs;
pub mod metrics;
pub mod node;
pub mod tls;
pub mod trace;
pub mod wire;

/// The generated protobuf messages and gRPC stubs (`proto/node.proto`, compiled by
/// `build.rs` with tonic_prost_build and protoc_bin_vendored); the generated code derives
/// `prost::Message` and encodes with `tonic_prost::ProstCodec`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("kvwarden.node.v1");
}

use std::future::Future;
use std::sync::Arc;

pub use metrics::TransferMetrics;
pub use node::{connect_lazy, Deadlines, NodeIdentity, NodeService, Role};
pub use tls::{TlsFiles, TlsIdentity};

/// Serves the internal API on `listener` (mutual TLS) until `shutdown` resolves.
pub async fn serve_node(
    listener: tokio::net::TcpListener,
    service: Arc<NodeService>,
    tls: &TlsIdentity,
    metrics: Arc<TransferMetrics>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let incoming = tls::incoming(listener, tls, metrics)?;
    let limit = service.max_message_bytes();
    let svc = pb::node_server::NodeServer::new(service)
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit);
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(5)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(5)))
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming.connections, shutdown)
        .await?;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("internal API: {0}")]
    Transport(#[from] tonic::transport::Error),
}
