//! How the layers of a pipeline are split into stages.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::{Init, VarBuilder, VarMap};

use super::UnitFactory;
use crate::error::{Error, Result};
use crate::units::build_layer;
use crate::util::lock::lock;
use crate::util::shared_backend::SharedBackend;

/// How many consecutive layers each stage gets.
#[derive(Debug, Clone)]
pub enum Balance {
    /// These many layers per stage, in order (torchgpipe's `balance`).
    Explicit(Vec<usize>),
    /// As equal counts as possible, the first stages taking one more.
    Uniform,
    /// Contiguous stages whose largest parameter footprint (bytes) is as
    /// small as it can be (DeepSpeed's `partition_method="parameters"`).
    /// Counted without allocating: no layer's values are created.
    ParameterBytes,
    /// Contiguous stages whose slowest one is as fast as it can be
    /// (torchgpipe's `balance_by_time`): each layer alone is built on the
    /// first device in a scratch `VarMap` and timed, forward and backward,
    /// on `sample` (a micro-batch of inputs) and the activations before it.
    Time {
        /// A representative micro-batch of the pipeline's input.
        sample: Tensor,
    },
}

/// The number of layers per stage for `balance`.
pub(crate) fn layers_per_stage(
    balance: &Balance,
    layers: &[UnitFactory],
    stages: usize,
    dtype: DType,
    device: &Device,
) -> Result<Vec<usize>> {
    let invalid = |reason: String| Error::InvalidBalance {
        layers: layers.len(),
        stages,
        reason,
    };
    if stages == 0 {
        return Err(invalid("a pipeline needs at least one device".into()));
    }
    if layers.len() < stages {
        return Err(invalid("every stage needs at least one layer".into()));
    }
    match balance {
        Balance::Explicit(sizes) => {
            if sizes.len() != stages {
                return Err(invalid(format!(
                    "{sizes:?} has {} entries, one per stage is needed",
                    sizes.len()
                )));
            }
            if let Some(stage) = sizes.iter().position(|&n| n == 0) {
                return Err(invalid(format!("{sizes:?} gives stage {stage} no layer")));
            }
            let total = sizes.iter().try_fold(0usize, |a, &n| a.checked_add(n));
            if total != Some(layers.len()) {
                return Err(invalid(format!(
                    "{sizes:?} does not add up to the {} layers",
                    layers.len()
                )));
            }
            Ok(sizes.clone())
        }
        Balance::Uniform => {
            let (base, extra) = (layers.len() / stages, layers.len() % stages);
            Ok((0..stages).map(|s| base + usize::from(s < extra)).collect())
        }
        Balance::ParameterBytes => Ok(min_max_split(&parameter_bytes(layers, dtype)?, stages)),
        Balance::Time { sample } => {
            let costs: Vec<f64> = layer_times(layers, sample, dtype, device)?
                .iter()
                .map(Duration::as_secs_f64)
                .collect();
            Ok(min_max_split(&costs, stages))
        }
    }
}

