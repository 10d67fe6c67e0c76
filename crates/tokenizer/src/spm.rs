//! SentencePiece-style tokenization (`tokenizer.ggml.model = llama`: Llama 2, Mistral, Phi-3,
//! ...), equivalent to llama.cpp's `llm_tokenizer_spm_session`.
//!
//! Spaces become `▁`, the text is split into characters, and adjacent symbols are merged
//! greedily by the score of the vocabulary entry they would form (highest first, leftmost
//! among equal scores). A final symbol that is not a vocabulary entry is spelled as its UTF-8
//! bytes through the `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::TokenizerError;

/// SentencePiece's visible space.
pub(crate) const SPACE: char = '\u{2581}';

pub(crate) struct Spm {
    scores: Vec<f32>,
    /// The token for each byte value (`<0xXX>`, else the one-byte text), if the vocabulary
    /// has one.
    byte_tokens: [Option<u32>; 256],
    /// What a byte with no token becomes (llama.cpp aborts there; kvwarden uses `<unk>`, or
    /// drops the byte when there is none).
    unk: Option<u32>,
    /// Whether text that starts the input or follows a special token gets a leading space.
    pub(crate) add_space_prefix: bool,
}

impl Spm {
    pub(crate) fn from_gguf(
        file: &gguf::GgufFile,
        vocab: &HashMap<String, u32>,
        n: usize,
        unk: Option<u32>,
    ) -> Result<Self, TokenizerError> {
        let invalid = |m: String| TokenizerError::InvalidMetadata(m);
        let scores = match file.get("tokenizer.ggml.scores") {
            None => vec![0.0; n],
            Some(v) => {
                let arr = v
                    .as_array()
                    .ok_or_else(|| invalid("tokenizer.ggml.scores is not an array".into()))?;
                if arr.len() < n {
                    return Err(invalid(format!("{} scores for {n} tokens", arr.len())));
                }
                arr.iter()
                    .take(n)
                    .enumerate()
                    .map(|(i, s)| {
                        s.as_f64()
                            .map(|s| s as f32)
                            .ok_or_else(|| invalid(format!("score {i} is not a number")))
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        let mut byte_tokens = [None; 256];
        for (b, slot) in (0u8..=255).zip(byte_tokens.iter_mut()) {
            *slot = vocab.get(&format!("<0x{b:02X}>")).copied().or_else(|| {
                // The raw one-byte text; only ASCII can be a one-byte string here.
                b.is_ascii()
                    .then(|| vocab.get(char::from(b).encode_utf8(&mut [0; 4])))
                    .flatten()
                    .copied()
            });
        }
        let add_space_prefix = match file.get("tokenizer.ggml.add_space_prefix") {
            None => true,
            Some(v) => v.as_bool().ok_or_else(|| {
                invalid("tokenizer.ggml.add_space_prefix is not a boolean".into())
            })?,
        };
        Ok(Spm {
            scores,
            byte_tokens,
            unk,
            add_space_prefix,
        })
    }

    /// Encodes one fragment of text (no special tokens in it), with a leading space when
    /// `prefix_space`, appending its tokens to `out`.
    pub(crate) fn encode(
        &self,
        text: &str,
        prefix_space: bool,
        vocab: &HashMap<String, u32>,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        let escaped = &mut scratch.text;
        escaped.clear();
        if prefix_space {
            escaped.push(SPACE);
        }
        escaped.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
        if escaped.is_empty() {
            return;
        }

        let syms = &mut scratch.symbols;
        let heap = &mut scratch.heap;
        syms.clear();
        heap.clear();
        let count = escaped.chars().count();
        for (i, (start, c)) in escaped.char_indices().enumerate() {
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (i + 1 < count).then_some(i + 1),
            });
        }
        for i in 1..syms.len() {
            self.push_pair(escaped, syms, heap, vocab, i - 1, i);
        }

        while let Some(cand) = heap.pop() {
            let (l, r) = (cand.left, cand.right);
            // A pair is stale once either side merged with something else: symbols only
            // grow or vanish, so the sizes no longer add up.
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != cand.size {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            let next = syms[r].next;
            syms[l].next = next;
            if let Some(next) = next {
                syms[next].prev = Some(l);
            }
            if let Some(prev) = syms[l].prev {
                self.push_pair(escaped, syms, heap, vocab, prev, l);
            }
            if let Some(next) = next {
                self.push_pair(escaped, syms, heap, vocab, l, next);
            }
        }

        // Symbol 0 only ever absorbs its right neighbours, so it heads the final chain.
        let mut i = Some(0);
        while let Some(at) = i {
            let s = syms[at];
            let piece = &escaped[s.start..s.start + s.len];
            match vocab.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        if let Some(id) = self.byte_tokens[usize::from(b)].or(self.unk) {
                            out.push(id);
                        }
                    }
                }
            }
            i = s.next;
        }
    }

    fn push_pair(
        &self,
        text: &str,
        syms: &[Symbol],
        heap: &mut BinaryHeap<Candidate>,
        vocab: &HashMap<String, u32>,
        l: usize,
        r: usize,
    ) {
        let (left, right) = (syms[l], syms[r]);
        let size = left.len + right.len;
        let Some(joined) = text.get(left.start..left.start + size) else {
            return;
        };
        if let Some(&id) = vocab.get(joined) {
            heap.push(Candidate {
                score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                left: l,
                right: r,
                size,
            });
        }
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    /// Byte offset in the escaped text.
    start: usize,
    /// Length in bytes; 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A possible merge. The heap pops the highest score first and, among equal scores, the
/// leftmost pair (llama.cpp's `llm_bigram_spm::comparator`; scores compare as floats, so
/// -0.0 equals 0.0).
#[derive(Clone, Copy)]
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// Buffers reused across the fragments of one `encode` call.
#[derive(Default)]
pub(crate) struct Scratch {
    text: String,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Candidate>,
}
