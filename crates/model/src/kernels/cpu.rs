//! Which instruction sets this CPU offers the kernels, detected once, and which of the
//! kernel paths `KVWARDEN_CPU` asks for.

/// The kernels' instruction-set paths, narrowest first. Every path gives the portable
/// code's bits (`scripts/eval-references.py --invariance` checks whole texts on each);
/// `KVWARDEN_CPU` selects a narrower one than the CPU's best, to measure or test the paths
/// other machines run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuPath {
    Portable,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX-512 F, BW, DQ, VL and VNNI, with the AVX2 set.
    Avx512,
    /// AMX-INT8 tiles for prefill products, with the AVX-512 set (`x86_amx.rs`).
    Amx,
}

impl CpuPath {
    pub const NAMES: &'static str = "portable, avx2, avx512, amx";

    pub fn name(self) -> &'static str {
        match self {
            CpuPath::Portable => "portable",
            CpuPath::Avx2 => "avx2",
            CpuPath::Avx512 => "avx512",
            CpuPath::Amx => "amx",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        [
            CpuPath::Portable,
            CpuPath::Avx2,
            CpuPath::Avx512,
            CpuPath::Amx,
        ]
        .into_iter()
        .find(|p| p.name() == name)
    }
}

/// The widest path this CPU runs.
pub fn best_path() -> CpuPath {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 = avx2
        && has!("avx512f")
        && has!("avx512bw")
        && has!("avx512dq")
        && has!("avx512vl")
        && has!("avx512vnni");
    if avx512 && super::x86_amx::usable() {
        CpuPath::Amx
    } else if avx512 {
        CpuPath::Avx512
    } else if avx2 {
        CpuPath::Avx2
    } else {
        CpuPath::Portable
    }
}

/// The path `KVWARDEN_CPU` asks for (the CPU's best when unset), or why it cannot be run:
/// an unknown name, or a path this CPU lacks. The binary checks it at start.
pub fn requested_path() -> Result<CpuPath, String> {
    let best = best_path();
    let Ok(value) = std::env::var("KVWARDEN_CPU") else {
        return Ok(best);
    };
    let path = CpuPath::parse(value.trim()).ok_or_else(|| {
        format!(
            "KVWARDEN_CPU={value:?} is not a kernel path ({})",
            CpuPath::NAMES
        )
    })?;
    if path > best {
        return Err(format!(
            "KVWARDEN_CPU={} asks for kernels this CPU cannot run (its widest path is {})",
            path.name(),
            best.name()
        ));
    }
    Ok(path)
}

/// The instruction sets the kernels use, detected once: the products ask per row, and
/// even cached detection showed as a few percent of a decode step when asked per row.
#[derive(Clone, Copy)]
pub(crate) struct Features {
    pub(crate) path: CpuPath,
    pub(crate) avx2: bool,
    pub(crate) f16c: bool,
    pub(crate) vnni: bool,
    pub(crate) wide: bool,
    pub(crate) amx: bool,
    /// Whether one-token passes over streamed weights request lines ahead themselves.
    pub(crate) one_token_prefetch: bool,
}

/// Whether the CPU is AMD's: on a 2-core Zen 4 the hardware prefetcher streamed a
/// one-token decode step's weights 8-18% faster without software requests, while on a
/// 2-core Xeon the one-row kernels ran at 11.3 decode tokens/s without them against 18-19
/// with (`x86::PREFETCH_DISTANCE`).
fn amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let vendor = [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat();
        vendor == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

pub(crate) fn features() -> Features {
    static FEATURES: std::sync::OnceLock<Features> = std::sync::OnceLock::new();
    *FEATURES.get_or_init(|| {
        // A value the binary refused at start never gets here; a library caller's falls
        // back to the CPU's best.
        let path = requested_path().unwrap_or_else(|_| best_path());
        let avx2 = path >= CpuPath::Avx2;
        let wide = path >= CpuPath::Avx512;
        Features {
            path,
            avx2,
            f16c: avx2,
            vnni: wide,
            wide,
            amx: path >= CpuPath::Amx,
            one_token_prefetch: !amd(),
        }
    })
}

/// The instruction-set path the kernels take (under `KVWARDEN_CPU`), for tools that
/// compare paths to say which one they ran.
pub fn path_name() -> &'static str {
    features().path.name()
}

pub(crate) fn has_f16c() -> bool {
    features().f16c
}

/// AVX2 with FMA.
pub(crate) fn has_avx2() -> bool {
    features().avx2
}

/// Whether a one-token pass over streamed weights should request lines ahead (see
/// [`Features::one_token_prefetch`]).
pub(crate) fn one_token_prefetch() -> bool {
    features().one_token_prefetch
}

pub(crate) fn has_vnni() -> bool {
    features().vnni
}

/// Whether the kernels run the 512-bit register tiles (AVX-512 F, BW, DQ, VL, VNNI, with
/// AVX2, FMA and F16C).
pub fn wide_available() -> bool {
    features().wide
}

/// Whether the k-quants' prefill products run on AMX tiles (which implies
/// [`wide_available`]).
pub(crate) fn has_amx() -> bool {
    features().amx
}

/// The k-quants' 256-bit integer lanes: AVX2 on the selected path.
pub fn avx2_detected() -> bool {
    features().avx2
}

/// AVX2, FMA and F16C on the selected path, as the formats' SIMD-compiled products need
/// them.
pub fn avx2_fma_f16c_detected() -> bool {
    features().avx2
}
