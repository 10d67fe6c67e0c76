//! Exact speculative decoding: what to draft, how much, and when a step may carry drafts.
//!
//! A decode row normally feeds its last token and gets one next token. With a draft it
//! feeds the last token and `d` proposed continuations as `d + 1` rows of one forward step
//! and gets logits at each. The target chooses each position's token exactly as plain
//! decoding would (the request's own sampler, seed, penalties and history, in order); a
//! draft token is kept only while it equals that choice, and at the first difference the
//! target's token is emitted and the rest of the draft's K/V rolled back
//! (`kv::SequenceKv::rollback`). Rows do not depend on the batch or the chunking
//! (ARCHITECTURE invariant 16), so each position's logits are bit for bit those of plain
//! decoding, and the tokens are the non-speculative tokens for any sampler and seed.
//!
//! Drafts come from the request's own stream only, never from another request's: prompt
//! lookup (the continuation of the latest earlier occurrence of its last few tokens), or a
//! draft model ([`DraftModel`]) run over that stream in K/V pages of the request's own. A
//! draft is a guess that verification checks, but a guess built from another tenant's text
//! could still be made visible by timing, so no drafter state is shared.
//!
//! Cost (`cargo bench -p model --bench verify_step`, default model, 2-core Xeon): a step
//! with one row and `d` drafts costs 1.39x plain decoding at `d = 1`, 1.55x at 2 and 2.24x
//! at 7 (`VERIFY_COST`); with eight rows one draft each already costs 1.53x. So drafting
//! pays for a single stream whose drafts are mostly kept and costs everyone in a full
//! batch. Each request drafts the length with the most expected tokens per unit of cost
//! under its own running acceptance estimate, and none when no length gains 5%. In
//! [`SpeculationMode::Auto`] a step carries drafts only while it has nothing else to do (no
//! prompt chunk to compute, nobody waiting for a slot) and at most [`AUTO_MAX_ROWS`] decode
//! rows.
//!
//! With a draft model each draft token also costs one of its one-token steps, measured at
//! start against the model's (`relative_step_cost`), and the length weighs that too; `Auto`
//! never drafts with a draft model that no length could pay for even at full acceptance,
//! since a draft also costs it the part of the stream it has not computed yet. Measured
//! here (2-core EPYC): SmolLM2-135M Q4_1 drafting for its own Q8_0 costs 1.11-1.14 of the
//! model's step, so only a draft model several times cheaper than the model pays.

/// When decode rows carry drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeculationMode {
    Off,
    /// While the step has spare room (see the module docs).
    Auto,
    /// On every decode row, however full the step (for benchmarks and tests).
    Always,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculationConfig {
    pub mode: SpeculationMode,
    /// The most draft tokens one row carries in a step (at most `VERIFY_COST.len() - 1`:
    /// longer drafts are never chosen).
    pub max_draft: usize,
}

impl Default for SpeculationConfig {
    fn default() -> Self {
        Self {
            mode: SpeculationMode::Auto,
            max_draft: 8,
        }
    }
}

/// A smaller model with the target's vocabulary that proposes the drafts instead of prompt
/// lookup (`serve --draft-model`). It proposes greedily; verification decides, so what it
/// proposes changes how fast a request runs, never what it answers.
///
/// Its K/V lives in a pool of its own (its layout is its own), in pages leased under each
/// request's own id and domain (`kv::Owner`), written and read only through that request's
/// `kv::SequenceKv`, rolled back with the target's K/V after verification and dropped (so
/// scrubbed) with the request. It computes only the request's own stream and drafts, so
/// nothing in it is shared between requests.
pub struct DraftModel {
    pub model: Box<dyn crate::StepModel>,
    /// Positions its pool holds. Pages are leased as requests draft and never preempt
    /// anything: a request whose draft finds no room decodes plainly.
    pub pool_tokens: usize,
    /// One of its one-token steps in plain decoding steps of the target: what a draft token
    /// costs in the draft-length policy. `None`: measured when the engine starts (the
    /// median of a few one-token steps of each model, on this machine).
    pub relative_cost: Option<f32>,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel")
            .field("pool_tokens", &self.pool_tokens)
            .field("relative_cost", &self.relative_cost)
            .finish_non_exhaustive()
    }
}

