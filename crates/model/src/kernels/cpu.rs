//! Which instruction sets this CPU offers the kernels, detected once.

/// The instruction sets the kernels use, detected once: the products ask per row, and
/// even cached detection showed as a few percent of a decode step when asked per row.
#[derive(Clone, Copy)]
pub(crate) struct Features {
    pub(crate) avx2: bool,
    pub(crate) f16c: bool,
    pub(crate) vnni: bool,
    pub(crate) wide: bool,
}

pub(crate) fn features() -> Features {
    static FEATURES: std::sync::OnceLock<Features> = std::sync::OnceLock::new();
    *FEATURES.get_or_init(|| {
        use std::arch::is_x86_feature_detected as has;
        // `KVWARDEN_CPU=avx2` keeps the kernels off AVX-512 on a CPU that has it: to measure
        // or test the 256-bit paths (which AVX2-only machines run) on the same machine.
        let cap_avx2 = std::env::var("KVWARDEN_CPU").is_ok_and(|v| v == "avx2");
        let avx2 = has!("avx2") && has!("fma");
        let vnni = avx2 && !cap_avx2 && has!("avx512vnni") && has!("avx512vl");
        Features {
            avx2,
            f16c: avx2 && has!("f16c"),
            vnni,
            wide: vnni && has!("avx512f") && has!("avx512bw") && has!("avx512dq"),
        }
    })
}

pub(crate) fn has_f16c() -> bool {
    features().f16c
}

/// AVX2 with FMA.
pub(crate) fn has_avx2() -> bool {
    features().avx2
}

pub(crate) fn has_vnni() -> bool {
    features().vnni
}

/// Whether this CPU runs the 512-bit register tiles (AVX-512 F, BW, DQ, VL, VNNI, with
/// AVX2, FMA and F16C).
pub fn wide_available() -> bool {
    let f = features();
    f.wide && f.f16c
}

/// AVX2 alone, as the k-quants' integer lanes need it.
pub fn avx2_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// AVX2, FMA and F16C, as the formats' SIMD-compiled products need them.
pub fn avx2_fma_f16c_detected() -> bool {
    avx2_detected()
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}
