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

/// The values of some buffers at one moment, to put back if a step fails
/// after its forward updated them: a failed step leaves the buffers as it
/// found them, on every rank.
pub(crate) struct BufferSnapshot {
    saved: Vec<(candle_core::Var, candle_core::Tensor)>,
}

impl BufferSnapshot {
    /// Copies the current values of `buffers` (no copy for none).
    pub(crate) fn take(buffers: &[(String, candle_core::Var)]) -> candle_core::Result<Self> {
        let saved = buffers
            .iter()
            .map(|(_, var)| Ok((var.clone(), var.as_tensor().copy()?)))
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { saved })
    }

    /// Puts every buffer back to its saved value.
    pub(crate) fn restore(&self) -> candle_core::Result<()> {
        for (var, value) in &self.saved {
            var.set(value)?;
        }
        Ok(())
    }

    /// [`restore`](Self::restore) on the way out of a failed step: the
    /// step's own failure (`why`) is the error the caller returns, so a
    /// restore that fails too (a copy of the same shape, on the same
    /// device: not expected) is logged rather than hiding it.
    pub(crate) fn restore_after(&self, why: &dyn std::fmt::Display) {
        if let Err(e) = self.restore() {
            tracing::error!("after a failed step ({why}), the buffers could not be restored: {e}");
        }
    }
}
