//! Mutual TLS for every internal connection: a node accepts only clients whose certificate
//! the cluster CA signed, and a client accepts only servers whose certificate it signed.
//! The server side does its own handshakes (rather than tonic's) so that each refused peer
//! is counted (`kvwarden_transfer_failures_total{reason="auth"}`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_rustls::rustls::{
    self,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    server::WebPkiClientVerifier,
    RootCertStore, ServerConfig,
};
use tokio_rustls::TlsAcceptor;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use crate::metrics::TransferMetrics;

/// The name every cluster certificate carries and every client verifies, so that nodes
/// can be reached at any address.
pub const SERVER_NAME: &str = "kvwarden-node";

/// A handshake that has not finished by then is dropped: a peer that connects and sends
/// nothing holds no task.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Pem { path: String, what: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The PEM files of one process's identity and the CA it trusts.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Loaded PEM text, ready for both the server and the client side.
#[derive(Clone)]
pub struct TlsIdentity {
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn certs(pem: &[u8], path: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs = certs.map_err(|e| TlsError::Pem {
        path: path.to_owned(),
        what: e.to_string(),
    })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_owned(),
            what: "no certificate found".into(),
        });
    }
    Ok(certs)
}

impl TlsIdentity {
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let id = Self::from_pem(read(&files.ca)?, read(&files.cert)?, read(&files.key)?);
        // Parse now, so a bad file stops the process at start rather than at first use.
        id.server_config()?;
        Ok(id)
    }

    pub fn from_pem(ca_pem: Vec<u8>, cert_pem: Vec<u8>, key_pem: Vec<u8>) -> Self {
        Self {
            ca_pem,
            cert_pem,
            key_pem,
        }
    }

    fn server_config(&self) -> Result<ServerConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for ca in certs(&self.ca_pem, "CA certificate")? {
            roots
                .add(ca)
                .map_err(|e| TlsError::Config(format!("CA certificate: {e}")))?;
        }
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
        let key = PrivateKeyDer::from_pem_slice(&self.key_pem).map_err(|e| TlsError::Pem {
            path: "private key".into(),
            what: e.to_string(),
        })?;
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs(&self.cert_pem, "certificate")?, key)
            .map_err(|e| TlsError::Config(e.to_string()))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }

    /// The client side: present this identity, trust only the cluster CA.
    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(SERVER_NAME)
    }
}

/// A listener that yields only connections whose client certificate verified.
pub struct TlsIncoming {
    pub local_addr: SocketAddr,
    pub connections: tokio_stream::wrappers::ReceiverStream<
        Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::io::Error>,
    >,
}

/// Accepts TCP connections on `listener` and completes each TLS handshake in its own
/// task; refused or stalled handshakes are counted and dropped.
pub fn incoming(
    listener: TcpListener,
    identity: &TlsIdentity,
    metrics: Arc<TransferMetrics>,
) -> Result<TlsIncoming, TlsError> {
    let acceptor = TlsAcceptor::from(Arc::new(identity.server_config()?));
    let local_addr = listener
        .local_addr()
        .map_err(|e| TlsError::Config(format!("listener address: {e}")))?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!("internal accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if tx.is_closed() {
                return;
            }
            // Small gRPC frames (a verdict, a token event) must not wait for the peer's
            // delayed ACK: with Nagle's algorithm on, an answer written in two pieces
            // stalled 40 ms, a third of an unloaded request's first token through the
            // router. (The clients set it on their side: `connect_lazy`.)
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("internal connection from {peer}: TCP_NODELAY: {e}");
            }
            let (acceptor, tx, metrics) = (acceptor.clone(), tx.clone(), metrics.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(tls)).await;
                    }
                    Ok(Err(e)) => {
                        metrics.failure("auth");
                        tracing::warn!("internal connection from {peer} refused: {e}");
                    }
                    Err(_) => {
                        metrics.failure("auth");
                        tracing::warn!("internal connection from {peer}: TLS handshake timed out");
                    }
                }
            });
        }
    });
    Ok(TlsIncoming {
        local_addr,
        connections: tokio_stream::wrappers::ReceiverStream::new(rx),
    })
}
