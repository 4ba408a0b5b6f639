//! A forward run unit by unit, kept for a backward unit by unit.

use candle_core::backprop::GradStore;
use candle_core::{ModuleT, Tensor, Var};

use super::boundary;

/// What the forward kept of each unit: the leaf its graph starts from
/// (none for the first unit, or after an output that is not floating
/// point) and its output.
pub(crate) struct Trace {
    leaves: Vec<Option<Var>>,
    outputs: Vec<Tensor>,
}

impl Trace {
    /// Runs `units` on `x`, each on a leaf holding a detached copy of the
    /// previous unit's output.
    pub(crate) fn forward(
        units: &[Box<dyn ModuleT>],
        x: &Tensor,
        train: bool,
    ) -> candle_core::Result<Trace> {
        let mut leaves = Vec::with_capacity(units.len());
        let mut outputs: Vec<Tensor> = Vec::with_capacity(units.len());
        for unit in units {
            let (leaf, input) = match outputs.last() {
                None => (None, x.clone()),
                Some(prev) if prev.dtype().is_float() => {
                    let leaf = boundary::leaf(prev)?;
                    let input = leaf.as_tensor().clone();
                    (Some(leaf), input)
                }
                Some(prev) => (None, prev.detach()),
            };
            outputs.push(unit.forward_t(&input, train)?);
            leaves.push(leaf);
        }
        Ok(Trace { leaves, outputs })
    }

    /// The model's output (the last unit's), with the last unit's graph; for
    /// no units, `x` itself is not kept, so `None`.
    pub(crate) fn output(&self) -> Option<&Tensor> {
        self.outputs.last()
    }

    /// Back-propagates `loss` (computed from [`output`](Self::output)) unit
    /// by unit, last first: `on_unit(k, grads)` sees the gradients of unit
    /// `k`'s backward alone (a weight tied across units gets one
    /// contribution per unit). Each unit's activations are dropped once
    /// its backward ran. A unit whose output got no gradient (the loss
    /// does not depend on it) ends the walk: the earlier units get none.
    pub(crate) fn backward<E>(
        self,
        loss: &Tensor,
        mut on_unit: impl FnMut(usize, GradStore) -> Result<(), E>,
    ) -> Result<(), E>
    where
        E: From<candle_core::Error>,
    {
        let Trace { leaves, outputs } = self;
        let last = outputs.len().checked_sub(1);
        let mut grad: Option<Tensor> = None;
        for (k, (leaf, output)) in leaves.into_iter().zip(outputs).enumerate().rev() {
            let grads = if Some(k) == last {
                loss.backward()?
            } else {
                let Some(g) = grad.take() else {
                    return Ok(());
                };
                boundary::backward_from(&output, &g)?
            };
            grad = leaf.and_then(|leaf| grads.get(leaf.as_tensor()).cloned());
            on_unit(k, grads)?;
        }
        Ok(())
    }
}
