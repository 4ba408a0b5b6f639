//! BatchNorm running statistics over the whole batch, not per micro-batch
//! (torchgpipe's `deferred_batch_norm`, with PyTorch's unbiased variance),
//! with no change to the model.
//!
//! A BatchNorm in training normalises each micro-batch by its own
//! statistics (as in every pipeline), and would also fold each
//! micro-batch's statistics into its running mean and variance, one
//! momentum update per micro-batch. Instead, the stage records the mean and
//! the sum of squared deviations of the layer's input, micro-batch by
//! micro-batch, merges them exactly (Chan's parallel formula, in f64), and
//! at the end of the step lets the layer make one update from a two-row
//! input with the whole batch's mean and unbiased variance: the layer's own
//! momentum and formula, so nothing about the layer needs to be known.
//!
//! That works when the layer's input is what the BatchNorm normalises
//! (the BatchNorm is a layer of its own). The first time a layer updates
//! buffers, the stage checks it: the layer's real update must equal the
//! one two-row inputs give (with two patterns across channels). A layer
//! that fails the check (a block with a BatchNorm inside, a norm with
//! another formula) keeps its per micro-batch updates, with a warning. The
//! check is made once per layer, on its first training micro-batch with at
//! least two values per channel; until then its updates are per
//! micro-batch. Two
//! layers sharing one norm's buffers are deferred together, in layer order,
//! as on one device; if only one of them passes the check, the deferral
//! wins.

use std::cell::Cell;

use candle_core::{DType, Tensor};

use super::stage::{Stage, StageVar};

/// A layer that updates a pair of BatchNorm buffers.
#[derive(Debug)]
pub(crate) struct NormUse {
    /// The layer's index within its stage.
    pub(crate) layer: usize,
    /// Indices of `running_mean` and `running_var` in the stage's buffers.
    mean: usize,
    var: usize,
    /// Whether the deferral is exact for this layer (unknown until its
    /// first training forward on at least two values per channel).
    deferrable: Cell<Option<bool>>,
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
                            deferrable: Cell::new(None),
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

