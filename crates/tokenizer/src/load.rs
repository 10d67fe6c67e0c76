//! Loading a vocabulary from GGUF metadata: tokens, types, merges or scores, special tokens and
//! the whitespace they strip, each checked against the vocabulary before it is used.

use std::collections::HashMap;

use crate::{
    bpe, bytes, pretokenize, spm, Model, PreTokenizer, Strip, TokenType, Tokenizer, TokenizerError,
};

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
