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
//!   digits; this one computes PyTorch's derivative in one pass, with a
//!   vectorised f32 `tanh`.
//! - [`layer_norm`]: LayerNorm over the last dimension; candle's fused
//!   `layer_norm` has no backward, and its composite `layer_norm_slow`
//!   takes about a dozen ops each way.
//! - [`causal_softmax`]: attention's scale, causal mask and softmax in one
//!   op; the masked positions are never computed.
//! - [`causal_attention`]: the whole of causal self-attention (scores,
//!   mask, softmax, the weighted sum of the values) from the packed
//!   `q | k | v` projection, without a `T x T` tensor kept or made.
//! - [`cross_entropy`]: the loss from logits and class indices, without a
//!   log-softmax tensor kept for the backward.
//! - [`linear`] and [`bias_add`]: a linear layer over any leading
//!   dimensions as one matrix product, the bias's gradient one column sum
//!   (candle-nn's `Linear` on a 3-D input makes one weight gradient per
//!   batch entry and sums them).
//! - [`fused_linear`]: a linear layer and its activation (ReLU or none)
//!   as one op: the bias and activation in one pass over the product's
//!   output; backward, the weight's gradient made in its own layout (not
//!   transposed into it) and no gradient for an input that is data.
//! - [`embedding`]: a table's rows at integer ids, whose backward sums a
//!   repeated token's rows before they meet the table's other gradients
//!   (a tied head's), as PyTorch does: the same bytes whole or unit by unit.
//!
//! On CPU, each kernel splits large inputs into blocks of rows run on the
//! current rayon pool (where candle's matmul runs), and the sums over rows (weight
//! and bias gradients, the loss) add the blocks in order: the results are
//! the same bytes on any number of threads.

mod attention;
mod column_sum;
mod cross_entropy;
pub mod dropout;
mod embedding;
mod fused_linear;
mod gelu;
mod indices;
mod kernel;
mod layer_norm;
mod linear;
mod softmax;
mod transpose;

pub use attention::{causal_attention, causal_attention_unfused};
pub(crate) use cross_entropy::class_indices;
pub use cross_entropy::cross_entropy;
pub use embedding::embedding;
pub use fused_linear::{fused_linear, Activation};
pub use gelu::gelu;
pub use layer_norm::layer_norm;
pub use linear::{bias_add, linear};
pub use softmax::{causal_mask, causal_softmax};
