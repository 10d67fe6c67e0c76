//! Causal attention's arithmetic, defined once ([`attend_rows_with`]) and compiled for each
//! instruction set from that one definition.
//!
//! # The arithmetic
//!
//! For one query head at sequence position `p`, seeing keys `from..=p` (`from` is 0, or
//! `p + 1 - window` on a sliding-window layer):
//!
//! 1. Keys are taken in blocks of [`KEY_BLOCK`] that start at multiples of it in absolute
//!    position; a block is cut to the visible keys.
//! 2. A key's score is `dot(q, k) * scale`: `dot = (p0 + p2) + (p1 + p3)`, `p_c` a chain of
//!    fused multiply-adds from 0 over the elements `d ≡ c (mod 4)` in order
//!    (`p_c = fma(q[d], k[d], p_c)`: four chains, so one query's products do not wait on one
//!    another); for an f16 cache the query is rounded to f16 first, as llama.cpp does.
//! 3. Per block: `m`, the block's largest score (NaN never counts). If `m` exceeds the running
//!    maximum `M`, the accumulator and the running sums are multiplied by `exp(M - m)` (unless
//!    nothing was seen yet) and `M = m`. Each key's weight is `w = exp(s - M)`; the running sum
//!    has 16 lanes, lane `i` adding the block's keys `i`, `16 + i`, `32 + i`, ... in that
//!    order (absent keys add nothing); the f32 accumulator takes `acc = fma(w, v, acc)` per key in position order.
//! 4. At the end: `L` = the sum lanes' tree ([`reduce16`]), `out = acc * (1 / L)` (0 if `L` is 0).
//!
//! `exp` is the C library's `expf`, on vector lanes where [`super::libm_expf`] proved it gives
//! the same bits. Every quantity depends only on the query, the keys, their absolute
//! positions and the window: not on how many rows or heads are computed together, how a
//! prompt was chunked, which instruction set runs, or prefill versus decode. That is the
//! chunk, batch and prefill/decode invariance the engine's tests assert; a query row is the
//! same whether computed alone, in a tile of 64, or on another machine's CPU.
//!
//! This is not llama.cpp's one-row kernel (an f16 accumulator rounded after every key and the
//! maximum rescaled key by key): that chain of dependent roundings cannot use a tile of query
//! rows, and an f32 accumulator is the more accurate of the two; its K·Q lane tree would cost
//! a transposition per key where a chain over the elements takes the keys as lanes. Agreement with llama.cpp is
//! held to the tolerances of `tests/llama_references.rs` and to `kvwarden eval`'s bar.
//!
//! # Speed
//!
//! A task is up to 64 query rows × the query heads of one KV head (`crate::attention` cuts
//! an item's rows into equal tasks, at least two per thread). Each block's K rows
//! are widened to f32 and transposed once for all of them (keys in lanes, so a score chain
//! runs 16 keys per instruction with no cross-lane reduction; the reuse a one-row kernel
//! lacks), V rows widened once, and the V updates run over every head of a row, so one V row
//! feeds several independent accumulator chains. The 256- and 512-bit builds are this
//! module's code compiled with those instruction sets (`x86.rs`); the 512-bit one does the
//! scores of up to four heads at once and the V updates with their accumulators in
//! registers, the same operations in the same order.
//!
//! A block-format cache (Q8_0, Q4_0) is widened to f32 with vector instructions (8 values
//! per product; K rows then transposed 16 × 16 in registers). On the default model (2-core
//! Zen 4) a 512-token prefill from an empty context ran at 986–1,006 tok/s with f16 K/V,
//! 901–904 with Q8_0 and 919–936 with Q4_0 (797 before the vector widening), and decode at
//! depth 4,096 at 36–38, 42–43 and 47–48 tok/s: fewer bytes per key outweigh the widening
//! once a step reads more K/V than weights.
//!
//! Where the time goes (December 2026, the same machine: 3.65 GHz, one 512-bit multiply-add
//! per cycle and core). Head size 256, four heads, 16 rows at 8,192 keys, one thread
//! (`kernels` bench, `attention`): 11.5–12 ns per head and key against 8.8 for the
//! multiply-adds alone. The scores run at 85% of that peak, the V updates at 94%; the
//! widening is 7% of the time and the softmax steps about 10% (the `exp` itself under 5%).
//! Gemma 3 at 30,000 tokens spent about 72% of its prefill in attention, at 62% of the
//! peak, with tasks of 16 rows; with tasks of up to 64, 71% at about 70% of the peak.
//! Rows per task: the bench at 30,000 keys ran 12.45 ns per head and key with
//! 16 rows, 11.5 with 32, 11.2 with 64 and 10.55 with 128 (each block widened for more rows,
//! from 8% of Gemma's prefill to 3%); serving Gemma at 30,000 tokens took 51–53 s to the
//! first token with equal tasks of up to 64 against 56–58 with a fixed 16, and 60–64 with
//! one task per thread (a short deep chunk then split a KV head's query heads instead).
//! Tried and dropped (the same bits, no faster): a block's steps phase by phase for all
//! rows, so each part of K and V stays in L1 while every row uses it (12.9 against 12.5 ns
//! per head and key at 30,000 keys); both groups of 16 keys per pass over the elements with
//! explicit query broadcasts (11.1 against 10.7 ns with 64 rows); one maximum reduction
//! instead of one per group (no change).
//! By head size (64 rows, four heads, 2,048 keys, one thread): 3.39 ns per head and key at
//! 64 (65% of its multiply-add floor: the softmax's work per key is the same at every head
//! size), 5.82 at 128 (76%), 11.12 at 256 (80%). A Llama-3.2-1B-shaped prefill of 500
//! tokens (head 64) spends 6.3% of its time here, so the weights' products decide it.