    /// Two rows whose per-channel mean is `self.mean` and whose unbiased
    /// variance is `self.unbiased_var()`, shaped `(2, C, 1, …)` for a layer
    /// that takes inputs of `rank` dimensions. `alternate` flips the
    /// spread of every other channel: the same per-channel moments, another
    /// pattern across channels (only a layer that mixes channels before its
    /// norm can tell the two apart).
    fn two_rows(&self, rank: usize, like: &Tensor, alternate: bool) -> candle_core::Result<Tensor> {
        let mut half_spread = (self.unbiased_var()? / 2.0)?.sqrt()?;
        if alternate {
            let channels = half_spread.dim(0)?;
            let signs: Vec<f64> = (0..channels)
                .map(|c| if c % 2 == 0 { 1.0 } else { -1.0 })
                .collect();
            let signs = Tensor::new(signs, half_spread.device())?;
            half_spread = (half_spread * signs)?;
        }
        let rows = Tensor::stack(
            &[(&self.mean + &half_spread)?, (&self.mean - &half_spread)?],
            0,
        )?;
        let mut shape = rows.dims().to_vec();
        shape.resize(rank.max(2), 1);
        rows.reshape(shape)?.to_dtype(like.dtype())
    }
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
    pub(crate) fn start(stage: &Stage) -> candle_core::Result<NormStep> {
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
    fn rewind(&self, stage: &Stage, u: &NormUse) -> candle_core::Result<()> {
        for i in [u.mean, u.var] {
            if let (Some(buffer), Some(start)) = (stage.buffers.get(i), self.start.get(i)) {
                buffer.local.set(start)?;
            }
        }
        Ok(())
    }
}

/// The training forward of layer `k`, which updates BatchNorm buffers:
/// records its input's moments for the deferred update.
pub(crate) fn forward_layer(
    stage: &Stage,
    k: usize,
    x: &Tensor,
    step: &mut NormStep,
) -> candle_core::Result<Tensor> {
    let uses: Vec<usize> = (0..stage.norms.len())
        .filter(|&i| stage.norms[i].layer == k)
        .collect();
    // A layer about to be checked updates from the start values, so that
    // its update can be compared with the two-row ones.
    let values_per_channel = match x.dims() {
        [_, channels, ..] if *channels > 0 => x.elem_count() / channels,
        _ => 0,
    };
    for &i in &uses {
        if stage.norms[i].deferrable.get().is_none() && values_per_channel >= 2 {
            step.rewind(stage, &stage.norms[i])?;
        }
    }
    let output = stage.layers[k].forward_t(x, true)?;
    for &i in &uses {
        let u = &stage.norms[i];
        if u.deferrable.get() == Some(false) {
            continue;
        }
        let channels = stage.buffers[u.mean].local.elem_count();
        let Some(moments) = Moments::of(x, channels)? else {
            not_deferrable(stage, u, "its input has no dimension 1 of that size");
            continue;
        };
        if u.deferrable.get().is_none() && moments.count >= 2.0 {
            if check(stage, u, x.rank(), &moments, step)? {
                u.deferrable.set(Some(true));
            } else {
                not_deferrable(
                    stage,
                    u,
                    "its update is not the one of its input's statistics",
                );
                continue;
            }
        }
        step.moments[i] = Some(match step.moments[i].take() {
            Some((earlier, _)) => (earlier.merge(moments)?, x.rank()),
            None => (moments, x.rank()),
        });
    }
    Ok(output)
}

fn not_deferrable(stage: &Stage, u: &NormUse, why: &str) {
    u.deferrable.set(Some(false));
    tracing::warn!(
        "pipeline: layer {} updates `{}` but {why}; its running statistics follow the micro-batches (a BatchNorm as a layer of its own gets them over the whole batch)",
        stage.first + u.layer,
        stage.buffers[u.mean].name,
    );
}

/// Whether layer `u`'s real update (just made from the start values) is
/// the one two-row inputs with `moments` give, with two patterns across
/// channels (a two-row micro-batch is itself such an input, so one pattern
/// could match a layer that mixes channels by chance). Leaves every buffer
/// as the real update left it.
fn check(
    stage: &Stage,
    u: &NormUse,
    rank: usize,
    moments: &Moments,
    step: &NormStep,
) -> candle_core::Result<bool> {
    let (mean, var) = (&stage.buffers[u.mean].local, &stage.buffers[u.var].local);
    // The layer may update other buffers too (a block with two norms).
    let real: Vec<Tensor> = stage
        .buffers
        .iter()
        .map(|b| b.local.as_tensor().copy())
        .collect::<candle_core::Result<_>>()?;
    let mut agree = true;
    for alternate in [false, true] {
        step.rewind(stage, u)?;
        let ran = moments
            .two_rows(rank, mean.as_tensor(), alternate)
            .and_then(|rows| stage.layers[u.layer].forward_t(&rows, true));
        let synthetic = (mean.as_tensor().copy()?, var.as_tensor().copy()?);
        for (buffer, value) in stage.buffers.iter().zip(&real) {
            buffer.local.set(value)?;
        }
        agree = agree
            && ran.is_ok()
            && close(u, moments, step, (&real[u.mean], &real[u.var]), &synthetic)?;
    }
    Ok(agree)
}

/// Whether two updates of `u`'s buffers agree within the rounding of
/// their dtype.
fn close(
    u: &NormUse,
    moments: &Moments,
    step: &NormStep,
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
    let (start_mean, start_var) = (f64s(&step.start[u.mean])?, f64s(&step.start[u.var])?);
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
    stage: &Stage,
    step: &mut NormStep,
) -> candle_core::Result<Vec<(candle_core::Var, Tensor)>> {
    let deferred: Vec<(usize, (Moments, usize))> = (0..stage.norms.len())
        .filter(|&i| stage.norms[i].deferrable.get() == Some(true))
        .filter_map(|i| step.moments[i].take().map(|m| (i, m)))
        // One micro-batch: the layer's own update already is the batch's.
        .filter(|(_, (m, _))| m.parts > 1)
        .collect();
    for (i, _) in &deferred {
        step.rewind(stage, &stage.norms[*i])?;
    }
    for (i, (moments, rank)) in &deferred {
        let u = &stage.norms[*i];
        let rows = moments.two_rows(*rank, stage.buffers[u.mean].local.as_tensor(), false)?;
        stage.layers[u.layer].forward_t(&rows, true)?;
    }
    stage
        .buffers
        .iter()
        .map(|b| Ok((b.master.clone(), b.local.as_tensor().copy()?)))
        .collect()
}
