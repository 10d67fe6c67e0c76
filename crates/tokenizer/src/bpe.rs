//! Byte-level BPE merging, equivalent to llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! llama.cpp merges strings; here every string that can ever appear as a symbol (the 256
//! byte stand-ins and the result of every merge) gets a numeric id up front, so merging
//! compares integers instead of building and hashing strings. Strings that are vocabulary
//! entries reuse their token id; the few that are not get ids past the vocabulary, which is
//! how a final symbol with no token is recognized.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::bytes::ByteMap;
use crate::TokenizerError;

const NONE: usize = usize::MAX;

pub(crate) struct Bpe {
    /// (left symbol, right symbol) -> (merge rank, merged symbol).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Symbol id of each byte's stand-in character.
    byte_symbol: [u32; 256],
    /// Each byte's stand-in character.
    stand_in: [char; 256],
    n_vocab: u32,
}

struct Interner<'a> {
    vocab: &'a HashMap<String, u32>,
    extra: HashMap<String, u32>,
    next: u32,
}

impl Interner<'_> {
    fn get(&self, s: &str) -> Option<u32> {
        self.vocab.get(s).or_else(|| self.extra.get(s)).copied()
    }

    fn intern(&mut self, s: &str) -> Result<u32, TokenizerError> {
        if let Some(id) = self.get(s) {
            return Ok(id);
        }
        let id = self.next;
        self.next = id.checked_add(1).ok_or_else(|| {
            TokenizerError::InvalidMetadata("too many BPE symbols for 32-bit ids".into())
        })?;
        self.extra.insert(s.to_owned(), id);
        Ok(id)
    }
}

/// Splits a merge rule the way llama.cpp does: at the first space after the first byte, so
/// that a rule may merge a literal space if a vocabulary ever had one.
fn split_merge(rule: &str) -> Option<(&str, &str)> {
    let pos = rule.as_bytes().iter().skip(1).position(|&b| b == b' ')? + 1;
    // `pos` indexes an ASCII space, so both halves are on character boundaries.
    Some((rule.get(..pos)?, rule.get(pos + 1..)?))
}

impl Bpe {
    pub(crate) fn new(
        vocab: &HashMap<String, u32>,
        n_vocab: u32,
        rules: &[gguf::MetaValue],
        bytes: &ByteMap,
    ) -> Result<Self, TokenizerError> {
        let mut interner = Interner {
            vocab,
            extra: HashMap::new(),
            next: n_vocab,
        };
        let mut byte_symbol = [0u32; 256];
        for (b, slot) in (0u8..=255).zip(byte_symbol.iter_mut()) {
            *slot = interner.intern(bytes.char_of(b).encode_utf8(&mut [0; 4]))?;
        }

        // Results first: a rule may use a symbol that only a later-ranked rule produces.
        let mut parsed = Vec::with_capacity(rules.len());
        let mut joined = String::new();
        for (rank, rule) in rules.iter().enumerate() {
            let rule = rule.as_str().ok_or_else(|| {
                TokenizerError::InvalidMetadata(format!("merge rule {rank} is not a string"))
            })?;
            let rank = u32::try_from(rank)
                .map_err(|_| TokenizerError::InvalidMetadata("too many merge rules".into()))?;
            // llama.cpp keeps a rule without a space as an unmatchable ("", "") pair.
            let Some((left, right)) = split_merge(rule) else {
                continue;
            };
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let merged = interner.intern(&joined)?;
            parsed.push((rank, left, right, merged));
        }

        let mut merges = HashMap::with_capacity(parsed.len());
        for (rank, left, right, merged) in parsed {
            // A side that no byte or merge can produce never appears as a symbol.
            if let (Some(l), Some(r)) = (interner.get(left), interner.get(right)) {
                // The first rule for a pair wins, as with llama.cpp's map emplace.
                merges.entry((l, r)).or_insert((rank, merged));
            }
        }

        let mut stand_in = ['\0'; 256];
        for (b, slot) in (0u8..=255).zip(stand_in.iter_mut()) {
            *slot = bytes.char_of(b);
        }
        Ok(Bpe {
            merges,
            byte_symbol,
            stand_in,
            n_vocab,
        })
    }

    /// The token for a single byte, if its stand-in character is in the vocabulary.
    pub(crate) fn byte_token(&self, b: u8) -> Option<u32> {
        let id = self.byte_symbol[usize::from(b)];
        (id < self.n_vocab).then_some(id)
    }

