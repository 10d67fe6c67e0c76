use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ConstraintError {
    /// The client's constraint is refused before or while compiling (a 400 naming why).
    #[error("{0}")]
    Invalid(String),
    /// Over one of the [`crate::limits`] (a 400 naming the limit).
    #[error("{0}")]
    TooLarge(String),
    /// The model cannot be constrained (no end-of-sequence token to finish on).
    #[error("structured outputs need a model with an end-of-sequence token")]
    NoEos,
    /// The parser failed while generating: a grammar that exhausted its per-step budget,
    /// or a token it should not have allowed. The request fails; nothing else is affected.
    #[error("the constraint failed during generation: {0}")]
    Generation(String),
}
