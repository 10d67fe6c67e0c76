//! Structured outputs: a request's JSON schema, regex, list of choices or grammar becomes a
//! token mask at every step of that request alone, computed by llguidance (the constraint
//! engine llama.cpp, vLLM, SGLang and mistral.rs use) over the model's own vocabulary.
//!
//! * [`ConstraintSpec`] is what the client asked for, as source text: checked against the
//!   [`limits`] before anything is compiled, and what crosses the node protocol, so that a
//!   prefill node and a decode node each compile the same constraint themselves.
//! * [`Vocabulary`] holds what llguidance derives from the vocabulary alone (the token
//!   trie and its slices): one per served model, built on first use, shared by every
//!   request because it holds nothing of any request.
//! * [`RowConstraint`] is one request's compiled constraint and its parser state. Each
//!   request compiles its own; none is cached or shared (a clone is a deep copy), so no
//!   request's grammar
//!   state, lexer cache or compile time depends on another request's (a shared cache of
//!   compiled schemas would be a timing side channel between tenants, as a shared prefix
//!   cache would). Its mask depends only on the tokens this request produced, so a row
//!   is constrained the same alone or in any batch, monolithic or split.

#![forbid(unsafe_code)]

mod error;
mod gbnf;
pub mod limits;
mod row;
mod spec;
mod vocab;

pub use error::ConstraintError;
pub use gbnf::gbnf_to_lark;
pub use row::{RowConstraint, TokenMask};
pub use spec::ConstraintSpec;
pub use vocab::Vocabulary;
