//! A unit built over its gathered parameters: a `VarBuilder` backend that
//! hands the unit's factory the whole parameters all-gathered for this
//! use, and nothing else.
//!
//! Under mixed precision each request gets its own cast of the gathered
//! parameter to the compute dtype, as DDP's mixed precision casts the
//! master at each request: a weight used twice (two requests) then gets
//! each use's gradient widened back and added in the parameters' dtype,
//! never in the compute dtype.

use std::collections::HashMap;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::Init;

/// The gathered parameters of one unit, by name, each with the dtype the
/// unit computes it in.
pub(crate) struct Gathered(pub(crate) HashMap<String, (Tensor, DType)>);

impl Gathered {
    fn tensor(&self, name: &str) -> candle_core::Result<Tensor> {
        let (tensor, dtype) = self.0.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "the unit asked for `{name}`, which it did not ask for when FSDP was built (a \
                 factory must ask for the same variables every time)"
            ))
        })?;
        tensor.to_dtype(*dtype)
    }
}

impl SimpleBackend for Gathered {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: Init,
        _: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let tensor = self.tensor(name)?;
        if tensor.shape() != &shape {
            candle_core::bail!(
                "the unit asked for `{name}` with shape {shape:?}, FSDP holds {:?}",
                tensor.dims()
            );
        }
        Ok(tensor)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        self.tensor(name)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}