/// What a one-token step of `draft` costs in one-token steps of `model`, on this machine:
/// the median of a few steps of each after an 8-token prompt, in scratch sequences of their
/// own pools that nothing else reads (leased under an id no request has, and scrubbed
/// when dropped). Taken once, at start.
pub(crate) fn relative_step_cost(
    draft: &dyn crate::StepModel,
    draft_pool: &kv::KvPool,
    model: &dyn crate::StepModel,
    pool: &kv::KvPool,
) -> f32 {
    let step = |m: &dyn crate::StepModel, pool: &kv::KvPool| -> Option<std::time::Duration> {
        let mut kv = kv::SequenceKv::new(
            pool,
            kv::Owner {
                request: kv::RequestId(u64::MAX),
                domain: kv::IsolationDomain::tenant("kvwarden-calibration"),
            },
        );
        kv.reserve(16).ok()?;
        let vocab = m.config().vocab_size.max(1) as u32;
        let prompt: Vec<u32> = (0..8).map(|t| t % vocab).collect();
        let mut feed = |tokens: &[u32]| {
            let mut items = [model::BatchItem {
                kv: &mut kv,
                tokens,
                logits: model::LogitsWanted::Last,
                adapter: None,
            }];
            m.forward(&mut items).pop().is_some_and(|r| r.is_ok())
        };
        if !feed(&prompt) {
            return None;
        }
        let mut times = Vec::new();
        for _ in 0..5 {
            let started = std::time::Instant::now();
            if !feed(&[1 % vocab]) {
                return None;
            }
            times.push(started.elapsed());
        }
        times.sort();
        Some(times[times.len() / 2])
    };
    match (step(draft, draft_pool), step(model, pool)) {
        (Some(d), Some(m)) if !m.is_zero() => d.as_secs_f32() / m.as_secs_f32(),
        // Unmeasurable (no room in a pool): as costly as the model, so drafts pay only at
        // very high acceptance.
        _ => 1.0,
    }
}

/// In `Auto`, steps with more decode rows than this carry no drafts.
pub const AUTO_MAX_ROWS: usize = 4;
/// Prompt lookup matches the last `NGRAM_MAX` down to `NGRAM_MIN` tokens.
const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 2;
/// How far back a match is looked for: bounds the search per step on long contexts.
const SEARCH_WINDOW: usize = 1 << 16;
/// After a draft of which nothing was accepted, the request drafts again only after this
/// many times more steps (doubling up to the cap), so text that never repeats itself costs
/// almost nothing.
const MAX_COOLDOWN: u32 = 32;

impl SpeculationConfig {
    /// Whether drafts costing `draft_cost` plain steps a token could pay at all, even were
    /// every one kept. In `Auto` a draft model for which they cannot never drafts: each
    /// draft would also cost it the stream it has not computed yet.
    pub(crate) fn can_pay(&self, draft_cost: f32) -> bool {
        best_length(1.0, self.max_draft, draft_cost) > 0
    }

    /// Whether this step's decode rows may carry drafts: `decode_rows` rows, `busy` when
    /// the step also computes a prompt chunk or a request waits for a running slot.
    pub(crate) fn allows(&self, decode_rows: usize, busy: bool) -> bool {
        match self.mode {
            SpeculationMode::Off => false,
            SpeculationMode::Always => self.max_draft > 0,
            SpeculationMode::Auto => self.max_draft > 0 && !busy && decode_rows <= AUTO_MAX_ROWS,
        }
    }
}

/// A step of `1 + d` rows relative to a one-row decode step, index `d` (default model,
/// 2-core Xeon, AVX-512; `cargo bench -p model --bench verify_step`). Not smooth: the
/// products run pairs of 4-token tiles (5 to 7 rows padded to 8), so 8 rows cost less than 5.
const VERIFY_COST: [f32; 13] = [
    1.0, 1.39, 1.55, 1.77, 2.22, 2.40, 2.55, 2.24, 3.45, 3.69, 3.56, 3.27, 4.10,
];
/// A draft must promise this many more tokens per unit of cost than plain decoding.
const MIN_GAIN: f32 = 1.05;
/// The acceptance estimate a request starts with, and how much of it each verification
/// replaces.
const PRIOR_ACCEPTANCE: f32 = 0.6;
const ACCEPTANCE_WEIGHT: f32 = 0.3;

/// The draft length with the most expected tokens per unit of step cost when each draft
/// token is kept with probability `acceptance` given the ones before it were (expected
/// tokens `1 + a + ... + a^d`), or 0 when none gains [`MIN_GAIN`]. Each draft token costs
/// `draft_cost` plain decoding steps to propose (0 for prompt lookup; a draft model's
/// one-token step relative to the target's).
fn best_length(acceptance: f32, max: usize, draft_cost: f32) -> usize {
    let mut best = (0, MIN_GAIN);
    let mut expected = 1.0f32;
    let mut term = 1.0f32;
    for (d, cost) in VERIFY_COST.iter().enumerate().take(max + 1).skip(1) {
        term *= acceptance;
        expected += term;
        let gain = expected / (cost + d as f32 * draft_cost);
        if gain > best.1 {
            best = (d, gain);
        }
    }
    best.0
}

