//! BatchNorm running statistics over the whole batch, not per micro-batch
//! (torchgpipe's `deferred_batch_norm`, with PyTorch's unbiased variance),
//! with no change to the model.
//!
//! A BatchNorm in training normalises each micro-batch by its own
//! statistics (as in every pipeline), and would also fold each
//! micro-batch's statistics into its running mean and variance, one
//! momentum update per micro-batch. Instead, the stage records the count,
//! the mean and the sum of squared deviations of the layer's input,
//! micro-batch by micro-batch, merges them exactly (Chan's parallel
//! formula, in f64), and at the end of the step lets the layer make one
//! update from a synthetic input with the whole batch's mean and unbiased
//! variance: the layer's own momentum and formula, so nothing about the
//! layer needs to be known. The synthetic input is two rows when the
//! layer's update depends on its input's mean and variance only (candle's
//! usual `BatchNorm`), and as many values per channel as the whole batch
//! had when it depends on their count too (`remove_mean: false`, whose
//! running variance is the mean square times `n / (n - 1)`).
//!
//! That works when the layer's input is what the BatchNorm normalises
//! (the BatchNorm is a layer of its own). On a layer's first training
//! forward, the stage checks which of the two holds, on a probe of its
//! own (three rows shaped like the layer's input, negative and positive in
//! every channel, with channel means away from zero, so that neither a
//! one-row micro-batch nor a two-row one, which any two-row input
//! reproduces exactly, decides it): the layer's
//! real update of the probe must equal the one a synthetic input with the
//! probe's statistics gives (with two patterns across channels). A layer
//! that fails both (a block with a BatchNorm inside, a norm with yet
//! another formula) keeps its per micro-batch updates, with a warning. The
//! check leaves the buffers as they were. Two layers sharing one norm's
//! buffers are deferred together, in layer order, as on one device; if
//! only one of them passes the check, the deferral wins.

use std::cell::Cell;

use candle_core::{DType, ModuleT, Tensor};

use super::stage_var::StageVar;

/// What the deferral reads of a stage: its layers, the global index of the
/// first, its buffers and the layers that update them.
pub(crate) struct NormLayers<'a> {
    pub(crate) layers: &'a [Box<dyn ModuleT>],
    pub(crate) first: usize,
    pub(crate) buffers: &'a [StageVar],
    pub(crate) norms: &'a [NormUse],
}

/// A layer that updates a pair of BatchNorm buffers.
#[derive(Debug)]
pub(crate) struct NormUse {
    /// The layer's index within its stage.
    pub(crate) layer: usize,
    /// Indices of `running_mean` and `running_var` in the stage's buffers.
    mean: usize,
    var: usize,
    /// How the deferral is exact for this layer, if it is (unknown until
    /// its first training forward).
    deferral: Cell<Option<Deferral>>,
}

/// What input makes a layer's one deferred update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Deferral {
    /// Two rows with the batch's mean and unbiased variance: the update
    /// depends on those only.
    TwoRows,
    /// As many values per channel as the batch had, with its mean and
    /// unbiased variance: the update depends on the count too.
    SameCount,
    /// None: the layer's updates stay per micro-batch.
    No,
}

impl NormUse {
    /// The layers that use a `…running_mean` and its `…running_var`.
    pub(crate) fn find(used_by_layer: &[Vec<String>], buffers: &[StageVar]) -> Vec<NormUse> {
        let index = |name: &str| buffers.iter().position(|b| b.name == name);
        let mut uses = Vec::new();
        for (layer, used) in used_by_layer.iter().enumerate() {
            for name in used {
                let Some(prefix) = name.strip_suffix("running_mean") else {
                    continue;
                };
                let var_name = format!("{prefix}running_var");
                if !used.contains(&var_name) {
                    continue;
                }
                if let (Some(mean), Some(var)) = (index(name), index(&var_name)) {
                    if !uses
                        .iter()
                        .any(|u: &NormUse| u.layer == layer && u.mean == mean)
                    {
                        uses.push(NormUse {
                            layer,
                            mean,
                            var,
                            deferral: Cell::new(None),
                        });
                    }
                }
            }
        }
        uses
    }
}

/// Per-channel count, mean and sum of squared deviations of a layer's input.
struct Moments {
    count: f64,
    mean: Tensor,
    m2: Tensor,
    /// How many micro-batches were merged.
    parts: usize,
}

