//! [`Trainables`]: what a strategy trains on a rank, the variables of its
//! model and the optimizer over those it steps, whole or (ZeRO) each rank
//! stepping its pieces.

use std::fmt;

use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::VarMap;

use super::{bytes_of, Memory};
use crate::error::Result;
use crate::optim::StatefulOptimizer;
use crate::util::vars::sorted_vars;
use crate::zero::ZeroOptimizer;

/// The optimizer, whole or as ZeRO's pieces.
pub(super) enum Stepper<O> {
    Whole(O),
    Zero(Box<ZeroOptimizer<O>>),
}

/// What a strategy trains on this rank: the variables of its model (a
/// pipeline's rank: its stages'), the variables the gradients are keyed by
/// (the model's, FSDP's pieces, or with ZeRO the whole parameters whose
/// pieces the optimizer steps), and the optimizer.
pub struct Trainables<O> {
    pub(super) varmap: VarMap,
    pub(super) vars: Vec<Var>,
    pub(super) stepper: Stepper<O>,
}

impl<O: StatefulOptimizer> Trainables<O> {
    /// The model's variables `varmap`, and the optimizer `make` over
    /// `named`, the variables it steps.
    ///
    /// # Errors
    ///
    /// `make`'s.
    pub fn build<F>(varmap: VarMap, named: Vec<(String, Var)>, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let vars = named.iter().map(|(_, v)| v.clone()).collect();
        Ok(Self {
            varmap,
            vars,
            stepper: Stepper::Whole(make(named)?),
        })
    }

    /// The model's variables `varmap`, and the optimizer `make` over all
    /// of them, sorted by name.
    ///
    /// # Errors
    ///
    /// `make`'s.
    pub fn over_all<F>(varmap: VarMap, make: F) -> Result<Self>
    where
        F: FnOnce(Vec<(String, Var)>) -> candle_core::Result<O>,
    {
        let named = sorted_vars(&varmap);
        Self::build(varmap, named, make)
    }

    /// The model's variables `varmap`, each rank stepping its pieces of
    /// them with `zero`.
    pub(super) fn zero(varmap: VarMap, zero: ZeroOptimizer<O>) -> Self {
        Self {
            varmap,
            vars: zero.grad_vars(),
            stepper: Stepper::Zero(Box::new(zero)),
        }
    }

    /// The variables of this rank's model.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// The variables the gradients are keyed by.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The optimizer (with ZeRO, this rank's, over its pieces).
    pub fn optimizer(&self) -> &O {
        match &self.stepper {
            Stepper::Whole(opt) => opt,
            Stepper::Zero(zero) => zero.inner(),
        }
    }

    /// The optimizer, to set its rates.
    pub fn optimizer_mut(&mut self) -> &mut O {
        match &mut self.stepper {
            Stepper::Whole(opt) => opt,
            Stepper::Zero(zero) => zero.inner_mut(),
        }
    }

    /// Steps the optimizer with the step's gradients.
    ///
    /// # Errors
    ///
    /// The optimizer's.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        match &mut self.stepper {
            Stepper::Whole(opt) => Ok(opt.step(grads)?),
            Stepper::Zero(zero) => zero.step(grads),
        }
    }

    /// The model's variables' bytes and the optimizer state's (ZeRO: this
    /// rank's pieces').
    ///
    /// # Errors
    ///
    /// The optimizer's state cannot be copied.
    pub fn memory(&self) -> Result<Memory> {
        let optimizer_state = match &self.stepper {
            Stepper::Whole(opt) => super::states::optimizer_bytes(opt)?,
            Stepper::Zero(zero) => zero.state_bytes()?,
        };
        Ok(Memory {
            parameters: bytes_of(&sorted_vars(&self.varmap)),
            optimizer_state,
            ..Memory::default()
        })
    }
}

impl<O> fmt::Debug for Trainables<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let zero = matches!(self.stepper, Stepper::Zero(_));
        f.debug_struct("Trainables")
            .field("vars", &self.vars.len())
            .field("zero", &zero)
            .finish_non_exhaustive()
    }
}
