//! Q4_K and Q6_K matrices repacked at load, on CPUs with AVX-512 VNNI, into tiles of
//! sixteen rows: per super-block, each half-precision field of the sixteen rows side by
//! side, then each 4-byte word of the block as sixteen rows' words (one 64-byte line).
//! The tile is a permutation of the rows' bytes, as many as they were, so a matrix is held
//! once (the file's pages released as it is repacked, as widened formats do), in memory
//! asked for 2 MiB pages (`load_buffer.rs`). A Llama-3.2-1B-shaped Q4_K_M decode on a
//! 2-core Zen 4 VM, 31 alternated pairs: median 37.3 tokens/s on 4 KiB pages, 49.0 on
//! these (median ratio 1.24, from 0.98 to 1.52; faster in 29), llama.cpp 32.5–42.8 (median
//! 37.7) in the same minutes; the VM's memory bandwidth moves by more than that from minute
//! to minute. Start went from 1.3–1.45 s to 1.17–1.22 (2.0–2.2 when the kernel first has
//! to compact memory for the huge pages); prefill did not change.
//!
//! Repacking is most of a start (the kernel zeroing the huge pages, then the copies), and
//! every layout gives the same bits, so `serve` defers it ([`Repack::Deferred`]): each
//! matrix reads the file's rows until its tiles are set, built over the global rayon pool
//! beside the forward passes. The same 1B file is healthy 0.39–0.44 s after start (0.78–0.83
//! repacking first; llama-server 1.10; of kvwarden's, 0.25 s is writing its 512 MiB KV
//! pool) and at full speed about 1.0 s later.
//!
//! Decode-sized products (at most [`ROWS_LANES_MAX`] tokens) run the rows-in-lanes kernel
//! on the tiles (`kernels/x86_512_rows_lanes.rs`); larger ones the tokens-in-lanes kernel,
//! which prepares each tile's sixteen rows with transpositions in registers
//! (`x86_512_lanes.rs`). Rows that do not start a tile rebuild ggml's blocks for the rows
//! they need and run the format's own kernels. Every path computes the format's definition (`Q4K::dot_scalar`,
//! `Q6K::dot_scalar`), so the layout changes no bit (`quant/tests.rs`).

use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use gguf::{GgmlType, TensorData};
use rayon::prelude::*;

use super::kquants::{Q4K, Q6K};
use super::load_buffer::LoadBuffer;
use super::{DeferredRepack, QuantFormat, Repack, WeightMatrix};
use crate::blocks::{Acts, BlockQ8K};
use crate::kernels::tile_out::Out;
use crate::kernels::x86_512_lanes::{k_quant_lanes, Format, Weights};
use crate::kernels::x86_512_rows_lanes::{self as kernel, TILE_ROWS};
use crate::kernels::x86_amx::k_quant_amx;
use crate::kernels::{cpu, ActKind, WeightRows};

/// Products of at most this many tokens run on the tiles. On a 2-core Zen 4 with the
/// Llama-3.2-1B shape, the tokens-in-lanes kernel took over from here: each tile serving
/// every pass in turn, 12 to 32 tokens ran 15-70% faster on the tiles than in lanes, 48 and
/// 64 10% slower (its prepared rows then serve enough token groups).
pub(crate) const ROWS_LANES_MAX: usize = 32;

/// Bytes of a tensor repacked between releases of its file pages.
const REPACK_SLICE: usize = 8 << 20;

/// A format whose super-blocks the tiles hold.
pub(crate) trait Interleave: QuantFormat<Act = BlockQ8K> {
    /// The kernels' name for it.
    const FORMAT: Format;
    /// Bytes of one super-block.
    const BLOCK: usize;
    /// Byte offsets of its half-precision fields.
    const HALVES: &'static [usize];
    /// Where its 4-byte words start; they run to the block's end or to the first half.
    const WORDS_AT: usize;
    /// How many words it has.
    const WORDS: usize;
    /// The block's word in a tile's slot `s`: slots run in the order the kernel reads
    /// them, so each tile is one forward stream.
    fn word_in_slot(s: usize) -> usize {
        s
    }
    /// Whether [`Self::word_in_slot`] is the identity (then sixteen slots go back to a
    /// row in one transposition).
    const SLOTS_IN_ORDER: bool = true;
}

impl Interleave for Q4K {
    const FORMAT: Format = Format::Q4K;
    const BLOCK: usize = 144;
    const HALVES: &'static [usize] = &[0, 2];
    const WORDS_AT: usize = 4;
    const WORDS: usize = 35;
}

