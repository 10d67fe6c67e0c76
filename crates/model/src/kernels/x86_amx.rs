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
//! (12 KiB, in L1) and serves every group of sixteen tokens, whose activations are loaded
//! as tiles straight from the Q8_K blocks (a last partial group from a zero-padded copy).

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::tile_out::Out;
use super::x86_512_lanes::Format;
use super::x86_512_rows_lanes::TILE_ROWS;
use crate::blocks::BlockQ8K;

/// Tokens per tile product (a tile's rows).
const TOKENS: usize = 16;
/// Bytes of a 16-row × 64-byte tile.
const TILE_BYTES: usize = 1024;
/// Weights of a super-block per tile product: the products' depth.
const DEPTH: usize = 64;
/// Tile products per super-block.
const STEPS: usize = gguf::QK_K / DEPTH;
/// Tile parts per step: Q4_K's scaled high and low parts and its mins; Q6_K uses two.
const PARTS: usize = 3;

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
/// Tiles 0..3 accumulate the parts, 3 holds the activations, 4..7 the weight parts.
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

/// The three accumulator tiles as stored: `[part][token][row]`.
#[repr(C, align(64))]
struct Sums([[[i32; TILE_ROWS]; TOKENS]; PARTS]);

/// Every whole tile of sixteen rows of `tiles` (`format`, `nb` super-blocks a row,
/// `[group * nb + i]`) against the `n` tokens of `x` (`nb` blocks each, token-major), into
/// `out` (rows numbered from the first tile's first).
///
/// # Safety
/// [`usable`] must be true and the CPU must support the features
/// `super::cpu::wide_available` checks. Slices are bounds-checked before any tile load.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn k_quant_amx(
    format: Format,
    tiles: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    out: &mut Out<'_>,
) {
    let tile_bytes = format.tile_bytes();
    let groups = tiles.len() / (nb * tile_bytes);
    assert!(x.len() >= n * nb, "k_quant_amx: activations too short");
    let qs_at = std::mem::offset_of!(BlockQ8K, qs);
    let stride = nb * size_of::<BlockQ8K>();
    let whole = n / TOKENS;
    // The last partial group's quants, zero-padded to a whole tile: `[token][i * 256 + k]`.
    let rest = n % TOKENS;
    let mut padded = vec![
        0i8;
        if rest > 0 {
            TOKENS * nb * gguf::QK_K
        } else {
            0
        }
    ];
    for t in 0..rest {
        for i in 0..nb {
            let row = &mut padded[(t * nb + i) * gguf::QK_K..][..gguf::QK_K];
            row.copy_from_slice(&x[(whole * TOKENS + t) * nb + i].qs);
        }
    }
    let token_groups = n.div_ceil(TOKENS);
    let mut acc = vec![_mm512_setzero_ps(); token_groups * TOKENS];
    let mut expanded = Box::new(Expanded {
        lines: [[[0; TILE_BYTES]; PARTS]; STEPS],
    });
    let mut sums = Box::new(Sums([[[0; TILE_ROWS]; TOKENS]; PARTS]));
    // SAFETY: `CONFIG` is a valid palette-1 configuration (64 bytes, aligned); loading it
    // sets this thread's tile shapes and zeroes the tiles.
    unsafe { asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) };
    for g in 0..groups {
        acc.fill(_mm512_setzero_ps());
        for i in 0..nb {
            let tile = &tiles[(g * nb + i) * tile_bytes..][..tile_bytes];
            let (d_w, neg_dmin_w) = match format {
                Format::Q4K => expand_q4_k(tile, &mut expanded),
                Format::Q6K => (expand_q6_k(tile, &mut expanded), _mm512_setzero_ps()),
            };
            for tg in 0..token_groups {
                let (a, a_stride) = if tg < whole {
                    let block = &x[tg * TOKENS * nb + i];
                    // The group's last row ends inside `x`: checked by the assert above.
                    (
                        std::ptr::from_ref(block).cast::<u8>().wrapping_add(qs_at),
                        stride,
                    )
                } else {
                    (
                        padded[i * gguf::QK_K..].as_ptr().cast::<u8>(),
                        nb * gguf::QK_K,
                    )
                };
                // SAFETY: the tile loads read rows `a + r * a_stride .. + 256` for r < 16,
                // all inside `x`'s blocks `(16 tg + r) * nb + i` (whole groups end at or
                // before token `n`) or inside `padded`; `expanded` and `sums` are the
                // layouts the offsets name.
                unsafe { products(format, a, a_stride, &expanded, &mut sums) };
                let first = tg * TOKENS;
                for t in 0..TOKENS.min(n - first) {
                    let ab = &x[(first + t) * nb + i];
                    let acc = &mut acc[first + t];
                    // SAFETY: each row of `sums` is 16 aligned `i32`.
                    let part =
                        |p: usize| unsafe { _mm512_load_si512(sums.0[p][t].as_ptr().cast()) };
                    let s = match format {
                        Format::Q4K => _mm512_add_epi32(_mm512_slli_epi32::<3>(part(0)), part(1)),
                        Format::Q6K => _mm512_add_epi32(_mm512_slli_epi32::<7>(part(0)), part(1)),
                    };
                    let d = _mm512_mul_ps(_mm512_set1_ps(ab.d), d_w);
                    *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), *acc);
                    if format == Format::Q4K {
                        let dmin = _mm512_mul_ps(_mm512_set1_ps(ab.d), neg_dmin_w);
                        *acc = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(part(2)), *acc);
                    }
                }
            }
        }
        for (t, &v) in acc.iter().take(n).enumerate() {
            let mut vals = [0f32; TILE_ROWS];
            // SAFETY: `vals` is 16 writable f32; the store is unaligned.
            unsafe { _mm512_storeu_ps(vals.as_mut_ptr(), v) };
            out.put_rows_of_token(g * TILE_ROWS, t, &vals);
        }
    }
    // SAFETY: no tile is live past this point; releasing returns the thread to the state
    // without tile data.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// One super-block's tile products for sixteen tokens (rows `a + r * a_stride`, 256 bytes
