//! Text to tokens: the text split at the special tokens the caller allows (none but the
//! user-defined ones for untrusted text, so it cannot forge control tokens), then each piece
//! through the vocabulary's model.

use std::ops::Range;

use crate::{bpe, pretokenize, spm, Model, Tokenizer};

/// Pre-tokenized pieces between two looks at the cancel flag: a few hundred microseconds
/// of work, so a hung-up client costs no more than that.
const CANCEL_CHECK_PIECES: usize = 1024;

impl Tokenizer {
    /// Tokenizes `text`, turning the literal text of control, user-defined and unknown
    /// tokens into those tokens (llama.cpp `parse_special = true`). Adds no BOS.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, &self.specials, &|| false)
            .unwrap_or_default()
    }

    /// [`Self::encode`], giving up (`None`) soon after `cancelled` turns true: it is asked
    /// between fragments and every 1,024 pre-tokenized pieces, so a client that hangs up
    /// stops the work on its text.
    pub fn encode_cancellable(&self, text: &str, cancelled: &dyn Fn() -> bool) -> Option<Vec<u32>> {
        self.encode_with(text, &self.specials, cancelled)
    }

    /// [`Self::encode_ordinary`], stopping as [`Self::encode_cancellable`] does.
    pub fn encode_ordinary_cancellable(
        &self,
        text: &str,
        cancelled: &dyn Fn() -> bool,
    ) -> Option<Vec<u32>> {
        self.encode_with(text, &self.user_defined, cancelled)
    }

    /// Tokenizes `text` with control-token text treated as plain text, so untrusted input
    /// cannot inject `<|im_start|>` and the like (llama.cpp `parse_special = false`, which
    /// still honours user-defined tokens).
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, &self.user_defined, &|| false)
            .unwrap_or_default()
    }

    fn encode_with(
        &self,
        text: &str,
        specials: &[u32],
        cancelled: &dyn Fn() -> bool,
    ) -> Option<Vec<u32>> {
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
            if cancelled() {
                return None;
            }
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
                    for (n, piece) in pieces.iter().enumerate() {
                        if n % CANCEL_CHECK_PIECES == CANCEL_CHECK_PIECES - 1 && cancelled() {
                            return None;
                        }
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
        Some(out)
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
}

enum Fragment {
    Text(Range<usize>),
    Token(u32),
}