    /// The vocabulary entry that spells the whole piece, if there is one (llama.cpp's
    /// `ignore_merges`: such a piece is that token whatever the merges would make of it).
    pub(crate) fn whole_piece(
        &self,
        piece: &[u8],
        vocab: &HashMap<String, u32>,
        scratch: &mut Scratch,
    ) -> Option<u32> {
        let text = &mut scratch.text;
        text.clear();
        text.extend(piece.iter().map(|&b| self.stand_in[usize::from(b)]));
        vocab.get(text.as_str()).copied()
    }

    /// Encodes one pre-tokenized piece (raw bytes) and appends its tokens to `out`.
    pub(crate) fn encode_piece(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        match piece {
            [] => return,
            &[b] => {
                self.emit(self.byte_symbol[usize::from(b)], piece, out);
                return;
            }
            _ => {}
        }

        let syms = &mut scratch.symbols;
        let heap = &mut scratch.heap;
        syms.clear();
        heap.clear();
        for (i, &b) in piece.iter().enumerate() {
            syms.push(Symbol {
                id: self.byte_symbol[usize::from(b)],
                len: 1,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == piece.len() { NONE } else { i + 1 },
            });
        }
        for i in 1..syms.len() {
            self.push_pair(syms, heap, i - 1, i);
        }

        // Lowest rank first, leftmost first among equal ranks: the order llama.cpp's
        // priority queue pops in.
        while let Some(Reverse(cand)) = heap.pop() {
            let (l, r) = (cand.left, cand.right);
            let stale = syms[l].len == 0
                || syms[r].len == 0
                || syms[l].next != r
                || syms[l].id != cand.left_id
                || syms[r].id != cand.right_id;
            if stale {
                continue;
            }
            syms[l].id = cand.merged;
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            let next = syms[r].next;
            syms[l].next = next;
            if next != NONE {
                syms[next].prev = l;
            }
            let prev = syms[l].prev;
            if prev != NONE {
                self.push_pair(syms, heap, prev, l);
            }
            if next != NONE {
                self.push_pair(syms, heap, l, next);
            }
        }

        // Symbol 0 only ever absorbs its right neighbours, so it heads the final chain; a
        // symbol's index is the byte offset where it starts.
        let mut i = 0;
        while i != NONE {
            let s = &syms[i];
            let bytes = piece.get(i..i + s.len).unwrap_or_default();
            self.emit(s.id, bytes, out);
            i = s.next;
        }
    }

    fn push_pair(
        &self,
        syms: &[Symbol],
        heap: &mut BinaryHeap<Reverse<Candidate>>,
        l: usize,
        r: usize,
    ) {
        let (left_id, right_id) = (syms[l].id, syms[r].id);
        if let Some(&(rank, merged)) = self.merges.get(&(left_id, right_id)) {
            heap.push(Reverse(Candidate {
                rank,
                left: l,
                right: r,
                left_id,
                right_id,
                merged,
            }));
        }
    }

    fn emit(&self, symbol: u32, bytes: &[u8], out: &mut Vec<u32>) {
        if symbol < self.n_vocab {
            out.push(symbol);
        } else {
            // llama.cpp looks up each byte of the symbol's *stand-in* UTF-8 as a
            // one-byte token text. Only printable ASCII stands for itself in a single
            // byte, so every other byte is dropped. That is lossy, but it is what the
            // reference does, and it is only reachable for byte values a vocabulary
            // lacks (SmolLM2 has no token for 0x04, 0xF1, ...) or a merge result
            // missing from the vocabulary.
            out.extend(
                bytes
                    .iter()
                    .filter(|b| (0x21..=0x7E).contains(*b))
                    .filter_map(|&b| self.byte_token(b)),
            );
        }
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    len: usize,
    prev: usize,
    next: usize,
}

/// Ordered by (rank, left) — the remaining fields only identify the candidate.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    rank: u32,
    left: usize,
    right: usize,
    left_id: u32,
    right_id: u32,
    merged: u32,
}

/// Buffers reused across the pieces of one `encode` call.
#[derive(Default)]
pub(crate) struct Scratch {
    text: String,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<Candidate>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_rules_split_like_llama_cpp() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ", "t")));
        assert_eq!(split_merge("a b c"), Some(("a", "b c")));
        assert_eq!(split_merge(" a b"), Some((" a", "b")));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge(""), None);
        assert_eq!(split_merge("é b"), Some(("é", "b")));
    }
}
