//! One admitted request's output, as text: engine tokens are detokenized incrementally,
//! run through the stop-string matcher, and released together with the logprobs of the
//! tokens whose text they carry.
//!
//! The [`Generation`] owns the engine's [`RequestHandle`]; dropping it (client gone,
//! stop string matched) cancels the request at the next engine step.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use engine::{Event, FinishReason, RequestHandle, TokenEvent, Usage};
use tokenizer::{IncrementalDecoder, Tokenizer};

use crate::error::ApiError;
use crate::metrics::{Outcome, ServerMetrics};
use crate::stop::{StopMatcher, StopPush};

/// A generated token as the client sees it.
#[derive(Debug, Clone)]
pub struct TokenOut {
    pub event: TokenEvent,
    /// Offset, in characters, of the token's text within the completion text.
    pub text_offset: usize,
}

/// Text that became final, with the tokens it completes.
#[derive(Debug, Clone, Default)]
pub struct Chunk {
    pub text: String,
    pub tokens: Vec<TokenOut>,
}

impl Chunk {
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.tokens.is_empty()
    }
}

#[derive(Debug)]
pub enum Step {
    Chunk(Chunk),
    /// The end: the last text, why it ended, and the token counts.
    Done {
        tail: Chunk,
        reason: FinishReason,
        usage: Usage,
    },
    Failed(ApiError),
}

struct Pending {
    event: TokenEvent,
    /// Character range of the token's text within the decoded text.
    start: usize,
    end: usize,
}

/// Records the request's outcome exactly once; a generation dropped before its end was
/// cancelled by its client.
struct OutcomeGuard {
    metrics: Arc<ServerMetrics>,
    recorded: bool,
}

impl OutcomeGuard {
    fn record(&mut self, outcome: Outcome) {
        if !self.recorded {
            self.recorded = true;
            self.metrics.outcome(outcome);
        }
    }
}

impl Drop for OutcomeGuard {
    fn drop(&mut self) {
        self.record(Outcome::Cancelled);
    }
}

pub struct Generation {
    handle: Option<RequestHandle>,
    tok: Arc<Tokenizer>,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    pending: VecDeque<Pending>,
    decoded_chars: usize,
    released_chars: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Prompt tokens the engine served from the prefix cache (carried on every token).
    cached_tokens: usize,
    admitted_at: Instant,
    last_token_at: Option<Instant>,
    metrics: Arc<ServerMetrics>,
    guard: OutcomeGuard,
    /// The LoRA adapter's name, for the per-adapter counters.
    adapter: Option<Arc<str>>,
    /// Stop strings match only the text of the tokens after this many (`min_tokens`).
    stops_after: usize,
}

impl Drop for Generation {
    fn drop(&mut self) {
        if let Some(name) = &self.adapter {
            self.metrics.adapter_generated(name, self.completion_tokens);
        }
    }
}

impl Generation {
    pub fn new(
        handle: RequestHandle,
        tok: Arc<Tokenizer>,
        stops: Vec<String>,
        prompt_tokens: usize,
        admitted_at: Instant,
        metrics: Arc<ServerMetrics>,
        adapter: Option<Arc<str>>,
    ) -> Self {
        Self {
            handle: Some(handle),
            tok,
            decoder: IncrementalDecoder::new(),
            stops_after: 0,
            stop: StopMatcher::new(stops),
            pending: VecDeque::new(),
            decoded_chars: 0,
            released_chars: 0,
            prompt_tokens,
            completion_tokens: 0,
            cached_tokens: 0,
            admitted_at,
            last_token_at: None,
            guard: OutcomeGuard {
                metrics: metrics.clone(),
                recorded: false,
            },
            metrics,
            adapter,
        }
    }

    /// Events the backend has produced that nobody has taken yet: how far the client is
    /// behind its generation.
    pub fn backlog(&self) -> usize {
        self.handle.as_ref().map_or(0, |h| h.events.len())
    }

    pub fn request_id(&self) -> Option<engine::RequestId> {
        self.handle.as_ref().map(|h| h.id)
    }

