//! Grouped expert GEMM over main and replica experts with cuBLAS.
//!
//! After [`super::permute::group_by_instance`] a rank holds one contiguous block of rows per
//! (expert, instance) it computes. Each block is multiplied by its expert's weight matrix, read
//! from the rank's own main-expert weights (instance 0) or from the redundant slot a replica was
//! streamed into ([`crate::weight_source`]), stored either way round ([`WeightOrder`]). Groups
//! differ in row count, so this issues one cuBLAS SGEMM per group on the GPU's stream (a loop of
//! GEMMs; cuBLAS queues them back to back).

use super::libs::{self, Lib};
use super::{guard, CudaError, Gpu};
use crate::KernelError;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};
use std::ops::Range;

/// How an `n`-output, `k`-input weight matrix is stored (row-major f32 either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightOrder {
    /// `n x k`, a linear layer's `weight` as checkpoints store it: `y = x · Wᵀ`.
    OutByIn,
    /// `k x n`, pre-transposed: `y = x · W` (the engine's expert layout, `[H, 2I]` and `[I, H]`).
    InByOut,
}

/// One group: rows `rows` of the input and output, times its weight matrix (`n * k` floats in
/// the run's [`WeightOrder`]).
pub struct GemmGroup<'a> {
    pub rows: Range<usize>,
    pub weight: CudaView<'a, f32>,
}

/// cuBLAS, located first (a typed error when it is missing, never cudarc's panic), bound to the
/// GPU's stream.
pub(crate) fn open_blas(gpu: &Gpu) -> Result<CudaBlas, CudaError> {
    libs::ensure(Lib::Cublas).map_err(|searched| {
        CudaError::Blas(format!(
            "libcublas was not found (`pip install nvidia-cublas`; searched {searched})"
        ))
    })?;
    let stream = gpu.stream().clone();
    guard(|| CudaBlas::new(stream))
        .map_err(CudaError::Blas)?
        .map_err(|e| CudaError::Blas(format!("{e:?}")))
}

/// cuBLAS on the GPU's stream.
pub struct GroupedGemm {
    blas: CudaBlas,
}

impl GroupedGemm {
    /// Loads cuBLAS (a typed error when it is missing) and binds it to the GPU's stream.
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        Ok(Self {
            blas: open_blas(gpu)?,
        })
    }

    /// `y[rows] = x[rows] · W` for every group's weight `W` (stored as `order` says): `x` is
    /// `total x k`, `y` is `total x n`, all row-major f32. `x` and `y` may be longer than the
    /// groups need (buffers reused across layers).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        k: usize,
        n: usize,
        order: WeightOrder,
        groups: &[GemmGroup<'_>],
    ) -> Result<(), CudaError> {
        if k == 0 || n == 0 {
            return Err(KernelError::ZeroDimension { what: "k and n" }.into());
        }
        let total_x = x.len() / k;
        let total_y = y.len() / n;
        let int = |v: usize, what| i32::try_from(v).map_err(|_| KernelError::Overflow { what });
        for g in groups {
            if g.rows.start > g.rows.end || g.rows.end > total_x || g.rows.end > total_y {
                return Err(KernelError::OutOfRange {
                    what: "group rows",
                    value: g.rows.end as u64,
                    limit: total_x.min(total_y) as u64,
                }
                .into());
            }
            if g.weight.len() != n * k {
                return Err(KernelError::Length {
                    what: "expert weight",
                    len: g.weight.len(),
                    expected: n * k,
                }
                .into());
            }
        }
        let (k32, n32) = (int(k, "k")?, int(n, "n")?);
        let stream = gpu.stream();
        let (x_ptr, _x_sync) = x.device_ptr(stream);
        let (y_ptr, _y_sync) = y.device_ptr_mut(stream);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // cuBLAS is column-major: a row-major `a x b` matrix is its `b x a` transpose to it. So
        // Yᵀ (n x m) = op(W) · Xᵀ (k x m), where the stored W reads as `k x n` (OutByIn: transpose
        // it back) or as `n x k` (InByOut: already the Wᵀ wanted).
        let (op_w, ld_w) = match order {
            WeightOrder::OutByIn => (cublasOperation_t::CUBLAS_OP_T, k32),
            WeightOrder::InByOut => (cublasOperation_t::CUBLAS_OP_N, n32),
        };
        for g in groups.iter().filter(|g| !g.rows.is_empty()) {
            let m32 = int(g.rows.len(), "group rows")?;
            let (w_ptr, _w_sync) = g.weight.device_ptr(stream);
            let a = w_ptr as *const f32;
            let b = (x_ptr as usize + g.rows.start * k * 4) as *const f32;
            let c = (y_ptr as usize + g.rows.start * n * 4) as *mut f32;
            // SAFETY: the pointers address `x`, `y` and the weight view, whose sizes were checked
            // above against rows * k, rows * n and n * k; alpha and beta live across the call.
            unsafe {
                cudarc::cublas::result::sgemm(
                    *self.blas.handle(),
                    op_w,
                    cublasOperation_t::CUBLAS_OP_N,
                    n32,
                    m32,
                    k32,
                    &alpha,
                    a,
                    ld_w,
                    b,
                    k32,
                    &beta,
                    c,
                    n32,
                )
            }
            .map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        }
        Ok(())
    }
}
