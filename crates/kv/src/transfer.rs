//! A sequence's K/V as bytes, for moving a prompt's cache from a prefill node to a decode
//! node. Export reads through the same checked path as attention (`SequenceKv::runs`), so
//! only slots written for this sequence can leave; import writes through
//! `SequenceKv::write`, so every received slot lands on a page this sequence owns, in
//! order, exactly once, and the written extents then prove coverage.
//!
//! Payload of one page: for each layer, the K rows then the V rows of its first `tokens`
//! slots, in the pool's element type, little-endian.

use crate::block::KvBlock;
use crate::layout::Row;
use crate::{KvError, KvLayout, KvSlice, SequenceKv};

impl KvLayout {
    /// Bytes of one page payload holding `tokens` slots.
    pub fn payload_bytes(&self, tokens: usize) -> usize {
        self.dtype
            .bytes_for(self.n_layers * 2 * tokens * self.kv_dim)
    }
}

fn push_slice(out: &mut Vec<u8>, s: KvSlice<'_>) {
    match s {
        KvSlice::F16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        KvSlice::F32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        KvSlice::Q8_0(v) => v.iter().for_each(|b| b.push_bytes(out)),
        KvSlice::Q4_0(v) => v.iter().for_each(|b| b.push_bytes(out)),
    }
}

impl SequenceKv {
    /// The payloads of the pages holding positions `[0, upto)`, one per page in position
    /// order (the last one holds `upto % page_tokens` slots when that is not zero). Fails,
    /// like attention would, if any of those positions was not written for this sequence.
    pub fn export_pages(&self, upto: usize) -> Result<Vec<Vec<u8>>, KvError> {
        let layout = self.layout();
        let p = layout.page_tokens;
        let mut pages: Vec<Vec<u8>> = (0..upto.div_ceil(p))
            .map(|i| Vec::with_capacity(layout.payload_bytes((upto - i * p).min(p))))
            .collect();
        for layer in 0..layout.n_layers {
            for (page, run) in pages.iter_mut().zip(self.runs(layer, upto)?) {
                push_slice(page, run.k);
                push_slice(page, run.v);
            }
        }
        Ok(pages)
    }

    /// Writes a received page: slots `[index * page_tokens, index * page_tokens + tokens)`
    /// on every layer. Refused unless the payload has exactly that shape, the page is
    /// reserved and owned by this sequence, and those slots are the next unwritten ones on
    /// every layer: a page sent twice, out of order, or past the reservation is an error.
    pub fn import_page(
        &mut self,
        index: usize,
        tokens: usize,
        bytes: &[u8],
    ) -> Result<(), KvError> {
        let layout = self.layout();
        let want = layout.payload_bytes(tokens);
        if tokens == 0 || tokens > layout.page_tokens || bytes.len() != want {
            return Err(KvError::PayloadShape {
                got: bytes.len(),
                want,
            });
        }
        let row_bytes = layout.dtype.bytes_for(layout.kv_dim);
        let base = index * layout.page_tokens;
        for (layer, rows) in bytes.chunks_exact(2 * tokens * row_bytes).enumerate() {
            let (ks, vs) = rows.split_at(tokens * row_bytes);
            for slot in 0..tokens {
                let at = slot * row_bytes..(slot + 1) * row_bytes;
                // Stored as received: the page holds the bytes the sender's held.
                self.write_row(
                    layer,
                    base + slot,
                    Row::Wire(&ks[at.clone()]),
                    Row::Wire(&vs[at]),
                )?;
            }
        }
        Ok(())
    }
}
