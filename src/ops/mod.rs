//! Fused training ops: one pass over memory forward and one backward, where
//! candle's composite ops make many (each its own pass and allocation).
//!
//! Each is a candle `CustomOp` whose `bwd` candle's autograd calls, so it
//! drops into a model in place of the composite. It runs fused on CPU
//! tensors of f32 and f64; on other devices or dtypes it is candle's own
//! op (its CUDA kernels), so a model that uses it runs everywhere.
//!
//! - [`gelu`]: GELU, tanh approximation (`gelu(approximate="tanh")`,
//!   candle's `Tensor::gelu`): candle's backward builds the derivative from
//!   seven tensor ops, two `powf` among them, with constants cut to six
//!   digits; this one computes PyTorch's derivative in one pass.

mod gelu;

pub use gelu::gelu;