impl Moments {
    /// The moments of `x` over every dimension but 1 (BatchNorm's channel
    /// dimension), or `None` when `x` has no dimension 1 of `channels`.
    fn of(x: &Tensor, channels: usize) -> candle_core::Result<Option<Moments>> {
        if x.rank() < 2 || x.dim(1)? != channels {
            return Ok(None);
        }
        let x = x
            .detach()
            .transpose(0, 1)?
            .flatten_from(1)?
            .to_dtype(DType::F64)?;
        let count = x.dim(1)? as f64;
        let mean = x.mean_keepdim(1)?;
        let m2 = x.broadcast_sub(&mean)?.sqr()?.sum(1)?;
        Ok(Some(Moments {
            count,
            mean: mean.squeeze(1)?,
            m2,
            parts: 1,
        }))
    }

    /// `self` and `other` as one sample (Chan et al.), exact in f64.
    fn merge(self, other: Moments) -> candle_core::Result<Moments> {
        let count = self.count + other.count;
        let delta = (&other.mean - &self.mean)?;
        let mean = (&self.mean + (&delta * (other.count / count))?)?;
        let m2 = ((&self.m2 + &other.m2)? + (delta.sqr()? * (self.count * other.count / count))?)?;
        Ok(Moments {
            count,
            mean,
            m2,
            parts: self.parts + other.parts,
        })
    }

    fn unbiased_var(&self) -> candle_core::Result<Tensor> {
        &self.m2 / (self.count - 1.0)
    }

    /// The number of values per channel that `deferral` synthesises.
    fn synthetic_count(&self, deferral: Deferral) -> usize {
        match deferral {
            Deferral::SameCount => self.count as usize,
            Deferral::TwoRows | Deferral::No => 2,
        }
    }

    /// `count` rows whose per-channel mean is `self.mean` and whose
    /// unbiased variance is `self.unbiased_var()`, shaped `(count, C, 1,
    /// …)` for a layer that takes inputs of `rank` dimensions. `alternate`
    /// flips the spread of every other channel: the same per-channel
    /// moments, another pattern across channels (only a layer that mixes
    /// channels before its norm can tell the two apart).
    fn rows(
        &self,
        count: usize,
        rank: usize,
        like: &Tensor,
        alternate: bool,
    ) -> candle_core::Result<Tensor> {
        let mut spread = self.unbiased_var()?.sqrt()?;
        if alternate {
            let channels = spread.dim(0)?;
            let signs: Vec<f64> = (0..channels)
                .map(|c| if c % 2 == 0 { 1.0 } else { -1.0 })
                .collect();
            let signs = Tensor::new(signs, spread.device())?;
            spread = (spread * signs)?;
        }
        let pattern = Tensor::new(unit_pattern(count), spread.device())?.unsqueeze(1)?;
        let rows = pattern
            .broadcast_mul(&spread.unsqueeze(0)?)?
            .broadcast_add(&self.mean.unsqueeze(0)?)?;
        let mut shape = rows.dims().to_vec();
        shape.resize(rank.max(2), 1);
        rows.reshape(shape)?.to_dtype(like.dtype())
    }
}

/// `count` numbers with mean 0 and unbiased variance 1 (0 for one number):
/// `±a` alternating, with a 0 last when `count` is odd.
fn unit_pattern(count: usize) -> Vec<f64> {
    let paired = count - count % 2;
    let a = if count.is_multiple_of(2) && count > 0 {
        ((count as f64 - 1.0) / count as f64).sqrt()
    } else {
        1.0
    };
    let mut pattern: Vec<f64> = (0..paired)
        .map(|i| if i % 2 == 0 { a } else { -a })
        .collect();
    pattern.resize(count, 0.0);
    pattern
}

/// The rows of the check: three rows shaped like `x` past dimension 0, in
/// `x`'s dtype and device. In every channel the first row is negative and
/// the last positive (a layer that clips or rectifies before its norm, a
/// ReLU, cannot pass for the identity), the mean is away from zero (an
/// update that depends on the count shows), and no two values are alike.
fn probe(x: &Tensor) -> candle_core::Result<Tensor> {
    const ROWS: [f64; 3] = [-1.0, 0.5, 2.5];
    let mut dims = x.dims().to_vec();
    dims[0] = ROWS.len();
    let channels = dims[1].max(1);
    let count: usize = dims.iter().product();
    let per_row = (count / ROWS.len()).max(1);
    let inner = (per_row / channels).max(1);
    let values: Vec<f64> = (0..count)
        .map(|k| {
            let (row, channel) = (k / per_row, (k / inner) % channels);
            let jitter = 0.3 * (k as f64 * 0.618 + 0.3).sin();
            (ROWS[row.min(ROWS.len() - 1)] + jitter) * (1.0 + 0.05 * channel as f64)
        })
        .collect();
    Tensor::from_vec(values, dims, &candle_core::Device::Cpu)?
        .to_dtype(x.dtype())?
        .to_device(x.device())
}

