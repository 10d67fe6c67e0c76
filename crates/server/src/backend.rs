//! What the HTTP layer runs requests on: the local engine (`kvwarden serve`) or a cluster
//! of prefill and decode nodes (`kvwarden router`). Both sit behind the same pipeline, so
//! they answer with the same routes, errors, streaming and usage.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use engine::{Admission, Admitted, EngineHandle, Rejection, RequestHandle};

use crate::error::ApiError;

/// Why a backend did not start an admitted request.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// A node's own admission refused it: the client sees that original error.
    #[error(transparent)]
    Rejected(Rejection),
    #[error(transparent)]
    Failed(ApiError),
}

pub type Submission = Pin<Box<dyn Future<Output = Result<RequestHandle, SubmitError>> + Send>>;

pub trait Backend: Send + Sync + 'static {
    /// The limits this backend promises: checked at the edge before `submit`.
    fn admission(&self) -> &Admission;

    /// Starts an admitted request. Resolves once the request is placed (on a cluster:
    /// admitted by a prefill node and holding pages on a decode node), so that a refusal
    /// is still an error status rather than an event inside a 200 stream.
    fn submit(self: Arc<Self>, admitted: Admitted) -> Submission;

    /// The backend's part of `/metrics`, in Prometheus text.
    fn render_metrics(&self, out: &mut String);

    /// `Err(why)` when the backend cannot serve now; `/health` answers 503 with it.
    fn health(&self) -> Result<(), String>;
}

impl Backend for EngineHandle {
    fn admission(&self) -> &Admission {
        EngineHandle::admission(self)
    }

    fn submit(self: Arc<Self>, admitted: Admitted) -> Submission {
        let handle = EngineHandle::submit(&self, admitted);
        Box::pin(std::future::ready(Ok(handle)))
    }

    fn render_metrics(&self, out: &mut String) {
        crate::metrics::render_engine(self, out);
    }

    fn health(&self) -> Result<(), String> {
        Ok(())
    }
}
