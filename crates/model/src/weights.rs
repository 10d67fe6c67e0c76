//! Weight matrices as the forward pass holds them: one [`Matrix`] whatever the format (the
//! formats and the table of GGUF types are `crate::quant`'s), and the 1-D norm vectors.

use gguf::{GgmlType, GgufFile, TensorInfo};

use crate::blocks::Acts;
use crate::kernels::{ActKind, WeightRows};
use crate::quant::{Repack, WeightMatrix};
use crate::ModelError;

// The forward pass and the benches name these here.
pub use crate::blocks::{BlockQ8_1, QK};
pub use crate::kernels::quantize_row_q8_1;

/// A weight matrix of `rows` output rows, each `cols` long, in the format it was stored in.
pub struct Matrix(Box<dyn WeightMatrix>);

impl Matrix {
    pub fn rows(&self) -> usize {
        self.0.rows()
    }

    pub fn cols(&self) -> usize {
        self.0.cols()
    }

    /// The GGUF type the matrix was loaded from.
    pub fn ty(&self) -> GgmlType {
        self.0.ty()
    }

    /// Whether the kernels take this matrix's input as quantized Q8_1 blocks.
    pub fn wants_q8(&self) -> bool {
        self.0.act_kind() != ActKind::F32
    }

    /// Whether the kernels also need the input as Q8_K super-blocks (the k-quants).
    pub fn wants_q8_k(&self) -> bool {
        self.0.act_kind() == ActKind::Q8K
    }

    /// Loads a 2-D tensor whose ggml dims are `[cols, rows]`, repacked (where its format
    /// is) before this returns.
    pub fn load(
        file: &GgufFile,
        info: &TensorInfo,
        rows: usize,
        cols: usize,
    ) -> Result<Self, ModelError> {
        Self::load_with(file, info, rows, cols, &Repack::AtLoad)
    }

    /// [`Self::load`], repacking when `repack` says.
    pub fn load_with(
        file: &GgufFile,
        info: &TensorInfo,
        rows: usize,
        cols: usize,
        repack: &Repack<'_>,
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
        let data = file.tensor_data(info);
        let m =
            crate::quant::table::matrix(info.ty, rows, cols, &data, repack).ok_or_else(|| {
                ModelError::Tensor {
                    name: info.name.clone(),
                    reason: format!("ggml type {:?} has no kernel", info.ty),
                }
            })?;
        Ok(Matrix(m))
    }

    /// Whether the matrix is read from the mapped file where it lies (not copied).
    pub fn is_mapped(&self) -> bool {
        self.0.is_mapped()
    }

    /// Row `r` dequantized to f32 (used for embedding lookups).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.0.row_f32(r, out);
    }
}

impl WeightRows for Matrix {
    fn rows(&self) -> usize {
        self.0.rows()
    }

    fn cols(&self) -> usize {
        self.0.cols()
    }

    fn act_kind(&self) -> ActKind {
        self.0.act_kind()
    }

    fn wants_tile_scales(&self) -> bool {
        self.0.wants_tile_scales()
    }

    fn wants_q8_k_lanes(&self, n: usize) -> bool {
        self.0.wants_q8_k_lanes(n)
    }

    fn wants_q8_1_lanes(&self, n: usize) -> bool {
        self.0.wants_q8_1_lanes(n)
    }

    fn prepares_rows(&self, n: usize) -> bool {
        self.0.prepares_rows(n)
    }

    fn wants_q8_k_tiles(&self, n: usize) -> bool {
        self.0.wants_q8_k_tiles(n)
    }

    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        self.0.rows_kernel(r0, nr, acts, n, out);
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
        self.0.rows_token_major(r0, nr, acts, n, out, ld)
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