/// One step's record of the stage's BatchNorm layers.
pub(crate) struct NormStep {
    /// Every buffer's value at the start of the step.
    start: Vec<Tensor>,
    /// Per [`NormUse`], the merged moments of its input so far, and the
    /// input's rank.
    moments: Vec<Option<(Moments, usize)>>,
}

impl NormStep {
    /// Records the buffers' values (after the stage's refresh).
    pub(crate) fn start(stage: &NormLayers<'_>) -> candle_core::Result<NormStep> {
        Ok(NormStep {
            start: stage
                .buffers
                .iter()
                .map(|b| b.local.as_tensor().copy())
                .collect::<candle_core::Result<_>>()?,
            moments: stage.norms.iter().map(|_| None).collect(),
        })
    }

    /// Puts the buffers of `u` back to their values at the start.
    fn rewind(&self, stage: &NormLayers<'_>, u: &NormUse) -> candle_core::Result<()> {
        for i in [u.mean, u.var] {
            if let (Some(buffer), Some(start)) = (stage.buffers.get(i), self.start.get(i)) {
                buffer.local.set(start)?;
            }
        }
        Ok(())
    }
}

/// The training forward of layer `k`, which updates BatchNorm buffers:
/// records its input's moments for the deferred update (checking first,
/// on the layer's first training forward, whether and how it can be
/// deferred).
pub(crate) fn forward_layer(
    stage: &NormLayers<'_>,
    k: usize,
    x: &Tensor,
    step: &mut NormStep,
) -> candle_core::Result<Tensor> {
    let uses: Vec<usize> = (0..stage.norms.len())
        .filter(|&i| stage.norms[i].layer == k)
        .collect();
    for &i in &uses {
        let u = &stage.norms[i];
        if u.deferral.get().is_none() {
            let channels = stage.buffers[u.mean].local.elem_count();
            if x.rank() < 2 || x.dim(1)? != channels {
                not_deferrable(stage, u, "its input has no dimension 1 of that size");
                continue;
            }
            let deferral = check(stage, u, x)?;
            u.deferral.set(Some(deferral));
            if deferral == Deferral::No {
                not_deferrable(
                    stage,
                    u,
                    "its update is not the one of its input's statistics",
                );
            }
        }
    }
    let output = stage.layers[k].forward_t(x, true)?;
    for &i in &uses {
        let u = &stage.norms[i];
        if u.deferral.get() == Some(Deferral::No) {
            continue;
        }
        let channels = stage.buffers[u.mean].local.elem_count();
        let Some(moments) = Moments::of(x, channels)? else {
            not_deferrable(stage, u, "its input has no dimension 1 of that size");
            continue;
        };
        step.moments[i] = Some(match step.moments[i].take() {
            Some((earlier, _)) => (earlier.merge(moments)?, x.rank()),
            None => (moments, x.rank()),
        });
    }
    Ok(output)
}

fn not_deferrable(stage: &NormLayers<'_>, u: &NormUse, why: &str) {
    u.deferral.set(Some(Deferral::No));
    tracing::warn!(
        "pipeline: layer {} updates `{}` but {why}; its running statistics follow the micro-batches (a BatchNorm as a layer of its own gets them over the whole batch)",
        stage.first + u.layer,
        stage.buffers[u.mean].name,
    );
}

