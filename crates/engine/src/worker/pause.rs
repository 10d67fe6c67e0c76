//! A step paused between two layers for a lighter tenant's first token.
//!
//! A heavy tenant's step (tens of decode rows) takes tens of milliseconds, and a request
//! that arrives just after it began would wait for all of it before its own first step:
//! with a flood of one tenant in flight, another tenant's first token took 4-6 times its
//! unloaded time, all of it waiting for steps it had no part in. So the forward pass calls
//! back between layers ([`model::Model::forward_yielding`]); there the engine takes the
//! commands that arrived, and when the oldest waiting request of a tenant running fewer
//! requests than the heaviest tenant (for their weights, as `Worker::plan` compares them)
//! fits, it places that request and computes its prompt and first token in a step of its
//! own, nested in the paused one, then lets the paused step go on. The paused step's values are locals of its forward pass: the nested
//! step neither reads nor changes them, so every row's bits are what they would have been
//! (batch invariance), and its sequences' K/V is written only through their own leases.
//!
//! Bounds: nested steps take at most as much of a step's time as the paused step itself
//! has had (the first one always runs), none runs inside a step that already computes only
//! lighter tenants' first tokens, a nested step's prompts fit one step's token budget, and
//! its requests the running rows' limit (with the extra rows of
//! [`super::schedule::burst_rows`], for tenants running nothing else). So a flood of new
//! tenants cannot stall the paused step: it keeps at least half of the time. Replays after preemption wait for a normal
//! step. A constrained request's first mask, which a normal step computes beside its
//! forward pass, is computed by the sampling step here (the same mask: it depends only on
//! the request's own tokens).
//!
//! The split roles take their commands here too: a decode node's reservations get their
//! pages, and an imported sequence's first token (the prefill node's) goes to the client,
//! without waiting for the step; other commands wait for the loop, in order.

