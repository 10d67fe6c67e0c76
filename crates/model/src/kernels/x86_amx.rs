//! Q4_K and Q6_K prefill products on AMX tiles (`tdpbssd`: a 16 × 64 tile of signed bytes
//! times a 64 × 16 one, into 16 × 16 exact `i32` sums), for CPUs with AMX-INT8 whose OS
//! lets the process use the tile state ([`usable`]).
//!
//! The arithmetic is the formats' definition (`Q4K::dot_scalar`, `Q6K::dot_scalar`): per
//! super-block an exact integer `S` (and Q4_K's `M`), then one float chain per output. A
//! tile product sums 64 weights per output, across a format's sub-blocks, so each weight is
//! first multiplied by its sub-block's scale; the product no longer fits a byte, so it is
//! split in two byte-sized parts whose exact sums are joined after the tile products:
//!
//! - Q4_K: `sc = 8·sh + sl` (`sh`, `sl` ≤ 7), so `sc·q = 8·(sh·q) + sl·q`, both parts at
//!   most 105, formed in place in 16-bit lanes (each lane's two bytes belong to one row, so
//!   one `vpmullw` scales both without a carry between them). `M = Σ_j m_j Σ a` is a third
//!   product, against each row's mins spread over their sub-blocks.
//! - Q6_K: `w = sc·(q − 32)` (at most 4,096 in size) as `128·hi + lo`, `hi = w >> 7`
//!   (−32..31), `lo = w & 127`, formed in 16-bit lanes.
//!
//! Every sum stays far inside `i32` (at most about 1.4·10^7 before the join), so `S` and
//! `M` are the definition's integers and the float part is the same chain
//! (`acc = fma(d_a·d_w, S, acc)`, then Q4_K's `fma(−d_a·dmin_w, M, acc)`): the bits of
//! every other path, as `quant/tests.rs` checks.
//!
//! A call takes the repacked tiles of sixteen rows (`quant/interleaved.rs`) against up to a
//! task's tokens: each super-block of a tile is expanded once into the tile-product layout
//! (8 KiB, in L1) and serves every pair of sixteen-token groups, whose activations the
//! product laid out once as tiles (`blocks::TilesQ8K`).

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::tile_out::Out;
use super::x86_512_lanes::Format;
use super::x86_512_rows_lanes::{halves, q4_k_scale_words, q6_k_values, word, TILE_ROWS};
use crate::blocks::{BlockQ8K, TilesQ8K};

/// Tokens per tile product (a tile's rows).
const TOKENS: usize = 16;
/// Bytes of a 16-row × 64-byte tile.
const TILE_BYTES: usize = 1024;
/// Weights of a super-block per tile product: the products' depth.
const DEPTH: usize = 64;
/// Tile products per super-block.
const STEPS: usize = gguf::QK_K / DEPTH;
/// Tile parts per step: the scaled weights' high and low parts.
const PARTS: usize = 2;
/// Row tiles whose super-block is expanded at once, so that each pair of token groups'
/// activation tiles, read from L2, serves them all from L1 (the driver's row blocks are
/// 64 rows). With one row tile at a time the activations' loads from L2 were the largest
/// share of the kernel.
const ROW_TILES: usize = 4;

/// Whether this CPU has AMX-INT8 (CPUID leaf 7: AMX-TILE, AMX-INT8) and Linux granted the
/// process the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once). Without the
/// grant the first tile instruction would fault, so a refusal means the AVX-512 kernels.
pub(crate) fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        // SAFETY: CPUID leaves 0 and 7 exist on every x86-64 CPU (leaf 7 is read only
        // where leaf 0 says it exists).
        #[allow(unused_unsafe)]
        let (max, leaf7) = unsafe { (__cpuid(0).eax, __cpuid_count(7, 0)) };
        let tile = max >= 7 && leaf7.edx & (1 << 24) != 0;
        let int8 = max >= 7 && leaf7.edx & (1 << 25) != 0;
        tile && int8 && request_tile_state()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: `arch_prctl` with this request only changes which state components the
    // process may use; it reads and writes no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// The tile configuration every call loads: palette 1, tiles 0..8 of 16 rows × 64 bytes.
/// Tiles 0..4 accumulate two token groups' two parts, 4 and 5 hold the groups'
/// activations, 6 and 7 the weights' parts.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    TileConfig(c)
};

/// One super-block of a tile of sixteen rows in the tile-product layout:
/// `[step][part][k / 4][4 · row + k % 4]` for weight `64 · step + k` of each row.
#[repr(C, align(64))]
struct Expanded {
    lines: [[[u8; TILE_BYTES]; PARTS]; STEPS],
}