#[cfg(target_arch = "x86_64")]
use super::cpu::has_f16c;

/// Keys per block of the online softmax; blocks start at multiples of it in absolute position.
pub const KEY_BLOCK: usize = 32;
/// Lanes of the running sum of weights: a block's key `i` adds to lane `i % SUM_LANES`.
const SUM_LANES: usize = 16;
const _: () = assert!(KEY_BLOCK.is_multiple_of(SUM_LANES) && KEY_BLOCK <= 64);

/// Element types of the KV cache.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Values one element holds: a row of `hd` values is `hd / VALUES` elements.
    const VALUES: usize = 1;
    /// `out[i]` = `q[i]` as the product sees it (an f16 cache rounds it to f16).
    fn round_queries(q: &[f32], out: &mut [f32]);
    /// `dst[i] = src[i]` as f32 (exact).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// `kt[d * KEY_BLOCK + off + i] = rows[i][d]` as f32 for `d < hd` (exact): a block's K
    /// rows with the keys in lanes.
    fn widen_transposed(rows: &[&[Self]], hd: usize, off: usize, kt: &mut [f32]) {
        widen_transposed_rows(rows, hd, off, kt);
    }
}

/// [`KvElem::widen_transposed`] one row at a time.
fn widen_transposed_rows<T: KvElem>(rows: &[&[T]], hd: usize, off: usize, kt: &mut [f32]) {
    let mut row = vec![0f32; hd];
    for (i, r) in rows.iter().enumerate() {
        T::widen(&r[..hd / T::VALUES], &mut row);
        for (d, &x) in row.iter().enumerate() {
            kt[d * KEY_BLOCK + off + i] = x;
        }
    }
}

impl KvElem for f32 {
    fn round_queries(q: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&q[..out.len()]);
    }

    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(&src[..dst.len()]);
    }
}

/// Block-format rows (`kv::KvBlock`: Q8_0, Q4_0) are widened to their exact f32 values,
/// and the queries stay f32: from there on the arithmetic is the f32 cache's. `$simd` is
/// the 256-bit widening of whole blocks (the same exact products).
macro_rules! block_kv_elem {
    ($block:ty, $simd:ident) => {
        impl KvElem for $block {
            const VALUES: usize = <$block as kv::KvBlock>::VALUES;

            fn round_queries(q: &[f32], out: &mut [f32]) {
                out.copy_from_slice(&q[..out.len()]);
            }

            fn widen(src: &[$block], dst: &mut [f32]) {
                let mut done = 0;
                #[cfg(target_arch = "x86_64")]
                if super::cpu::features().avx2 {
                    // SAFETY: AVX2 is present (checked); the function stays within whole
                    // blocks of both slices.
                    done = unsafe { x86::$simd(src, dst) };
                }
                for (d, b) in dst[done..]
                    .chunks_exact_mut(Self::VALUES)
                    .zip(&src[done / Self::VALUES..])
                {
                    kv::KvBlock::dequantize(b, d);
                }
            }

            fn widen_transposed(rows: &[&[$block]], hd: usize, off: usize, kt: &mut [f32]) {
                widen_transposed_blocks(rows, hd, off, kt);
            }
        }
    };
}
block_kv_elem!(kv::Q8Block, widen_q8_0);
block_kv_elem!(kv::Q4Block, widen_q4_0);

