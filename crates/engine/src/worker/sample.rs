//! From logits to what the client sees: a sampled token (with its log-probabilities),
//! the end of the stream, or, on a prefill node, the hand-over of the prompt's K/V.

use model::sampling::{log_softmax, top_logprobs, History};

use super::{Outcome, Progress, Running};
use crate::handoff::PrefillOutput;
use crate::{EngineError, EngineMetrics, Event, FinishReason, TokenEvent};

fn sampled_token(
    p: &mut Progress,
    logits: &[f32],
    config: &model::LlamaConfig,
) -> Result<TokenEvent, Event> {
    let vocab = config.vocab_size;
    if logits.len() != vocab {
        return Err(Event::Failed(EngineError::Model(format!(
            "expected {vocab} logits, got {}",
            logits.len()
        ))));
    }
    let history = History {
        prompt: &p.request.prompt,
        output: &p.output,
    };
    let token = match p.request.constraint.as_mut() {
        None if p.output.len() < p.request.sampling.min_tokens => {
            let held = ending_tokens(&p.request, config);
            p.sampler
                .sample_allowed(logits, history, &all_but(vocab, &held))
        }
        None => p.sampler.sample(logits, history),
        Some(row) => {
            // Computed beside the forward pass; here only if that thread failed.
            let mask = p
                .next_mask
                .take()
                .unwrap_or_else(|| row.mask())
                .map_err(constraint_failed)?;
            p.sampler.sample_allowed(logits, history, mask.words())
        }
    };
    let (logprob, top) = match p.request.logprobs {
        Some(k) => {
            let lp = log_softmax(logits);
            (Some(lp[token as usize]), top_logprobs(&lp, k))
        }
        None => (None, Vec::new()),
    };
    Ok(TokenEvent {
        id: token,
        logprob,
        top_logprobs: top,
        cached_prompt_tokens: p.cached_tokens.unwrap_or(0),
    })
}

/// The tokens that would end `request`'s answer: the model's end-of-generation tokens
/// (unless it ignores them) and its own stop tokens.
fn ending_tokens(request: &crate::GenerateRequest, config: &model::LlamaConfig) -> Vec<u32> {
    let ends: &[u32] = match request.ignore_eos {
        true => &[],
        false => &config.end_tokens,
    };
    let mut held: Vec<u32> = ends
        .iter()
        .chain(request.sampling.stop_tokens.iter())
        .copied()
        .collect();
    held.sort_unstable();
    held.dedup();
    held
}

/// A mask (token `t` is bit `t % 32` of word `t / 32`) allowing every token of the
/// vocabulary but `held`.
fn all_but(vocab: usize, held: &[u32]) -> Vec<u32> {
    let mut bits = vec![u32::MAX; vocab.div_ceil(32)];
    for &t in held {
        if let Some(w) = bits.get_mut(t as usize / 32) {
            *w &= !(1 << (t % 32));
        }
    }
    bits
}

fn constraint_failed(e: constraint::ConstraintError) -> Event {
    Event::Failed(EngineError::Constraint(e.to_string()))
}

pub(super) fn sample_next(
    p: &mut Progress,
    logits: &[f32],
    config: &model::LlamaConfig,
    metrics: &EngineMetrics,
) -> Outcome {
    match sampled_token(p, logits, config) {
        Ok(token) => accept_token(p, token, config, metrics),
        Err(failed) => Outcome::Done(failed),
    }
}