    /// The next piece of output; `None` once a `Done` or `Failed` has been returned.
    pub async fn next(&mut self) -> Option<Step> {
        loop {
            let handle = self.handle.as_mut()?;
            let event = handle.events.recv().await;
            match event {
                Some(Event::Token(t)) => match self.on_token(t) {
                    Some(step) => return Some(step),
                    None => continue,
                },
                Some(Event::Finished { reason, usage }) => {
                    return Some(self.on_finished(reason, usage))
                }
                Some(Event::Failed(e)) => return Some(self.fail(e.into())),
                // Only a prefill node's own requests end this way, never a client's.
                Some(Event::Prefilled(_)) => {
                    return Some(self.fail(ApiError::Internal(
                        "a prefill-only result reached a client stream".into(),
                    )))
                }
                // The engine dropped the request without a terminal event: it is gone.
                None => return Some(self.fail(engine::EngineError::Shutdown.into())),
            }
        }
    }

    /// Stop strings match only the text of the tokens after the first `min_tokens` (vLLM's
    /// `min_tokens`: nothing ends the answer before it has that many).
    pub fn with_min_tokens(mut self, min_tokens: usize) -> Self {
        self.stops_after = min_tokens;
        self
    }

    fn on_token(&mut self, t: TokenEvent) -> Option<Step> {
        let now = Instant::now();
        match self.last_token_at {
            None => self.metrics.ttft.observe(now - self.admitted_at),
            Some(last) => self.metrics.itl.observe(now - last),
        }
        self.last_token_at = Some(now);
        self.completion_tokens += 1;
        self.cached_tokens = t.cached_prompt_tokens;

        let piece = match self.decoder.push(&self.tok, t.id) {
            Ok(p) => p,
            Err(e) => return Some(self.fail(ApiError::Internal(format!("detokenizing: {e}")))),
        };
        let start = self.decoded_chars;
        self.decoded_chars += piece.chars().count();
        self.pending.push_back(Pending {
            event: t,
            start,
            end: self.decoded_chars,
        });
        if self.completion_tokens <= self.stops_after {
            // Nothing is held back yet: the matcher has seen no text.
            let chunk = self.release(piece, false);
            return (!chunk.is_empty()).then_some(Step::Chunk(chunk));
        }
        match self.stop.push(&piece) {
            StopPush::Text(text) => {
                let chunk = self.release(text, false);
                (!chunk.is_empty()).then_some(Step::Chunk(chunk))
            }
            StopPush::Stopped(text) => {
                let tail = self.release(text, true);
                let usage = Usage {
                    prompt_tokens: self.prompt_tokens,
                    completion_tokens: self.completion_tokens,
                    cached_tokens: self.cached_tokens,
                };
                Some(self.done(tail, FinishReason::Stop, usage))
            }
        }
    }

    fn on_finished(&mut self, mut reason: FinishReason, usage: Usage) -> Step {
        let rest = self.decoder.finish();
        let tail = match self.stop.push(&rest) {
            StopPush::Text(mut text) => {
                text.push_str(&self.stop.finish());
                self.release(text, true)
            }
            StopPush::Stopped(text) => {
                reason = FinishReason::Stop;
                self.release(text, true)
            }
        };
        self.done(tail, reason, usage)
    }

    /// Marks `text` as sent and collects the tokens it completes. At the end (`last`),
    /// every token whose text at least starts inside the output goes with it; tokens
    /// wholly inside a matched stop string are dropped.
    fn release(&mut self, text: String, last: bool) -> Chunk {
        self.released_chars += text.chars().count();
        let mut tokens = Vec::new();
        while let Some(p) = self.pending.front() {
            let included = if last {
                p.start < self.released_chars
                    || (p.start == p.end && p.start <= self.released_chars)
            } else {
                p.end <= self.released_chars
            };
            if !included {
                break;
            }
            if let Some(p) = self.pending.pop_front() {
                tokens.push(TokenOut {
                    event: p.event,
                    text_offset: p.start,
                });
            }
        }
        if last {
            self.pending.clear();
        }
        Chunk { text, tokens }
    }

    fn done(&mut self, tail: Chunk, reason: FinishReason, usage: Usage) -> Step {
        // Dropping the handle cancels the engine request if it is still running (a stop
        // string matched) and frees its pages at the next step.
        self.handle = None;
        self.guard.record(match reason {
            FinishReason::Stop => Outcome::Stop,
            FinishReason::Length => Outcome::Length,
        });
        Step::Done {
            tail,
            reason,
            usage,
        }
    }

    fn fail(&mut self, e: ApiError) -> Step {
        self.handle = None;
        self.guard.record(Outcome::Error);
        Step::Failed(e)
    }
}
