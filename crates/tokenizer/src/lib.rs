//! Tokenizer for GGUF models that reproduces llama.cpp token for token, plus streaming
//! detokenization and chat-template rendering.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = gpt2`) is implemented, with the
//! pre-tokenizers listed in [`PreTokenizer`]; anything else is refused at load time rather
//! than tokenized subtly wrong.

// Memory safety here rests on the compiler alone: the only unsafe code in the workspace is
// the SIMD kernels of the `model` crate, each with its own safety argument and test.
#![forbid(unsafe_code)]

mod bpe;
mod bytes;
mod decoder;
mod pretokenize;
mod template;

use std::collections::HashMap;
use std::ops::Range;

pub use decoder::IncrementalDecoder;
pub use pretokenize::PreTokenizer;
pub use template::{ChatMessage, ChatTemplate, TemplateError};

/// Everything that can go wrong loading a vocabulary or decoding tokens.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("reading tokenizer metadata: {0}")]
    Gguf(#[from] gguf::GgufError),
    #[error("unsupported tokenizer model {0:?}: only byte-level BPE (\"gpt2\") is implemented")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer {0:?}")]
    UnsupportedPreTokenizer(String),
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

/// A byte-level BPE tokenizer loaded from GGUF metadata. Immutable after loading, so it can
/// be shared between threads freely.
pub struct Tokenizer {
    texts: Vec<String>,
    types: Vec<TokenType>,
    /// Decoded bytes of every token, concatenated; token `i` is
    /// `piece_bytes[piece_offsets[i]..piece_offsets[i + 1]]`.
    piece_bytes: Vec<u8>,
    piece_offsets: Vec<usize>,
    text_to_id: HashMap<String, u32>,
    bpe: bpe::Bpe,
    pre: PreTokenizer,
    /// Tokens matched literally by `encode`, longest text first.
    specials: Vec<u32>,
    /// The user-defined subset, which llama.cpp still matches when special parsing is off.
    user_defined: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.texts.len())
            .field("pre", &self.pre)
            .field("specials", &self.specials.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

fn invalid(msg: impl Into<String>) -> TokenizerError {
    TokenizerError::InvalidMetadata(msg.into())
}

/// Reads an optional token-id key, rejecting ids outside the vocabulary.
fn optional_id(file: &gguf::GgufFile, key: &str, n: usize) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = file.get(key) else {
        return Ok(None);
    };
    let id = v
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .filter(|&id| (id as usize) < n)
        .ok_or_else(|| invalid(format!("{key} = {v:?} is not a token id below {n}")))?;
    Ok(Some(id))
}

impl Tokenizer {
    /// Loads the vocabulary, merges and special tokens from a GGUF file's metadata.
    pub fn from_gguf(file: &gguf::GgufFile) -> Result<Self, TokenizerError> {
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_owned()));
        }
        let pre_name = file.get_str("tokenizer.ggml.pre")?;
        let pre = PreTokenizer::from_gguf_name(pre_name)
            .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(pre_name.to_owned()))?;

        let raw_tokens = file.get_array("tokenizer.ggml.tokens")?;
        let n = raw_tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(invalid(format!("vocabulary size {n} is not usable")));
        }
        let mut texts = Vec::with_capacity(n);
        for (i, t) in raw_tokens.iter().enumerate() {
            let s = t
                .as_str()
                .ok_or_else(|| invalid(format!("token {i} is not a string")))?;
            // llama.cpp renames empty tokens; an empty special token would otherwise match
            // everywhere.
            texts.push(if s.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                s.to_owned()
            });
        }

        let types = match file.get("tokenizer.ggml.token_type") {
            None => vec![TokenType::Normal; n],
            Some(v) => {
                let arr = v
                    .as_array()
                    .ok_or_else(|| invalid("tokenizer.ggml.token_type is not an array"))?;
                if arr.len() != n {
                    return Err(invalid(format!("{} token types for {n} tokens", arr.len())));
                }
                arr.iter()
                    .enumerate()
                    .map(|(i, t)| {
                        t.as_i64()
                            .map(TokenType::from_gguf)
                            .ok_or_else(|| invalid(format!("token type {i} is not an integer")))
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };

        // Later duplicates win, as in llama.cpp's token_to_id map.
        let mut text_to_id = HashMap::with_capacity(n);
        for (i, t) in texts.iter().enumerate() {
            text_to_id.insert(t.clone(), i as u32);
        }

        let byte_map = bytes::ByteMap::new();
        let rules = file.get_array("tokenizer.ggml.merges")?;
        let bpe = bpe::Bpe::new(&text_to_id, n as u32, rules, &byte_map)?;

        let mut piece_bytes = Vec::new();
        let mut piece_offsets = Vec::with_capacity(n + 1);
        piece_offsets.push(0);
        for (text, ty) in texts.iter().zip(&types) {
            if ty.is_special() {
                piece_bytes.extend_from_slice(text.as_bytes());
            } else {
                for c in text.chars() {
                    match byte_map.byte_of(c) {
                        Some(b) => piece_bytes.push(b),
                        // Not a byte stand-in: keep the character itself rather than
                        // llama.cpp's "[UNK_BYTE_..]" marker, so text stays readable.
                        None => {
                            piece_bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes())
                        }
                    }
                }
            }
            piece_offsets.push(piece_bytes.len());
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| types[i as usize].is_special())
            .collect();
        // Longest first; ties by id so the order is deterministic (llama.cpp's std::sort
        // leaves it unspecified).
        specials.sort_by_key(|&i| (std::cmp::Reverse(texts[i as usize].len()), i));
        let user_defined = specials
            .iter()
            .copied()
            .filter(|&i| types[i as usize] == TokenType::UserDefined)
            .collect();

        let bos = optional_id(file, "tokenizer.ggml.bos_token_id", n)?;
        let eos = optional_id(file, "tokenizer.ggml.eos_token_id", n)?;
        let chat_template = file
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_owned);

        Ok(Tokenizer {
            texts,
            types,
            piece_bytes,
            piece_offsets,
            text_to_id,
            bpe,
            pre,
            specials,
            user_defined,
            bos,
            eos,
            chat_template,
        })
    }

    /// Tokenizes `text`, turning the literal text of control, user-defined and unknown
    /// tokens into those tokens (llama.cpp `parse_special = true`). Adds no BOS.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, &self.specials)
    }

    /// Tokenizes `text` with control-token text treated as plain text, so untrusted input
    /// cannot inject `<|im_start|>` and the like (llama.cpp `parse_special = false`, which
    /// still honours user-defined tokens).
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, &self.user_defined)
    }

    fn encode_with(&self, text: &str, specials: &[u32]) -> Vec<u32> {
        let fragments = self.partition(text, specials);
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut pieces: Vec<Range<usize>> = Vec::new();
        let mut scratch = bpe::Scratch::default();
        for frag in fragments {
            match frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(range) => {
                    let Some(chunk) = text.get(range) else {
                        continue;
                    };
                    pieces.clear();
                    pretokenize::split(chunk, self.pre, &mut pieces);
                    for piece in &pieces {
                        let bytes = chunk.as_bytes().get(piece.clone()).unwrap_or_default();
                        self.bpe.encode_piece(bytes, &mut scratch, &mut out);
                    }
                }
            }
        }
        out
    }

    /// Splits `text` on special-token text the way llama.cpp's `tokenizer_st_partition`
    /// does: one token at a time, longest first, each splitting every remaining text
    /// fragment at all its leftmost non-overlapping occurrences. (This differs from a
    /// leftmost-longest scan when two special texts overlap.)
    fn partition(&self, text: &str, specials: &[u32]) -> Vec<Fragment> {
        let mut frags = vec![Fragment::Text(0..text.len())];
        for &id in specials {
            let needle = self.texts[id as usize].as_str();
            if !text.contains(needle) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                let Fragment::Text(range) = frag else {
                    next.push(frag);
                    continue;
                };
                let Some(hay) = text.get(range.clone()) else {
                    continue;
                };
                let mut start = range.start;
                for (at, _) in hay.match_indices(needle) {
                    let at = range.start + at;
                    if at > start {
                        next.push(Fragment::Text(start..at));
                    }
                    next.push(Fragment::Token(id));
                    start = at + needle.len();
                }
                if start < range.end {
                    next.push(Fragment::Text(start..range.end));
                }
            }
            frags = next;
        }
        frags
    }

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

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
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

    /// The GGUF's `tokenizer.chat_template` source, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Compiles the GGUF's chat template with `bos_token`/`eos_token` bound to this
    /// vocabulary's BOS and EOS text. `Ok(None)` when the GGUF has no template.
    pub fn compile_chat_template(&self) -> Result<Option<ChatTemplate>, TemplateError> {
        let Some(source) = self.chat_template() else {
            return Ok(None);
        };
        let text_of = |id: Option<u32>| {
            id.and_then(|id| self.token_text(id))
                .unwrap_or_default()
                .to_owned()
        };
        Ok(Some(
            ChatTemplate::new(source)?.with_special_tokens(text_of(self.bos), text_of(self.eos)),
        ))
    }

    /// The pre-tokenizer this vocabulary uses.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }
}

enum Fragment {
    Text(Range<usize>),
    Token(u32),
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
