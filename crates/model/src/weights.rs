//! Weight matrices in kernel-friendly layouts. Quantized blocks keep ggml's integers
//! exactly; only the f16 scales are widened to f32 at load (exact), so the kernels do no
//! per-block conversion.

use gguf::{GgmlType, GgufFile, TensorInfo};
use half::f16;

use crate::quant::BlockMatrix;
use crate::ModelError;

pub const QK: usize = 32;

#[cfg(test)]
mod tests {
    #[test]
    fn magic_rounding_is_round_half_even() {
        let mut y = -130.0f32;
        while y < 130.0 {
            assert_eq!(super::round_ties_even_small(y), y.round_ties_even(), "{y}");
            y += 0.125;
        }
        for y in [
            0.5f32, 1.5, 2.5, -0.5, -1.5, 126.49999, 126.5, 127.5, -127.5,
        ] {
            assert_eq!(super::round_ties_even_small(y), y.round_ties_even(), "{y}");
        }
    }
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f32,
    pub qs: [u8; 16],
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f32,
    pub m: f32,
    pub qs: [u8; 16],
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f32,
    pub qs: [i8; 32],
}

/// An activation block quantized as ggml's Q8_1: `x ≈ d * q`, and `s = d * Σq` so that
/// the offset term of Q4_1 weights costs one multiply per block.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

impl Default for BlockQ8_1 {
    fn default() -> Self {
        Self {
            d: 0.0,
            s: 0.0,
            qs: [0; 32],
        }
    }
}

/// Quantizes one activation row (length a multiple of 32) the way ggml does for Q8_1:
/// scale `amax / 127` stored as f16, values rounded to nearest, sum scaled and stored as f16.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    let done = crate::kernels::quantize_blocks_q8_1(x, out);
    quantize_row_q8_1_scalar(&x[done * QK..], &mut out[done..]);
}

/// The definition [`quantize_row_q8_1`]'s SIMD path is tested against.
pub fn quantize_row_q8_1_scalar(x: &[f32], out: &mut [BlockQ8_1]) {
    for (blk, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        // ggml multiplies by 127 / amax, not 1 / d: the two differ in the last bit.
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in o.qs.iter_mut().zip(blk) {
            let r = round_ties_even_small(v * id) as i32;
            *q = r as i8;
            sum += r;
        }
        o.d = f16::from_f32(d).to_f32();
        o.s = f16::from_f32(d * sum as f32).to_f32();
    }
}

/// Round half to even for |y| < 2^22, as `_mm256_round_ps(_MM_ROUND_NEAREST)` does: adding
/// and subtracting 1.5 * 2^23 leaves the integer the FPU rounded to. (`round_ties_even`
/// compiles to a libm call on baseline x86-64, the hottest line of quantization.)
#[inline]
fn round_ties_even_small(y: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (y + MAGIC) - MAGIC
}

/// A weight matrix of `rows` output rows, each `cols` long.
pub enum Matrix {
    F32 {
        rows: usize,
        cols: usize,
        data: Vec<f32>,
    },
    Q4_0 {
        rows: usize,
        cols: usize,
        data: Vec<BlockQ4_0>,
    },
    Q4_1 {
        rows: usize,
        cols: usize,
        data: Vec<BlockQ4_1>,
    },
    Q8_0 {
        rows: usize,
        cols: usize,
        data: Vec<BlockQ8_0>,
    },
    /// Q5_0, Q5_1 and the k-quants, one `QuantFormat` each (`crate::quant`).
    Blocks(Box<dyn BlockMatrix>),
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

impl Matrix {
    pub fn rows(&self) -> usize {
        match self {
            Matrix::F32 { rows, .. }
            | Matrix::Q4_0 { rows, .. }
            | Matrix::Q4_1 { rows, .. }
            | Matrix::Q8_0 { rows, .. } => *rows,
            Matrix::Blocks(m) => m.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Matrix::F32 { cols, .. }
            | Matrix::Q4_0 { cols, .. }
            | Matrix::Q4_1 { cols, .. }
            | Matrix::Q8_0 { cols, .. } => *cols,
            Matrix::Blocks(m) => m.cols(),
        }
    }

    /// Whether the kernels take this matrix's input as quantized Q8_1 blocks.
    pub fn wants_q8(&self) -> bool {
        !matches!(self, Matrix::F32 { .. })
    }

    /// Whether the kernels also need the input as Q8_K super-blocks (the k-quants).
    pub fn wants_q8_k(&self) -> bool {
        matches!(self, Matrix::Blocks(m) if m.wants_q8_k())
    }

