//! Tokenizer for GGUF models that reproduces llama.cpp token for token, plus streaming
//! detokenization and chat-template rendering.
//!
//! Two vocabulary types are implemented: byte-level BPE (`tokenizer.ggml.model = gpt2`) with
//! the pre-tokenizers listed in [`PreTokenizer`], and SentencePiece (`llama`: Llama 2,
//! Mistral, Phi-3, ...). Anything else is refused at load time rather than tokenized subtly
//! wrong; `crates/tokenizer/tests/llama_vocabs.rs` runs llama.cpp's own conformance cases on
//! every vocabulary llama.cpp ships.

// Memory safety here rests on the compiler alone: the only unsafe code in the workspace is
// the SIMD kernels of the `model` crate and `gguf`'s mapping of the model file, each with
// its own safety argument and test.
#![forbid(unsafe_code)]

mod bpe;
mod bytes;
mod decoder;
mod encode;
mod load;
mod pretokenize;
mod pyjson;
mod spm;
mod strftime;
mod template;

use std::collections::{HashMap, HashSet};

pub use decoder::IncrementalDecoder;
pub use pretokenize::PreTokenizer;
pub use template::{ChatMessage, ChatTemplate, TemplateError};

/// Everything that can go wrong loading a vocabulary or decoding tokens.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("reading tokenizer metadata: {0}")]
    Gguf(#[from] gguf::GgufError),
    #[error(
        "unsupported tokenizer model {0:?}: only byte-level BPE (\"gpt2\") and SentencePiece \
         (\"llama\") are implemented"
    )]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer {0:?}")]
    UnsupportedPreTokenizer(String),
    #[error(
        "byte-level BPE vocabulary with no tokenizer.ggml.pre: llama.cpp would guess one and warn \
         that output quality degrades; refusing instead"
    )]
    MissingPreTokenizer,
    #[error("invalid tokenizer metadata: {0}")]
    InvalidMetadata(String),
    #[error("token id {id} is out of range (vocabulary has {vocab_size} tokens)")]
    TokenOutOfRange { id: u32, vocab_size: usize },
}

/// GGUF `tokenizer.ggml.token_type` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_gguf(v: i64) -> Self {
        match v {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            // llama.cpp maps unknown values to "undefined" too.
            _ => Self::Undefined,
        }
    }

    /// Tokens whose literal text is matched in the input before BPE, and which decode to
    /// that literal text (llama.cpp's CONTROL | USER_DEFINED | UNKNOWN attributes).
    fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined | Self::Unknown)
    }
}

/// How text between special tokens becomes tokens.
enum Model {
    /// Byte-level BPE after a pre-tokenizer; with `ignore_merges`, a piece that is a
    /// vocabulary entry as a whole is that entry.
    Bpe {
        bpe: bpe::Bpe,
        pre: PreTokenizer,
        ignore_merges: bool,
    },
    Spm(spm::Spm),
}

/// Whitespace a special token swallows on either side when it splits the text (llama.cpp's
/// `LLAMA_TOKEN_ATTR_LSTRIP` / `RSTRIP`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Strip {
    left: bool,
    right: bool,
}

/// The control tokens' texts, to tell whether strings placed among a chat template's own
/// text (which is tokenized with control tokens parsed) could make one
/// ([`Tokenizer::control_texts`]).
pub struct ControlTexts<'a> {
    needles: Vec<&'a str>,
    /// Every proper start and end of a needle.
    starts: HashSet<&'a str>,
    ends: HashSet<&'a str>,
    longest: usize,
}

