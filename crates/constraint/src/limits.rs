//! Every bound on a constraint, checked before work (the source text) or enforced by
//! llguidance while it works (its fuel and state counts): a hostile schema or grammar
//! costs at most these, and is refused with a 400 naming the one it hit.

/// Bytes of a schema, regex or grammar as the client wrote it.
pub const MAX_SOURCE_BYTES: usize = 128 * 1024;
/// Entries of a `choice` list.
pub const MAX_CHOICES: usize = 1024;
/// Symbols of the compiled grammar (llguidance's `max_grammar_size`).
pub const MAX_GRAMMAR_SYMBOLS: usize = 100_000;
/// Lexer work to build the grammar's initial lexer (llguidance's `initial_lexer_fuel`;
/// about 50,000 a millisecond, so about 20 ms).
pub const INITIAL_LEXER_FUEL: u64 = 1_000_000;
/// Lexer work for one token's mask (llguidance's `step_lexer_fuel`; about 14,000 a
/// millisecond, so about 15 ms at most per token).
pub const STEP_LEXER_FUEL: u64 = 200_000;
/// Earley items for one token's mask (llguidance's `step_max_items`).
pub const STEP_MAX_ITEMS: usize = 50_000;
/// Lexer states one request may build (llguidance's `max_lexer_states`; 1 to 2 kB each, so
/// at most about 40 MB).
pub const MAX_LEXER_STATES: usize = 20_000;
