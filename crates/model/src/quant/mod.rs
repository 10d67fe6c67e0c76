//! Weight formats: one [`QuantFormat`] implementation per format, each in its own file of
//! this folder (a family of formats sharing kernels shares one), defining its stored block, its reference dequantization, its dot product against the
//! activation quantization ggml pairs it with (f32, Q8_1 blocks of 32, or Q8_K super-blocks
//! of 256) and the kernels it runs per instruction set; [`table`] maps GGUF types to them.
//!
//! The quantized kernels compute exact integer sums, then apply the blocks' float scales in
//! llama.cpp's AVX2 float order (its `ggml_vec_dot_*` kernels): eight integer lanes (lane `i`
//! holding elements `4i..4i+4` of each 32-element chunk), one fused multiply-add per lane and
//! block, the min/offset terms as llama.cpp accumulates them, and its final lane sum. So the
//! logits on these types equal llama.cpp's bit for bit (`tests/llama_references.rs`); with
//! the same products in another order this small model moved by tenths of a nat. Q4_K and Q6_K
//! have an order of their own (one float chain per output, `kquants::Q4K::dot_scalar`) for
//! the tokens-in-lanes kernel; `kvwarden eval` measures it against llama.cpp's spread. The
//! k-quants have AVX2 builds of the integer lanes (run-time dispatch, as in `kernels/`);
//! integer lanes do not depend on how they are summed, so both paths give the same bits.

pub mod float;
#[cfg(target_arch = "x86_64")]
pub(crate) mod interleaved;
pub mod iq4_nl;
pub mod kquants;
mod load_buffer;
pub mod low_kquants;
pub mod q4_0;
pub mod q4_1;
pub mod q5;
pub mod q8_0;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod table;

use gguf::{GgmlType, TensorData};

use crate::blocks::{Acts, BlockQ8K, BlockQ8_1, LanesQ8K, LanesQ8_1, TILE};
use crate::kernels::{ActKind, WeightRows};

/// An activation block type: how many elements a block covers, and where to find it.
pub trait ActBlock: Copy + Send + Sync + 'static {
    const ELEMS: usize;
    const KIND: ActKind;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self];
}

impl ActBlock for f32 {
    const ELEMS: usize = 1;
    const KIND: ActKind = ActKind::F32;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self] {
        acts.f32
    }
}

impl ActBlock for BlockQ8_1 {
    const ELEMS: usize = crate::blocks::QK;
    const KIND: ActKind = ActKind::Q8_1;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self] {
        acts.q8_1
    }
}

impl ActBlock for BlockQ8K {
    const ELEMS: usize = gguf::QK_K;
    const KIND: ActKind = ActKind::Q8K;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self] {
        acts.q8_k
    }
}

