//! One engine step: plan a batch within the token budget, run the forward pass, and
//! turn its logits into each request's next event.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use model::{BatchItem, LogitsWanted, ModelError};

use super::pause::Pause;
use super::sample::{hand_over, sample_next, verify_draft};
use super::{finish, Outcome, Running, Worker};
use crate::preemption::Load;
use crate::{EngineError, EngineMetrics, Event, StepModel};

type MaskResult = Result<constraint::TokenMask, constraint::ConstraintError>;

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Consecutive forward steps that may panic before the engine gives up: one panic is a bug
/// hit by some batch, and the engine goes on without that batch's requests; a panic at
/// every step means nothing can be served, and the engine stops so that `/health` says so.
const MAX_CONSECUTIVE_PANICS: u32 = 3;

impl Worker {
    /// The step's batch: which running requests compute which positions.
    ///
    /// Normally decode rows first (one token each), then prefill and replay chunks within
    /// the token budget and the pages already reserved, shared between tenants: each
    /// tenant's requests first get up to its weight's part of what the decode rows left, in
    /// arrival order, then the rest goes in arrival order. So one tenant's long prompts
    /// slow another tenant's prefill by a share of the step, not by their length; with one
    /// tenant this is plain arrival order.
    ///
    /// But when a request of a lighter tenant (one running fewer requests for its weight
    /// than another) waits for its first token, and the last step was not such a step, this
    /// step computes only those first tokens: a heavy tenant's full batch of decode rows
    /// would make the light one's first token wait for the whole batch. The heavy tenant's rows
    /// then wait one step, which is short (a few prompt chunks), and never two in a row.
    fn plan(&mut self) -> Vec<(usize, std::ops::Range<usize>)> {
        let tenant = |i: usize| self.running[i].progress.request.domain.tenant_name();
        let weight = |i: usize| self.running[i].progress.request.weight.max(1);
        let mut counts: HashMap<&str, (usize, u32)> = HashMap::new();
        for i in 0..self.running.len() {
            counts.entry(tenant(i)).or_insert((0, weight(i))).0 += 1;
        }
        let load = |t: &str| {
            let (count, w) = counts[t];
            Load::new(count, w)
        };
        let heaviest = counts
            .values()
            .map(|&(count, w)| Load::new(count, w))
            .reduce(|a, b| if a.lighter_than(b) { b } else { a });
        // A prompt chunk deep in a long prompt is capped by its cost (`step_cost`), so it
        // never holds the step longer than the budget would at a prompt's start.
        let cost = &self.cost;
        let room = |r: &Running| {
            let left = r
                .progress
                .stream_len()
                .min(r.kv.capacity())
                .saturating_sub(r.kv.len());
            left.min(cost.chunk_cap(r.kv.len()))
        };
        let light_first: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let r = &self.running[i];
                r.progress.output.is_empty()
                    && r.remaining() > 1
                    && room(r) > 0
                    && heaviest.is_some_and(|h| load(tenant(i)).lighter_than(h))
            })
            .collect();
        let first_tokens_only = !light_first.is_empty() && !self.first_tokens_last;
        self.first_tokens_last = first_tokens_only;
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        let filling: Vec<usize> = if first_tokens_only {
            light_first
        } else {
            for (i, r) in self.running.iter().enumerate() {
                if r.remaining() == 1 && budget > 0 {
                    plan.push((i, r.kv.len()..r.kv.len() + 1));
                    budget -= 1;
                }
            }
            (0..self.running.len())
                .filter(|&i| self.running[i].remaining() > 1 && room(&self.running[i]) > 0)
                .collect()
        };
        let mut take = vec![0usize; self.running.len()];
        let tenants: HashMap<&str, u32> = filling.iter().map(|&i| (tenant(i), weight(i))).collect();
        if !tenants.is_empty() {
            let weights: u64 = tenants.values().map(|&w| u64::from(w)).sum();
            let left = budget as u64;
            let share = |w: u32| (left * u64::from(w) / weights).max(1) as usize;
            let mut used: HashMap<&str, usize> = HashMap::new();
            for &i in &filling {
                let used = used.entry(tenant(i)).or_default();
                let n = share(weight(i))
                    .saturating_sub(*used)
                    .min(budget)
                    .min(room(&self.running[i]));
                take[i] += n;
                *used += n;
                budget -= n;
            }
            for &i in &filling {
                let n = budget.min(room(&self.running[i]) - take[i]);
                take[i] += n;
                budget -= n;
            }
        }
        for &i in &filling {
            if take[i] > 0 {
                let start = self.running[i].kv.len();
                plan.push((i, start..start + take[i]));
            }
        }
        plan
    }

    /// Gives this step's decode rows their drafts (`crate::speculation`), when the policy
    /// lets this step carry them: each row's draft within its reserved pages, its
    /// `max_tokens` and the step's token budget. A row with a draft feeds it after its last
    /// token (`Progress::drafter`'s `pending`), and its range grows by the draft's length.
    /// Returns the rows whose draft K/V failed a check, to fail.
    fn attach_drafts(
        &mut self,
        plan: &mut [(usize, std::ops::Range<usize>)],
    ) -> Vec<(usize, EngineError)> {
        let spec = self.config.speculation;
        let is_decode = |r: &super::Running, range: &std::ops::Range<usize>| {
            range.len() == 1 && r.remaining() == 1
        };
        let decode_rows = plan
            .iter()
            .filter(|(i, range)| is_decode(&self.running[*i], range))
            .count();
        let busy =
            !self.waiting.is_empty() || !self.reservations.is_empty() || decode_rows < plan.len();
        if decode_rows == 0 || !spec.allows(decode_rows, busy) {
            return Vec::new();
        }
        let mut budget = self
            .config
            .max_batch_tokens
            .saturating_sub(plan.iter().map(|(_, r)| r.len()).sum());
        let draft_cost = self.draft.as_ref().map_or(0.0, |d| d.cost);
        if spec.mode == crate::SpeculationMode::Auto && !spec.can_pay(draft_cost) {
            return Vec::new();
        }
        // Rows that ask the draft model: (index in the plan, tokens wanted).
        let mut asks: Vec<(usize, usize)> = Vec::new();
        for (at, (i, range)) in plan.iter_mut().enumerate() {
            let r = &mut self.running[*i];
            if !is_decode(r, range) || r.progress.prefill_only {
                continue;
            }
            let p = &mut r.progress;
            // A constraint's mask depends on the tokens before it: drafting through one
            // would mean advancing its parser speculatively; such rows decode plainly. A
            // prompt's last token (its first answer token not yet sampled) does too: the
            // prompt's pages are offered to the prefix cache right after that step, and
            // must then hold the prompt alone.
            if p.request.constraint.is_some() || p.output.is_empty() {
                continue;
            }
            let next = r.kv.len() + 1;
            let limit = budget
                .min(r.kv.capacity().saturating_sub(next))
                .min(p.request.max_tokens.saturating_sub(p.output.len() + 1));
            if limit == 0 {
                continue;
            }
            if self.draft.is_some() {
                let want = p.drafter.wanted(&spec, limit, draft_cost);
                if want > 0 {
                    budget -= want;
                    asks.push((at, want));
                }
                continue;
            }
            let draft = p
                .drafter
                .propose(&p.request.prompt, &p.output, &spec, limit);
            budget -= draft.len();
            range.end += draft.len();
            p.drafter.pending = draft;
        }
        let Some(drafter) = &self.draft else {
            return Vec::new();
        };
        if asks.is_empty() {
            return Vec::new();
        }
        let drafts = {
            let mut slots: Vec<Option<&mut Running>> = self.running.iter_mut().map(Some).collect();
            let mut rows: Vec<(&mut Running, usize)> = asks
                .iter()
                .filter_map(|&(at, want)| slots[plan[at].0].take().map(|r| (r, want)))
                .collect();
            drafter.draft(&mut rows, self.config.max_batch_tokens)
        };
        let mut failed = Vec::new();
        for (&(at, _), draft) in asks.iter().zip(drafts) {
            let (i, range) = &mut plan[at];
            match draft {
                Ok(draft) => {
                    range.end += draft.len();
                    self.running[*i].progress.drafter.pending = draft;
                }
                Err(e) => {
                    EngineMetrics::add(&self.metrics.isolation_failures, 1);
                    tracing::error!("isolation check failed on draft K/V: {e}");
                    failed.push((*i, e));
                }
            }
        }
        failed
    }

    /// Returns false when the engine must stop.
    pub(super) fn step(&mut self) -> bool {
        self.drop_cancelled();
        self.place_reservations();
        self.promote();
        self.grow();
        if self.running.is_empty() {
            if !self.waiting.is_empty() || !self.reservations.is_empty() {
                // Nothing running yet the head cannot be placed: only possible while pages
                // are still being returned by another thread. Back off briefly.
                std::thread::sleep(Duration::from_millis(1));
            }
            return true;
        }
        EngineMetrics::add(&self.metrics.steps, 1);

        let mut plan = self.plan();
        let failed_drafts = self.attach_drafts(&mut plan);
        plan.retain(|(i, _)| failed_drafts.iter().all(|(f, _)| f != i));

        let inputs: Vec<Vec<u32>> = plan
            .iter()
            .map(|(i, range)| {
                let p = &self.running[*i].progress;
                let len = p.stream_len();
                range
                    .clone()
                    .map(|t| {
                        if t < len {
                            p.stream_token(t)
                        } else {
                            p.drafter.pending[t - len]
                        }
                    })
                    .collect()
            })
            .collect();
        // The running requests leave `self` for the forward pass, so that a pause between
        // layers (`pause.rs`) can place and compute others meanwhile.
        let mut running = std::mem::take(&mut self.running);
        let mut pause = Pause::new(&running, !self.first_tokens_last);
        let results = {
            let mut slots: Vec<Option<&mut Running>> = running.iter_mut().map(Some).collect();
            let mut items: Vec<BatchItem<'_>> = Vec::with_capacity(plan.len());
            let mut masks = Vec::new();
            for ((i, range), tokens) in plan.iter().zip(&inputs) {
                let Some(r) = slots[*i].take() else {
                    continue;
                };
                let drafted = r.progress.drafter.pending.len();
                let last = range.end == r.progress.stream_len() + drafted;
                let Running { progress, kv, .. } = r;
                let adapter = progress.request.adapter.as_ref().and_then(|a| a.weights());
                if let (true, Some(c), None) = (
                    last,
                    progress.request.constraint.as_mut(),
                    &progress.next_mask,
                ) {
                    masks.push((c, &mut progress.next_mask));
                }
                items.push(BatchItem {
                    kv,
                    tokens,
                    logits: if !last {
                        LogitsWanted::None
                    } else if drafted > 0 {
                        LogitsWanted::All
                    } else {
                        LogitsWanted::Last
                    },
                    adapter,
                });
            }
            // A panic in the model must not take the engine thread (and every other
            // request) with it. The model keeps no state between steps, so unwinding out
            // of one leaves nothing half-done but this step's requests, which fail below.
            let model = Arc::clone(&self.model);
            let metrics = Arc::clone(&self.metrics);
            let mut between_layers = || self.between_layers(&mut pause);
            if masks.is_empty() {
                catch_unwind(AssertUnwindSafe(|| {
                    model.forward_yielding(&mut items, &mut between_layers)
                }))
            } else {
                forward_beside_masks(
                    model.as_ref(),
                    &metrics,
                    &mut items,
                    masks,
                    &mut between_layers,
                )
            }
        };
        debug_assert!(self.running.is_empty());
        self.running = running;
        let results = match results {
            Ok(results) => {
                self.panics_in_a_row = 0;
                results
            }
            Err(panic) => {
                let go_on = self.step_panicked(&plan, panic.as_ref());
                self.join_early();
                return go_on;
            }
        };

        let mut outcomes: Vec<Outcome> =
            (0..self.running.len()).map(|_| Outcome::Continue).collect();
        for (i, e) in failed_drafts {
            outcomes[i] = Outcome::Done(Event::Failed(e));
        }
        for ((i, range), result) in plan.into_iter().zip(results) {
            let logits = match result {
                Ok(l) => l,
                Err(e) => {
                    outcomes[i] = Outcome::Done(Event::Failed(self.step_error(e)));
                    continue;
                }
            };
            let r = &mut self.running[i];
            let drafted = r.progress.drafter.pending.len();
            if range.end < r.progress.stream_len() + drafted {
                continue;
            }
            let prompt_just_done = r.progress.output.is_empty();
            outcomes[i] = if r.progress.prefill_only {
                hand_over(r, &logits, self.model.config())
            } else if drafted > 0 {
                verify_draft(
                    r,
                    &logits,
                    self.model.config(),
                    &self.metrics,
                    &self.config.speculation,
                    self.draft.as_ref().map_or(0.0, |d| d.cost),
                )
            } else {
                sample_next(&mut r.progress, &logits, self.model.config(), &self.metrics)
            };
            if prompt_just_done {
                self.share_prompt(i);
            }
        }

        // Retire finished requests: the terminal event consumes the sender, the record's
        // drop releases the pages.
        let finished: Vec<(usize, Event)> = outcomes
            .into_iter()
            .enumerate()
            .filter_map(|(i, outcome)| match outcome {
                Outcome::Done(ev) => Some((i, ev)),
                Outcome::Continue => None,
            })
            .collect();
        for (i, ev) in finished.into_iter().rev() {
            let r = self.running.remove(i);
            finish(r, ev);
        }
        self.join_early();
        true
    }

    /// The requests a paused step started join the running ones, in arrival order.
    fn join_early(&mut self) {
        if !self.early.is_empty() {
            self.running.append(&mut self.early);
            self.running.sort_by_key(|r| r.progress.arrival);
        }
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
    }

    /// A sequence's error in a forward pass, as its request's: a K/V check that failed is
    /// an isolation failure, counted and logged loudly.
    pub(super) fn step_error(&self, e: ModelError) -> EngineError {
        match e {
            ModelError::Kv(k) => {
                EngineMetrics::add(&self.metrics.isolation_failures, 1);
                tracing::error!("isolation check failed: {k}");
                EngineError::Isolation(k)
            }
            other => EngineError::Model(other.to_string()),
        }
    }

    /// Fails the requests of a step whose forward pass panicked; their pages are dropped
    /// with them (whatever the step wrote is never read). Returns false when too many steps
    /// in a row panicked: then every request fails and the engine stops.
    fn step_panicked(
        &mut self,
        plan: &[(usize, std::ops::Range<usize>)],
        panic: &(dyn std::any::Any + Send),
    ) -> bool {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        self.panics_in_a_row += 1;
        tracing::error!(
            "the forward pass panicked ({} in a row): {what}",
            self.panics_in_a_row
        );
        let error = EngineError::Model(format!("the forward pass panicked: {what}"));
        let mut failed: Vec<usize> = plan.iter().map(|(i, _)| *i).collect();
        failed.sort_unstable();
        failed.dedup();
        for i in failed.into_iter().rev() {
            let r = self.running.remove(i);
            finish(r, Event::Failed(error.clone()));
        }
        if self.panics_in_a_row >= MAX_CONSECUTIVE_PANICS {
            tracing::error!("the forward pass keeps panicking; the engine stops");
            self.fail_all(&error);
            return false;
        }
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        true
    }
}

