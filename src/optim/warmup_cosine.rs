//! The transformer recipe's schedule as one call: a linear warm-up, then a
//! cosine decay to zero at the last step.

use super::LrScheduler;
use crate::error::{Error, Result};

impl LrScheduler {
    /// A linear warm-up from 1% of `lr` over `warmup` steps (at least 1),
    /// then a cosine decay to 0 at step `total`: PyTorch's `SequentialLR`
    /// of `LinearLR(start_factor=0.01)` and `CosineAnnealingLR(T_max=total
    /// - warmup)`, milestone `warmup`.
    ///
    /// ```
    /// use candle_dp::optim::LrScheduler;
    /// let mut schedule = LrScheduler::warmup_cosine(0.1, 2, 10)?;
    /// assert!((schedule.lr() - 0.001).abs() < 1e-12);
    /// schedule.step()?;
    /// schedule.step()?;
    /// assert!((schedule.lr() - 0.1).abs() < 1e-12); // warmed up
    /// # Ok::<(), candle_dp::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::LrSchedule`] when the warm-up leaves no step to decay
    /// (`warmup >= total`), or for a rate PyTorch refuses.
    pub fn warmup_cosine(lr: f64, warmup: u64, total: u64) -> Result<Self> {
        if warmup >= total {
            return Err(Error::LrSchedule(format!(
                "a warm-up of {warmup} steps leaves none of the run's {total} steps to decay"
            )));
        }
        let rise = LrScheduler::linear(lr, 0.01, 1.0, warmup.max(1))?;
        let fall = LrScheduler::cosine_annealing(lr, total - warmup, 0.0)?;
        LrScheduler::sequential(lr, vec![rise, fall], vec![warmup])
    }
}
