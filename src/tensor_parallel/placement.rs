//! [`Placement`]: how a parameter lies across the tensor-parallel ranks,
//! and the cutting and joining of its pieces.

use std::fmt;

use candle_core::{Shape, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How one parameter is laid out over the `tp` ranks of a group (PyTorch's
/// DTensor placements `Replicate` and `Shard(dim)`).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::tensor_parallel::Placement;
///
/// // GPT-2's fused q/k/v weight (3 x 2 rows of 2): each of q, k and v
/// // is split by rows, so a rank's piece holds its heads of all three.
/// let qkv = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((6, 2))?;
/// let blocks = Placement::ShardBlocks { dim: 0, blocks: 3 };
/// let piece = blocks.piece(&qkv, 1, 2, "c_attn.weight")?;
/// assert_eq!(piece.to_vec2::<f32>()?, [[2., 3.], [6., 7.], [10., 11.]]);
/// let whole = blocks.join(&[blocks.piece(&qkv, 0, 2, "c_attn.weight")?, piece], "c_attn.weight")?;
/// assert_eq!(whole.to_vec2::<f32>()?, qkv.to_vec2::<f32>()?);
/// # Ok::<(), candle_dp::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Placement {
    /// Every rank holds the whole tensor.
    Replicate,
    /// Rank `r` holds the `r`-th of `tp` equal pieces along `dim`.
    Shard(usize),
    /// `dim` is `blocks` equal blocks (a fused q/k/v projection: 3), each
    /// split as [`Shard`](Self::Shard): rank `r`'s piece is its piece of
    /// every block, in block order.
    ShardBlocks {
        /// The dimension split.
        dim: usize,
        /// The blocks along it.
        blocks: usize,
    },
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Replicate => f.write_str("replicated"),
            Placement::Shard(dim) => write!(f, "sharded along dimension {dim}"),
            Placement::ShardBlocks { dim, blocks } => {
                write!(
                    f,
                    "sharded along dimension {dim} in each of {blocks} blocks"
                )
            }
        }
    }
}

impl Placement {
    /// The dimension it splits and into how many blocks.
    fn split(&self) -> Option<(usize, usize)> {
        match *self {
            Placement::Replicate => None,
            Placement::Shard(dim) => Some((dim, 1)),
            Placement::ShardBlocks { dim, blocks } => Some((dim, blocks.max(1))),
        }
    }

    /// Whether each rank holds a piece (not the whole).
    pub fn is_sharded(&self) -> bool {
        self.split().is_some()
    }

    /// The shape of a rank's piece of a tensor of shape `whole` over `tp`
    /// ranks.
    ///
    /// # Errors
    ///
    /// [`Error::TensorParallel`] naming `name` when the dimension is
    /// missing or does not split into `tp` equal pieces (per block).
    pub fn piece_shape(&self, whole: &Shape, tp: usize, name: &str) -> Result<Shape> {
        let Some((dim, blocks)) = self.split() else {
            return Ok(whole.clone());
        };
        let mut dims = whole.dims().to_vec();
        let size = *dims.get(dim).ok_or_else(|| {
            Error::TensorParallel(format!(
                "`{name}` of shape {dims:?} has no dimension {dim} to shard"
            ))
        })?;
        if tp == 0 || !size.is_multiple_of(blocks * tp) {
            return Err(Error::TensorParallel(format!(
                "`{name}` of shape {dims:?}: its dimension {dim} ({size}{}) does not split \
                 among tp = {tp} ranks",
                match blocks {
                    1 => String::new(),
                    b => format!(", {b} blocks of {}", size / b),
                }
            )));
        }
        dims[dim] = size / tp;
        Ok(Shape::from(dims))
    }

    /// The shape of the whole tensor whose pieces have shape `piece`.
    pub fn whole_shape(&self, piece: &Shape, tp: usize) -> Shape {
        let Some((dim, _)) = self.split() else {
            return piece.clone();
        };
        let mut dims = piece.dims().to_vec();
        if let Some(size) = dims.get_mut(dim) {
            *size *= tp;
        }
        Shape::from(dims)
    }

    /// Rank `rank`'s piece of `whole` over `tp` ranks (a copy).
    ///
    /// # Errors
    ///
    /// As [`piece_shape`](Self::piece_shape).
    pub fn piece(&self, whole: &Tensor, rank: usize, tp: usize, name: &str) -> Result<Tensor> {
        self.piece_shape(whole.shape(), tp, name)?;
        let Some((dim, blocks)) = self.split() else {
            return Ok(whole.clone());
        };
        let block = whole.dim(dim)? / blocks;
        let size = block / tp;
        let parts = (0..blocks)
            .map(|b| whole.narrow(dim, b * block + rank * size, size))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, dim)?.contiguous()?)
    }

    /// The whole tensor from every rank's piece, in rank order.
    ///
    /// # Errors
    ///
    /// [`Error::TensorParallel`] naming `name` for pieces that do not fit
    /// together.
    pub fn join(&self, pieces: &[Tensor], name: &str) -> Result<Tensor> {
        let Some((dim, blocks)) = self.split() else {
            return pieces
                .first()
                .cloned()
                .ok_or_else(|| Error::TensorParallel(format!("`{name}`: no pieces to join")));
        };
        let odd = pieces
            .iter()
            .map(|p| p.dim(dim).map(|size| !size.is_multiple_of(blocks)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        if pieces.is_empty() || odd.iter().any(|&o| o) {
            return Err(Error::TensorParallel(format!(
                "`{name}`: {} pieces that do not make {blocks} blocks along dimension {dim}",
                pieces.len()
            )));
        }
        let mut parts = Vec::with_capacity(blocks * pieces.len());
        for b in 0..blocks {
            for piece in pieces {
                let size = piece.dim(dim)? / blocks;
                parts.push(piece.narrow(dim, b * size, size)?);
            }
        }
        Ok(Tensor::cat(&parts, dim)?.contiguous()?)
    }
}
