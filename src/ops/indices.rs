//! Integer indices read to the host and checked against their bound: a
//! lookup's ids, a loss's class targets.

use candle_core::{DType, Tensor};

/// The values of `indices` (any integer dtype, any shape, flattened), or
/// the position and value of the first one outside `0..bound`.
pub(super) fn indices_below(
    indices: &Tensor,
    bound: usize,
) -> candle_core::Result<Result<Vec<i64>, (usize, i64)>> {
    let values: Vec<i64> = indices.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    Ok(
        match values
            .iter()
            .enumerate()
            .find(|(_, &v)| v < 0 || v as u64 >= bound as u64)
        {
            Some((position, &value)) => Err((position, value)),
            None => Ok(values),
        },
    )
}