/// each) against `expanded`, stored into `sums`.
///
/// # Safety
/// The tile configuration [`CONFIG`] must be loaded on this thread, and the sixteen rows of
/// 256 bytes at `a` readable.
#[inline]
unsafe fn products(format: Format, a: *const u8, a_stride: usize, w: &Expanded, sums: &mut Sums) {
    let b = w.lines.as_ptr().cast::<u8>();
    let c = sums.0.as_mut_ptr().cast::<u8>();
    // Tile 0 and 1 take the high and low parts, 2 the mins (Q4_K); 3 the activations, 4..7
    // the weights. Steps are 64 weights apart in `a`, 3 KiB apart in `expanded`.
    macro_rules! step {
        ($a:literal, $b:literal, $b1:literal, $b2:literal) => {
            concat!(
                "tileloadd tmm3, [{a} + {stride}*1 + ",
                $a,
                "]\n",
                "tileloadd tmm4, [{b} + {s64}*1 + ",
                $b,
                "]\n",
                "tileloadd tmm5, [{b} + {s64}*1 + ",
                $b1,
                "]\n",
                "tdpbssd tmm0, tmm3, tmm4\n",
                "tdpbssd tmm1, tmm3, tmm5\n",
                "tileloadd tmm6, [{b} + {s64}*1 + ",
                $b2,
                "]\n",
                "tdpbssd tmm2, tmm3, tmm6\n",
            )
        };
    }
    macro_rules! step2 {
        ($a:literal, $b:literal, $b1:literal) => {
            concat!(
                "tileloadd tmm3, [{a} + {stride}*1 + ",
                $a,
                "]\n",
                "tileloadd tmm4, [{b} + {s64}*1 + ",
                $b,
                "]\n",
                "tileloadd tmm5, [{b} + {s64}*1 + ",
                $b1,
                "]\n",
                "tdpbssd tmm0, tmm3, tmm4\n",
                "tdpbssd tmm1, tmm3, tmm5\n",
            )
        };
    }
    match format {
        // SAFETY: as the function's; the offsets stay inside `Expanded` (12 KiB) and
        // `Sums` (3 KiB), and the activation rows' 256 bytes.
        Format::Q4K => unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                step!("0", "0", "1024", "2048"),
                step!("64", "3072", "4096", "5120"),
                step!("128", "6144", "7168", "8192"),
                step!("192", "9216", "10240", "11264"),
                "tilestored [{c} + {s64}*1], tmm0",
                "tilestored [{c} + {s64}*1 + 1024], tmm1",
                "tilestored [{c} + {s64}*1 + 2048], tmm2",
                a = in(reg) a,
                stride = in(reg) a_stride,
                b = in(reg) b,
                c = in(reg) c,
                s64 = in(reg) 64usize,
                options(nostack, preserves_flags),
            )
        },
        // SAFETY: as above.
        Format::Q6K => unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                step2!("0", "0", "1024"),
                step2!("64", "3072", "4096"),
                step2!("128", "6144", "7168"),
                step2!("192", "9216", "10240"),
                "tilestored [{c} + {s64}*1], tmm0",
                "tilestored [{c} + {s64}*1 + 1024], tmm1",
                a = in(reg) a,
                stride = in(reg) a_stride,
                b = in(reg) b,
                c = in(reg) c,
                s64 = in(reg) 64usize,
                options(nostack, preserves_flags),
            )
        },
    }
}

