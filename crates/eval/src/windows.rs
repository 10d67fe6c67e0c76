//! Teacher-forced windows through the model, as llama-perplexity runs them: the token stream
//! cut into windows of `n_ctx`, each evaluated from an empty KV cache with its first token
//! replaced by the BOS when the vocabulary asks for one, and the logits of its second half
//! (`n_ctx/2 ..= n_ctx − 2`, each predicting the next token) kept.
//!
//! How the window is fed is a parameter, because it must not matter: whole, in pieces of
//! `chunk` tokens (chunked prefill), or beside other windows in one forward pass (batching).
//! kvwarden's arithmetic gives the same bits in every case, and the suite checks that
//! through the files this writes.

use kv::{IsolationDomain, KvDtype, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy, SequenceKv};
use model::lora::LoraAdapter;
use model::{BatchItem, LogitsWanted, Model};

use crate::logits_file::Shape;
use crate::EvalError;

/// How windows are fed to the model.
#[derive(Debug, Clone, Copy)]
pub struct Feeding {
    /// Tokens per forward step of a window (`None`: the whole window at once).
    pub chunk: Option<usize>,
    /// Windows per forward pass.
    pub batch: usize,
    /// The K/V element type.
    pub kv_dtype: KvDtype,
}

impl Default for Feeding {
    fn default() -> Self {
        Self {
            chunk: None,
            batch: 1,
            kv_dtype: KvDtype::F16,
        }
    }
}

const PAGE_TOKENS: usize = 16;

/// Runs every window of `tokens` (`shape.n_chunk` windows of `shape.n_ctx`), every row under
/// `adapter` when one is given, and hands each window's scored logits
/// (`rows_per_chunk × n_vocab`, position after position) to `score`, in window order.
pub fn run(
    model: &Model,
    adapter: Option<&LoraAdapter>,
    bos: Option<u32>,
    shape: Shape,
    tokens: &[u32],
    feeding: Feeding,
    mut score: impl FnMut(usize, &[f32]) -> Result<(), EvalError>,
) -> Result<(), EvalError> {
    let batch = feeding.batch.max(1);
    let fed = shape.n_ctx - 1;
    let step = feeding.chunk.unwrap_or(fed).clamp(1, fed);
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(PAGE_TOKENS, feeding.kv_dtype),
        pages: batch * shape.n_ctx.div_ceil(PAGE_TOKENS),
        scrub: ScrubPolicy::Zero,
    });
    let first = shape.first();
    let vocab = shape.n_vocab;
    for group_start in (0..shape.n_chunk).step_by(batch) {
        let group: Vec<usize> = (group_start..(group_start + batch).min(shape.n_chunk)).collect();
        let inputs: Vec<Vec<u32>> = group
            .iter()
            .map(|&w| {
                let mut window = tokens[w * shape.n_ctx..w * shape.n_ctx + fed].to_vec();
                if let Some(bos) = bos {
                    window[0] = bos;
                }
                window
            })
            .collect();
        let mut seqs: Vec<SequenceKv> = group
            .iter()
            .map(|&w| {
                SequenceKv::new(
                    &pool,
                    Owner {
                        request: RequestId(w as u64),
                        domain: IsolationDomain::tenant("eval"),
                    },
                )
            })
            .collect();
        for seq in &mut seqs {
            seq.reserve(fed)?;
        }
        let mut logits: Vec<Vec<f32>> = vec![Vec::new(); group.len()];
        for offset in (0..fed).step_by(step) {
            let end = (offset + step).min(fed);
            let wanted = if end <= first {
                LogitsWanted::None
            } else {
                LogitsWanted::From(first.saturating_sub(offset))
            };
            let mut items: Vec<BatchItem<'_>> = seqs
                .iter_mut()
                .zip(&inputs)
                .map(|(kv, input)| BatchItem {
                    kv,
                    tokens: &input[offset..end],
                    logits: wanted,
                    adapter,
                })
                .collect();
            for (out, result) in logits.iter_mut().zip(model.forward(&mut items)) {
                out.extend_from_slice(&result?);
            }
        }
        drop(seqs);
        for (&w, rows) in group.iter().zip(&logits) {
            debug_assert_eq!(rows.len(), shape.rows_per_chunk() * vocab);
            score(w, rows)?;
        }
    }
    Ok(())
}
