//! The shape of a page and where its values lie: element type, per-layer K/V offsets, the
//! page's memory, and the borrowed row views that reads hand out.

use half::f16;

/// Element type of stored K/V values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
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
        self.n_layers * 2 * self.kv_dim * self.dtype.bytes()
    }

    pub fn page_bytes(&self) -> usize {
        self.page_elems() * self.dtype.bytes()
    }

    /// Offset of the first value of the K (`kv = 0`) or V (`kv = 1`) rows of `layer`.
    /// Rows of consecutive slots are contiguous, so a page's slots form one run.
    pub(crate) fn offset(&self, layer: usize, kv: usize, slot: usize) -> usize {
        ((layer * 2 + kv) * self.page_tokens + slot) * self.kv_dim
    }
}

pub(crate) enum PageData {
    F16(Box<[f16]>),
    F32(Box<[f32]>),
}

impl PageData {
    pub(crate) fn fill(&mut self, value: f32) {
        match self {
            PageData::F16(d) => d.fill(f16::from_f32(value)),
            PageData::F32(d) => d.fill(value),
        }
    }

    #[cfg(feature = "test-support")]
    pub(crate) fn to_f32(&self) -> Vec<f32> {
        match self {
            PageData::F16(d) => d.iter().map(|x| x.to_f32()).collect(),
            PageData::F32(d) => d.to_vec(),
        }
    }
}

/// Borrowed K or V rows of consecutive slots, in the pool's element type.
#[derive(Clone, Copy)]
pub enum KvSlice<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl KvSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F16(s) => s.len(),
            KvSlice::F32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the first `min(self.len(), out.len())` values into `out` as f32 (exact for
    /// both types) and returns how many it copied.
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
    }
}
