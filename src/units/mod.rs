//! A model given as units: an ordered list of parts, each built by its own
//! factory, as a [`Pipeline`](crate::pipeline::Pipeline)'s layers are (the
//! same [`UnitFactory`] and [`layer`]).
//!
//! Given whole, a model's backward is one call: candle computes every
//! gradient before returning any, so nothing can start on the first ones.
//! Given as units, the forward runs each unit on a detached copy of the
//! previous unit's output (a leaf), and the backward runs unit by unit, last
//! first, handing each unit the gradient of its output (one injection per
//! unit: `sum(output * grad)`, whose gradient is exactly `grad`). Between
//! two units the caller sees the gradients that are final: the
//! [`DistributedDataParallel`](crate::DistributedDataParallel) overlap
//! reduces them while the earlier units' backward computes.
//!
//! Weights may be tied across units (a language model's embedding and
//! head): their contributions are summed, and they are final after the
//! earliest unit that uses them.
//!
//! As a [`ModuleT`], `Units` is the plain model: its forward chains the
//! units in one graph, for evaluation, for a drop-in `loss.backward()`, or
//! for any engine that takes a module.
//!
//! ```
//! use candle_core::{DType, Device, ModuleT, Tensor};
//! use candle_dp::pipeline::unit;
//! use candle_dp::units::Units;
//! use candle_nn::{linear, Activation, VarBuilder, VarMap};
//!
//! # fn main() -> anyhow::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let units = Units::build(vb, &[
//!     unit(|vb| linear(4, 8, vb.pp("l1"))),
//!     unit(|_| Ok(Activation::Relu)),
//!     unit(|vb| linear(8, 2, vb.pp("l2"))),
//! ])?;
//! assert_eq!(units.len(), 3);
//! assert_eq!(units.vars_of(2), ["l2.bias", "l2.weight"]);
//! let y = units.forward_t(&Tensor::ones((3, 4), DType::F32, &Device::Cpu)?, false)?;
//! assert_eq!(y.dims(), [3, 2]);
//! # Ok(())
//! # }
//! ```

pub(crate) mod boundary;
mod factory;
mod fingerprint;
mod record;
mod trace;

use candle_core::{ModuleT, Tensor};
use candle_nn::VarBuilder;

pub(crate) use factory::build_layer;
#[allow(deprecated)]
pub use factory::{layer, LayerFactory};
pub use factory::{unit, UnitFactory};
pub(crate) use fingerprint::{fingerprint, Fingerprint};
pub(crate) use trace::Trace;

use crate::error::Result;
use record::Recording;

/// A model as an ordered list of units. See the [module docs](self).
pub struct Units {
    units: Vec<Box<dyn ModuleT>>,
    /// Per unit, the names of the variables it asked its `VarBuilder` for,
    /// sorted.
    vars: Vec<Vec<String>>,
}

impl Units {
    /// Builds each unit from `factories`, in order, from `vb` (the model's
    /// `VarBuilder`, whose root the units' paths start from), recording
    /// which variables each unit uses. A factory's error or panic is
    /// [`Error::LayerBuild`](crate::Error::LayerBuild) naming its index.
    pub fn build(vb: VarBuilder, factories: &[UnitFactory]) -> Result<Units> {
        let recording = Recording::new(&vb);
        let mut units = Vec::with_capacity(factories.len());
        let mut vars = Vec::with_capacity(factories.len());
        for (index, factory) in factories.iter().enumerate() {
            units.push(build_layer(factory, index, recording.builder())?);
            vars.push(recording.take());
        }
        Ok(Units { units, vars })
    }

    /// The number of units.
    pub fn len(&self) -> usize {
        self.units.len()
    }

    /// Whether there are no units (the model is the identity).
    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// The names of the variables unit `index` uses, sorted (none for an
    /// index out of range).
    pub fn vars_of(&self, index: usize) -> &[String] {
        self.vars.get(index).map_or(&[], Vec::as_slice)
    }

    /// For each variable name, the first unit that uses it: the unit after
    /// whose backward its gradient is final.
    pub(crate) fn first_use(&self) -> std::collections::HashMap<&str, usize> {
        let mut first = std::collections::HashMap::new();
        for (unit, names) in self.vars.iter().enumerate() {
            for name in names {
                first.entry(name.as_str()).or_insert(unit);
            }
        }
        first
    }

    /// The variables in the order their gradients become final in a
    /// backward unit by unit: the last unit's first, each variable at the
    /// earliest unit that uses it (a tied weight with that unit), sorted
    /// by name within a unit. DDP fills its buckets in this order, as
    /// PyTorch fills them in reverse registration order.
    pub fn bucket_order(&self) -> Vec<String> {
        let first = self.first_use();
        let mut order = Vec::new();
        for (unit, names) in self.vars.iter().enumerate().rev() {
            order.extend(
                names
                    .iter()
                    .filter(|name| first.get(name.as_str()) == Some(&unit))
                    .cloned(),
            );
        }
        order
    }

    /// Runs the units with a leaf between each two, for a backward unit by
    /// unit ([`Trace::backward`]).
    pub(crate) fn forward_traced(&self, x: &Tensor, train: bool) -> candle_core::Result<Trace> {
        Trace::forward(&self.units, x, train)
    }
}

impl ModuleT for Units {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.units
            .iter()
            .try_fold(x.clone(), |h, unit| unit.forward_t(&h, train))
    }
}

impl std::fmt::Debug for Units {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Units")
            .field("units", &self.units.len())
            .field("vars", &self.vars)
            .finish()
    }
}
