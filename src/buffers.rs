//! Which variables are buffers: updated by the forward pass itself, never
//! by the optimizer (BatchNorm's running statistics). Replicas work on
//! private copies of them, DDP broadcasts them instead of reducing them.

use std::sync::Arc;

/// Decides which variables are buffers from their `VarMap` name.
pub type BufferPredicate = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// The default [`BufferPredicate`]: candle-nn's BatchNorm statistics,
/// `*running_mean` and `*running_var`.
///
/// ```
/// assert!(candle_dp::is_batch_norm_buffer("bn.running_mean"));
/// assert!(!candle_dp::is_batch_norm_buffer("bn.weight"));
/// ```
pub fn is_batch_norm_buffer(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}
