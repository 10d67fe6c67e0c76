//! Decode role inside the engine: pages reserved for K/V another node sends, and a
//! verified sequence joining the running set at its first token.

use kv::{Owner, SequenceKv};
use model::Sampler;
use tokio::sync::mpsc::UnboundedSender;

use super::sample::accept_token;
use super::{finish, Outcome, Progress, Running, Worker};
use crate::handoff::{ImportReservation, Ticket, VerifiedImport};
use crate::Event;

impl Worker {
    /// Gives pending reservations their pages, in order, while the pool (after evicting
    /// unused cached prefixes) has room for a whole prompt.
    pub(super) fn place_reservations(&mut self) {
        self.reservations.retain(|r| !r.reply.is_closed());
        while let Some(head) = self.reservations.front() {
            let request = head.admitted.request();
            let owner = Owner {
                request: head.id,
                domain: request.domain.clone(),
            };
            let prompt_len = request.prompt.len();
            let domain = owner.domain.clone();
            let mut kv = SequenceKv::new(&self.pool, owner);
            if !self.make_room(kv.pages_needed(prompt_len), &domain)
                || kv.reserve(prompt_len).is_err()
            {
                break;
            }
            let Some(r) = self.reservations.pop_front() else {
                break;
            };
            let reservation = ImportReservation {
                id: r.id,
                ticket: Ticket::random(),
                request_id: r.request_id,
                admitted: r.admitted,
                kv,
                vocab_size: self.model.config().vocab_size,
                slot: r.slot,
            };
            // A requester that left drops the reservation, and with it the pages.
            let _ = r.reply.send(Ok(reservation));
        }
    }

    /// Decode role: a verified sequence, with its prompt's K/V in place, and the prefill
    /// node's first token accepted as if sampled here (so the client has it now); the
    /// request to run, unless that token ended it.
    pub(super) fn start_import(
        &mut self,
        verified: VerifiedImport,
        events: UnboundedSender<Event>,
    ) -> Option<Running> {
        let VerifiedImport {
            id,
            admitted,
            kv,
            first_token,
            sampler_state,
            cached_tokens,
            slot,
        } = verified;
        self.arrivals += 1;
        let total_tokens = admitted.total_tokens;
        let request = admitted.request;
        // Prompt tokens are the prefill node's count: it computed them.
        let mut progress = Progress {
            id,
            arrival: self.arrivals,
            sampler: Sampler::resume(request.sampling.clone(), sampler_state),
            request,
            events,
            output: Vec::new(),
            next_mask: None,
            drafter: Default::default(),
            cached_tokens: Some(cached_tokens),
            total_tokens,
            slot,
            prefill_only: false,
            #[cfg(feature = "fault-injection")]
            fault_claim: 0,
        };
        match accept_token(
            &mut progress,
            first_token,
            self.model.config(),
            &self.metrics,
        ) {
            Outcome::Continue => Some(Running::new(progress, kv)),
            Outcome::Done(ev) => {
                finish(Running::new(progress, kv), ev);
                None
            }
        }
    }
}
