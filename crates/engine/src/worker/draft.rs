//! Drafts from a draft model (`crate::speculation::DraftModel`): each drafting row's own
//! stream, caught up into its own draft K/V, then its draft tokens proposed greedily one
//! forward step at a time, every drafting row of the step in one batch.
//!
//! A row's draft K/V holds a prefix of its stream and never its last token (the target's
//! next input, fed here first): verification rolls it back to the stream's accepted length
//! with the target's (`sample::verify_draft`). So on a decode node, which received only the
//! target's K/V, the draft model computes the prompt itself, once, the first time the row
//! drafts (in chunks of at most the step's token budget, one per drafting step).

use std::panic::{catch_unwind, AssertUnwindSafe};

use kv::{KvPool, Owner, SequenceKv};
use model::{BatchItem, LogitsWanted, ModelError};

use super::Running;
use crate::{EngineError, StepModel};

pub(crate) struct DraftWorker {
    pub(super) model: Box<dyn StepModel>,
    pub(super) pool: KvPool,
    /// A draft token's cost in plain decoding steps of the target.
    pub(super) cost: f32,
}

/// The most likely token (the lowest id among equals; a NaN never wins).
fn argmax(logits: &[f32]) -> u32 {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0 as u32
}

impl DraftWorker {
    /// Up to `want` draft tokens for each row (fewer, or none, when its draft K/V finds no
    /// room in the draft pool, reaches the draft model's context, or still has more than
    /// `catch_up` tokens of the stream to compute: then this step computes `catch_up` of
    /// them). An error is a failed K/V check on the row's own draft K/V: it fails the
    /// request, as any refused read does.
    pub(super) fn draft(
        &self,
        rows: &mut [(&mut Running, usize)],
        catch_up: usize,
    ) -> Vec<Result<Vec<u32>, EngineError>> {
        let n = rows.len();
        let context = self.model.config().context_length;
        let mut failed: Vec<Option<EngineError>> = (0..n).map(|_| None).collect();
        let mut feeds: Vec<Vec<u32>> = Vec::with_capacity(n);
        let mut wants = vec![0usize; n];
        for (k, (r, want)) in rows.iter_mut().enumerate() {
            let p = &r.progress;
            let stream = p.stream_len();
            if stream > context {
                // Past the draft model's context: this row decodes plainly from here on.
                r.draft_kv = None;
                feeds.push(Vec::new());
                continue;
            }
            let dk = r.draft_kv.get_or_insert_with(|| {
                SequenceKv::new(
                    &self.pool,
                    Owner {
                        request: p.id,
                        domain: p.request.domain.clone(),
                    },
                )
            });
            if dk.len() >= stream {
                if let Err(e) = dk.rollback(stream - 1) {
                    failed[k] = Some(EngineError::Isolation(e));
                    feeds.push(Vec::new());
                    continue;
                }
            }
            let from = dk.len();
            // Positions up to `stream - 1 + want - 1` are fed: all within the context.
            let want = (*want).min((context + 1).saturating_sub(stream));
            let (upto, want) = if stream - from > catch_up {
                (from + catch_up, 0)
            } else {
                (stream, want)
            };
            if dk.reserve(upto + want.saturating_sub(1)).is_err() {
                feeds.push(Vec::new());
                continue;
            }
            feeds.push((from..upto).map(|t| p.stream_token(t)).collect());
            wants[k] = want;
        }

        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); n];
        for round in 0.. {
            let inputs: Vec<Option<Vec<u32>>> = (0..n)
                .map(|k| {
                    if failed[k].is_some() {
                        None
                    } else if round == 0 {
                        (!feeds[k].is_empty()).then(|| std::mem::take(&mut feeds[k]))
                    } else if round < wants[k] && drafts[k].len() == round {
                        Some(vec![drafts[k][round - 1]])
                    } else {
                        None
                    }
                })
                .collect();
            let mut which = Vec::new();
            let mut items = Vec::new();
            for (k, ((r, _), tokens)) in rows.iter_mut().zip(&inputs).enumerate() {
                let (Some(tokens), Some(kv)) = (tokens, r.draft_kv.as_mut()) else {
                    continue;
                };
                which.push(k);
                items.push(BatchItem {
                    kv,
                    tokens,
                    logits: if round < wants[k] {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    },
                    // The draft model is another model: the request's adapter (if any)
                    // applies to the target alone, whose verification keeps the answer
                    // exactly the adapter's.
                    adapter: None,
                });
            }
            if items.is_empty() {
                break;
            }
            let results = catch_unwind(AssertUnwindSafe(|| self.model.forward(&mut items)));
            drop(items);
            let Ok(results) = results else {
                // What the step wrote is unknown: those rows start their draft K/V afresh
                // another time, and decode plainly now.
                tracing::error!("the draft model's forward pass panicked");
                for k in which {
                    rows[k].0.draft_kv = None;
                    drafts[k].clear();
                    wants[k] = 0;
                }
                break;
            };
            for (k, result) in which.into_iter().zip(results) {
                match result {
                    Ok(logits) if round < wants[k] => drafts[k].push(argmax(&logits)),
                    Ok(_) => {}
                    Err(ModelError::Kv(e)) => failed[k] = Some(EngineError::Isolation(e)),
                    Err(e) => {
                        tracing::warn!("no draft: {e}");
                        rows[k].0.draft_kv = None;
                        drafts[k].clear();
                        wants[k] = 0;
                    }
                }
            }
        }
        failed
            .into_iter()
            .zip(drafts)
            .map(|(failed, draft)| match failed {
                Some(e) => Err(e),
                None => Ok(draft),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::argmax;

    #[test]
    fn argmax_takes_the_first_of_equals_and_never_a_nan() {
        assert_eq!(argmax(&[0.0, 2.0, 2.0, 1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, 3.0]), 2);
        assert_eq!(argmax(&[1.0, f32::NAN, 0.5]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY]), 0);
    }
}