/// One request's drafter: its acceptance estimate and the draft in flight. Part of the
/// request's own progress; nothing in it is shared with any other request.
#[derive(Debug)]
pub(crate) struct Drafter {
    /// The estimated probability that a draft token is kept, given those before it were.
    acceptance: f32,
    /// Steps to skip before drafting again, and the next skip after another miss.
    cooldown: u32,
    next_cooldown: u32,
    /// The draft the current step feeds after the last token; taken by verification.
    pub(crate) pending: Vec<u32>,
}

impl Default for Drafter {
    fn default() -> Self {
        Self {
            acceptance: PRIOR_ACCEPTANCE,
            cooldown: 0,
            next_cooldown: 0,
            pending: Vec::new(),
        }
    }
}

impl Drafter {
    /// How many tokens to draft this step (at most `limit`), each costing `draft_cost`
    /// plain steps to propose. When the estimate says no draft pays, a one-token draft now
    /// and then (after the cooldown) keeps the estimate current.
    pub(crate) fn wanted(
        &mut self,
        config: &SpeculationConfig,
        limit: usize,
        draft_cost: f32,
    ) -> usize {
        if self.cooldown > 0 {
            self.cooldown -= 1;
            return 0;
        }
        best_length(self.acceptance, config.max_draft, draft_cost)
            .max(1)
            .min(config.max_draft)
            .min(limit)
    }

    /// A prompt-lookup draft of at most `limit` tokens continuing the stream `prompt ++
    /// output`, or none.
    pub(crate) fn propose(
        &mut self,
        prompt: &[u32],
        output: &[u32],
        config: &SpeculationConfig,
        limit: usize,
    ) -> Vec<u32> {
        let want = self.wanted(config, limit, 0.0);
        if want == 0 {
            return Vec::new();
        }
        let token = |t: usize| match t.checked_sub(prompt.len()) {
            None => prompt[t],
            Some(o) => output[o],
        };
        prompt_lookup(token, prompt.len() + output.len(), want)
    }

    /// Updates the estimate with what verification kept of a `drafted`-token draft:
    /// `accepted` kept of `accepted + 1` tried (or of `drafted`, when all were kept).
    pub(crate) fn record(
        &mut self,
        drafted: usize,
        accepted: usize,
        config: &SpeculationConfig,
        draft_cost: f32,
    ) {
        if drafted == 0 {
            return;
        }
        let tried = if accepted == drafted {
            drafted
        } else {
            accepted + 1
        };
        let rate = accepted as f32 / tried as f32;
        self.acceptance += ACCEPTANCE_WEIGHT * (rate - self.acceptance);
        if best_length(self.acceptance, config.max_draft, draft_cost) == 0 {
            self.next_cooldown = (self.next_cooldown * 2).clamp(1, MAX_COOLDOWN);
            self.cooldown = self.next_cooldown;
        } else {
            self.next_cooldown = 0;
        }
    }
}

