//! How a unit (or a pipeline's layer) is built: a factory from a
//! `VarBuilder`, run behind a guard that names the unit when it fails or
//! panics.

use std::sync::Arc;

use candle_core::ModuleT;
use candle_nn::VarBuilder;

use crate::error::{Error, Result};

/// Builds one unit (a pipeline's layer, an FSDP or DDP-overlap unit, a
/// Fabric module's part) from a `VarBuilder` on its device.
pub type UnitFactory =
    Arc<dyn Fn(VarBuilder) -> candle_core::Result<Box<dyn ModuleT>> + Send + Sync>;

/// The former name of [`UnitFactory`].
#[deprecated(note = "one word for one idea: use `UnitFactory`")]
pub type LayerFactory = UnitFactory;

/// A [`UnitFactory`] from a closure that builds any layer (every candle
/// `Module` is a `ModuleT`).
///
/// ```
/// use candle_nn::linear;
/// let l1 = candle_dp::units::unit(|vb| linear(4, 8, vb.pp("l1")));
/// # let _ = l1;
/// ```
pub fn unit<L, F>(factory: F) -> UnitFactory
where
    L: ModuleT + 'static,
    F: Fn(VarBuilder) -> candle_core::Result<L> + Send + Sync + 'static,
{
    Arc::new(move |vb| Ok(Box::new(factory(vb)?) as Box<dyn ModuleT>))
}

/// The former name of [`unit()`].
#[deprecated(note = "one word for one idea: use `unit`")]
pub fn layer<L, F>(factory: F) -> UnitFactory
where
    L: ModuleT + 'static,
    F: Fn(VarBuilder) -> candle_core::Result<L> + Send + Sync + 'static,
{
    unit(factory)
}

/// Runs the factory of layer `index`: its error, or its panic, becomes
/// [`Error::LayerBuild`] naming the layer. Every place that builds layers
/// (the stages, and the balances that measure them) goes through here.
pub(crate) fn build_layer(
    factory: &UnitFactory,
    index: usize,
    vb: VarBuilder,
) -> Result<Box<dyn ModuleT>> {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    let built = catch_unwind(AssertUnwindSafe(|| factory(vb))).unwrap_or_else(|payload| {
        Err(candle_core::Error::Msg(format!(
            "the layer factory panicked: {}",
            crate::util::panic_message::panic_message(payload.as_ref())
        )))
    });
    built.map_err(|source| Error::LayerBuild {
        layer: index,
        source,
    })
}
