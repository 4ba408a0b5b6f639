//! The boundary between two parts of a model run as separate graphs (the
//! pipeline's stages, DDP's units, FSDP's units): where the later part's
//! graph starts, and how the earlier part's backward is driven from the
//! gradient the later part computed.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

/// A leaf holding a copy of `input` (detached: its graph stays behind), for
/// the next part's graph to start at, so that the part's backward stops
/// there and yields the gradient of its input.
pub(crate) fn leaf(input: &Tensor) -> candle_core::Result<Var> {
    // `detach` drops the graph, so `from_tensor` makes a new variable.
    Var::from_tensor(&input.detach())
}

/// The backward of the graph that produced `output`, given the gradient
/// of `output`: `sum(output * grad)`, whose gradient with respect to
/// `output` is exactly `grad` (one multiplication by one per element).
pub(crate) fn backward_from(output: &Tensor, grad: &Tensor) -> candle_core::Result<GradStore> {
    (output * grad.detach())?.sum_all()?.backward()
}