/// [`KvElem::widen_transposed`] of block rows: each row widened, then transposed 16 × 16
/// in registers where the CPU has AVX-512 (exact either way).
fn widen_transposed_blocks<T: KvElem>(rows: &[&[T]], hd: usize, off: usize, kt: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::features().wide && hd.is_multiple_of(16) {
        thread_local! {
            // The widened rows: every value is written before it is read, so the buffer is
            // kept between calls (zeroing a fresh one was 2.6% of a prefill at depth).
            static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        WIDENED.with_borrow_mut(|flat| {
            if flat.len() < rows.len() * hd {
                flat.resize(rows.len() * hd, 0.0);
            }
            for (r, out) in rows.iter().zip(flat.chunks_exact_mut(hd)) {
                T::widen(&r[..hd / T::VALUES], out);
            }
            // SAFETY: AVX-512 F is present (checked); `hd` is a multiple of 16.
            unsafe { x86::widen_transposed_f32_512(flat, rows.len(), hd, off, kt) };
        });
        return;
    }
    widen_transposed_rows(rows, hd, off, kt);
}

impl KvElem for half::f16 {
    fn round_queries(q: &[f32], out: &mut [f32]) {
        let n = q.len().min(out.len());
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if has_f16c() {
            // SAFETY: AVX2, FMA and F16C are present (checked); the function stays within
            // the first `n` elements of both slices.
            done = unsafe { x86::round_f16_slice(&q[..n], &mut out[..n]) };
        }
        for (o, &x) in out[done..n].iter_mut().zip(&q[done..n]) {
            *o = half::f16::from_f32(x).to_f32();
        }
    }

    fn widen_transposed(rows: &[&[half::f16]], hd: usize, off: usize, kt: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::cpu::features().wide && hd.is_multiple_of(16) {
            // SAFETY: AVX-512 F with F16C is present (checked); `hd` is a multiple of 16.
            unsafe { x86::widen_transposed_f16_512(rows, hd, off, kt) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if has_f16c() && hd.is_multiple_of(8) {
            // SAFETY: AVX2, FMA and F16C are present (checked); `hd` is a multiple of 8.
            unsafe { x86::widen_transposed_f16_256(rows, hd, off, kt) };
            return;
        }
        widen_transposed_rows(rows, hd, off, kt);
    }

    fn widen(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if has_f16c() {
            // SAFETY: F16C is present (checked); the function stays within the first `n`
            // elements of both slices.
            done = unsafe { x86::widen_f16(&src[..n], &mut dst[..n]) };
        }
        for (d, s) in dst[done..n].iter_mut().zip(&src[done..n]) {
            *d = s.to_f32();
        }
    }
}

/// The rows one call attends: `q` holds `rows × heads` query heads of `hd` (row-major, row
/// `r` at position `first + r`), all reading one KV head.
#[derive(Clone, Copy, Debug)]
pub struct RowsShape {
    pub heads: usize,
    pub hd: usize,
    /// Position of the first query row.
    pub first: usize,
    /// Position of `k[0]` and `v[0]`.
    pub base: usize,
    pub scale: f32,
    /// Sliding window: the query at position `p` sees positions from `p + 1 - w` on.
    pub window: Option<usize>,
}

impl RowsShape {
    /// The first position the query at `p` sees.
    pub fn from(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }
}

/// One query row's heads against one block of keys: the inputs of [`Build::row_block`].
pub(crate) struct RowBlock<'a> {
    /// The row's query heads, `hd` each.
    pub q: &'a [f32],
    /// The block's K rows widened to f32 with the keys in lanes (element `d` of block offset
    /// `j` at `d * KEY_BLOCK + j`).
    pub kt: &'a [f32],
    /// The block's V rows widened to f32, `hd` each, block offset `j` at `j * hd`.
    pub vf: &'a [f32],
    pub hd: usize,
    /// The keys this row sees in the block, as block offsets.
    pub lo: usize,
    pub hi: usize,
    pub scale: f32,
}

/// The steps of the arithmetic a build may do with its own instructions, each giving the
/// bits of the portable code.
pub(crate) trait Build: Sized {
    /// Step 3 of the arithmetic for each of the row's heads: `max`, `sums` and `acc` (`hd`
    /// per head) carry the running state from block to block.
    #[inline(always)]
    fn row_block<const HD: usize>(
        b: RowBlock<'_>,
        max: &mut [f32],
        sums: &mut [[f32; SUM_LANES]],
        acc: &mut [f32],
    ) {
        row_block_with::<Self>(b, max, sums, acc);
    }

    /// `xs[i] = expf(xs[i])`, the C library's bits.
    fn exp(xs: &mut [f32]);
}

/// The definition, one step at a time.
pub(crate) struct Portable;

impl Build for Portable {
    #[inline(always)]
    fn exp(xs: &mut [f32]) {
        for x in xs {
            *x = x.exp();
        }
    }
}

/// Causal attention of the rows `shape` describes over `k[i]`, `v[i]` (position
/// `shape.base + i`; every position a row sees must be there), into `out` (laid out as `q`).
/// The arithmetic of the module's documentation, on the widest instruction set this CPU runs
/// (under `KVWARDEN_CPU`).
pub fn attend_rows<T: KvElem>(
    q: &[f32],
    shape: &RowsShape,
    k: &[&[T]],
    v: &[&[T]],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        let f = super::cpu::features();
        if f.wide {
            // SAFETY: AVX-512 F, BW, DQ and VL with AVX2, FMA and F16C are present (checked).
            unsafe {
                match shape.hd {
                    64 => x86::attend_rows_512::<T, 64>(q, shape, k, v, out),
                    128 => x86::attend_rows_512::<T, 128>(q, shape, k, v, out),
                    256 => x86::attend_rows_512::<T, 256>(q, shape, k, v, out),
                    _ => x86::attend_rows_512::<T, 0>(q, shape, k, v, out),
                }
            }
            return;
        }
        if f.avx2 {
            // SAFETY: AVX2, FMA and F16C are present (checked).
            unsafe {
                match shape.hd {
                    64 => x86::attend_rows_256::<T, 64>(q, shape, k, v, out),
                    128 => x86::attend_rows_256::<T, 128>(q, shape, k, v, out),
                    256 => x86::attend_rows_256::<T, 256>(q, shape, k, v, out),
                    _ => x86::attend_rows_256::<T, 0>(q, shape, k, v, out),
                }
            }
            return;
        }
    }
    attend_rows_portable(q, shape, k, v, out);
}

/// [`attend_rows`] in the portable build whatever the CPU: the reference the others are
/// tested against.
pub fn attend_rows_portable<T: KvElem>(
    q: &[f32],
    shape: &RowsShape,
    k: &[&[T]],
    v: &[&[T]],
    out: &mut [f32],
) {
    attend_rows_with::<T, Portable, 0>(q, shape, k, v, out);
}

/// The arithmetic of the module's documentation. `HD` is the head size where the build knows
/// it at compile time (0: `shape.hd`); `B` does the steps a build has instructions for.
#[inline(always)]
pub(crate) fn attend_rows_with<T: KvElem, B: Build, const HD: usize>(
    q: &[f32],
    shape: &RowsShape,
    k: &[&[T]],
    v: &[&[T]],
    out: &mut [f32],
) {
    let hd = if HD == 0 { shape.hd } else { HD };
    let heads = shape.heads;
    let width = heads * hd;
    if width == 0 {
        return;
    }
    let rows = q.len() / width;
    assert!(out.len() >= rows * width, "attention output too short");
    if rows == 0 {
        return;
    }
    let nq = rows * heads;
    let mut max = vec![f32::NEG_INFINITY; nq];
    let mut sums = vec![[0f32; SUM_LANES]; nq];
    let mut acc = vec![0f32; nq * hd];
    let mut kt = vec![0f32; KEY_BLOCK * hd];
    let mut vf = vec![0f32; KEY_BLOCK * hd];

    let keys_from = shape.from(shape.first);
    let keys_to = shape.first + rows;
    assert!(
        keys_from >= shape.base && keys_to - shape.base <= k.len().min(v.len()),
        "attention rows see positions the K/V view does not hold"
    );
    let first_block = keys_from - keys_from % KEY_BLOCK;
    for kb in (first_block..keys_to).step_by(KEY_BLOCK) {
        let (from, to) = (kb.max(keys_from), (kb + KEY_BLOCK).min(keys_to));
        // A long context's rows come from memory, a page's rows apart from the next page's,
        // where the hardware prefetcher does not run ahead: ask for the next block's.
        #[cfg(target_arch = "x86_64")]
        for j in (to..(to + KEY_BLOCK).min(keys_to)).map(|j| j - shape.base) {
            for row in [k[j], v[j]] {
                for line in (0..row.len()).step_by((64 / std::mem::size_of::<T>()).max(1)) {
                    // SAFETY: a prefetch reads nothing and cannot fault; the address lies in `row`.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                            row[line..].as_ptr() as *const i8,
                        )
                    };
                }
            }
        }
        T::widen_transposed(
            &k[from - shape.base..to - shape.base],
            hd,
            from - kb,
            &mut kt,
        );
        for j in from..to {
            let at = (j - kb) * hd;
            T::widen(&v[j - shape.base][..hd / T::VALUES], &mut vf[at..at + hd]);
        }
        for r in 0..rows {
            let p = shape.first + r;
            let lo = kb.max(shape.from(p));
            let hi = (kb + KEY_BLOCK).min(p + 1);
            if lo >= hi {
                continue;
            }
            let (lo, hi) = (lo - kb, hi - kb);
            let qs = r * heads;
            B::row_block::<HD>(
                RowBlock {
                    q: &q[r * width..][..width],
                    kt: &kt,
                    vf: &vf,
                    hd,
                    lo,
                    hi,
                    scale: shape.scale,
                },
                &mut max[qs..qs + heads],
                &mut sums[qs..qs + heads],
                &mut acc[r * width..][..width],
            );
        }
    }
    for (iq, o) in out[..rows * width].chunks_exact_mut(hd).enumerate() {
        let l = reduce16(&sums[iq]);
        let inv = if l == 0.0 { 0.0 } else { 1.0 / l };
        for (o, &a) in o.iter_mut().zip(&acc[iq * hd..][..hd]) {
            *o = a * inv;
        }
    }
}

