//! A bias's gradient: the column sums of the output's gradient, in one
//! pass (blocks of rows summed in parallel, then added in block order, so
//! the same bytes on any number of threads).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};

use super::kernel::{column_sums, per_float, Float};

/// Per-column sums of a `rows x width` gradient (its last dimension the
/// columns), as a tensor of `width`; a backward's part, run with
/// `apply_op1_no_bwd`.
pub(super) struct ColumnSum;

impl CustomOp1 for ColumnSum {
    fn name(&self) -> &'static str {
        "candle-dp-column-sum"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let width = layout.dims().last().copied().unwrap_or(1);
        let op = "bias add backward";
        let out = per_float!(storage.dtype(), op, T => {
            T::storage(column_sums(T::slice(storage, layout, op)?, width))
        });
        Ok((out, Shape::from(width)))
    }
}