/// Two token groups' accumulator tiles as stored: `[group][part][token][row]`.
#[repr(C, align(64))]
struct Sums([[[[i32; TILE_ROWS]; TOKENS]; PARTS]; 2]);

/// A super-block's factors for sixteen rows: `d_w`, and for Q4_K `−dmin_w` and the mins in
/// pairs (`m_2p | m_2p+1 << 16`, against the activations' sub-block sums in pairs).
struct Factors {
    d: __m512,
    neg_dmin: __m512,
    m_pairs: [__m512i; 4],
}

impl Factors {
    /// For row tiles a call does not have.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn none() -> Factors {
        Factors {
            d: _mm512_setzero_ps(),
            neg_dmin: _mm512_setzero_ps(),
            m_pairs: [_mm512_setzero_si512(); 4],
        }
    }
}

/// Every whole tile of sixteen rows of `tiles` (`format`, `nb` super-blocks a row,
/// `[group * nb + i]`) against the `n` tokens of `x` (`nb` blocks each, token-major; the
/// same quants as `a_tiles`, `[token group * nb + i]`), into `out` (rows numbered from the
/// first tile's first).
///
/// # Safety
/// [`usable`] must be true and the CPU must support the features
/// `super::cpu::wide_available` checks. Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn k_quant_amx(
    format: Format,
    tiles: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    a_tiles: &[TilesQ8K],
    n: usize,
    out: &mut Out<'_>,
) {
    let token_groups = n.div_ceil(TOKENS);
    assert!(x.len() >= n * nb, "k_quant_amx: activations too short");
    assert!(
        a_tiles.len() >= token_groups * nb,
        "k_quant_amx: activation tiles too short"
    );
    SCRATCH.with_borrow_mut(|scratch| {
        let scratch = scratch.get_or_insert_with(|| {
            Box::new(Scratch {
                expanded: [const {
                    Expanded {
                        lines: [[[0; TILE_BYTES]; PARTS]; STEPS],
                    }
                }; ROW_TILES],
                sums: [const { Sums([[[[0; TILE_ROWS]; TOKENS]; PARTS]; 2]) }; 2],
                acc: Vec::new(),
            })
        });
        let groups = (tiles.len() / (nb * format.tile_bytes())).min(ROW_TILES);
        scratch
            .acc
            .resize(groups * token_groups * TOKENS, _mm512_setzero_ps());
        // SAFETY: as this function's.
        unsafe { tiles_against_tokens(format, tiles, nb, x, a_tiles, n, out, scratch) };
    });
}

/// A thread's buffers for [`k_quant_amx`], kept between calls: written through before
/// they are read, they need no zeroing (which showed as 2-4% of a prefill when allocated
/// per call).
struct Scratch {
    expanded: [Expanded; ROW_TILES],
    sums: [Sums; 2],
    acc: Vec<__m512>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Option<Box<Scratch>>> = const { std::cell::RefCell::new(None) };
}