/// Line `w` of a tile (64 bytes at `at + 64 w`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn line(tile: &[u8], at: usize, w: usize) -> __m512i {
    let src = &tile[at + 64 * w..at + 64 * w + 64];
    // SAFETY: `src` is 64 readable bytes (sliced above); the load is unaligned.
    unsafe { _mm512_loadu_si512(src.as_ptr().cast()) }
}

/// Half-precision field `k` of a tile's sixteen rows, widened.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn halves(tile: &[u8], k: usize) -> __m512 {
    let src = &tile[32 * k..32 * k + 32];
    // SAFETY: `src` is 32 readable bytes (sliced above); the load is unaligned.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(src.as_ptr().cast()) })
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

/// A Q4_K super-block of sixteen rows (a tile's) expanded; returns `d_w` and `−dmin_w`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn expand_q4_k(tile: &[u8], e: &mut Expanded) -> (__m512, __m512) {
    let nibble = _mm512_set1_epi8(0x0f);
    let six = _mm512_set1_epi8(0x3f);
    let top = _mm512_set1_epi8(0x30);
    // Words a, b, c of each row's 12 scale bytes (`gguf::k4_scale_min`, lane by lane).
    let (a, b, c) = (line(tile, 64, 0), line(tile, 64, 1), line(tile, 64, 2));
    let sc_lo = _mm512_and_si512(a, six);
    let m_lo = _mm512_and_si512(b, six);
    let sc_hi = _mm512_or_si512(
        _mm512_and_si512(c, nibble),
        _mm512_and_si512(_mm512_srli_epi32::<2>(a), top),
    );
    let m_hi = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32::<4>(c), nibble),
        _mm512_and_si512(_mm512_srli_epi32::<2>(b), top),
    );
    let sub = |lo: __m512i, hi: __m512i, j: usize| byte_lane(if j < 4 { lo } else { hi }, j % 4);
    for step in 0..STEPS {
        let [hi_part, lo_part, mins] = &mut e.lines[step];
        // Sub-blocks 2·step (the low nibbles, rows k/4 0..8) and 2·step + 1 (high, 8..16).
        for (half, j) in [2 * step, 2 * step + 1].into_iter().enumerate() {
            let sc = sub(sc_lo, sc_hi, j);
            let sh = both_halves(_mm512_srli_epi32::<3>(sc));
            let sl = both_halves(_mm512_and_si512(sc, _mm512_set1_epi32(7)));
            let m = _mm512_mullo_epi32(sub(m_lo, m_hi, j), _mm512_set1_epi32(0x0101_0101));
            for u in 0..8 {
                let w = line(tile, 64, 3 + 8 * step + u);
                let q = if half == 0 {
                    _mm512_and_si512(w, nibble)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibble)
                };
                store(hi_part, 8 * half + u, _mm512_mullo_epi16(q, sh));
                store(lo_part, 8 * half + u, _mm512_mullo_epi16(q, sl));
                store(mins, 8 * half + u, m);
            }
        }
    }
    let neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), halves(tile, 1));
    (halves(tile, 0), neg_dmin)
}