/// The forward pass, with the next-token masks of this step's constrained rows computed
/// on a thread beside it: a mask depends only on its own row's tokens so far, all known
/// before the step, so neither waits for the other (llguidance catches its own panics,
/// so a failed mask is an error for that row alone).
fn forward_beside_masks(
    model: &dyn StepModel,
    metrics: &EngineMetrics,
    items: &mut [BatchItem<'_>],
    masks: Vec<(&mut constraint::RowConstraint, &mut Option<MaskResult>)>,
    between_layers: &mut (dyn FnMut() + Send),
) -> std::thread::Result<Vec<Result<model::Logits, ModelError>>> {
    let count = masks.len() as u64;
    EngineMetrics::add(&metrics.constrained_tokens, count);
    let compute = move || {
        let started = Instant::now();
        for (row, slot) in masks {
            *slot = Some(row.mask());
        }
        started.elapsed()
    };
    // Shared so that, should the thread not start, this thread computes them itself.
    let compute = std::sync::Mutex::new(Some(compute));
    let take = || compute.lock().ok().and_then(|mut c| c.take());
    std::thread::scope(|scope| {
        let computing = std::thread::Builder::new()
            .name("masks".into())
            .spawn_scoped(scope, || take().map(|f| f()));
        let results = catch_unwind(AssertUnwindSafe(|| {
            model.forward_yielding(items, between_layers)
        }));
        let waiting = Instant::now();
        let spent = match computing {
            Ok(handle) => handle.join().ok().flatten(),
            // No thread to be had: the sampling step computes any mask still missing.
            Err(_) => take().map(|f| f()),
        };
        EngineMetrics::add(&metrics.mask_wait_micros, micros(waiting.elapsed()));
        if let Some(spent) = spent {
            EngineMetrics::add(&metrics.mask_micros, micros(spent));
        }
        results
    })
}
