//! The shape of a page and where its values lie: element type, per-layer K/V offsets, the
//! page's memory, and the borrowed row views that reads hand out.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::block::{dequantize_into, from_wire, quantize_into, KvBlock};
use crate::page_memory::PageMemory;
use crate::q4::Q4Block;
use crate::q8::Q8Block;

/// Element type of stored K/V values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
    /// 32-value blocks of bytes and an f16 scale (`crate::q8`); rows must hold a multiple
    /// of 32 values.
    Q8_0,
    /// 32-value blocks of nibbles and an f16 scale (`crate::q4`); rows as Q8_0's.
    Q4_0,
}

impl KvDtype {
    /// Bytes of `values` stored values (for a block format, whole blocks).
    pub fn bytes_for(self, values: usize) -> usize {
        values / self.values_per_element() * self.element_bytes()
    }

    /// Values per stored element (a block format's element is a block).
    pub fn values_per_element(self) -> usize {
        match self {
            KvDtype::F16 | KvDtype::F32 => 1,
            KvDtype::Q8_0 => Q8Block::VALUES,
            KvDtype::Q4_0 => Q4Block::VALUES,
        }
    }

    fn element_bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
            KvDtype::Q8_0 => Q8Block::BYTES,
            KvDtype::Q4_0 => Q4Block::BYTES,
        }
    }

    /// Every type, as `--kv-dtype` lists them.
    pub const ALL: [KvDtype; 4] = [KvDtype::F16, KvDtype::F32, KvDtype::Q8_0, KvDtype::Q4_0];

    /// The type `--kv-dtype` names `name`.
    pub fn from_name(name: &str) -> Option<KvDtype> {
        KvDtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// As `--kv-dtype` names it.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
            KvDtype::Q8_0 => "q8_0",
            KvDtype::Q4_0 => "q4_0",
        }
    }
}

/// Shape of one page: `page_tokens` slots, each holding K and V rows of `kv_dim` values
/// for every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub kv_dim: usize,
    pub page_tokens: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    pub fn page_elems(&self) -> usize {
        self.n_layers * 2 * self.page_tokens * self.kv_dim
    }

    pub fn bytes_per_token(&self) -> usize {
        self.dtype.bytes_for(self.n_layers * 2 * self.kv_dim)
    }

    pub fn page_bytes(&self) -> usize {
        self.dtype.bytes_for(self.page_elems())
    }

    /// Whether rows of this layout can be stored in its element type (a block format needs
    /// whole blocks per row).
    pub fn is_storable(&self) -> bool {
        self.kv_dim.is_multiple_of(self.dtype.values_per_element())
    }

    /// Offset of the first value of the K (`kv = 0`) or V (`kv = 1`) rows of `layer`.
    /// Rows of consecutive slots are contiguous, so a page's slots form one run.
    pub(crate) fn offset(&self, layer: usize, kv: usize, slot: usize) -> usize {
        ((layer * 2 + kv) * self.page_tokens + slot) * self.kv_dim
    }
}

pub(crate) enum PageData {
    F16(PageMemory<f16>),
    F32(PageMemory<f32>),
    Q8_0(PageMemory<Q8Block>),
    Q4_0(PageMemory<Q4Block>),
}

/// Pools from this size are committed on every core the process may use: the kernel's
/// zeroing of the fresh memory is most of a large pool's start (an 8 GiB pool took 1.4-1.7 s
/// on one core of a 2-core Xeon).
const PARALLEL_COMMIT_BYTES: usize = 256 << 20;

/// Threads to commit `pages` on: one for a small pool, every core the process may use for
/// a large one.
fn commit_threads(pages: &[PageData]) -> usize {
    let bytes: usize = pages.iter().map(PageData::bytes).sum();
    match bytes >= PARALLEL_COMMIT_BYTES {
        true => std::thread::available_parallelism().map_or(1, |n| n.get()),
        false => 1,
    }
}

/// Commits `pages` ([`PageMemory::commit`]) on `threads` threads taking pages from one
/// queue (a thread the system will not start leaves its pages to the others).
fn commit_all(pages: &mut [PageData], threads: usize) {
    let queue = std::sync::Mutex::new(pages.iter_mut());
    let next = || {
        let mut queue = queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.next()
    };
    let work = || {
        while let Some(page) = next() {
            page.commit();
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            let spawned = std::thread::Builder::new()
                .name("kv-commit".into())
                .spawn_scoped(scope, work);
            if spawned.is_err() {
                break;
            }
        }
        work();
    });
}

/// One row into the blocks of a block-format page, from `at` (a block boundary).
fn store_blocks<B: KvBlock>(d: &mut [B], at: usize, values: usize, row: Row<'_>) {
    let blocks = &mut d[at / B::VALUES..(at + values) / B::VALUES];
    match row {
        Row::Values(x) => quantize_into(x, blocks),
        Row::Wire(bytes) => from_wire(bytes, blocks),
    }
}

