//! llama.cpp's file of stored log-probabilities, as `llama-perplexity --kl-divergence-base`
//! writes it and `--kl-divergence` reads it, so a reference is llama.cpp's own output and
//! kvwarden's files are read back by llama.cpp.
//!
//! Layout (little-endian):
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | `_logits_` |
//! | 4 | `n_ctx` (u32): the window length |
//! | 4 | `n_vocab` (i32) |
//! | 4 | `n_chunk` (i32): the number of windows |
//! | 4 × `n_ctx` × `n_chunk` | the evaluated token ids (i32), window after window, as tokenized (the BOS that replaces each window's first token is not stored) |
//! | per window, `n_ctx − 1 − n_ctx/2` rows | one [`StoredRow`] per scored position: `nv = 2·⌈n_vocab/2⌉ + 4` u16, the first four holding two f32 (`scale`, `min_log_prob`), then one u16 per token |
//!
//! The rows are the second half of each window: position `n_ctx/2 + r` predicts token
//! `n_ctx/2 + r + 1`. The file's size follows from its header, so a truncated or padded file
//! is refused before anything is read past the header.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::row::StoredRow;
use crate::EvalError;

const MAGIC: &[u8; 8] = b"_logits_";
const HEADER_BYTES: u64 = 8 + 4 + 4 + 4;
/// Far above any model's context or vocabulary; bounds the allocation a hostile header asks.
const MAX_CTX: u32 = 1 << 20;
const MAX_VOCAB: i32 = 1 << 24;

/// The shape of a file: what its header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
}

impl Shape {
    /// Scored rows per window (`n_ctx − 1 − n_ctx/2`, llama-perplexity's count).
    pub fn rows_per_chunk(&self) -> usize {
        self.n_ctx - 1 - self.n_ctx / 2
    }

    /// The first scored position of a window.
    pub fn first(&self) -> usize {
        self.n_ctx / 2
    }

    /// u16 per stored row.
    pub fn row_len(&self) -> usize {
        StoredRow::len_for(self.n_vocab)
    }

    fn file_bytes(&self) -> Option<u64> {
        let tokens = (self.n_ctx as u64)
            .checked_mul(self.n_chunk as u64)?
            .checked_mul(4)?;
        let rows = (self.rows_per_chunk() as u64)
            .checked_mul(self.n_chunk as u64)?
            .checked_mul(self.row_len() as u64)?
            .checked_mul(2)?;
        HEADER_BYTES.checked_add(tokens)?.checked_add(rows)
    }
}

/// A stored file opened for reading: its header and tokens read, its rows read window by
/// window.
pub struct LogitsReader {
    path: PathBuf,
    pub shape: Shape,
    /// `n_ctx × n_chunk` token ids.
    pub tokens: Vec<u32>,
    input: BufReader<File>,
    next_chunk: usize,
}