/// How layer `u`, whose inputs are shaped like `x`, can be deferred: its
/// real update of a [`probe`] is compared with the updates synthetic
/// inputs with the probe's statistics give, two rows first, then as many
/// values per channel as the probe has; each with two patterns across
/// channels (one pattern could match a layer that mixes channels by
/// chance). Leaves every buffer as it was.
fn check(stage: &NormLayers<'_>, u: &NormUse, x: &Tensor) -> candle_core::Result<Deferral> {
    let (mean, var) = (&stage.buffers[u.mean].local, &stage.buffers[u.var].local);
    let channels = mean.elem_count();
    if x.rank() < 2 || x.dim(1)? != channels {
        return Ok(Deferral::No);
    }
    let probe = probe(x)?;
    let Some(moments) = Moments::of(&probe, channels)? else {
        return Ok(Deferral::No);
    };
    // The layer may update other buffers too (a block with two norms).
    let before: Vec<Tensor> = stage
        .buffers
        .iter()
        .map(|b| b.local.as_tensor().copy())
        .collect::<candle_core::Result<_>>()?;
    let restore = || -> candle_core::Result<()> {
        for (buffer, value) in stage.buffers.iter().zip(&before) {
            buffer.local.set(value)?;
        }
        Ok(())
    };
    let update_of = |input: &Tensor| -> candle_core::Result<Option<(Tensor, Tensor)>> {
        // A layer that panics on the probe is not deferred (and not
        // probed again), rather than failing every step.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            stage.layers[u.layer].forward_t(input, true)
        }))
        .unwrap_or_else(|_| Err(candle_core::Error::Msg("panicked".into())));
        let update = (mean.as_tensor().copy()?, var.as_tensor().copy()?);
        restore()?;
        Ok(ran.ok().map(|_| update))
    };
    let Some(real) = update_of(&probe)? else {
        return Ok(Deferral::No);
    };
    let start = (&before[u.mean], &before[u.var]);
    for deferral in [Deferral::TwoRows, Deferral::SameCount] {
        let mut agree = true;
        for alternate in [false, true] {
            let rows = moments.rows(
                moments.synthetic_count(deferral),
                x.rank(),
                mean.as_tensor(),
                alternate,
            )?;
            agree = agree
                && match update_of(&rows)? {
                    Some(synthetic) => close(&moments, start, (&real.0, &real.1), &synthetic)?,
                    None => false,
                };
        }
        if agree {
            return Ok(deferral);
        }
    }
    Ok(Deferral::No)
}

/// Whether two updates of `u`'s buffers agree within the rounding of
/// their dtype.
fn close(
    moments: &Moments,
    start: (&Tensor, &Tensor),
    real: (&Tensor, &Tensor),
    synthetic: &(Tensor, Tensor),
) -> candle_core::Result<bool> {
    let f64s = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
    let tolerance = match real.0.dtype() {
        DType::F64 => 1e-9,
        DType::F32 => 1e-4,
        _ => 5e-2,
    };
    let (m, sd) = (
        f64s(&moments.mean)?,
        f64s(&moments.unbiased_var()?.sqrt()?)?,
    );
    let (start_mean, start_var) = (f64s(start.0)?, f64s(start.1)?);
    let near = |a: f64, b: f64, scale: f64| {
        (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= tolerance * (scale + 1e-12)
    };
    let means_agree = f64s(real.0)?
        .iter()
        .zip(f64s(&synthetic.0)?)
        .enumerate()
        .all(|(c, (&a, b))| near(a, b, start_mean[c].abs() + m[c].abs() + sd[c]));
    let vars_agree = f64s(real.1)?
        .iter()
        .zip(f64s(&synthetic.1)?)
        .enumerate()
        .all(|(c, (&a, b))| near(a, b, start_var[c].abs() + sd[c] * sd[c]));
    Ok(means_agree && vars_agree)
}

/// The end of a successful training step on the stage: one update of each
/// deferred layer's buffers from the whole batch's statistics (in layer
/// order), then every buffer's new value with the `VarMap` variable it
/// belongs to, for the caller to commit once every stage has succeeded.
pub(crate) fn finish(
    stage: &NormLayers<'_>,
    step: &mut NormStep,
) -> candle_core::Result<Vec<(candle_core::Var, Tensor)>> {
    let deferred: Vec<(usize, (Moments, usize))> = (0..stage.norms.len())
        .filter(|&i| matches!(stage.norms[i].deferral.get(), Some(d) if d != Deferral::No))
        .filter_map(|i| step.moments[i].take().map(|m| (i, m)))
        // One micro-batch: the layer's own update already is the batch's.
        .filter(|(_, (m, _))| m.parts > 1)
        .collect();
    for (i, _) in &deferred {
        step.rewind(stage, &stage.norms[*i])?;
    }
    for (i, (moments, rank)) in &deferred {
        let u = &stage.norms[*i];
        let count = moments.synthetic_count(u.deferral.get().unwrap_or(Deferral::TwoRows));
        let rows = moments.rows(count, *rank, stage.buffers[u.mean].local.as_tensor(), false)?;
        stage.layers[u.layer].forward_t(&rows, true)?;
    }
    stage
        .buffers
        .iter()
        .map(|b| Ok((b.master.clone(), b.local.as_tensor().copy()?)))
        .collect()
}