/// Splits `costs` into `parts` contiguous non-empty runs whose largest sum
/// is the smallest possible (the earliest such split on ties).
/// `costs.len() >= parts >= 1`.
pub(crate) fn min_max_split(costs: &[f64], parts: usize) -> Vec<usize> {
    let n = costs.len();
    let prefix: Vec<f64> = std::iter::once(0.)
        .chain(costs.iter().scan(0., |sum, c| {
            *sum += c;
            Some(*sum)
        }))
        .collect();
    // best[k][i]: the smallest largest-run sum of the first i costs in k runs;
    // cut[k][i]: where the last of those runs starts.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                let worst = best[k - 1][j].max(prefix[i] - prefix[j]);
                if worst < best[k][i] {
                    best[k][i] = worst;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut sizes = vec![0; parts];
    let mut end = n;
    for k in (1..=parts).rev() {
        let start = cut[k][end];
        sizes[k - 1] = end - start;
        end = start;
    }
    sizes
}

/// Bytes of the variables each layer creates first (a variable shared by
/// several layers counts once, for the first).
fn parameter_bytes(layers: &[UnitFactory], dtype: DType) -> Result<Vec<f64>> {
    let counter = std::sync::Arc::new(CountingBackend::default());
    let mut seen = HashSet::new();
    layers
        .iter()
        .enumerate()
        .map(|(index, factory)| {
            let vb = VarBuilder::from_backend(
                Box::new(SharedBackend(counter.clone())),
                dtype,
                Device::Cpu,
            );
            build_layer(factory, index, vb)?;
            let created = std::mem::take(&mut *lock(&counter.created));
            Ok(created
                .into_iter()
                .filter(|(name, _)| seen.insert(name.clone()))
                .map(|(_, bytes)| bytes as f64)
                .sum())
        })
        .collect()
}

/// A `VarBuilder` backend that records what a layer asks for and hands out
/// zero-stride tensors: no memory for the values.
#[derive(Default)]
struct CountingBackend {
    created: Mutex<Vec<(String, usize)>>,
}

impl candle_nn::var_builder::SimpleBackend for CountingBackend {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _init: Init,
        dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let bytes = shape.elem_count() * dtype.size_in_bytes();
        lock(&self.created).push((name.to_string(), bytes));
        Tensor::zeros((), dtype, &Device::Cpu)?.broadcast_as(shape)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!(
            "balancing by parameter bytes needs the shape of `{name}`: build it with a shape (VarBuilder::get), or give an explicit balance"
        )
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        false
    }
}

/// How long each layer takes, forward and backward, on `device` and the
/// activations `sample` produces before it: the fastest of three runs.
fn layer_times(
    layers: &[UnitFactory],
    sample: &Tensor,
    dtype: DType,
    device: &Device,
) -> Result<Vec<Duration>> {
    let mut input = crate::device_copy::to_device(sample, device)?;
    let mut times = Vec::with_capacity(layers.len());
    for (index, factory) in layers.iter().enumerate() {
        // One layer at a time, in a scratch VarMap: the model never exists
        // whole on one device.
        let scratch = VarMap::new();
        let layer = build_layer(
            factory,
            index,
            VarBuilder::from_varmap(&scratch, dtype, device),
        )?;
        let leaf = Var::from_tensor(&input.detach())?;
        let mut fastest = Duration::MAX;
        let mut output = None;
        for _ in 0..3 {
            let start = Instant::now();
            // Named like a factory's failure: a layer that cannot run on
            // the sample fails `build`, and no panic escapes it.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let out = layer.forward_t(leaf.as_tensor(), true)?;
                out.sum_all()?.backward()?;
                Ok(out)
            }))
            .unwrap_or_else(|payload| {
                Err(candle_core::Error::Msg(format!(
                    "panicked: {}",
                    crate::util::panic_message::panic_message(payload.as_ref())
                )))
            });
            let out = ran.map_err(|e| Error::LayerBuild {
                layer: index,
                source: candle_core::Error::Msg(format!(
                    "timing its forward and backward on the sample (Balance::Time) failed: {e}"
                )),
            })?;
            fastest = fastest.min(start.elapsed());
            output = Some(out);
        }
        times.push(fastest);
        if let Some(out) = output {
            input = out.detach();
        }
    }
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_max_split_minimises_the_largest_stage() {
        assert_eq!(min_max_split(&[1., 1., 1., 1.], 2), vec![2, 2]);
        assert_eq!(min_max_split(&[4., 1., 1., 1., 1.], 2), vec![1, 4]);
        assert_eq!(min_max_split(&[1., 2., 3., 4., 5.], 3), vec![3, 1, 1]);
        assert_eq!(min_max_split(&[5., 0., 0.], 3), vec![1, 1, 1]);
        assert_eq!(min_max_split(&[2., 3.], 1), vec![2]);
    }
}
