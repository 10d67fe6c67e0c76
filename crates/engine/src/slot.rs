//! A request's place in the engine, and the refusal a client gets when none is free.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The engine holds as many requests as it may (running plus waiting): retry later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the engine's queue is full ({limit} requests running or waiting)")]
pub struct QueueFull {
    pub limit: usize,
}

/// One of the engine's places for a request, held from `submit` until the request ends
/// (whichever way: finished, failed, cancelled, or the command dropped undelivered).
/// Dropping it frees the place.
#[derive(Debug)]
pub(crate) struct Slot(pub(crate) Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