impl Interleave for Q6K {
    const FORMAT: Format = Format::Q6K;
    const BLOCK: usize = 210;
    const HALVES: &'static [usize] = &[208];
    const WORDS_AT: usize = 0;
    const WORDS: usize = 52;
    const SLOTS_IN_ORDER: bool = false;

    /// The Q6_K pass of `tile_rows` reads, per half of the block and half of each 32, for each quad of
    /// four elements: `ql`'s two words and `qh`'s; then the four scale words.
    fn word_in_slot(s: usize) -> usize {
        if s >= 48 {
            return s;
        }
        let (pass, q, part) = (s / 12, s % 12 / 3, s % 3);
        let (half, upper) = (pass / 2, pass % 2);
        let q = 4 * upper + q;
        [16 * half + q, 16 * half + 8 + q, 32 + 8 * half + q][part]
    }
}

/// Bytes of one tile of format `F`.
const fn tile_bytes<F: Interleave>() -> usize {
    TILE_ROWS * F::BLOCK
}

/// Whether a matrix of `rows` rows of `F` is repacked here: the CPU runs the kernel and
/// the rows are whole tiles.
pub(crate) fn applies<F: Interleave>(rows: usize) -> bool {
    const { assert!(2 * F::HALVES.len() + 4 * F::WORDS == F::BLOCK) };
    rows.is_multiple_of(TILE_ROWS) && cpu::wide_available() && cpu::has_f16c()
}

/// Sixteen rows' super-block `i` (`rows`: their blocks, `nb` a row) as a tile.
fn pack<F: Interleave>(rows: &[u8], nb: usize, i: usize, tile: &mut [u8]) {
    let words_at = 32 * F::HALVES.len();
    for r in 0..TILE_ROWS {
        let block = &rows[(r * nb + i) * F::BLOCK..(r * nb + i + 1) * F::BLOCK];
        for (k, &at) in F::HALVES.iter().enumerate() {
            tile[32 * k + 2 * r..32 * k + 2 * r + 2].copy_from_slice(&block[at..at + 2]);
        }
        for slot in 0..F::WORDS {
            let to = words_at + 64 * slot + 4 * r;
            let from = F::WORDS_AT + 4 * F::word_in_slot(slot);
            tile[to..to + 4].copy_from_slice(&block[from..from + 4]);
        }
    }
}

/// A matrix of format `F` as tiles, `[group * nb + i]` for groups of sixteen rows, or the
/// file's rows until a deferred repack ([`Repack::Deferred`]) has built them.
pub(crate) struct InterleavedMatrix<F: Interleave> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    tiles: Tiles<F>,
}

enum Tiles<F: Interleave> {
    /// Built at load.
    Built(LoadBuffer),
    /// Built when the deferred repack reaches this matrix.
    Deferred(Arc<DeferredTiles<F>>),
}