/// A decode row that fed its last token and a draft: chooses each position's token from
/// its own logits exactly as plain decoding would (`sample_next`, in order, so the sampler,
/// its seed and the penalties' history advance as they would), keeps the draft while it
/// equals those choices, and rolls the K/V of the rest of the draft back. The tokens emitted
/// are the tokens plain decoding emits (see `crate::speculation`).
pub(super) fn verify_draft(
    r: &mut Running,
    logits: &[f32],
    config: &model::LlamaConfig,
    metrics: &EngineMetrics,
    spec: &crate::SpeculationConfig,
    draft_cost: f32,
) -> Outcome {
    let draft = std::mem::take(&mut r.progress.drafter.pending);
    let vocab = config.vocab_size;
    if logits.len() != (draft.len() + 1) * vocab {
        return Outcome::Done(Event::Failed(EngineError::Model(format!(
            "expected {} rows of logits for a {}-token draft, got {} values",
            draft.len() + 1,
            draft.len(),
            logits.len()
        ))));
    }
    EngineMetrics::add(&metrics.draft_tokens, draft.len() as u64);
    let mut accepted = 0;
    for (j, row) in logits.chunks_exact(vocab).enumerate() {
        if let Outcome::Done(ev) = sample_next(&mut r.progress, row, config, metrics) {
            EngineMetrics::add(&metrics.accepted_draft_tokens, accepted as u64);
            return Outcome::Done(ev);
        }
        let emitted = r.progress.output.last().copied();
        if j == draft.len() || emitted != Some(draft[j]) {
            break;
        }
        accepted += 1;
    }
    EngineMetrics::add(&metrics.accepted_draft_tokens, accepted as u64);
    r.progress
        .drafter
        .record(draft.len(), accepted, spec, draft_cost);
    // The K/V the next step needs is the stream's but for its last token; the positions of
    // the draft's rejected tokens become unwritten again, in the draft model's K/V too
    // (which holds the kept ones: they are the stream's tokens now).
    let keep = r.progress.stream_len() - 1;
    let rolled_back =
        r.kv.rollback(keep)
            .and_then(|()| match r.draft_kv.as_mut() {
                Some(draft_kv) => draft_kv.rollback(draft_kv.len().min(keep)),
                None => Ok(()),
            });
    match rolled_back {
        Ok(()) => Outcome::Continue,
        Err(e) => Outcome::Done(Event::Failed(EngineError::Isolation(e))),
    }
}

/// Prefill role: the first token and the prompt's K/V, read back through the same checks
/// as attention, end the request.
pub(super) fn hand_over(r: &mut Running, logits: &[f32], config: &model::LlamaConfig) -> Outcome {
    let first = match sampled_token(&mut r.progress, logits, config) {
        Ok(token) => token,
        Err(failed) => return Outcome::Done(failed),
    };
    let prompt = &r.progress.request.prompt;
    match r.kv.export_pages(prompt.len()) {
        Ok(pages) => Outcome::Done(Event::Prefilled(Box::new(PrefillOutput {
            first,
            sampler_state: r.progress.sampler.state(),
            prompt: prompt.clone(),
            page_tokens: r.kv.layout().page_tokens,
            pages,
            cached_tokens: r.progress.cached_tokens.unwrap_or(0),
        }))),
        Err(e) => Outcome::Done(Event::Failed(EngineError::Isolation(e))),
    }
}

/// Applies a sampled token: the end of the stream (EOS, a stop token, `max_tokens`), or
/// one more token event for the client.
pub(super) fn accept_token(
    p: &mut Progress,
    token: TokenEvent,
    config: &model::LlamaConfig,
    metrics: &EngineMetrics,
) -> Outcome {
    let id = token.id;
    let eos = config.end_tokens.binary_search(&id).is_ok()
        && (!p.request.ignore_eos || p.request.constraint.is_some());
    if eos || p.request.sampling.stop_tokens.binary_search(&id).is_ok() {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Stop,
            usage: p.usage(),
        });
    }
    // The parser moves past the token before the client sees it: a token the constraint
    // does not allow (one a prefill node sent) ends the request instead.
    let complete = match p.request.constraint.as_mut() {
        None => false,
        Some(row) => match row.advance(id) {
            Ok(()) => row.is_finished(),
            Err(e) => return Outcome::Done(constraint_failed(e)),
        },
    };
    p.output.push(id);
    EngineMetrics::add(&metrics.generated_tokens, 1);
    let _ = p.events.send(Event::Token(token));
    if complete {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Stop,
            usage: p.usage(),
        });
    }
    if p.output.len() >= p.request.max_tokens {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Length,
            usage: p.usage(),
        });
    }
    Outcome::Continue
}
