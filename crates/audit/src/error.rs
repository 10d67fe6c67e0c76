use std::path::PathBuf;

/// Why an audit could not run or did not pass.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("bad arguments: {0}")]
    Usage(String),
    #[error("cannot reach {url}: {message}")]
    Unreachable { url: String, message: String },
    #[error("cannot tell the server's context window: {0} (pass --max-context)")]
    NoContext(String),
    #[error("cannot tell the served model's name: {0} (pass --model)")]
    NoModel(String),
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    Client(#[from] oai_client::ClientError),
    #[error(transparent)]
    Launch(#[from] crate::deploy::LaunchError),
    /// The audit ran and found failures; the report has been printed.
    #[error("the audit failed: {0}")]
    Failed(String),
}
