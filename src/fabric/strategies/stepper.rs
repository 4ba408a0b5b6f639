//! The optimizer as a strategy that may shard it holds it: whole, or
//! (ZeRO) each rank stepping its pieces.

use candle_core::backprop::GradStore;
use candle_core::Var;

use super::whole_state::optimizer_bytes;
use crate::error::Result;
use crate::optim::StatefulOptimizer;
use crate::zero::ZeroOptimizer;

/// The optimizer, whole or as ZeRO's pieces.
pub(super) enum Stepper<O> {
    Whole(O),
    Zero(Box<ZeroOptimizer<O>>),
}

impl<O: StatefulOptimizer> Stepper<O> {
    /// A ZeRO optimizer, with the variables its gradients are keyed by.
    pub(super) fn zero(zero: ZeroOptimizer<O>) -> (Self, Vec<Var>) {
        let vars = zero.grad_vars();
        (Stepper::Zero(Box::new(zero)), vars)
    }

    pub(super) fn inner(&self) -> &O {
        match self {
            Stepper::Whole(opt) => opt,
            Stepper::Zero(zero) => zero.inner(),
        }
    }

    pub(super) fn inner_mut(&mut self) -> &mut O {
        match self {
            Stepper::Whole(opt) => opt,
            Stepper::Zero(zero) => zero.inner_mut(),
        }
    }

    pub(super) fn step(&mut self, grads: &GradStore) -> Result<()> {
        match self {
            Stepper::Whole(opt) => Ok(opt.step(grads)?),
            Stepper::Zero(zero) => zero.step(grads),
        }
    }

    /// The bytes of its state (ZeRO: this rank's pieces').
    pub(super) fn state_bytes(&self) -> Result<usize> {
        match self {
            Stepper::Whole(opt) => optimizer_bytes(opt),
            Stepper::Zero(zero) => zero.state_bytes(),
        }
    }
}