/// One weight format the kernels can multiply. A stored block covers as many elements as
/// one block of its activations ([`ActBlock::ELEMS`]), so a row of `nb` weight blocks meets
/// `nb` activation blocks.
pub trait QuantFormat: Send + Sync + Sized + 'static {
    /// The ggml type whose layout [`Self::Block`] holds.
    const TYPE: GgmlType;
    /// One stored block: ggml's bytes (`[u8; N]`, read back with `as_flattened`), or a form
    /// widened once at load.
    type Block: Copy + Send + Sync + 'static;
    /// The activation blocks the dot product takes.
    type Act: ActBlock;
    /// Whether [`Self::product`] reads [`Acts::tile_scales`].
    const TILE_SCALES: bool = false;
    /// A tensor of ggml type `ty` (its bytes, whole blocks) as stored blocks.
    fn load(ty: GgmlType, bytes: &[u8]) -> Vec<Self::Block>;
    /// The file's bytes as stored blocks where they are stored as they lie in the file
    /// (then a mapped file's tensor is used in place, never copied); `None` for the formats
    /// that widen their blocks at load.
    fn view(bytes: &[u8]) -> Option<&[Self::Block]> {
        let _ = bytes;
        None
    }
    /// The reference dequantization of whole blocks into `out`.
    fn dequantize(w: &[Self::Block], out: &mut [f32]);
    /// One weight row against one activation row.
    fn dot(w: &[Self::Block], a: &[Self::Act]) -> f32;
    /// One weight row against up to [`TILE`] activation rows, `out[t]` exactly
    /// `dot(w, acts[t])`; formats whose unpacking dominates share it across the tile.
    #[inline(always)]
    fn dot_tile(w: &[Self::Block], acts: &[&[Self::Act]], out: &mut [f32]) {
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot(w, a);
        }
    }
    /// The tokens (whole tiles, from the first) the format's 512-bit register tiles put
    /// into row-major `out[r * n + t]`, where it has them and the CPU runs them; 0 where not.
    #[inline(always)]
    fn wide_rows(
        w: &[Self::Block],
        nb: usize,
        x: &[Self::Act],
        n: usize,
        out: &mut [f32],
    ) -> usize {
        let _ = (w, nb, x, n, out);
        0
    }
    /// `out[r * n + t] = dot(w[r], x[t])` for the rows of `w` (`nb` blocks each) and the
    /// `n` tokens of `x`: the wide tiles' tokens, then the rest one row and up to [`TILE`]
    /// tokens at a time through [`Self::dot_tile`].
    #[inline(always)]
    fn rows(w: &[Self::Block], x: &[Self::Act], nb: usize, n: usize, out: &mut [f32]) {
        let done = Self::wide_rows(w, nb, x, n, out);
        tokens_by_tiles::<Self>(w, x, nb, n, done, out);
    }
    /// One task's product (rows of `w` against the `n` tokens of `acts`, row-major): where
    /// the instruction set is chosen, once per task. By default [`Self::rows`] compiled for
    /// AVX2, FMA and F16C where the CPU has them (see `simd.rs`), else as built.
    #[inline(always)]
    fn product(w: &[Self::Block], nb: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        let x = Self::Act::pick(acts);
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::cpu::avx2_fma_f16c_detected() {
            // SAFETY: AVX2, FMA and F16C are present (checked), the function's requirement.
            unsafe { simd::rows_for_avx2::<Self>(w, x, nb, n, out) };
            return;
        }
        Self::rows(w, x, nb, n, out);
    }
    /// Whether a product of `n` tokens runs the format's tokens-in-lanes kernel here (so
    /// the product builds [`Acts::q8_k_lanes`]): where it has one and the CPU runs it.
    #[inline(always)]
    fn wants_lanes(n: usize) -> bool {
        let _ = n;
        false
    }

    /// The rows of `w` against the `n` tokens of `lanes` with the tokens-in-lanes kernel,
    /// into `out[r * n + t]`, or token-major `out[t * ld + r]` given `ld`; false (nothing
    /// done) where [`Self::wants_lanes`] is false.
    #[inline(always)]
    fn lanes_rows(
        w: &[Self::Block],
        nb: usize,
        lanes: &[LanesQ8K],
        n: usize,
        out: &mut [f32],
        ld: Option<usize>,
    ) -> bool {
        let _ = (w, nb, lanes, n, out, ld);
        false
    }

    /// Whether a product of `n` tokens runs the format's 32-element-block tokens-in-lanes
    /// kernel here (so the product builds [`Acts::q8_1_lanes`]).
    #[inline(always)]
    fn wants_block_lanes(n: usize) -> bool {
        let _ = n;
        false
    }

    /// [`Self::lanes_rows`] for that kernel.
    #[inline(always)]
    fn block_lanes_rows(
        w: &[Self::Block],
        nb: usize,
        lanes: &[LanesQ8_1],
        n: usize,
        out: &mut [f32],
        ld: Option<usize>,
    ) -> bool {
        let _ = (w, nb, lanes, n, out, ld);
        false
    }

    /// As [`Self::rows`] but token-major, `out[t * ld + r]`, for formats with a kernel that
    /// writes that layout (a prefill then needs no transposition); false, nothing done, for
    /// the others or where the CPU lacks the kernel.
    #[inline(always)]
    fn rows_token_major(
        w: &[Self::Block],
        nb: usize,
        x: &[Self::Act],
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        let _ = (w, nb, x, n, out, ld);
        false
    }
}

