//! Single-threaded f32 matrix products on row-major slices (the `gemm` crate's kernels), and
//! row-parallel helpers. The hot paths (grouped experts, causal attention) parallelise across
//! independent work items (experts, heads x query blocks) and run each product on one core:
//! on small per-expert blocks that beats splitting every product across threads.

use rayon::prelude::*;

/// `out[m, n] = a[m, k] · b[k, n]`; every matrix row-major with the given row strides.
pub fn matmul_strided(out: &mut [f32], out_stride: usize, a: &[f32], b: &[f32], dims: Dims) {
    product(
        out,
        out_stride,
        a,
        b,
        BLayout::RowMajor,
        Write::Overwrite,
        dims,
    );
}

/// `out[m, n] += a[m, k] · b[k, n]`, every matrix row-major (`out` with row stride `n`): the
/// running value product of blocked attention.
pub fn matmul_accumulate(out: &mut [f32], a: &[f32], b: &[f32], dims: Dims) {
    product(
        out,
        dims.n,
        a,
        b,
        BLayout::RowMajor,
        Write::Accumulate,
        dims,
    );
}

/// `out[m, n] = a[m, k] · b[n, k]^T` (b row-major `[n, k]`, e.g. keys for `Q K^T`).
pub fn matmul_bt(out: &mut [f32], a: &[f32], b: &[f32], dims: Dims) {
    product(
        out,
        dims.n,
        a,
        b,
        BLayout::Transposed,
        Write::Overwrite,
        dims,
    );
}

/// Whether a product replaces the output or adds to it.
#[derive(Clone, Copy, PartialEq)]
enum Write {
    Overwrite,
    Accumulate,
}

/// How the right-hand matrix of a product is stored.
#[derive(Clone, Copy)]
enum BLayout {
    /// `[k, n]` row-major.
    RowMajor,
    /// `[n, k]` row-major, i.e. the product uses its transpose.
    Transposed,
}

/// The one call into the `gemm` crate: bounds checked, single-threaded.
fn product(
    out: &mut [f32],
    out_stride: usize,
    a: &[f32],
    b: &[f32],
    layout: BLayout,
    write: Write,
    dims: Dims,
) {
    let Dims { m, k, n } = dims;
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        out_stride >= n && out.len() >= (m - 1) * out_stride + n,
        "gemm: output too small"
    );
    assert!(
        a.len() >= m * k && b.len() >= k * n,
        "gemm: input too small"
    );
    // (column stride, row stride) of b as a k x n matrix.
    let (b_col, b_row) = match layout {
        BLayout::RowMajor => (1, n as isize),
        BLayout::Transposed => (k as isize, 1),
    };
    // `out = alpha * out + beta * a b`, `out` read only when accumulating.
    let accumulate = write == Write::Accumulate;
    let alpha = if accumulate { 1.0 } else { 0.0 };
    // SAFETY: the asserts above keep every access of the m x k, k x n and m x n (row stride
    // `out_stride`) matrices inside the slices, whichever layout b has.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            out_stride as isize,
            accumulate,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            b_col,
            b_row,
            alpha,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `a[m, k] · b[k, n]` into a new row-major vector.
pub fn matmul(a: &[f32], b: &[f32], dims: Dims) -> Vec<f32> {
    let mut out = vec![0f32; dims.m * dims.n];
    matmul_strided(&mut out, dims.n, a, b, dims);
    out
}

/// Matrix product dimensions: `[m, k] · [k, n]`.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// Rows per parallel task when one product is split by rows: enough for efficient kernels.
const ROWS_PER_TASK: usize = 64;

/// `a[m, k] · b[k, n]`, rows split across the thread pool.
pub fn matmul_par(a: &[f32], b: &[f32], dims: Dims) -> Vec<f32> {
    let Dims { m, k, n } = dims;
    let threads = rayon::current_num_threads().max(1);
    let rows = m.div_ceil(threads).max(ROWS_PER_TASK);
    let mut out = vec![0f32; m * n];
    out.par_chunks_mut(rows * n.max(1))
        .zip(a.par_chunks(rows * k.max(1)))
        .for_each(|(out, a)| {
            let m = out.len() / n.max(1);
            matmul_strided(out, n, a, b, Dims { m, k, n });
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        out
    }

    #[test]
    fn products_match_the_naive_definition() {
        let (m, k, n) = (130, 7, 5);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 - 6.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.5).collect();
        let want = naive(&a, &b, m, k, n);
        assert_eq!(matmul(&a, &b, Dims { m, k, n }), want);
        assert_eq!(matmul_par(&a, &b, Dims { m, k, n }), want);
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let mut out = vec![0f32; m * n];
        matmul_bt(&mut out, &a, &bt, Dims { m, k, n });
        assert_eq!(out, want);
        matmul_accumulate(&mut out, &a, &b, Dims { m, k, n });
        let twice: Vec<f32> = want.iter().map(|x| 2.0 * x).collect();
        assert_eq!(out, twice);
    }
}
