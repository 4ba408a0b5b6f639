//! Dropout keyed by the sample: each element's mask is a hash of the run's
//! seed, the step, the sample's place in the global batch, the layer and
//! the element, never of a random state a rank or a thread holds. So the
//! same sample gets the same mask on whichever rank computes it, and a
//! recomputed unit (FSDP's, a pipeline's checkpoint) draws the same mask
//! again; deterministic training ([`crate::deterministic`]) keeps its
//! promise with dropout on.
//!
//! The Fabric sets the keys of each batch (or chunk) it runs
//! ([`with_sample_keys`]); [`keyed_dropout`] reads them.

use std::cell::Cell;

use candle_core::{Device, Tensor};

/// Where a batch's masks come from: the run's seed, the step (an optimizer
/// step's micro-batch counted within it) and the global index of the
/// batch's first sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleKeys {
    /// The run's seed.
    pub seed: u64,
    /// Which forward of the run: the step and its micro-batch.
    pub step: u64,
    /// The first row's index among the samples of the step.
    pub first: u64,
}

thread_local! {
    static CURRENT: Cell<Option<SampleKeys>> = const { Cell::new(None) };
}

/// Runs `f` with `keys` as this thread's sample keys (the ones before
/// put back after, on unwind too).
pub fn with_sample_keys<R>(keys: SampleKeys, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<SampleKeys>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(Some(keys))));
    f()
}

/// This thread's sample keys, if a Fabric step set them.
pub fn sample_keys() -> Option<SampleKeys> {
    CURRENT.with(Cell::get)
}

/// Dropout of `x` (its first dimension the samples: the keys name rows
/// of the batch, so a `(batch x time, width)` input would key each
/// position as a sample) with probability `p`, the kept
/// values scaled by `1 / (1 - p)` as candle's and PyTorch's: in training
/// only, its mask keyed by the sample ([`SampleKeys`]) and by `layer`
/// (distinct for each dropout of the model, the same each time it runs).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::ops::dropout::{keyed_dropout, with_sample_keys, SampleKeys};
///
/// let x = Tensor::ones((4, 8), candle_core::DType::F32, &Device::Cpu)?;
/// let keys = SampleKeys { seed: 7, step: 0, first: 0 };
/// let all = with_sample_keys(keys, || keyed_dropout(&x, 0.5, 3, true))?;
/// // Rows 2 and 3 alone, as another rank would see them: the same mask.
/// let keys = SampleKeys { first: 2, ..keys };
/// let part = with_sample_keys(keys, || keyed_dropout(&x.narrow(0, 2, 2)?, 0.5, 3, true))?;
/// assert_eq!(all.narrow(0, 2, 2)?.to_vec2::<f32>()?, part.to_vec2::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// In training with `p` above 0 and no keys set (outside a Fabric step,
/// give them with [`with_sample_keys`]); `p` outside `[0, 1)`.
pub fn keyed_dropout(x: &Tensor, p: f64, layer: u64, train: bool) -> candle_core::Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!("dropout probability {p} is not in [0, 1)");
    }
    if !train || p == 0.0 {
        return Ok(x.clone());
    }
    let Some(keys) = sample_keys() else {
        candle_core::bail!(
            "keyed dropout (layer {layer}) found no sample keys on this thread: the Fabric sets \
             them around the forward it runs (single, dp's replicas, the DDP family, FSDP, \
             HSDP; not a pipeline's stages); elsewhere give them with with_sample_keys"
        );
    };
    let rows = x.dim(0)?;
    let per_row = x.elem_count() / rows.max(1);
    let base = mix(mix(mix(keys.seed) ^ keys.step) ^ layer.wrapping_mul(0x9e37_79b9));
    let keep = (1.0 / (1.0 - p)) as f32;
    let mut mask = Vec::with_capacity(x.elem_count());
    for r in 0..rows {
        let sample = mix(base ^ (keys.first + r as u64));
        for i in 0..per_row {
            let u = (mix(sample ^ i as u64) >> 11) as f64 / (1u64 << 53) as f64;
            mask.push(if u < p { 0.0 } else { keep });
        }
    }
    let mask = Tensor::from_vec(mask, x.shape(), &Device::Cpu)?
        .to_dtype(x.dtype())?
        .to_device(x.device())?;
    x * mask
}

/// SplitMix64's finaliser: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn about_p_of_the_elements_are_dropped_and_the_rest_scaled() {
        let x = Tensor::ones((64, 100), candle_core::DType::F32, &Device::Cpu).unwrap();
        let keys = SampleKeys {
            seed: 1,
            step: 2,
            first: 0,
        };
        let y = with_sample_keys(keys, || keyed_dropout(&x, 0.25, 0, true)).unwrap();
        let v = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let dropped = v.iter().filter(|&&e| e == 0.0).count() as f64 / v.len() as f64;
        assert!((dropped - 0.25).abs() < 0.02, "{dropped}");
        assert!(v.iter().all(|&e| e == 0.0 || (e - 1.0 / 0.75).abs() < 1e-6));
        // Another step, another mask; no keys, an error; evaluation, x.
        let next = with_sample_keys(SampleKeys { step: 3, ..keys }, || {
            keyed_dropout(&x, 0.25, 0, true)
        })
        .unwrap();
        assert_ne!(next.flatten_all().unwrap().to_vec1::<f32>().unwrap(), v);
        assert!(keyed_dropout(&x, 0.25, 0, true).is_err());
        assert!(keyed_dropout(&x, 1.0, 0, false).is_err());
        let eval = keyed_dropout(&x, 0.25, 0, false).unwrap();
        assert_eq!(
            eval.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![1.0; 6400]
        );
    }
}