impl PageData {
    /// `count` pages of `elems` values, all zero and committed (`PageMemory::commit`):
    /// every page mapped before any is touched, so that neighbours can share huge pages.
    pub(crate) fn zeroed_pages(dtype: KvDtype, elems: usize, count: usize) -> Vec<Self> {
        let mut pages: Vec<Self> = (0..count)
            .map(|_| match dtype {
                KvDtype::F16 => PageData::F16(PageMemory::zeroed_uncommitted(elems)),
                KvDtype::F32 => PageData::F32(PageMemory::zeroed_uncommitted(elems)),
                KvDtype::Q8_0 => {
                    PageData::Q8_0(PageMemory::zeroed_uncommitted(elems / Q8Block::VALUES))
                }
                KvDtype::Q4_0 => {
                    PageData::Q4_0(PageMemory::zeroed_uncommitted(elems / Q4Block::VALUES))
                }
            })
            .collect();
        let threads = commit_threads(&pages);
        commit_all(&mut pages, threads);
        pages
    }

    fn bytes(&self) -> usize {
        match self {
            PageData::F16(d) => size_of_val::<[f16]>(d),
            PageData::F32(d) => size_of_val::<[f32]>(d),
            PageData::Q8_0(d) => size_of_val::<[Q8Block]>(d),
            PageData::Q4_0(d) => size_of_val::<[Q4Block]>(d),
        }
    }

    fn commit(&mut self) {
        match self {
            PageData::F16(d) => d.commit(),
            PageData::F32(d) => d.commit(),
            PageData::Q8_0(d) => d.commit(),
            // Zero bytes read as -0.0 in Q4_0 (`0 * (0 - 8)`): its zero block has other
            // bytes, and writing them commits the page.
            PageData::Q4_0(d) => d.fill(Q4Block::ZERO),
        }
    }

    pub(crate) fn fill(&mut self, value: f32) {
        match self {
            PageData::F16(d) => d.fill(f16::from_f32(value)),
            PageData::F32(d) => d.fill(value),
            PageData::Q8_0(d) => d.fill(Q8Block::filled(value)),
            PageData::Q4_0(d) => d.fill(Q4Block::filled(value)),
        }
    }

    #[cfg(feature = "test-support")]
    pub(crate) fn to_f32(&self) -> Vec<f32> {
        match self {
            PageData::F16(d) => d.iter().map(|x| x.to_f32()).collect(),
            PageData::F32(d) => d.to_vec(),
            PageData::Q8_0(_) | PageData::Q4_0(_) => {
                let mut out = vec![0f32; self.values()];
                KvSlice::from(self).to_f32(&mut out);
                out
            }
        }
    }

    #[cfg(feature = "test-support")]
    fn values(&self) -> usize {
        match self {
            PageData::F16(d) => d.len(),
            PageData::F32(d) => d.len(),
            PageData::Q8_0(d) => d.len() * Q8Block::VALUES,
            PageData::Q4_0(d) => d.len() * Q4Block::VALUES,
        }
    }

    /// Stores one row of `values` values at value offset `at` (for a block format, a block
    /// boundary); the caller checked the row's shape (`Row::fits`).
    pub(crate) fn store(&mut self, at: usize, values: usize, row: Row<'_>) {
        match (self, row) {
            // The slice conversion checks the CPU once per row and converts several values
            // per instruction (per element, it was a call each); same rounding.
            (PageData::F16(d), Row::Values(x)) => d[at..at + values].convert_from_f32_slice(x),
            (PageData::F32(d), Row::Values(x)) => d[at..at + values].copy_from_slice(x),
            (PageData::Q8_0(d), row) => store_blocks(d, at, values, row),
            (PageData::Q4_0(d), row) => store_blocks(d, at, values, row),
            (PageData::F16(d), Row::Wire(bytes)) => {
                for (o, b) in d[at..at + values].iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([b[0], b[1]]);
                }
            }
            (PageData::F32(d), Row::Wire(bytes)) => {
                for (o, b) in d[at..at + values].iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }
}

/// One K or V row to store: values a forward pass computed, or a row as
/// `SequenceKv::export_pages` sent it (the pool's element type, little-endian), stored as it
/// came, so a page moved between nodes holds the bytes it left with.
#[derive(Clone, Copy)]
pub(crate) enum Row<'a> {
    Values(&'a [f32]),
    Wire(&'a [u8]),
}

impl Row<'_> {
    /// Whether this is one row of `layout`; otherwise the length found.
    pub(crate) fn fits(&self, layout: &KvLayout) -> Result<(), usize> {
        let (got, want) = match self {
            Row::Values(x) => (x.len(), layout.kv_dim),
            Row::Wire(b) => (b.len(), layout.dtype.bytes_for(layout.kv_dim)),
        };
        if got == want {
            Ok(())
        } else {
            Err(got)
        }
    }
}

#[cfg(feature = "test-support")]
impl<'a> From<&'a PageData> for KvSlice<'a> {
    fn from(d: &'a PageData) -> Self {
        match d {
            PageData::F16(d) => KvSlice::F16(d),
            PageData::F32(d) => KvSlice::F32(d),
            PageData::Q8_0(d) => KvSlice::Q8_0(d),
            PageData::Q4_0(d) => KvSlice::Q4_0(d),
        }
    }
}

