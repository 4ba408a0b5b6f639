//! A `VarBuilder` backend kept in an `Arc`, so that whoever builds a model
//! can still read what the backend recorded after the `VarBuilder` (which
//! owns a boxed backend) is gone.

use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::Init;

/// Forwards every call to the shared backend.
pub(crate) struct SharedBackend<B>(pub(crate) Arc<B>);

impl<B: SimpleBackend> SimpleBackend for SharedBackend<B> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.0.get(s, name, h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_tensor(name)
    }
}