/// [`QuantFormat::rows`] for tokens `t0..n`, one row and up to [`TILE`] tokens at a time
/// through [`QuantFormat::dot_tile`].
#[inline(always)]
pub(crate) fn tokens_by_tiles<F: QuantFormat>(
    w: &[F::Block],
    x: &[F::Act],
    nb: usize,
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let mut acts: [&[F::Act]; TILE] = [&[]; TILE];
    for (r, row) in w.chunks_exact(nb).enumerate() {
        let mut t = t0;
        while t < n {
            let k = (n - t).min(TILE);
            for (j, a) in acts.iter_mut().enumerate().take(k) {
                *a = &x[(t + j) * nb..(t + j + 1) * nb];
            }
            F::dot_tile(row, &acts[..k], &mut out[r * n + t..r * n + t + k]);
            t += k;
        }
    }
}

/// ggml's bytes as `N`-byte blocks (the stored form of the formats kept as in the file).
pub(crate) fn byte_blocks<const N: usize>(bytes: &[u8]) -> Vec<[u8; N]> {
    byte_view(bytes).to_vec()
}

/// The same blocks, borrowed.
pub(crate) fn byte_view<const N: usize>(bytes: &[u8]) -> &[[u8; N]] {
    bytes.as_chunks::<N>().0
}

/// When the matrices a CPU runs on repacked tiles (`interleaved.rs`) are built.
pub enum Repack<'a> {
    /// While the model loads.
    AtLoad,
    /// By [`PendingRepacks::run`], later: until then each matrix reads the file's rows.
    /// Every layout gives the same bits, so a server can answer while its weights are
    /// still being repacked.
    Deferred(&'a PendingRepacks),
}

/// One matrix's deferred repack.
pub(crate) trait DeferredRepack: Send + Sync {
    /// Builds the tiles unless built; the file bytes they cover.
    fn repack(&self) -> usize;
}

/// The repacks a load deferred ([`Repack::Deferred`]).
#[derive(Default)]
pub struct PendingRepacks(std::sync::Mutex<Vec<std::sync::Arc<dyn DeferredRepack>>>);

impl PendingRepacks {
    pub(crate) fn add(&self, repack: std::sync::Arc<dyn DeferredRepack>) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(repack);
    }

    /// How many matrices wait.
    pub fn len(&self) -> usize {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Repacks every matrix in turn, each over the global rayon pool; the file bytes
    /// repacked.
    pub fn run(self) -> usize {
        let pending = self
            .0
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pending.iter().map(|m| m.repack()).sum()
    }
}

/// What [`crate::weights::Matrix`] holds: a matrix of some format, behind one virtual call
/// per product task.
pub trait WeightMatrix: WeightRows {
    /// The GGUF type the matrix was loaded from.
    fn ty(&self) -> GgmlType;
    /// Row `r` dequantized (embedding lookups).
    fn row_f32(&self, r: usize, out: &mut [f32]);
    /// Whether the blocks are read from the mapped file.
    fn is_mapped(&self) -> bool;
}

/// Bytes of a tensor widened at once (see [`QuantMatrix::new`]).
const WIDEN_SLICE: usize = 8 << 20;

/// Where a matrix's blocks are: in the mapped file, or widened into memory of its own.
enum Blocks<B> {
    Owned(Vec<B>),
    Mapped(TensorData),
}

/// A matrix of format `F`, its blocks row after row.
pub struct QuantMatrix<F: QuantFormat> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    blocks: Blocks<F::Block>,
}

