//! One request's compiled constraint and where its parser stands.

use llguidance::{Matcher, TokenParser};
use toktrie::SimpleVob;

use crate::{ConstraintError, ConstraintSpec};

/// The tokens a row may sample next.
#[derive(Debug, Clone)]
pub struct TokenMask {
    bits: SimpleVob,
    vocab_size: usize,
}

impl TokenMask {
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.vocab_size && self.bits.is_allowed(token)
    }

    /// The mask as a bitset: token `t` is bit `t % 32` of word `t / 32`.
    pub fn words(&self) -> &[u32] {
        self.bits.as_slice()
    }

    pub fn allowed_count(&self) -> usize {
        self.bits.num_set()
    }

    /// The allowed token ids, lowest first.
    pub fn allowed(&self) -> Vec<u32> {
        let mut ids = self.bits.to_list();
        ids.retain(|&id| (id as usize) < self.vocab_size);
        ids
    }
}

/// A request's constraint, compiled for it alone: its parser advances only by the tokens
/// this request samples, so its masks are a function of the request's own output.
pub struct RowConstraint {
    matcher: Matcher,
    spec: ConstraintSpec,
    vocab_size: usize,
}

/// A copy of this request's parser that shares no mutable state with it (llguidance's
/// deep clone: the lexer's lazily built states are copied, not shared), so the copy's
/// work never speeds up or slows down the original's. Only ever a copy of the same
/// request (tests run one request alone and batched); requests never share one.
impl Clone for RowConstraint {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            spec: self.spec.clone(),
            vocab_size: self.vocab_size,
        }
    }
}

impl std::fmt::Debug for RowConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowConstraint")
            .field("kind", &self.spec.kind())
            .field("finished", &self.is_finished())
            .finish_non_exhaustive()
    }
}

fn generation(e: impl std::fmt::Display) -> ConstraintError {
    let message = e.to_string();
    ConstraintError::Generation(
        message
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(400)
            .collect(),
    )
}

impl RowConstraint {
    pub(crate) fn new(
        parser: TokenParser,
        spec: ConstraintSpec,
        vocab_size: usize,
    ) -> Result<Self, ConstraintError> {
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Invalid(e));
        }
        Ok(Self {
            matcher,
            spec,
            vocab_size,
        })
    }

    pub fn spec(&self) -> &ConstraintSpec {
        &self.spec
    }

    /// The tokens allowed next (the end-of-sequence token among them once the answer may
    /// end). Never empty: a parser with nothing to allow is an error.
    pub fn mask(&mut self) -> Result<TokenMask, ConstraintError> {
        let bits = self.matcher.compute_mask_or_eos().map_err(generation)?;
        if bits.is_zero() {
            return Err(ConstraintError::Generation(
                "the constraint allows no token".into(),
            ));
        }
        Ok(TokenMask {
            bits,
            vocab_size: self.vocab_size,
        })
    }

    /// Moves the parser past `token` (one the last mask allowed, other than the
    /// end-of-sequence token, which ends the request instead).
    pub fn advance(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher.consume_token(token).map_err(generation)
    }

    /// True once the answer is complete and nothing may follow: the request ends as if
    /// the model had produced its end-of-sequence token.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