impl ControlTexts<'_> {
    /// Whether any of `texts` holds a control token's text, or ends with the start of one
    /// or starts with the end of one (which the template's text beside it could complete).
    /// Linear in the texts' length: each text's ends are looked up in the tables, and the
    /// texts, joined by NUL (which no control token holds), are searched once per token.
    pub fn could_form<'s>(&self, texts: impl IntoIterator<Item = &'s str>) -> bool {
        let mut joined = String::new();
        for t in texts {
            for k in 1..self.longest.min(t.len() + 1) {
                let tail = t.len() - k;
                if (t.is_char_boundary(tail) && self.starts.contains(&t[tail..]))
                    || (t.is_char_boundary(k) && self.ends.contains(&t[..k]))
                {
                    return true;
                }
            }
            joined.push_str(t);
            joined.push('\0');
        }
        self.needles.iter().any(|n| joined.contains(n))
    }
}

/// A tokenizer loaded from GGUF metadata. Immutable after loading, so it can be shared
/// between threads freely.
pub struct Tokenizer {
    texts: Vec<String>,
    types: Vec<TokenType>,
    /// Decoded bytes of every token, concatenated; token `i` is
    /// `piece_bytes[piece_offsets[i]..piece_offsets[i + 1]]`.
    piece_bytes: Vec<u8>,
    piece_offsets: Vec<usize>,
    text_to_id: HashMap<String, u32>,
    model: Model,
    /// Tokens matched literally by `encode`, longest text first.
    specials: Vec<u32>,
    /// The special tokens that strip whitespace next to them (few or none).
    strip: HashMap<u32, Strip>,
    /// The user-defined subset, which llama.cpp still matches when special parsing is off.
    user_defined: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    /// Whether a prompt must start with `bos` (llama.cpp's `add_bos`).
    add_bos: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.texts.len())
            .field("pre", &self.pre_tokenizer())
            .field("specials", &self.specials.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Detokenizes `tokens`. Bytes that do not form valid UTF-8 (e.g. a sequence cut in
    /// the middle of a character) become U+FFFD; nothing else is altered. Control tokens
    /// render as their literal text.
    pub fn decode(&self, tokens: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(tokens.len() * 4);
        for &id in tokens {
            bytes.extend_from_slice(self.bytes_or_err(id)?);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    pub(crate) fn bytes_or_err(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.token_bytes(id).ok_or(TokenizerError::TokenOutOfRange {
            id,
            vocab_size: self.vocab_size(),
        })
    }

    /// The raw bytes token `id` stands for (for control tokens: their literal text).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let start = *self.piece_offsets.get(i)?;
        let end = *self.piece_offsets.get(i + 1)?;
        self.piece_bytes.get(start..end)
    }

    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    /// The most bytes of input text one token can stand for, so that a text of `n` bytes
    /// is at least `n / this` tokens, known without tokenizing it: the longest token's
    /// bytes, and no less than one character (an unknown character may become one unknown
    /// token). `None` when some special token swallows the whitespace beside it, which
    /// lets one token cover any number of bytes.
    pub fn max_bytes_per_token(&self) -> Option<usize> {
        if !self.strip.is_empty() {
            return None;
        }
        let longest = self
            .piece_offsets
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .max()
            .unwrap_or(0);
        Some(longest.max(4))
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether prompts must start with the BOS token (`tokenizer.ggml.add_bos_token`, or
    /// llama.cpp's default for the vocabulary type when the file does not say).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// A prompt's tokens as the model must see them: with the BOS in front when the
    /// vocabulary asks for one and the prompt does not already start with it (a chat
    /// template that renders `bos_token` has put it there; llama.cpp strips that one and
    /// adds its own, which gives the same single BOS).
    pub fn with_bos(&self, mut tokens: Vec<u32>) -> Vec<u32> {
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            if tokens.first() != Some(&bos) {
                tokens.insert(0, bos);
            }
        }
        tokens
    }

    /// The texts of the special tokens that [`Self::encode_ordinary`] would not match, with
    /// their proper starts and ends, to check strings a chat template renders as its own
    /// text ([`ControlTexts::could_form`]). Built once per prompt: a few thousand entries.
    pub fn control_texts(&self) -> ControlTexts<'_> {
        let needles: Vec<&str> = self
            .specials
            .iter()
            .filter(|id| !self.user_defined.contains(id))
            .map(|&id| self.texts[id as usize].as_str())
            .filter(|needle| !needle.is_empty())
            .collect();
        let (mut starts, mut ends) = (HashSet::new(), HashSet::new());
        for needle in &needles {
            for k in (1..needle.len()).filter(|&k| needle.is_char_boundary(k)) {
                starts.insert(&needle[..k]);
                ends.insert(&needle[k..]);
            }
        }
        let longest = needles.iter().map(|n| n.len()).max().unwrap_or(0);
        ControlTexts {
            needles,
            starts,
            ends,
            longest,
        }
    }

    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// The token whose vocabulary entry is exactly `text`. Entries are stored as GGUF has
    /// them: control tokens literally (`"<|im_end|>"`), normal tokens in the byte-level
    /// alphabet (`"Ġworld"` for " world").
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.text_to_id.get(text).copied()
    }

    /// The vocabulary entry of token `id`, in the same form as [`Self::token_id`] takes.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The first way in which `other`'s token ids do not mean what this vocabulary's mean
    /// (its size, a token's entry or type, the end-of-sequence token), or `None` when every
    /// id means the same: what a draft model's tokens must satisfy to be the target's.
    pub fn vocabulary_difference(&self, other: &Tokenizer) -> Option<String> {
        if self.vocab_size() != other.vocab_size() {
            return Some(format!(
                "{} tokens against {}",
                other.vocab_size(),
                self.vocab_size()
            ));
        }
        for id in 0..self.vocab_size() as u32 {
            let (mine, theirs) = (self.token_text(id), other.token_text(id));
            if mine != theirs {
                return Some(format!("token {id} is {theirs:?} against {mine:?}"));
            }
            let (mine, theirs) = (self.token_type(id), other.token_type(id));
            if mine != theirs {
                return Some(format!("token {id} is of type {theirs:?} against {mine:?}"));
            }
        }
        if self.eos != other.eos {
            return Some(format!(
                "the end-of-sequence token is {:?} against {:?}",
                other.eos, self.eos
            ));
        }
        None
    }

    /// The GGUF's `tokenizer.chat_template` source, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Compiles the GGUF's chat template with `bos_token`/`eos_token` bound to this
    /// vocabulary's BOS and EOS text. `Ok(None)` when the GGUF has no template.
    pub fn compile_chat_template(&self) -> Result<Option<ChatTemplate>, TemplateError> {
        match self.chat_template() {
            Some(source) => self.compile_template_source(source).map(Some),
            None => Ok(None),
        }
    }

    /// Compiles a chat template given by the operator (a file without one of its own, or one
    /// to override it) with this vocabulary's BOS and EOS text, as the GGUF's own would be.
    pub fn compile_template_source(&self, source: &str) -> Result<ChatTemplate, TemplateError> {
        let text_of = |id: Option<u32>| {
            id.and_then(|id| self.token_text(id))
                .unwrap_or_default()
                .to_owned()
        };
        Ok(ChatTemplate::new(source)?.with_special_tokens(text_of(self.bos), text_of(self.eos)))
    }

    /// The pre-tokenizer of a byte-level BPE vocabulary; `None` for SentencePiece.
    pub fn pre_tokenizer(&self) -> Option<PreTokenizer> {
        match &self.model {
            Model::Bpe { pre, .. } => Some(*pre),
            Model::Spm(_) => None,
        }
    }
}

/// Splits `text` into the pieces BPE runs on (exposed for differential tests against a
/// regex implementation).
pub fn pre_tokenize(text: &str, mode: PreTokenizer) -> Vec<&str> {
    let mut ranges = Vec::new();
    pretokenize::split(text, mode, &mut ranges);
    ranges.into_iter().filter_map(|r| text.get(r)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
        check::<ChatTemplate>();
        check::<IncrementalDecoder>();
    }
}