/// [`Build::row_block`] as the definition states it.
#[inline(always)]
pub(crate) fn row_block_with<B: Build>(
    b: RowBlock<'_>,
    max: &mut [f32],
    sums: &mut [[f32; SUM_LANES]],
    acc: &mut [f32],
) {
    let RowBlock {
        q,
        kt,
        vf,
        hd,
        lo,
        hi,
        scale,
    } = b;
    let heads = max.len();
    let mut weights = [[0f32; KEY_BLOCK]; MAX_ROW_HEADS];
    let mut live = [false; MAX_ROW_HEADS];
    for h0 in (0..heads).step_by(MAX_ROW_HEADS) {
        let n = (heads - h0).min(MAX_ROW_HEADS);
        for i in 0..n {
            let h = h0 + i;
            let s = block_scores(&q[h * hd..][..hd], kt, hd, lo, hi, scale);
            let m = s[lo..hi]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
            if m > max[h] {
                if max[h] != f32::NEG_INFINITY {
                    let a = (max[h] - m).exp();
                    for x in &mut acc[h * hd..][..hd] {
                        *x *= a;
                    }
                    for x in &mut sums[h] {
                        *x *= a;
                    }
                }
                max[h] = m;
            }
            live[i] = max[h] != f32::NEG_INFINITY;
            if !live[i] {
                continue;
            }
            let w = &mut weights[i];
            *w = [0.0; KEY_BLOCK];
            for j in lo..hi {
                w[j] = s[j] - max[h];
            }
            B::exp(&mut w[lo..hi]);
            let sum = &mut sums[h];
            for g in w.chunks_exact(SUM_LANES) {
                for (x, &wg) in sum.iter_mut().zip(g) {
                    *x += wg;
                }
            }
        }
        for j in lo..hi {
            let vr = &vf[j * hd..][..hd];
            for i in 0..n {
                if !live[i] {
                    continue;
                }
                let w = weights[i][j];
                for (a, &x) in acc[(h0 + i) * hd..][..hd].iter_mut().zip(vr) {
                    *a = w.mul_add(x, *a);
                }
            }
        }
    }
}