use std::collections::{HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use model::{BatchItem, LogitsWanted};

use super::sample::{hand_over, sample_next};
use super::schedule::{burst_rows, share_prompt_of, Placement};
use super::{finish, Outcome, Running, Worker};
use crate::command::Command;
use crate::preemption::Load;
use crate::{EngineError, EngineMetrics, Event};

/// What a paused step lets through.
pub(super) struct Pause {
    /// Each tenant's running requests (in the paused step or started in a pause of it) and
    /// weight: only a tenant running less than the heaviest, for its weight, starts here.
    running: HashMap<String, (usize, u32)>,
    /// The paused step's running rows (nested steps add `Worker::early`'s).
    rows: usize,
    /// Whether this step may pause at all.
    may_pause: bool,
    started: Instant,
    /// Time spent in nested steps so far.
    nested: Duration,
    /// Whether a request arrived since the waiting queue was last looked at: only a new
    /// arrival can qualify (those waiting before the step were offered to it already), so
    /// a pause point with nothing new costs one empty channel read.
    arrived: bool,
}

impl Pause {
    pub(super) fn new(running: &[Running], may_pause: bool) -> Self {
        let mut counts: HashMap<String, (usize, u32)> = HashMap::new();
        for r in running {
            let request = &r.progress.request;
            let entry = counts
                .entry(request.domain.tenant_name().to_owned())
                .or_insert((0, request.weight));
            entry.0 += 1;
        }
        Pause {
            running: counts,
            rows: running.len(),
            may_pause,
            started: Instant::now(),
            nested: Duration::ZERO,
            arrived: false,
        }
    }

    /// Whether `tenant`'s next request, of weight `weight`, runs less than the heaviest
    /// tenant (as `Worker::plan`'s first-tokens-only steps choose).
    fn lighter(&self, tenant: &str, weight: u32) -> bool {
        let load = |&(count, w): &(usize, u32)| Load::new(count, w);
        let heaviest =
            self.running
                .values()
                .map(load)
                .reduce(|a, b| if a.lighter_than(b) { b } else { a });
        let own = self.running.get(tenant).map_or(Load::new(0, weight), load);
        heaviest.is_some_and(|h| own.lighter_than(h))
    }

    /// `tenant`'s running requests.
    fn runs(&self, tenant: &str) -> usize {
        self.running.get(tenant).map_or(0, |&(count, _)| count)
    }

    /// Whether another nested step may run: the first one always, later ones while the
    /// paused step has had at least as much time as the nested ones.
    fn open(&self) -> bool {
        self.may_pause
            && (self.nested.is_zero()
                || self.nested <= self.started.elapsed().saturating_sub(self.nested))
    }
}

impl Worker {
    /// Called between layers of a step whose running requests are out of `self.running`:
    /// takes the commands that arrived (module docs), then computes the first tokens of
    /// requests that qualify.
    pub(super) fn between_layers(&mut self, pause: &mut Pause) {
        while let Some(cmd) = self.commands.as_ref().and_then(|c| c.try_recv().ok()) {
            match cmd {
                // A request waits, to be looked at below.
                Command::Submit { .. } => {
                    pause.arrived = true;
                    self.accept(cmd);
                }
                // A decode node's reservation takes its pages now.
                Command::Reserve { .. } => {
                    self.accept(cmd);
                }
                // A decode node's imported sequence brings its first token, which goes to
                // the client now; the sequence runs from the next step.
                Command::SubmitImport { verified, events } => {
                    if let Some(r) = self.start_import(*verified, events) {
                        self.early.push(r);
                    }
                }
                other => self.deferred.push_back(other),
            }
        }
        if !pause.arrived || !pause.open() {
            return;
        }
        pause.arrived = false;
        let placed = self.place_light(pause);
        if placed.is_empty() {
            return;
        }
        let began = Instant::now();
        let early_before = self.early.len();
        EngineMetrics::add(&self.metrics.paused_steps, 1);
        EngineMetrics::add(&self.metrics.steps, 1);
        self.first_tokens_now(placed);
        pause.nested += began.elapsed();
        // Those that go on count as running from now.
        for r in &self.early[early_before..] {
            let request = &r.progress.request;
            pause
                .running
                .entry(request.domain.tenant_name().to_owned())
                .or_insert((0, request.weight))
                .0 += 1;
        }
    }

    /// Places the oldest waiting request of each tenant lighter than the heaviest that
    /// qualifies, within one step's tokens and the rows' limit.
    fn place_light(&mut self, pause: &Pause) -> Vec<Running> {
        let mut placed: Vec<Running> = Vec::new();
        let rows_limit = self.config.max_running + burst_rows(self.config.max_running);
        let mut tokens_left = self.config.max_batch_tokens;
        let mut seen: HashSet<String> = HashSet::new();
        let mut w = 0;
        while w < self.waiting.len() && pause.rows + self.early.len() + placed.len() < rows_limit {
            let head = &self.waiting[w];
            let tenant = head.request.domain.tenant_name();
            // Only a tenant's oldest: its requests start in arrival order.
            if !seen.insert(tenant.to_owned()) || !pause.lighter(tenant, head.request.weight) {
                w += 1;
                continue;
            }
            // Beyond the slots, only a tenant running nothing, as `Worker::promote` gives its
            // extra rows: a tenant already running that took one would keep it, and the
            // running set would stay at the split this pause happened to meet.
            let rows = pause.rows + self.early.len() + placed.len();
            if rows >= self.config.max_running && pause.runs(tenant) > 0 {
                w += 1;
                continue;
            }
            // A client that already left is dropped at the next step, not computed here.
            let fits = head.output.is_empty()
                && !head.events.is_closed()
                && head.stream_len() <= tokens_left;
            if !fits {
                w += 1;
                continue;
            }
            match self.place(w, pause.rows + self.early.len() + placed.len()) {
                Placement::Placed(r) => {
                    tokens_left -= r.remaining();
                    placed.push(*r);
                }
                Placement::Failed => {}
                Placement::NoRoom => break,
            }
        }
        placed
    }

    /// The nested step: `placed`'s prompts and first tokens; those that go on wait in
    /// `self.early` for the paused step to end.
    fn first_tokens_now(&mut self, mut placed: Vec<Running>) {
        let model = Arc::clone(&self.model);
        let inputs: Vec<Vec<u32>> = placed
            .iter()
            .map(|r| {
                let p = &r.progress;
                (r.kv.len()..p.stream_len())
                    .map(|t| p.stream_token(t))
                    .collect()
            })
            .collect();
        let results = {
            let mut items: Vec<BatchItem<'_>> = placed
                .iter_mut()
                .zip(&inputs)
                .map(|(r, tokens)| {
                    let Running { progress, kv, .. } = r;
                    BatchItem {
                        kv,
                        tokens,
                        logits: LogitsWanted::Last,
                        adapter: progress.request.adapter.as_ref().and_then(|a| a.weights()),
                    }
                })
                .collect();
            catch_unwind(AssertUnwindSafe(|| model.forward(&mut items)))
        };
        let Ok(results) = results else {
            tracing::error!("the forward pass of a paused step's first tokens panicked");
            let error = EngineError::Model("the forward pass panicked".into());
            for r in placed {
                finish(r, Event::Failed(error.clone()));
            }
            return;
        };
        for (mut r, result) in placed.into_iter().zip(results) {
            let logits = match result {
                Ok(l) => l,
                Err(e) => {
                    let error = self.step_error(e);
                    finish(r, Event::Failed(error));
                    continue;
                }
            };
            if r.progress.request.constraint.is_some() {
                EngineMetrics::add(&self.metrics.constrained_tokens, 1);
            }
            let outcome = if r.progress.prefill_only {
                hand_over(&mut r, &logits, model.config())
            } else {
                sample_next(&mut r.progress, &logits, model.config(), &self.metrics)
            };
            share_prompt_of(&mut self.cache, self.config.page_tokens, &mut r);
            match outcome {
                Outcome::Done(ev) => finish(r, ev),
                Outcome::Continue => self.early.push(r),
            }
        }
    }
}
