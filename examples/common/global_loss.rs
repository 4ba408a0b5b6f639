//! The loss a distributed run reports: the global batch's, as one device
//! training on the same global batch computes it, rather than one rank's
//! loss over its own share of the rows.
//!
//! Example code, not part of candle-dp: a program includes it with
//! `#[path = "common/global_loss.rs"] mod global_loss;`.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_dp::comm::{ProcessGroup, ReduceOp};

/// The mean loss over every rank's rows, from this rank's `loss` (a mean
/// over its `rows` rows): the ranks' losses weighted by their rows (one
/// all-reduce of two numbers, in f64), so ranks with unequal shares count
/// as their rows do; with equal shares, the mean of the ranks' losses.
/// Every rank must call it, and every rank gets the same value.
pub fn global_loss(pg: &dyn ProcessGroup, loss: &Tensor, rows: usize) -> Result<f32> {
    let loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let rows = rows as f64;
    let mine = Tensor::new(&[loss * rows, rows], &Device::Cpu)?;
    let sums = pg.all_reduce(&mine, ReduceOp::Sum)?.to_vec1::<f64>()?;
    Ok(match sums.as_slice() {
        &[weighted, total] if total > 0.0 => (weighted / total) as f32,
        _ => f32::NAN,
    })
}
