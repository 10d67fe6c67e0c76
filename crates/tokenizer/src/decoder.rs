//! Streaming detokenization.

use crate::{Tokenizer, TokenizerError};

/// Turns a stream of tokens into text without ever splitting a UTF-8 character: byte-level
/// BPE often spells one character (CJK, emoji) over several tokens, and emitting each token
/// separately would produce replacement characters.
#[derive(Clone, Debug, Default)]
pub struct IncrementalDecoder {
    /// Bytes of a character that is not complete yet (at most 3).
    pending: Vec<u8>,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one token; returns the text that became complete (possibly empty). Bytes of an
    /// unfinished character are held back until a later token completes it; bytes that can
    /// never become valid UTF-8 are emitted as U+FFFD right away.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.pending.extend_from_slice(tok.bytes_or_err(id)?);
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            let rest = &self.pending[start..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&rest[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            start += valid + bad;
                        }
                        None => {
                            // An incomplete character at the end: wait for more bytes.
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        Ok(out)
    }

    /// Ends the stream: whatever incomplete character is still held back, rendered lossily.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Whether bytes of an unfinished character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}