/// A Q6_K super-block of sixteen rows (a tile's) expanded; returns `d_w`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn expand_q6_k(tile: &[u8], e: &mut Expanded) -> __m512 {
    let nibble = _mm512_set1_epi8(0x0f);
    let top = _mm512_set1_epi8(0x30);
    let offset = _mm512_set1_epi8(32);
    let low7 = _mm512_set1_epi16(127);
    // Row r's 16-bit value in the four lanes of its bytes, rows 0..8 and 8..16.
    let spread: [__m512i; 2] = std::array::from_fn(|h| {
        let idx: [i16; 32] = std::array::from_fn(|e| (8 * h + e / 4) as i16);
        // SAFETY: `idx` is 64 readable bytes; the load is unaligned.
        unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
    });
    for half in 0..2 {
        for upper in 0..2 {
            // The group scales of this pass, k = 0..4: group 8·half + 2k + upper, each
            // row's signed byte as a 16-bit value (rows in the low 16 of 32 lanes).
            let sc: [[__m512i; 2]; 4] = std::array::from_fn(|k| {
                let group = 8 * half + 2 * k + upper;
                let scales = line(tile, 32, 48 + group / 4);
                let up = _mm512_set1_epi32(24 - 8 * (group % 4) as i32);
                let sc32 = _mm512_srai_epi32::<24>(_mm512_sllv_epi32(scales, up));
                let sc16 = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(sc32));
                spread.map(|s| _mm512_permutexvar_epi16(s, sc16))
            });
            for q in 4 * upper..4 * upper + 4 {
                let slot = 12 * (2 * half + upper) + 3 * (q - 4 * upper);
                let ql0 = line(tile, 32, slot);
                let ql1 = line(tile, 32, slot + 1);
                let h = line(tile, 32, slot + 2);
                // Element 128·half + 32k + 4q + (0..4) of each row, as 0..63.
                let v = [
                    _mm512_or_si512(
                        _mm512_and_si512(ql0, nibble),
                        _mm512_and_si512(_mm512_slli_epi16::<4>(h), top),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(ql1, nibble),
                        _mm512_and_si512(_mm512_slli_epi16::<2>(h), top),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(ql0), nibble),
                        _mm512_and_si512(h, top),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(ql1), nibble),
                        _mm512_and_si512(_mm512_srli_epi16::<2>(h), top),
                    ),
                ];
                for (k, &v) in v.iter().enumerate() {
                    let signed = _mm512_sub_epi8(v, offset);
                    let words = [
                        _mm512_cvtepi8_epi16(_mm512_castsi512_si256(signed)),
                        _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(signed)),
                    ];
                    let w = [
                        _mm512_mullo_epi16(words[0], sc[k][0]),
                        _mm512_mullo_epi16(words[1], sc[k][1]),
                    ];
                    let bytes = |f: &dyn Fn(__m512i) -> __m512i| {
                        _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(_mm512_cvtepi16_epi8(f(w[0]))),
                            _mm512_cvtepi16_epi8(f(w[1])),
                        )
                    };
                    let hi = bytes(&|x| _mm512_srai_epi16::<7>(x));
                    let lo = bytes(&|x| _mm512_and_si512(x, low7));
                    // Weight 64·step + 4·k4 + (0..4): step = 2·half + k/2, k4 = 8(k%2) + q.
                    let (step, k4) = (2 * half + k / 2, 8 * (k % 2) + q);
                    let [hi_part, lo_part, _] = &mut e.lines[step];
                    store(hi_part, k4, hi);
                    store(lo_part, k4, lo);
                }
            }
        }
    }
    halves(tile, 0)
}