    /// Loads a 2-D tensor whose ggml dims are `[cols, rows]`.
    pub fn load(
        file: &GgufFile,
        info: &TensorInfo,
        rows: usize,
        cols: usize,
    ) -> Result<Self, ModelError> {
        if info.dims.len() != 2 || info.dims[0] as usize != cols || info.dims[1] as usize != rows {
            return Err(ModelError::Tensor {
                name: info.name.clone(),
                reason: format!("shape {:?}, expected [{cols}, {rows}]", info.dims),
            });
        }
        if !cols.is_multiple_of(info.ty.block_elems()) {
            return Err(ModelError::Tensor {
                name: info.name.clone(),
                reason: format!("rows of {cols} are not whole {:?} blocks", info.ty),
            });
        }
        let bytes = file.tensor_bytes(info);
        let bb = info.ty.block_bytes();
        Ok(match info.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Matrix::F32 {
                rows,
                cols,
                data: file.tensor_f32(info),
            },
            GgmlType::Q4_0 => Matrix::Q4_0 {
                rows,
                cols,
                data: bytes
                    .chunks_exact(bb)
                    .map(|b| {
                        let mut qs = [0u8; 16];
                        qs.copy_from_slice(&b[2..18]);
                        BlockQ4_0 {
                            d: f16_at(b, 0),
                            qs,
                        }
                    })
                    .collect(),
            },
            GgmlType::Q4_1 => Matrix::Q4_1 {
                rows,
                cols,
                data: bytes
                    .chunks_exact(bb)
                    .map(|b| {
                        let mut qs = [0u8; 16];
                        qs.copy_from_slice(&b[4..20]);
                        BlockQ4_1 {
                            d: f16_at(b, 0),
                            m: f16_at(b, 2),
                            qs,
                        }
                    })
                    .collect(),
            },
            GgmlType::Q8_0 => Matrix::Q8_0 {
                rows,
                cols,
                data: bytes
                    .chunks_exact(bb)
                    .map(|b| {
                        let mut qs = [0i8; 32];
                        for (q, &v) in qs.iter_mut().zip(&b[2..34]) {
                            *q = v as i8;
                        }
                        BlockQ8_0 {
                            d: f16_at(b, 0),
                            qs,
                        }
                    })
                    .collect(),
            },
            ty => Matrix::Blocks(
                crate::quant::block_matrix(ty, rows, cols, bytes.to_vec()).ok_or_else(|| {
                    ModelError::Tensor {
                        name: info.name.clone(),
                        reason: format!("ggml type {ty:?} has no kernel"),
                    }
                })?,
            ),
        })
    }

    /// Row `r` dequantized to f32 (used for embedding lookups).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let cols = self.cols();
        let nb = cols / QK;
        match self {
            Matrix::F32 { data, .. } => out.copy_from_slice(&data[r * cols..(r + 1) * cols]),
            Matrix::Q4_0 { data, .. } => {
                for (b, o) in data[r * nb..(r + 1) * nb]
                    .iter()
                    .zip(out.chunks_exact_mut(QK))
                {
                    for j in 0..16 {
                        o[j] = ((b.qs[j] & 15) as i32 - 8) as f32 * b.d;
                        o[j + 16] = ((b.qs[j] >> 4) as i32 - 8) as f32 * b.d;
                    }
                }
            }
            Matrix::Q4_1 { data, .. } => {
                for (b, o) in data[r * nb..(r + 1) * nb]
                    .iter()
                    .zip(out.chunks_exact_mut(QK))
                {
                    for j in 0..16 {
                        o[j] = (b.qs[j] & 15) as f32 * b.d + b.m;
                        o[j + 16] = (b.qs[j] >> 4) as f32 * b.d + b.m;
                    }
                }
            }
            Matrix::Q8_0 { data, .. } => {
                for (b, o) in data[r * nb..(r + 1) * nb]
                    .iter()
                    .zip(out.chunks_exact_mut(QK))
                {
                    for (v, &q) in o.iter_mut().zip(&b.qs) {
                        *v = q as f32 * b.d;
                    }
                }
            }
            Matrix::Blocks(m) => m.row_f32(r, out),
        }
    }
}

/// Loads a 1-D f32-convertible vector (norm weights).
pub fn load_vector(file: &GgufFile, info: &TensorInfo, len: usize) -> Result<Vec<f32>, ModelError> {
    if info.dims.len() != 1 || info.dims[0] as usize != len {
        return Err(ModelError::Tensor {
            name: info.name.clone(),
            reason: format!("shape {:?}, expected [{len}]", info.dims),
        });
    }
    Ok(file.tensor_f32(info))
}
