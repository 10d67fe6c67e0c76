use std::path::PathBuf;

/// Why a benchmark could not run, or ran with failed requests.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("bad arguments: {0}")]
    Usage(String),
    #[error(transparent)]
    Client(#[from] oai_client::ClientError),
    #[error("cannot reach {url}: {message} (is the server running there?)")]
    Unreachable { url: String, message: String },
    #[error("{url} refused the request with HTTP {status}: {message}")]
    Refused {
        url: String,
        status: u16,
        message: String,
    },
    #[error("cannot tell the served model's name: {0} (pass --model)")]
    NoModel(String),
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
    /// The benchmark ran and some requests failed; the report has been printed.
    #[error("{failed} of {total} requests failed: {first}")]
    Failed {
        failed: usize,
        total: usize,
        first: String,
    },
}