impl LogitsReader {
    pub fn open(path: &Path) -> Result<Self, EvalError> {
        let bad = |reason: String| EvalError::LogitsFile {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
        let len = file
            .metadata()
            .map_err(|e| bad(format!("cannot read its size: {e}")))?
            .len();
        let mut input = BufReader::with_capacity(1 << 20, file);
        let mut header = [0u8; HEADER_BYTES as usize];
        input.read_exact(&mut header).map_err(|_| {
            bad(format!(
                "{len} bytes: shorter than the {HEADER_BYTES}-byte header"
            ))
        })?;
        if &header[..8] != MAGIC {
            return Err(bad(
                "does not start with `_logits_`: not a file of llama-perplexity's \
                 --kl-divergence-base format"
                    .into(),
            ));
        }
        let word = |at: usize| [header[at], header[at + 1], header[at + 2], header[at + 3]];
        let n_ctx = u32::from_le_bytes(word(8));
        let n_vocab = i32::from_le_bytes(word(12));
        let n_chunk = i32::from_le_bytes(word(16));
        if !(4..=MAX_CTX).contains(&n_ctx) {
            return Err(bad(format!(
                "context {n_ctx} in the header (4 to {MAX_CTX} expected)"
            )));
        }
        if !(1..=MAX_VOCAB).contains(&n_vocab) {
            return Err(bad(format!(
                "vocabulary of {n_vocab} tokens in the header (1 to {MAX_VOCAB} expected)"
            )));
        }
        if n_chunk < 1 {
            return Err(bad(format!("{n_chunk} windows in the header")));
        }
        let shape = Shape {
            n_ctx: n_ctx as usize,
            n_vocab: n_vocab as usize,
            n_chunk: n_chunk as usize,
        };
        let want = shape
            .file_bytes()
            .ok_or_else(|| bad("a header whose sizes overflow".into()))?;
        if len != want {
            return Err(bad(format!(
                "{len} bytes, but its header ({} windows of {} tokens, a vocabulary of {}) \
                 needs {want}: {}",
                shape.n_chunk,
                shape.n_ctx,
                shape.n_vocab,
                if len < want {
                    "truncated"
                } else {
                    "trailing bytes"
                }
            )));
        }
        let mut raw = vec![0u8; shape.n_ctx * shape.n_chunk * 4];
        input
            .read_exact(&mut raw)
            .map_err(|e| bad(format!("reading its tokens: {e}")))?;
        let mut tokens = Vec::with_capacity(raw.len() / 4);
        for (i, w) in raw.chunks_exact(4).enumerate() {
            let id = i32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            if id < 0 || id as usize >= shape.n_vocab {
                return Err(bad(format!(
                    "token {i} is {id}, outside its own vocabulary of {}",
                    shape.n_vocab
                )));
            }
            tokens.push(id as u32);
        }
        Ok(Self {
            path: path.to_path_buf(),
            shape,
            tokens,
            input,
            next_chunk: 0,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored rows of the next window, in order (`rows_per_chunk` rows).
    pub fn next_chunk(&mut self) -> Result<Vec<StoredRow>, EvalError> {
        let shape = self.shape;
        if self.next_chunk >= shape.n_chunk {
            return Err(EvalError::LogitsFile {
                path: self.path.clone(),
                reason: format!(
                    "asked for window {} of {}",
                    self.next_chunk + 1,
                    shape.n_chunk
                ),
            });
        }
        let mut rows = Vec::with_capacity(shape.rows_per_chunk());
        let mut raw = vec![0u8; shape.row_len() * 2];
        for r in 0..shape.rows_per_chunk() {
            self.input
                .read_exact(&mut raw)
                .map_err(|e| EvalError::LogitsFile {
                    path: self.path.clone(),
                    reason: format!("window {} row {r}: {e}", self.next_chunk + 1),
                })?;
            rows.push(StoredRow::from_le_bytes(&raw, shape.n_vocab));
        }
        self.next_chunk += 1;
        Ok(rows)
    }

    /// Back to the first window.
    pub fn rewind(&mut self) -> Result<(), EvalError> {
        let at = HEADER_BYTES + (self.shape.n_ctx * self.shape.n_chunk * 4) as u64;
        self.input
            .seek(SeekFrom::Start(at))
            .map_err(|e| EvalError::LogitsFile {
                path: self.path.clone(),
                reason: format!("seeking to its rows: {e}"),
            })?;
        self.next_chunk = 0;
        Ok(())
    }
}

/// Writes a file in the same format, window by window.
pub struct LogitsWriter {
    path: PathBuf,
    shape: Shape,
    out: BufWriter<File>,
    chunks_written: usize,
}

impl LogitsWriter {
    pub fn create(path: &Path, shape: Shape, tokens: &[u32]) -> Result<Self, EvalError> {
        let fail = |e: std::io::Error| EvalError::Write {
            path: path.to_path_buf(),
            source: e,
        };
        assert_eq!(
            tokens.len(),
            shape.n_ctx * shape.n_chunk,
            "one token per position of every window"
        );
        let file = File::create(path).map_err(fail)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(MAGIC).map_err(fail)?;
        out.write_all(&(shape.n_ctx as u32).to_le_bytes())
            .map_err(fail)?;
        out.write_all(&(shape.n_vocab as i32).to_le_bytes())
            .map_err(fail)?;
        out.write_all(&(shape.n_chunk as i32).to_le_bytes())
            .map_err(fail)?;
        let mut raw = Vec::with_capacity(tokens.len() * 4);
        for &t in tokens {
            raw.extend_from_slice(&(t as i32).to_le_bytes());
        }
        out.write_all(&raw).map_err(fail)?;
        Ok(Self {
            path: path.to_path_buf(),
            shape,
            out,
            chunks_written: 0,
        })
    }

    /// One window's rows, in order.
    pub fn write_chunk(&mut self, rows: &[StoredRow]) -> Result<(), EvalError> {
        assert_eq!(rows.len(), self.shape.rows_per_chunk());
        let mut raw = Vec::with_capacity(self.shape.row_len() * 2);
        for row in rows {
            raw.clear();
            row.write_le_bytes(&mut raw);
            self.out.write_all(&raw).map_err(|e| EvalError::Write {
                path: self.path.clone(),
                source: e,
            })?;
        }
        self.chunks_written += 1;
        Ok(())
    }

    pub fn finish(mut self) -> Result<(), EvalError> {
        assert_eq!(self.chunks_written, self.shape.n_chunk);
        self.out.flush().map_err(|e| EvalError::Write {
            path: self.path.clone(),
            source: e,
        })
    }
}
