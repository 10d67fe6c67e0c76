//! The engine thread's loop: block while idle, take every command that arrived, step.

use std::sync::atomic::Ordering;
use std::sync::mpsc;

use model::Sampler;

use super::{PendingReservation, Progress, Worker};
use crate::command::Command;
use crate::EngineError;

impl Worker {
    pub(crate) fn run(mut self, commands: mpsc::Receiver<Command>) {
        self.commands = Some(commands);
        loop {
            if self.lifecycle.stopping.load(Ordering::Acquire) {
                self.fail_all(&EngineError::Shutdown);
                return;
            }
            // What a paused step took and left, first: it arrived before anything else.
            while let Some(cmd) = self.deferred.pop_front() {
                if !self.accept(cmd) {
                    return;
                }
            }
            let Some(commands) = self.commands.take() else {
                return;
            };
            let go_on = self.take_commands(&commands);
            self.commands = Some(commands);
            if !go_on || !self.step() {
                return;
            }
        }
    }

    /// Blocks for a command while idle, then takes every one that arrived. Returns false on
    /// shutdown.
    fn take_commands(&mut self, commands: &mpsc::Receiver<Command>) -> bool {
        // Idle: block for work. Busy: take whatever arrived and step.
        if self.idle() {
            match commands.recv() {
                Ok(cmd) => {
                    if !self.accept(cmd) {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(cmd) => {
                    if !self.accept(cmd) {
                        return false;
                    }
                }
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => return !self.idle(),
            }
        }
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.reservations.is_empty()
    }

    /// Returns false on shutdown.
    pub(super) fn accept(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit {
                id,
                admitted,
                events,
                slot,
                prefill_only,
            } => {
                self.arrivals += 1;
                let total_tokens = admitted.total_tokens;
                #[cfg(feature = "fault-injection")]
                let fault_claim = admitted.fault_claim;
                let request = admitted.request;
                self.waiting.push_back(Progress {
                    #[cfg(feature = "fault-injection")]
                    fault_claim,
                    total_tokens,
                    id,
                    arrival: self.arrivals,
                    sampler: Sampler::new(request.sampling.clone()),
                    request,
                    events,
                    output: Vec::new(),
                    next_mask: None,
                    drafter: Default::default(),
                    cached_tokens: None,
                    slot,
                    prefill_only,
                });
                true
            }
            Command::Reserve {
                id,
                admitted,
                request_id,
                slot,
                reply,
            } => {
                self.reservations.push_back(PendingReservation {
                    id,
                    admitted,
                    request_id,
                    slot,
                    reply,
                });
                self.place_reservations();
                true
            }
            Command::SubmitImport { verified, events } => {
                if let Some(r) = self.start_import(*verified, events) {
                    self.running.push(r);
                }
                true
            }
            Command::Shutdown => {
                if self.lifecycle.stopping.load(Ordering::Acquire) {
                    self.fail_all(&EngineError::Shutdown);
                    return false;
                }
                true
            }
        }
    }
}