/// [`k_quant_amx`] with this thread's buffers.
///
/// # Safety
/// As [`k_quant_amx`]'s.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tiles_against_tokens(
    format: Format,
    tiles: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    a_tiles: &[TilesQ8K],
    n: usize,
    out: &mut Out<'_>,
    scratch: &mut Scratch,
) {
    let tile_bytes = format.tile_bytes();
    let groups = tiles.len() / (nb * tile_bytes);
    let token_groups = n.div_ceil(TOKENS);
    let per_group = token_groups * TOKENS;
    let Scratch {
        expanded,
        sums,
        acc,
    } = scratch;
    // SAFETY: `CONFIG` is a valid palette-1 configuration (64 bytes, aligned); loading it
    // sets this thread's tile shapes and zeroes the tiles.
    unsafe { asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) };
    for g0 in (0..groups).step_by(ROW_TILES) {
        let gs = ROW_TILES.min(groups - g0);
        acc.fill(_mm512_setzero_ps());
        for i in 0..nb {
            let f: [Factors; ROW_TILES] = std::array::from_fn(|g| {
                if g >= gs {
                    return Factors::none();
                }
                let tile = &tiles[((g0 + g) * nb + i) * tile_bytes..][..tile_bytes];
                match format {
                    Format::Q4K => expand_q4_k(tile, &mut expanded[g]),
                    Format::Q6K => expand_q6_k(tile, &mut expanded[g]),
                }
            });
            // Each pair of token groups meets the row tiles in turn, its activation tiles
            // read from L2 once and from L1 for the others. Each product is issued before
            // the previous one's sums are taken into the float chains (the sums
            // double-buffered).
            let mut pending: Option<(usize, bool, usize, usize)> = None;
            let mut buffer = 0;
            let units = token_groups.div_ceil(2) * gs;
            for unit in 0..=units {
                let issued = (unit < units).then(|| {
                    let (tg, g) = (unit / gs * 2, unit % gs);
                    let pair = tg + 1 < token_groups;
                    let a = [
                        &a_tiles[tg * nb + i],
                        &a_tiles[(tg + usize::from(pair)) * nb + i],
                    ];
                    buffer ^= 1;
                    products(pair, a, &expanded[g], &mut sums[buffer]);
                    (tg, pair, g, buffer)
                });
                if let Some((tg, pair, g, buffer)) = pending {
                    for k in 0..1 + usize::from(pair) {
                        let first = (tg + k) * TOKENS;
                        let chains = Chains {
                            format,
                            f: &f[g],
                            sums: &sums[buffer].0[k],
                            x: &x[first * nb + i..],
                            nb,
                            sum_pairs: &a_tiles[(tg + k) * nb + i].sum_pairs,
                        };
                        let acc = &mut acc[g * per_group..][first..first + TOKENS.min(n - first)];
                        chains.add(acc);
                    }
                }
                pending = issued;
            }
        }
        for g in 0..gs {
            for (t, &v) in acc[g * per_group..].iter().take(n).enumerate() {
                out.put_16_rows_of_token((g0 + g) * TILE_ROWS, t, v);
            }
        }
    }
    // The streaming stores above are ordered before whatever this thread does next (the
    // product's join, after which other threads read the output).
    _mm_sfence();
    // SAFETY: no tile is live past this point; releasing returns the thread to the state
    // without tile data.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// One token group's super-block sums, taken into its tokens' float chains.
struct Chains<'a> {
    format: Format,
    f: &'a Factors,
    /// `[part][token][row]`.
    sums: &'a [[[i32; TILE_ROWS]; TOKENS]; PARTS],
    /// The group's first token's block of this super-block; token `t`'s is `x[t * nb]`.
    x: &'a [BlockQ8K],
    nb: usize,
    sum_pairs: &'a [[i32; 4]; TOKENS],
}

impl Chains<'_> {
    /// `acc[t] = fma(d_a·d_w, S, acc[t])`, then Q4_K's `fma(−d_a·dmin_w, M, acc[t])`, for
    /// the group's tokens in `acc`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn add(&self, acc: &mut [__m512]) {
        let f = self.f;
        for (t, acc) in acc.iter_mut().enumerate() {
            let ab = &self.x[t * self.nb];
            // SAFETY: each row of `sums` is 16 aligned `i32`.
            let part = |p: usize| unsafe { _mm512_load_si512(self.sums[p][t].as_ptr().cast()) };
            let s = match self.format {
                Format::Q4K => _mm512_add_epi32(_mm512_slli_epi32::<3>(part(0)), part(1)),
                Format::Q6K => _mm512_add_epi32(_mm512_slli_epi32::<7>(part(0)), part(1)),
            };
            let d_a = _mm512_set1_ps(ab.d);
            *acc = _mm512_fmadd_ps(_mm512_mul_ps(d_a, f.d), _mm512_cvtepi32_ps(s), *acc);
            if self.format == Format::Q4K {
                let mut mins = _mm512_setzero_si512();
                for (&m, &a) in f.m_pairs.iter().zip(&self.sum_pairs[t]) {
                    mins = _mm512_dpwssd_epi32(mins, m, _mm512_set1_epi32(a));
                }
                let dmin = _mm512_mul_ps(d_a, f.neg_dmin);
                *acc = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(mins), *acc);
            }
        }
    }
}