/// Heads of a row whose weights are held at once by [`row_block_with`].
const MAX_ROW_HEADS: usize = 8;

/// `dot(q, k_j) * scale` for the block's keys `lo..hi` (`kt`: the block's K rows, keys in
/// lanes), `-inf` for the rest.
#[inline(always)]
pub(crate) fn block_scores(
    q: &[f32],
    kt: &[f32],
    hd: usize,
    lo: usize,
    hi: usize,
    scale: f32,
) -> [f32; KEY_BLOCK] {
    let mut p = [[0f32; KEY_BLOCK]; 4];
    for (d, &qd) in q[..hd].iter().enumerate() {
        let keys = &kt[d * KEY_BLOCK..(d + 1) * KEY_BLOCK];
        for (s, &k) in p[d % 4].iter_mut().zip(keys) {
            *s = qd.mul_add(k, *s);
        }
    }
    let mut s = [f32::NEG_INFINITY; KEY_BLOCK];
    for j in lo..hi {
        s[j] = ((p[0][j] + p[2][j]) + (p[1][j] + p[3][j])) * scale;
    }
    s
}

/// The tree of the running sum's lanes (`_mm512_reduce_add_ps`'s): halves, then quarters,
/// then pairs.
pub(super) fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t3 = [0f32; 8];
    for i in 0..8 {
        t3[i] = v[8 + i] + v[i];
    }
    let t6 = [t3[4] + t3[0], t3[5] + t3[1], t3[6] + t3[2], t3[7] + t3[3]];
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86;
