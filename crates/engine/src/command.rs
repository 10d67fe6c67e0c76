//! What the handles ([`crate::EngineHandle`]) tell the engine thread ([`crate::worker`]):
//! the commands on its channel, and the lifecycle flags both read beside it.

use std::sync::atomic::AtomicBool;

use kv::RequestId;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::admission::Admitted;
use crate::handoff::{ImportReservation, ReserveError, VerifiedImport};
use crate::slot::Slot;
use crate::Event;

pub(crate) enum Command {
    Submit {
        id: RequestId,
        admitted: Admitted,
        events: UnboundedSender<Event>,
        slot: Slot,
        /// Prefill role: stop after the first token and hand over the prompt's K/V.
        prefill_only: bool,
    },
    /// Decode role: reserve pages for a prompt whose K/V another node will send.
    Reserve {
        id: RequestId,
        admitted: Admitted,
        request_id: String,
        slot: Slot,
        reply: oneshot::Sender<Result<ImportReservation, ReserveError>>,
    },
    /// Decode role: run a received, verified sequence (which holds its slot) from its
    /// first token on.
    SubmitImport {
        verified: Box<VerifiedImport>,
        events: UnboundedSender<Event>,
    },
    /// Only wakes the engine: the request to stop is the `stopping` flag, which a full
    /// command channel cannot hold back.
    Shutdown,
}

/// What the engine thread and its handles share about its state.
pub(crate) struct Lifecycle {
    /// Set by [`crate::EngineHandle::shutdown`].
    pub(crate) stopping: AtomicBool,
    /// True while the engine thread runs; cleared when it exits, however it exits.
    pub(crate) alive: AtomicBool,
}