/// One super-block's tile products for one or (`pair`) two groups of sixteen tokens
/// against `w`, stored into `sums[k]`. The caller has loaded [`CONFIG`] on this thread;
/// every operand is a reference to the layout the offsets below name.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn products(pair: bool, a: [&TilesQ8K; 2], w: &Expanded, sums: &mut Sums) {
    let a = a.map(|a| a.q.as_ptr().cast::<u8>());
    let b = w.lines.as_ptr().cast::<u8>();
    let c = sums.0.as_mut_ptr().cast::<u8>();
    // Tiles 0 and 1 take group 0's high and low parts, 2 and 3 group 1's; 4 and 5 the
    // groups' activations, 6 and 7 the weights' parts. Steps are 1 KiB apart in `a` and
    // 2 KiB in `expanded`; every tile's rows are 64 bytes apart.
    macro_rules! step {
        ($a:literal, $b:literal, $b1:literal) => {
            concat!(
                "tileloadd tmm6, [{b} + {s64}*1 + ",
                $b,
                "]\n",
                "tileloadd tmm4, [{a0} + {s64}*1 + ",
                $a,
                "]\n",
                "tileloadd tmm7, [{b} + {s64}*1 + ",
                $b1,
                "]\n",
                "tdpbssd tmm0, tmm4, tmm6\n",
                "tileloadd tmm5, [{a1} + {s64}*1 + ",
                $a,
                "]\n",
                "tdpbssd tmm1, tmm4, tmm7\n",
                "tdpbssd tmm2, tmm5, tmm6\n",
                "tdpbssd tmm3, tmm5, tmm7\n",
            )
        };
    }
    macro_rules! step1 {
        ($a:literal, $b:literal, $b1:literal) => {
            concat!(
                "tileloadd tmm6, [{b} + {s64}*1 + ",
                $b,
                "]\n",
                "tileloadd tmm4, [{a0} + {s64}*1 + ",
                $a,
                "]\n",
                "tileloadd tmm7, [{b} + {s64}*1 + ",
                $b1,
                "]\n",
                "tdpbssd tmm0, tmm4, tmm6\n",
                "tdpbssd tmm1, tmm4, tmm7\n",
            )
        };
    }
    if pair {
        // SAFETY: the caller loaded the tile configuration on this thread; the loads read
        // inside the two `TilesQ8K` (4 KiB of quants each) and `Expanded` (8 KiB), the
        // stores write inside `Sums` (8 KiB).
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                step!("0", "0", "1024"),
                step!("1024", "2048", "3072"),
                step!("2048", "4096", "5120"),
                step!("3072", "6144", "7168"),
                "tilestored [{c} + {s64}*1], tmm0",
                "tilestored [{c} + {s64}*1 + 1024], tmm1",
                "tilestored [{c} + {s64}*1 + 2048], tmm2",
                "tilestored [{c} + {s64}*1 + 3072], tmm3",
                a0 = in(reg) a[0],
                a1 = in(reg) a[1],
                b = in(reg) b,
                c = in(reg) c,
                s64 = in(reg) 64usize,
                options(nostack, preserves_flags),
            )
        }
    } else {
        // SAFETY: as above, one group.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                step1!("0", "0", "1024"),
                step1!("1024", "2048", "3072"),
                step1!("2048", "4096", "5120"),
                step1!("3072", "6144", "7168"),
                "tilestored [{c} + {s64}*1], tmm0",
                "tilestored [{c} + {s64}*1 + 1024], tmm1",
                a0 = in(reg) a[0],
                b = in(reg) b,
                c = in(reg) c,
                s64 = in(reg) 64usize,
                options(nostack, preserves_flags),
            )
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn store(dst: &mut [u8; TILE_BYTES], k4: usize, v: __m512i) {
    let line = &mut dst[64 * k4..64 * k4 + 64];
    // SAFETY: `line` is 64 writable bytes (sliced above); the store is unaligned.
    unsafe { _mm512_storeu_si512(line.as_mut_ptr().cast(), v) }
}

/// Byte `b` of every `i32` lane, as the lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn byte_lane(v: __m512i, b: usize) -> __m512i {
    let shifted = _mm512_srlv_epi32(v, _mm512_set1_epi32(8 * b as i32));
    _mm512_and_si512(shifted, _mm512_set1_epi32(0xff))
}

/// A 16-bit value per lane (low half) in both halves of the lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn both_halves(v: __m512i) -> __m512i {
    let low = _mm512_and_si512(v, _mm512_set1_epi32(0xffff));
    _mm512_or_si512(low, _mm512_slli_epi32::<16>(low))
}

