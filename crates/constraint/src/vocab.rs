//! What llguidance derives from the model's vocabulary alone, built once per served model.

use std::sync::{Arc, OnceLock};

use llguidance::ParserFactory;
use tokenizer::{TokenType, Tokenizer};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::limits;
use crate::{ConstraintError, ConstraintSpec, RowConstraint};

/// The token trie of one model and the factory that compiles constraints against it.
/// It holds nothing of any request, so every request of every tenant uses the same one.
pub struct Vocabulary {
    tokenizer: Arc<Tokenizer>,
    /// The model's logit count, which may exceed the tokenizer's entries (padding rows).
    vocab_size: usize,
    eos: Option<u32>,
    /// Built on the first constrained request: a few hundred milliseconds for a large
    /// vocabulary, which a server that never sees a constraint should not spend at start.
    factory: OnceLock<Result<ParserFactory, ConstraintError>>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// The tokenizer as llguidance asks for it: the trie of every token's bytes (control,
/// unknown and unused tokens marked special, so no lexeme can produce them) and the
/// model's own tokenization of text.
struct ModelTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode_ordinary(text),
            // Not text (a token boundary inside a character): the trie's own longest-match
            // tokenization, which llguidance accepts for such fragments.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

impl Vocabulary {
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: Option<u32>) -> Self {
        Self {
            tokenizer,
            vocab_size,
            eos,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&ParserFactory, ConstraintError> {
        self.factory
            .get_or_init(|| self.build_factory())
            .as_ref()
            .map_err(Clone::clone)
    }

    fn build_factory(&self) -> Result<ParserFactory, ConstraintError> {
        let eos = self.eos.ok_or(ConstraintError::NoEos)?;
        let words: Vec<Vec<u8>> = (0..self.vocab_size as u32)
            .map(|id| {
                let bytes = self.tokenizer.token_bytes(id).unwrap_or_default();
                match self.tokenizer.token_type(id) {
                    Some(TokenType::Control | TokenType::Unknown | TokenType::Unused) => {
                        let mut special = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                        special.extend_from_slice(bytes);
                        special
                    }
                    _ => bytes.to_vec(),
                }
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: self.vocab_size as u32,
            tok_eos: eos,
            tok_bos: self.tokenizer.bos_id(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let env: TokEnv = Arc::new(ModelTokEnv {
            trie: TokTrie::from(&info, &words),
            tokenizer: self.tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstraintError::Invalid(format!("the vocabulary: {e}")))?;
        factory.quiet();
        let l = factory.limits_mut();
        l.max_grammar_size = limits::MAX_GRAMMAR_SYMBOLS;
        l.initial_lexer_fuel = limits::INITIAL_LEXER_FUEL;
        l.step_lexer_fuel = limits::STEP_LEXER_FUEL;
        l.step_max_items = limits::STEP_MAX_ITEMS;
        l.max_lexer_states = limits::MAX_LEXER_STATES;
        // Errors name the grammar, never the tokens produced so far.
        l.verbose_errors = false;
        Ok(factory)
    }

    /// Compiles one request's constraint (bounded by [`crate::limits`]): a fresh parser,
    /// shared with nothing.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<RowConstraint, ConstraintError> {
        let grammar = spec.to_grammar()?;
        let factory = self.factory()?;
        let parser = factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Invalid(first_line(&e.to_string())))?;
        RowConstraint::new(parser, spec.clone(), self.vocab_size)
    }
}

/// llguidance's messages can run long (a grammar dump after the reason); the reason is
/// the first line.
fn first_line(message: &str) -> String {
    let line = message.lines().next().unwrap_or(message);
    line.chars().take(400).collect()
}