impl<F: QuantFormat> QuantMatrix<F> {
    /// `data` must hold `rows` rows of `cols` elements of type `ty` (the GGUF reader
    /// checked the size; `cols` is a whole number of blocks). A mapped tensor whose format
    /// keeps the file's blocks is used in place; any other is loaded into memory (and a
    /// mapped one's pages then released).
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &TensorData) -> Self {
        debug_assert_eq!(F::TYPE.block_elems(), F::Act::ELEMS);
        debug_assert_eq!(cols % F::Act::ELEMS, 0);
        let blocks = if data.is_mapped() && F::view(data.bytes()).is_some() {
            data.prefault();
            Blocks::Mapped(data.clone())
        } else {
            // Widened a slice at a time, each slice's file pages released once copied, so a
            // mapped tensor is never resident twice over (a 128k-token Q8_0 embedding is
            // 270 MB).
            let step = (WIDEN_SLICE / ty.block_bytes()).max(1) * ty.block_bytes();
            let mut owned = Vec::with_capacity(rows * cols / F::Act::ELEMS);
            for (i, slice) in data.bytes().chunks(step).enumerate() {
                owned.extend(F::load(ty, slice));
                data.release_part(i * step, slice.len());
            }
            Blocks::Owned(owned)
        };
        let m = QuantMatrix {
            ty,
            rows,
            cols,
            blocks,
        };
        debug_assert_eq!(m.data().len(), rows * cols / F::Act::ELEMS);
        m
    }

    /// Whether the blocks are read from the mapped file.
    pub fn is_mapped(&self) -> bool {
        matches!(self.blocks, Blocks::Mapped(_))
    }

    fn data(&self) -> &[F::Block] {
        match &self.blocks {
            Blocks::Owned(v) => v,
            // `view` is a pure function of the bytes, which gave `Some` when the matrix
            // was made; an empty slice is unreachable.
            Blocks::Mapped(d) => F::view(d.bytes()).unwrap_or_default(),
        }
    }

    /// Blocks per row.
    fn nb(&self) -> usize {
        self.cols / F::Act::ELEMS
    }
}

impl<F: QuantFormat> WeightRows for QuantMatrix<F> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn act_kind(&self) -> ActKind {
        F::Act::KIND
    }

    fn wants_tile_scales(&self) -> bool {
        F::TILE_SCALES
    }

    fn wants_q8_k_lanes(&self, n: usize) -> bool {
        F::wants_lanes(n)
    }

    fn wants_q8_1_lanes(&self, n: usize) -> bool {
        F::wants_block_lanes(n)
    }

    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        let nb = self.nb();
        let w = &self.data()[r0 * nb..(r0 + nr) * nb];
        if !acts.q8_k_lanes.is_empty() && F::lanes_rows(w, nb, acts.q8_k_lanes, n, out, None) {
            return;
        }
        if !acts.q8_1_lanes.is_empty() && F::block_lanes_rows(w, nb, acts.q8_1_lanes, n, out, None)
        {
            return;
        }
        F::product(w, nb, acts, n, out);
    }

    fn rows_token_major(
        &self,
        r0: usize,
        nr: usize,
        acts: &Acts<'_>,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        let nb = self.nb();
        let w = &self.data()[r0 * nb..(r0 + nr) * nb];
        if !acts.q8_k_lanes.is_empty() && F::lanes_rows(w, nb, acts.q8_k_lanes, n, out, Some(ld)) {
            return true;
        }
        if !acts.q8_1_lanes.is_empty()
            && F::block_lanes_rows(w, nb, acts.q8_1_lanes, n, out, Some(ld))
        {
            return true;
        }
        F::rows_token_major(w, nb, F::Act::pick(acts), n, out, ld)
    }
}

impl<F: QuantFormat> WeightMatrix for QuantMatrix<F> {
    fn ty(&self) -> GgmlType {
        self.ty
    }

    fn row_f32(&self, r: usize, out: &mut [f32]) {
        let nb = self.nb();
        F::dequantize(&self.data()[r * nb..(r + 1) * nb], out);
    }

    fn is_mapped(&self) -> bool {
        QuantMatrix::is_mapped(self)
    }
}

#[cfg(test)]
mod tests;