/// A Q4_K super-block of sixteen rows (a tile's) expanded, with its factors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn expand_q4_k(tile: &[u8], e: &mut Expanded) -> Factors {
    let nibble = _mm512_set1_epi8(0x0f);
    let (a, b, c) = (
        word(tile, 2, 0, false),
        word(tile, 2, 1, false),
        word(tile, 2, 2, false),
    );
    let [sc_lo, sc_hi, m_lo, m_hi] = q4_k_scale_words(a, b, c);
    let sub = |lo: __m512i, hi: __m512i, j: usize| byte_lane(if j < 4 { lo } else { hi }, j % 4);
    for step in 0..STEPS {
        let [hi_part, lo_part] = &mut e.lines[step];
        // Sub-blocks 2·step (the low nibbles, rows k/4 0..8) and 2·step + 1 (high, 8..16).
        for (half, j) in [2 * step, 2 * step + 1].into_iter().enumerate() {
            let sc = sub(sc_lo, sc_hi, j);
            let sh = both_halves(_mm512_srli_epi32::<3>(sc));
            let sl = both_halves(_mm512_and_si512(sc, _mm512_set1_epi32(7)));
            for u in 0..8 {
                let w = word(tile, 2, 3 + 8 * step + u, false);
                let q = if half == 0 {
                    _mm512_and_si512(w, nibble)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibble)
                };
                store(hi_part, 8 * half + u, _mm512_mullo_epi16(q, sh));
                store(lo_part, 8 * half + u, _mm512_mullo_epi16(q, sl));
            }
        }
    }
    let m_pairs = std::array::from_fn(|p| {
        let (m0, m1) = (sub(m_lo, m_hi, 2 * p), sub(m_lo, m_hi, 2 * p + 1));
        _mm512_or_si512(m0, _mm512_slli_epi32::<16>(m1))
    });
    Factors {
        d: halves(tile, 0),
        neg_dmin: _mm512_sub_ps(_mm512_setzero_ps(), halves(tile, 1)),
        m_pairs,
    }
}

/// A Q6_K super-block of sixteen rows (a tile's) expanded, with its factor `d_w`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn expand_q6_k(tile: &[u8], e: &mut Expanded) -> Factors {
    let low_byte = _mm512_set1_epi16(0xff);
    let low7s = _mm512_set1_epi8(0x7f);
    for half in 0..2 {
        for upper in 0..2 {
            // The group scales of this pass, k = 0..4 (group 8·half + 2k + upper): each
            // row's signed byte in the even bytes of its lane and in the odd ones (for
            // `maddubs`, which multiplies each byte of a pair and adds them), and `32·sc`
            // in both halves (the weights' offset).
            let sc: [[__m512i; 3]; 4] = std::array::from_fn(|k| {
                let group = 8 * half + 2 * k + upper;
                let scales = word(tile, 1, 48 + group / 4, false);
                let up = _mm512_set1_epi32(24 - 8 * (group % 4) as i32);
                let sc32 = _mm512_srai_epi32::<24>(_mm512_sllv_epi32(scales, up));
                let even = both_halves(_mm512_and_si512(sc32, _mm512_set1_epi32(0xff)));
                [
                    even,
                    _mm512_slli_epi32::<8>(even),
                    both_halves(_mm512_slli_epi32::<5>(sc32)),
                ]
            });
            for q in 4 * upper..4 * upper + 4 {
                let slot = 12 * (2 * half + upper) + 3 * (q - 4 * upper);
                let ql0 = word(tile, 1, slot, false);
                let ql1 = word(tile, 1, slot + 1, false);
                let h = word(tile, 1, slot + 2, false);
                let v = q6_k_values(ql0, ql1, h);
                for (k, &v) in v.iter().enumerate() {
                    // `sc·(q − 32)` of the even bytes and of the odd ones, as 16-bit lanes
                    // (at most 4,096 in size).
                    let [sc_even, sc_odd, sc32] = sc[k];
                    let w_even = _mm512_sub_epi16(_mm512_maddubs_epi16(v, sc_even), sc32);
                    let w_odd = _mm512_sub_epi16(_mm512_maddubs_epi16(v, sc_odd), sc32);
                    // Each lane's even value in its low byte, the odd one in its high byte:
                    // `(a & 0xff) | (b << 8)` (ternary-logic table 0xD8: where the third
                    // operand, the low byte's mask, has a bit, the second's, else the first's).
                    let join = |a: __m512i, b: __m512i| {
                        _mm512_ternarylogic_epi32::<0xD8>(_mm512_slli_epi16::<8>(b), a, low_byte)
                    };
                    let hi = join(
                        _mm512_srai_epi16::<7>(w_even),
                        _mm512_srai_epi16::<7>(w_odd),
                    );
                    let lo = _mm512_and_si512(join(w_even, w_odd), low7s);
                    // Weight 64·step + 4·k4 + (0..4): step = 2·half + k/2, k4 = 8(k%2) + q.
                    let (step, k4) = (2 * half + k / 2, 8 * (k % 2) + q);
                    let [hi_part, lo_part] = &mut e.lines[step];
                    store(hi_part, k4, hi);
                    store(lo_part, k4, lo);
                }
            }
        }
    }
    Factors {
        d: halves(tile, 0),
        neg_dmin: _mm512_setzero_ps(),
        m_pairs: [_mm512_setzero_si512(); 4],
    }
}