/// Prompt lookup: for the longest `n` in `NGRAM_MAX..=NGRAM_MIN` whose last `n` tokens
/// occurred earlier in the stream, the `want` tokens that followed their latest earlier
/// occurrence.
fn prompt_lookup(token: impl Fn(usize) -> u32, len: usize, want: usize) -> Vec<u32> {
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if len <= n {
            continue;
        }
        let suffix: Vec<u32> = (len - n..len).map(&token).collect();
        let lowest = len.saturating_sub(SEARCH_WINDOW);
        // Candidate starts `j` with a token after the match that is not the suffix itself.
        let found = (lowest..len - n)
            .rev()
            .find(|&j| (0..n).all(|i| token(j + i) == suffix[i]));
        if let Some(j) = found {
            // Past the stream's end the copy goes on from the draft itself, so a stream
            // repeating with period p drafts the repetition in full, not p tokens.
            let from = j + n;
            let mut draft = Vec::with_capacity(want);
            for at in from..from + want {
                let next = if at < len { token(at) } else { draft[at - len] };
                draft.push(next);
            }
            return draft;
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(stream: &[u32], want: usize) -> Vec<u32> {
        prompt_lookup(|i| stream[i], stream.len(), want)
    }

    #[test]
    fn prompt_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix() {
        // "... 1 2 3 [4 5] ... 9 2 3 [7 8] ... 1 2 3": the 3-gram "1 2 3" matches at the start.
        let s = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(lookup(&s, 2), vec![4, 5]);
        // Only "2 3" matches, latest first: after "9 2 3".
        let s = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3];
        assert_eq!(lookup(&s, 3), vec![7, 8, 6]);
        // Past the stream's end the repetition goes on.
        let s = [5, 6, 5, 6];
        assert_eq!(lookup(&s, 5), vec![5, 6, 5, 6, 5]);
        let s = [1, 9, 9, 9];
        assert_eq!(lookup(&s, 3), vec![9, 9, 9]);
        // No repeated bigram: no draft.
        assert!(lookup(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(lookup(&[1], 4).is_empty());
    }

    #[test]
    fn a_draft_reads_the_prompt_and_the_answer_as_one_stream() {
        let config = SpeculationConfig::default();
        // The answer so far ends "7 8", which the prompt holds followed by "9 1".
        let draft = Drafter::default().propose(&[6, 7, 8, 9, 1, 5], &[3, 7, 8], &config, 2);
        assert_eq!(draft, vec![9, 1]);
        // A match wholly inside the answer, continued into the draft itself.
        let draft = Drafter::default().propose(&[4], &[2, 6, 2, 6], &config, 2);
        assert_eq!(draft, vec![2, 6]);
    }

    #[test]
    fn the_draft_length_is_the_most_tokens_per_cost() {
        // Hopeless or marginal acceptance: no draft pays.
        assert_eq!(best_length(0.2, 8, 0.0), 0);
        // Middling: a short draft.
        assert!(
            (1..=2).contains(&best_length(0.6, 8, 0.0)),
            "{}",
            best_length(0.6, 8, 0.0)
        );
        // High: the 8-row step, the cheapest per row.
        assert_eq!(best_length(0.9, 8, 0.0), 7);
        assert!(best_length(0.9, 3, 0.0) <= 3);
        assert!(best_length(0.99, 12, 0.0) >= 7);
    }

    #[test]
    fn acceptance_sets_the_draft_length_and_misses_back_off() {
        let config = SpeculationConfig {
            mode: SpeculationMode::Always,
            max_draft: 8,
        };
        let repeat: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 8, 9].repeat(8);
        let mut d = Drafter::default();
        let first = d.propose(&repeat, &[], &config, 100).len();
        assert!((1..=2).contains(&first), "a short first draft: {first}");
        for _ in 0..6 {
            let len = d.propose(&repeat, &[], &config, 100).len();
            d.record(len, len, &config, 0.0);
        }
        assert_eq!(d.propose(&repeat, &[], &config, 100).len(), 7);
        assert_eq!(
            d.propose(&repeat, &[], &config, 3).len(),
            3,
            "the limit holds"
        );
        // Nothing kept, again and again: one-token probes after a doubling cooldown.
        let mut gaps = Vec::new();
        let mut gap = 0;
        for _ in 0..40 {
            let len = d.propose(&repeat, &[], &config, 100).len();
            if len == 0 {
                gap += 1;
                continue;
            }
            gaps.push(gap);
            gap = 0;
            d.record(len, 0, &config, 0.0);
        }
        assert!(gaps.windows(2).skip(3).all(|w| w[1] >= w[0]), "{gaps:?}");
        assert!(gaps.last().copied().unwrap_or(0) >= 8, "{gaps:?}");
    }

    #[test]
    fn a_draft_model_as_costly_as_the_model_never_pays() {
        let config = SpeculationConfig::default();
        assert!(config.can_pay(0.0));
        assert!(config.can_pay(0.2));
        assert!(!config.can_pay(1.0));
        assert!(!config.can_pay(1.11));
        // One token for 1.39 + 0.6 steps: 2 tokens, under the 5% gain.
        assert!(!SpeculationConfig {
            max_draft: 1,
            ..config
        }
        .can_pay(0.6));
    }

    #[test]
    fn auto_drafts_only_in_a_quiet_small_step() {
        let auto = SpeculationConfig::default();
        assert!(auto.allows(1, false));
        assert!(auto.allows(AUTO_MAX_ROWS, false));
        assert!(!auto.allows(AUTO_MAX_ROWS + 1, false));
        assert!(!auto.allows(1, true));
        let always = SpeculationConfig {
            mode: SpeculationMode::Always,
            ..auto
        };
        assert!(always.allows(32, true));
        let off = SpeculationConfig {
            mode: SpeculationMode::Off,
            ..auto
        };
        assert!(!off.allows(1, false));
    }
}
