//! Gemma 3's feed-forward activation: GeGLU with ggml's tanh-approximated GELU, as
//! llama.cpp's `src/models/gemma3.cpp` builds it (its metadata is read in `config/gemma3.rs`).

use half::f16;

/// ggml's GELU with the tanh approximation, as its CPU GeGLU computes it: the input rounded
/// to f16 and looked up in a table of f16 results (`ggml_table_gelu_f16`, each entry the
/// f32 formula on that f16 value), except at or beyond ±10 where it is 0 or the input.
pub fn gelu_tanh(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        gelu_table()[usize::from(f16::from_f32(x).to_bits())]
    }
}

/// Every f16's GELU, rounded to f16 (as f32), built on first use as ggml builds its table:
/// computing `tanh` per element instead was a fifth of a Gemma 3 prefill.
fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| gelu_f16_value(f16::from_bits(bits).to_f32()))
            .collect()
    })
}

/// The table's entry for the f16 value `h`.
fn gelu_f16_value(h: f32) -> f32 {
    f16::from_f32(gelu_f32(h)).to_f32()
}

/// `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))` in f32, with the one contraction GCC
/// makes of ggml's expression (`1 + (a x) x` fused).
fn gelu_f32(x: f32) -> f32 {
    const GELU_COEF_A: f32 = 0.044715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = (GELU_COEF_A * x).mul_add(x, 1.0);
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh())
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]` (ggml's `geglu_split`).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    crate::kernels::table_glu(gate, up, gelu_table(), gelu_tanh);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector GeGLU (one conversion and a gather per eight lanes) against the scalar
    /// definition on every f16 value, the saturation edges and values between f16s.
    #[test]
    fn vector_geglu_matches_the_scalar_definition() {
        let mut gate: Vec<f32> = (0..=u16::MAX).map(|b| f16::from_bits(b).to_f32()).collect();
        gate.extend([
            -10.0, 10.0, -10.001, 10.001, 9.999, -9.999, 0.1234567, -3.3333333,
        ]);
        gate.extend((0..1000).map(|i| (i as f32 - 500.0) * 0.0213));
        let up: Vec<f32> = (0..gate.len())
            .map(|i| 1.0 + (i % 7) as f32 * 0.25)
            .collect();
        let want: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(&g, u)| gelu_tanh(g) * u)
            .collect();
        geglu(&mut gate, &up);
        for (i, (got, want)) in gate.iter().zip(&want).enumerate() {
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "element {i}: {got} against {want}"
            );
        }
    }

    #[test]
    fn gelu_matches_the_formula_to_f16_precision_and_saturates() {
        for i in -400..400 {
            let x = i as f32 * 0.025;
            let exact = 0.5
                * x as f64
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt()
                        * (x as f64 + 0.044715 * (x as f64).powi(3)))
                    .tanh());
            let got = gelu_tanh(x) as f64;
            // Two f16 roundings (input and output): within a few parts in a thousand.
            assert!(
                (got - exact).abs() <= 4e-3 * exact.abs().max(1.0),
                "gelu({x}) = {got}, formula {exact}"
            );
        }
        assert_eq!(gelu_tanh(-10.0), 0.0);
        assert_eq!(gelu_tanh(12.5), 12.5);
        // The table works on the f16 value: inputs that round to the same f16 agree.
        assert_eq!(gelu_tanh(1.0), gelu_tanh(1.0 + 1e-4));
        // Each lookup is the formula on the input's f16 value, rounded to f16.
        for i in -100_000..100_000 {
            let x = i as f32 * 9.99e-5;
            let direct = gelu_f16_value(f16::from_f32(x).to_f32());
            assert_eq!(gelu_tanh(x).to_bits(), direct.to_bits(), "gelu({x})");
        }
    }
}
