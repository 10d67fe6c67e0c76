//! What one sequence brings to a forward pass, and which logits it wants back.

use kv::SequenceKv;

use crate::lora::LoraAdapter;

/// Which positions of an item need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Intermediate prefill chunk: nothing to sample yet.
    None,
    /// The next-token distribution after the item's last token.
    Last,
    /// One distribution per input token (scoring, tests).
    All,
    /// One distribution per input token from this index of the item's tokens on (none when
    /// the index is past them): teacher-forced scoring of a window's second half.
    From(usize),
}

/// `vocab_size` logits per wanted position, concatenated.
pub type Logits = Vec<f32>;

/// One sequence's share of a forward pass: its new tokens, appended at positions
/// `kv.len()..kv.len() + tokens.len()`. The KV view must already hold pages for them.
pub struct BatchItem<'a> {
    pub kv: &'a mut SequenceKv,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
    /// The adapter this sequence is computed under (`None`: the base model). Its K/V is a
    /// function of it: the engine keeps such K/V in a domain of its own.
    pub adapter: Option<&'a LoraAdapter>,
}