/// Where a product reads the rows.
enum Layout<'a> {
    Tiles(&'a [u8]),
    /// As the file holds them (a deferred repack not yet run).
    File(&'a [u8]),
}

/// A deferred repack's matrix: the file's rows, read until the tiles are set.
struct DeferredTiles<F: Interleave> {
    file: TensorData,
    rows: usize,
    cols: usize,
    tiles: OnceLock<LoadBuffer>,
    format: PhantomData<F>,
}

/// The tiles of `rows` rows of `cols` from the file's rows `file`, its pages released
/// slice by slice, over the global rayon pool (not the model's: a deferred repack shares
/// the cores with the forward passes instead of queueing in front of them). Readers of the
/// file's rows meanwhile fault released pages back in from the file: they read the same
/// bytes.
fn build<F: Interleave>(file: &TensorData, rows: usize, cols: usize) -> LoadBuffer {
    let nb = cols / gguf::QK_K;
    let group = nb * tile_bytes::<F>();
    let mut tiles = LoadBuffer::zeroed(rows / TILE_ROWS * group);
    let groups_per_slice = (REPACK_SLICE / group.max(1)).max(1);
    let src = file.bytes();
    let pack_group = |(dst, rows): (&mut [u8], &[u8])| {
        for (i, tile) in dst.chunks_exact_mut(tile_bytes::<F>()).enumerate() {
            pack::<F>(rows, nb, i, tile);
        }
    };
    for (s, dst) in tiles.chunks_mut(groups_per_slice * group).enumerate() {
        let at = s * groups_per_slice * group;
        let from = &src[at..at + dst.len()];
        dst.par_chunks_mut(group)
            .zip(from.par_chunks(group))
            .for_each(pack_group);
        file.release_part(at, dst.len());
    }
    tiles
}

impl<F: Interleave> DeferredRepack for DeferredTiles<F> {
    fn repack(&self) -> usize {
        if self.tiles.get().is_none() {
            let tiles = build::<F>(&self.file, self.rows, self.cols);
            if self.tiles.set(tiles).is_ok() {
                // Pages that readers faulted back in while the repack ran: nothing reads
                // the file's rows once the tiles are set.
                self.file.release_part(0, self.file.bytes().len());
            }
        }
        self.file.bytes().len()
    }
}

impl<F: Interleave> InterleavedMatrix<F> {
    /// `data` must hold `rows` rows of `cols` elements of `F` (the GGUF reader checked the
    /// size), `rows` a multiple of sixteen ([`applies`]). At load, a mapped tensor's pages
    /// are released slice by slice as they are repacked. Deferred, the matrix reads the
    /// file's rows until the repack registered with `repack` has run.
    pub(crate) fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &TensorData,
        repack: &Repack<'_>,
    ) -> Self {
        assert!(
            rows.is_multiple_of(TILE_ROWS),
            "interleaved: rows not whole tiles"
        );
        let tiles = match repack {
            Repack::Deferred(pending) => {
                let deferred = Arc::new(DeferredTiles {
                    file: data.clone(),
                    rows,
                    cols,
                    tiles: OnceLock::new(),
                    format: PhantomData,
                });
                pending.add(deferred.clone());
                Tiles::Deferred(deferred)
            }
            Repack::AtLoad => Tiles::Built(build::<F>(data, rows, cols)),
        };
        InterleavedMatrix {
            ty,
            rows,
            cols,
            tiles,
        }
    }

    fn layout(&self) -> Layout<'_> {
        match &self.tiles {
            Tiles::Built(tiles) => Layout::Tiles(tiles),
            Tiles::Deferred(d) => match d.tiles.get() {
                Some(tiles) => Layout::Tiles(tiles),
                None => Layout::File(d.file.bytes()),
            },
        }
    }

    fn nb(&self) -> usize {
        self.cols / gguf::QK_K
    }

    /// Rows `r0..r0 + nr` (at least one) as ggml's blocks, given to `use_blocks`: the
    /// file's rows before the tiles exist, else rebuilt into this thread's buffer, whole
    /// tiles' words sixteen by sixteen in registers. For what the tile kernels do not take:
    /// rows that do not start a tile, and dequantized rows (embedding lookups).
    fn with_blocks<R>(&self, r0: usize, nr: usize, use_blocks: impl FnOnce(&[F::Block]) -> R) -> R {
        thread_local! {
            static BLOCKS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let nb = self.nb();
        let row_bytes = nb * F::BLOCK;
        let words_at = 32 * F::HALVES.len();
        let tiles = match self.layout() {
            Layout::Tiles(tiles) => tiles,
            Layout::File(file) => {
                let rows = &file[r0 * row_bytes..(r0 + nr) * row_bytes];
                return use_blocks(F::view(rows).expect("k-quant blocks are viewed in place"));
            }
        };
        BLOCKS.with_borrow_mut(|buf| {
            if buf.len() < nr * row_bytes {
                buf.resize(nr * row_bytes, 0);
            }
            let out = &mut buf[..nr * row_bytes];
            for g in r0 / TILE_ROWS..(r0 + nr).div_ceil(TILE_ROWS) {
                let first = (g * TILE_ROWS).max(r0);
                let last = (g * TILE_ROWS + TILE_ROWS).min(r0 + nr);
                let rows = &mut out[(first - r0) * row_bytes..(last - r0) * row_bytes];
                for i in 0..nb {
                    let at = (g * nb + i) * tile_bytes::<F>();
                    let tile = &tiles[at..at + tile_bytes::<F>()];
                    let mut w0 = 0;
                    if last - first == TILE_ROWS && F::SLOTS_IN_ORDER {
                        while w0 + TILE_ROWS <= F::WORDS {
                            let to = i * F::BLOCK + F::WORDS_AT + 4 * w0;
                            // SAFETY: the matrix exists only where `applies` found the CPU's
                            // features.
                            unsafe {
                                kernel::untile_words(tile, F::HALVES.len(), w0, rows, row_bytes, to)
                            };
                            w0 += TILE_ROWS;
                        }
                    }
                    for (k, row) in rows.chunks_exact_mut(row_bytes).enumerate() {
                        let lane = (first + k) % TILE_ROWS;
                        let block = &mut row[i * F::BLOCK..(i + 1) * F::BLOCK];
                        for (h, &field) in F::HALVES.iter().enumerate() {
                            let from = 32 * h + 2 * lane;
                            block[field..field + 2].copy_from_slice(&tile[from..from + 2]);
                        }
                        for slot in w0..F::WORDS {
                            let from = words_at + 64 * slot + 4 * lane;
                            let to = F::WORDS_AT + 4 * F::word_in_slot(slot);
                            block[to..to + 4].copy_from_slice(&tile[from..from + 4]);
                        }
                    }
                }
            }
            use_blocks(F::view(out).expect("k-quant blocks are viewed in place"))
        })
    }

    /// Whether prefill-sized products run on AMX: the CPU has it and the tiles exist (a
    /// deferred repack's file rows run the tokens-in-lanes kernel). Once true, it stays.
    fn on_amx(&self) -> bool {
        cpu::has_amx() && matches!(self.layout(), Layout::Tiles(_))
    }

    /// The tiles of rows `r0..r0 + nr` where they are whole tiles.
    fn tiles_of(&self, r0: usize, nr: usize) -> Option<&[u8]> {
        if !r0.is_multiple_of(TILE_ROWS) || !nr.is_multiple_of(TILE_ROWS) {
            return None;
        }
        let group = self.nb() * tile_bytes::<F>();
        match self.layout() {
            Layout::Tiles(tiles) => {
                Some(&tiles[r0 / TILE_ROWS * group..(r0 + nr) / TILE_ROWS * group])
            }
            Layout::File(_) => None,
        }
    }

    /// The rows computed on their tiles, into `out`: at most [`ROWS_LANES_MAX`] tokens by
    /// the rows-in-lanes kernel, more by the tokens-in-lanes one where the format has it
    /// there; false (nothing done) where neither runs.
    fn on_tiles(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut Out<'_>) -> bool {
        let Some(tiles) = self.tiles_of(r0, nr) else {
            return false;
        };
        let nb = self.nb();
        if n <= ROWS_LANES_MAX {
            // SAFETY: the matrix exists only where `applies` found the CPU's features.
            unsafe { kernel::tile_rows(F::FORMAT, tiles, nb, acts.q8_k, n, out) };
            return true;
        }
        if !acts.q8_k_tiles.is_empty() {
            // SAFETY: the product asked for the AMX tiles only where the CPU has AMX
            // (`has_amx` asked the OS for the tile state), and the matrix exists only where
            // `applies` found the rest of the features.
            unsafe { k_quant_amx(F::FORMAT, tiles, nb, acts.q8_k, acts.q8_k_tiles, n, out) };
            return true;
        }
        if acts.q8_k_lanes.is_empty() || !F::wants_lanes(n) {
            return false;
        }
        // SAFETY: as above.
        unsafe {
            k_quant_lanes(
                F::FORMAT,
                Weights::Tiles(tiles),
                nb,
                acts.q8_k_lanes,
                n,
                out,
            )
        };
        true
    }
}

