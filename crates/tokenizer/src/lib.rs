//! Tokenizer for GGUF models that reproduces llama.cpp token for token, plus streaming
//! detokenization and chat-template rendering.
//!
//! Two vocabulary types are implemented: byte-level BPE (`tokenizer.ggml.model = gpt2`) with
//! the pre-tokenizers listed in [`PreTokenizer`], and SentencePiece (`llama`: Llama 2,
//! Mistral, Phi-3, ...). Anything else is refused at load time rather than tokenized subtly
//! wrong; `crates/tokenizer/tests/llama_vocabs.rs` runs llama.cpp's own conformance cases on
//! every vocabulary llama.cpp ships.

// Memory safety here rests on the compiler alone: the only unsafe code in the workspace is
// the SIMD kernels of the `model` crate, each with its own safety argument and test.
#![forbid(unsafe_code)]

mod bpe;
mod bytes;
mod decoder;
mod pretokenize;
mod spm;
mod strftime;
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
        let model_name = file.get_str("tokenizer.ggml.model")?;
        // The pre-tokenizer is checked before the (large) vocabulary is read.
        let pre = match model_name {
            "gpt2" => {
                let name = match file.get("tokenizer.ggml.pre") {
                    None => return Err(TokenizerError::MissingPreTokenizer),
                    Some(_) => file.get_str("tokenizer.ggml.pre")?,
                };
                Some(
                    pretokenize::PreSpec::from_gguf_name(name)
                        .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(name.to_owned()))?,
                )
            }
            "llama" => None,
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };

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
        let model = match pre {
            Some(spec) => {
                let rules = file.get_array("tokenizer.ggml.merges")?;
                Model::Bpe {
                    bpe: bpe::Bpe::new(&text_to_id, n as u32, rules, &byte_map)?,
                    pre: spec.pre,
                    ignore_merges: spec.ignore_merges,
                }
            }
            None => {
                let unk = optional_id(file, "tokenizer.ggml.unknown_token_id", n)?;
                Model::Spm(spm::Spm::from_gguf(file, &text_to_id, n, unk)?)
            }
        };

        let mut piece_bytes = Vec::new();
        let mut piece_offsets = Vec::with_capacity(n + 1);
        piece_offsets.push(0);
        for (text, &ty) in texts.iter().zip(&types) {
            if ty.is_special() {
                piece_bytes.extend_from_slice(text.as_bytes());
            } else if matches!(model, Model::Spm(_)) {
                spm_piece(text, ty, &mut piece_bytes);
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

        let strip = special_strips(file, &specials, &text_to_id);

        let bos = optional_id(file, "tokenizer.ggml.bos_token_id", n)?;
        let eos = optional_id(file, "tokenizer.ggml.eos_token_id", n)?;
        // llama.cpp's default: SentencePiece vocabularies and the Llama 3 family of BPE
        // pre-tokenizers (the `Llama3` rows that ignore merges) add a BOS, others do not;
        // `tokenizer.ggml.add_bos_token` overrides it.
        let default_add_bos = match &model {
            Model::Spm(_) => true,
            Model::Bpe {
                pre, ignore_merges, ..
            } => *pre == PreTokenizer::Llama3 && *ignore_merges,
        };
        let add_bos = match file.get("tokenizer.ggml.add_bos_token") {
            None => default_add_bos,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| invalid(format!("tokenizer.ggml.add_bos_token = {v:?}")))?,
        };
        if add_bos && bos.is_none() {
            // Prompts would silently lack the token the model was trained to see first.
            return Err(invalid(
                "the vocabulary asks for a BOS token but tokenizer.ggml.bos_token_id is missing",
            ));
        }
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
            model,
            specials,
            strip,
            user_defined,
            bos,
            eos,
            add_bos,
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
        let mut bpe_scratch = bpe::Scratch::default();
        let mut spm_scratch = spm::Scratch::default();
        // SentencePiece prefixes a space to text at the start or after a special token.
        let mut after_special = true;
        for frag in fragments {
            let range = match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                    continue;
                }
                Fragment::Text(range) => range,
            };
            let Some(chunk) = text.get(range) else {
                continue;
            };
            match &self.model {
                Model::Bpe {
                    bpe,
                    pre,
                    ignore_merges,
                } => {
                    pieces.clear();
                    pretokenize::split(chunk, *pre, &mut pieces);
                    for piece in &pieces {
                        let bytes = chunk.as_bytes().get(piece.clone()).unwrap_or_default();
                        let whole = ignore_merges
                            .then(|| bpe.whole_piece(bytes, &self.text_to_id, &mut bpe_scratch))
                            .flatten();
                        match whole {
                            Some(id) => out.push(id),
                            None => bpe.encode_piece(bytes, &mut bpe_scratch, &mut out),
                        }
                    }
                }
                Model::Spm(spm) => {
                    let prefix = spm.add_space_prefix && after_special;
                    spm.encode(chunk, prefix, &self.text_to_id, &mut spm_scratch, &mut out);
                }
            }
            after_special = false;
        }
        out
    }

    /// Splits `text` on special-token text the way llama.cpp's `tokenizer_st_partition`
    /// does: one token at a time, longest first, each splitting every remaining text
    /// fragment at all its leftmost non-overlapping occurrences. (This differs from a
    /// leftmost-longest scan when two special texts overlap.) A token with a [`Strip`]
    /// attribute also swallows the ASCII whitespace next to it.
    fn partition(&self, text: &str, specials: &[u32]) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if !text.is_empty() {
            frags.push(Fragment::Text(0..text.len()));
        }
        let bytes = text.as_bytes();
        // C's isspace in the "C" locale, which llama.cpp uses for stripping.
        let is_space = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | b'\x0B' | b'\x0C' | b'\r');
        for &id in specials {
            let needle = self.texts[id as usize].as_str();
            if !text.contains(needle) {
                continue;
            }
            let strip = self.strip.get(&id).copied().unwrap_or_default();
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                let Fragment::Text(range) = frag else {
                    next.push(frag);
                    continue;
                };
                let mut start = range.start;
                while let Some(at) = text.get(start..range.end).and_then(|h| h.find(needle)) {
                    let at = start + at;
                    let mut left_end = at;
                    while strip.left && left_end > start && is_space(bytes[left_end - 1]) {
                        left_end -= 1;
                    }
                    if left_end > start {
                        next.push(Fragment::Text(start..left_end));
                    }
                    next.push(Fragment::Token(id));
                    start = at + needle.len();
                    while strip.right && start < range.end && is_space(bytes[start]) {
                        start += 1;
                    }
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

/// The bytes a SentencePiece token stands for (llama.cpp's `token_to_piece`): `▁` is a
/// space, `<0xXX>` byte tokens are that byte, and unused or undefined entries are nothing.
fn spm_piece(text: &str, ty: TokenType, out: &mut Vec<u8>) {
    match ty {
        TokenType::Normal => {
            for c in text.chars() {
                let c = if c == spm::SPACE { ' ' } else { c };
                out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
            }
        }
        TokenType::Byte => {
            let hex = text
                .strip_prefix("<0x")
                .and_then(|t| t.strip_suffix('>'))
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match hex {
                Some(b) => out.push(b),
                // Not the <0xXX> form: keep the text rather than invent a byte.
                None => out.extend_from_slice(text.as_bytes()),
            }
        }
        TokenType::Control | TokenType::UserDefined | TokenType::Unknown => {
            out.extend_from_slice(text.as_bytes())
        }
        TokenType::Unused | TokenType::Undefined => {}
    }
}

/// The whitespace-stripping attributes llama.cpp gives special tokens. GGUF does not store
/// them, so llama.cpp sets them by model name; of its rules, kvwarden needs Phi-3's (every
/// special token but `<unk>`, `<s>` and `<|endoftext|>` swallows the whitespace after it,
/// and so does `</s>`). The other rules concern vocabulary types kvwarden refuses.
fn special_strips(
    file: &gguf::GgufFile,
    specials: &[u32],
    text_to_id: &HashMap<String, u32>,
) -> HashMap<u32, Strip> {
    let mut strip = HashMap::new();
    let name = file
        .get("general.name")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_ascii_lowercase();
    if name.contains("phi-3") || name.contains("phi3") {
        let right = Strip {
            left: false,
            right: true,
        };
        for &id in specials {
            strip.insert(id, right);
        }
        if let Some(&id) = text_to_id.get("</s>") {
            strip.insert(id, right);
        }
        for t in ["<unk>", "<s>", "<|endoftext|>"] {
            if let Some(&id) = text_to_id.get(t) {
                strip.remove(&id);
            }
        }
    }
    strip
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
