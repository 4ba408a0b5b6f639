//! The two networks the benchmark trains.

use candle_core::{Module, Tensor};
use candle_dp::ops::{fused_linear, Activation};
use candle_nn::{conv2d, linear, Conv2d, Conv2dConfig, Linear, VarBuilder};

use crate::plan::Model;

/// The reference MLP 784-1024-1024-10, or wider: 784-w-w-10; its layers
/// fused (`candle_dp::ops::fused_linear`) or candle-nn's.
pub struct Mlp(Linear, Linear, Linear, bool);

impl Mlp {
    fn new(width: usize, fused: bool, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp(
            linear(784, width, vb.pp("l1"))?,
            linear(width, width, vb.pp("l2"))?,
            linear(width, 10, vb.pp("l3"))?,
            fused,
        ))
    }
}

/// A small conv net on 1x28x28: conv 16 -> pool -> conv 32 -> pool -> fc 10.
pub struct Conv(Conv2d, Conv2d, Linear);

pub enum Net {
    Mlp(Mlp),
    Conv(Conv),
}

impl Net {
    pub fn new(model: Model, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(match model {
            Model::Mlp => Net::Mlp(Mlp::new(1024, true, vb)?),
            Model::MlpCandleOps => Net::Mlp(Mlp::new(1024, false, vb)?),
            Model::MlpWide => Net::Mlp(Mlp::new(4096, true, vb)?),
            Model::Conv => Net::Conv(Conv(
                conv2d(1, 16, 3, Conv2dConfig::default(), vb.pp("c1"))?,
                conv2d(16, 32, 3, Conv2dConfig::default(), vb.pp("c2"))?,
                linear(32 * 5 * 5, 10, vb.pp("fc"))?,
            )),
        })
    }

    pub fn input_shape(model: Model, batch: usize) -> Vec<usize> {
        match model {
            Model::Mlp | Model::MlpCandleOps | Model::MlpWide => vec![batch, 784],
            Model::Conv => vec![batch, 1, 28, 28],
        }
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(m) if !m.3 => m.2.forward(&m.1.forward(&m.0.forward(x)?.relu()?)?.relu()?),
            Net::Mlp(m) => {
                let h = layer(&m.0, x, Activation::Relu)?;
                let h = layer(&m.1, &h, Activation::Relu)?;
                layer(&m.2, &h, Activation::Identity)
            }
            Net::Conv(c) => {
                let h = c.0.forward(x)?.relu()?.max_pool2d(2)?;
                let h = c.1.forward(&h)?.relu()?.max_pool2d(2)?;
                c.2.forward(&h.flatten_from(1)?)
            }
        }
    }
}

/// A linear layer and its activation as one op (`candle_dp::ops`' fused
/// kernels on CPU f32, candle's ops elsewhere): the same values as
/// `Linear` and `relu` up to rounding.
fn layer(l: &Linear, x: &Tensor, act: Activation) -> candle_core::Result<Tensor> {
    fused_linear(x, l.weight(), l.bias(), act)
}