impl<F: Interleave> WeightRows for InterleavedMatrix<F> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn act_kind(&self) -> ActKind {
        ActKind::Q8K
    }

    fn wants_tile_scales(&self) -> bool {
        false
    }

    fn wants_q8_k_lanes(&self, n: usize) -> bool {
        n > ROWS_LANES_MAX && F::wants_lanes(n) && !self.on_amx()
    }

    fn wants_q8_k_tiles(&self, n: usize) -> bool {
        n > ROWS_LANES_MAX && self.on_amx()
    }

    fn prepares_rows(&self, n: usize) -> bool {
        n > ROWS_LANES_MAX && F::wants_lanes(n)
    }

    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        if self.on_tiles(r0, nr, acts, n, &mut Out::RowMajor { out: &mut *out, n }) {
            return;
        }
        let nb = self.nb();
        self.with_blocks(r0, nr, |w| {
            if !acts.q8_k_lanes.is_empty() && F::lanes_rows(w, nb, acts.q8_k_lanes, n, out, None) {
                return;
            }
            F::product(w, nb, acts, n, out);
        });
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
        if self.on_tiles(r0, nr, acts, n, &mut Out::TokenMajor { out: &mut *out, ld }) {
            return true;
        }
        if acts.q8_k_lanes.is_empty() {
            return false;
        }
        self.with_blocks(r0, nr, |w| {
            F::lanes_rows(w, self.nb(), acts.q8_k_lanes, n, out, Some(ld))
        })
    }
}

impl<F: Interleave> WeightMatrix for InterleavedMatrix<F> {
    fn ty(&self) -> GgmlType {
        self.ty
    }

    fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.with_blocks(r, 1, |w| F::dequantize(w, out));
    }

    fn is_mapped(&self) -> bool {
        false
    }
}