/// Borrowed K or V rows of consecutive slots, in the pool's element type.
#[derive(Clone, Copy)]
pub enum KvSlice<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
    Q8_0(&'a [Q8Block]),
    Q4_0(&'a [Q4Block]),
}

impl KvSlice<'_> {
    /// Values (not elements) in the slice.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F16(s) => s.len(),
            KvSlice::F32(s) => s.len(),
            KvSlice::Q8_0(s) => s.len() * Q8Block::VALUES,
            KvSlice::Q4_0(s) => s.len() * Q4Block::VALUES,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the first `min(self.len(), out.len())` values into `out` as f32 (exact for
    /// every type) and returns how many it copied.
    pub fn to_f32(&self, out: &mut [f32]) -> usize {
        match self {
            KvSlice::F16(s) => {
                for (o, v) in out.iter_mut().zip(s.iter()) {
                    *o = v.to_f32();
                }
            }
            KvSlice::F32(s) => {
                for (o, v) in out.iter_mut().zip(s.iter()) {
                    *o = *v;
                }
            }
            KvSlice::Q8_0(s) => dequantize_into(s, out),
            KvSlice::Q4_0(s) => dequantize_into(s, out),
        }
        self.len().min(out.len())
    }
}

/// K and V rows of the first `n` slots of `layer`; callers check `n` against what was
/// written.
pub(crate) fn rows<'a>(
    layout: &KvLayout,
    data: &'a PageData,
    layer: usize,
    n: usize,
) -> (KvSlice<'a>, KvSlice<'a>) {
    let k0 = layout.offset(layer, 0, 0);
    let v0 = layout.offset(layer, 1, 0);
    let len = n * layout.kv_dim;
    match data {
        PageData::F16(d) => (
            KvSlice::F16(&d[k0..k0 + len]),
            KvSlice::F16(&d[v0..v0 + len]),
        ),
        PageData::F32(d) => (
            KvSlice::F32(&d[k0..k0 + len]),
            KvSlice::F32(&d[v0..v0 + len]),
        ),
        PageData::Q8_0(d) => {
            let (k, v) = block_rows(d, k0, v0, len);
            (KvSlice::Q8_0(k), KvSlice::Q8_0(v))
        }
        PageData::Q4_0(d) => {
            let (k, v) = block_rows(d, k0, v0, len);
            (KvSlice::Q4_0(k), KvSlice::Q4_0(v))
        }
    }
}

/// The blocks of `len` values at value offsets `k0` and `v0` (block boundaries).
fn block_rows<B: KvBlock>(d: &[B], k0: usize, v0: usize, len: usize) -> (&[B], &[B]) {
    let (k0, v0, len) = (k0 / B::VALUES, v0 / B::VALUES, len / B::VALUES);
    (&d[k0..k0 + len], &d[v0..v0 + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh page reads as zero in every element type, element by element.
    #[test]
    fn fresh_pages_read_zero_in_every_element_type() {
        let elems = 64 * 1024;
        for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8_0, KvDtype::Q4_0] {
            let [page]: [PageData; 1] = PageData::zeroed_pages(dtype, elems, 1)
                .try_into()
                .unwrap_or_else(|_| panic!("one page asked for"));
            assert_eq!(page.values(), elems, "{dtype:?}");
            assert!(page.to_f32().iter().all(|&v| v.to_bits() == 0), "{dtype:?}");
            match &page {
                PageData::F16(d) => assert!(d.iter().all(|&v| v == f16::ZERO)),
                PageData::F32(_) => {}
                PageData::Q8_0(d) => assert!(d.iter().all(|&b| b == Q8Block::ZERO)),
                PageData::Q4_0(d) => assert!(d.iter().all(|&b| b == Q4Block::ZERO)),
            }
        }
    }

    /// Committed on several threads, every page is visited once: a Q4_0 page left out would
    /// keep its all-zero bytes, which are not Q4_0's zero block.
    #[test]
    fn every_page_is_committed_on_any_number_of_threads() {
        for threads in [1, 2, 3, 8] {
            let mut pages: Vec<PageData> = (0..37)
                .map(|_| PageData::Q4_0(PageMemory::zeroed_uncommitted(1000)))
                .collect();
            commit_all(&mut pages, threads);
            for (i, page) in pages.iter().enumerate() {
                let PageData::Q4_0(d) = page else {
                    unreachable!()
                };
                assert!(
                    d.iter().all(|&b| b == Q4Block::ZERO),
                    "page {i}, {threads} threads"
                );
            }
        }
    }
}
