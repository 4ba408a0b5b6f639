//! The tensor-parallel layers: a linear layer split by its outputs
//! (column-parallel) or by its inputs (row-parallel), and an embedding
//! split by its vocabulary. Each holds its piece, built from a
//! `VarBuilder` with the piece's shape; the model's [`TpPlan`](super::TpPlan)
//! says the same placements, so that the pieces are drawn from one
//! device's initial values.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Init, VarBuilder};

use super::TensorParallel;

/// `nn.Linear(input, output)` split by its outputs (PyTorch's
/// `ColwiseParallel`): each rank holds `output / tp` rows of the weight
/// (out x in) and of the bias, takes the whole input and gives its part
/// of the output's last dimension. Its placement: `Shard(0)` (or
/// `ShardBlocks` for a fused projection whose outputs are blocks).
#[derive(Debug, Clone)]
pub struct ColumnLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    tp: TensorParallel,
}

impl ColumnLinear {
    /// The piece of `nn.Linear(input, output)` on this rank, its weight
    /// drawn with `init` and its bias (when `bias`) zero.
    ///
    /// # Errors
    ///
    /// `output` does not divide among the ranks; the `VarBuilder`'s.
    pub fn new(
        input: usize,
        output: usize,
        init: Init,
        bias: bool,
        tp: &TensorParallel,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let local = tp
            .share(output, &format!("the outputs of `{}`", vb.prefix()))
            .map_err(candle_core::Error::wrap)?;
        let (weight, bias) = weight_and_bias(&vb, (local, input), init, bias.then_some(local))?;
        Ok(Self {
            weight,
            bias,
            tp: tp.clone(),
        })
    }

    /// The layer over a piece already built (`weight`: its rows).
    pub fn from_piece(weight: Tensor, bias: Option<Tensor>, tp: &TensorParallel) -> Self {
        Self {
            weight,
            bias,
            tp: tp.clone(),
        }
    }

    /// This rank's rows of the weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

impl Module for ColumnLinear {
    /// The whole input (with sequence parallelism, this rank's part of
    /// the sequence) to this rank's part of the output.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = self.tp.enter(x)?;
        crate::ops::linear(&x, &self.weight, self.bias.as_ref())
    }
}

/// `nn.Linear(input, output)` split by its inputs (PyTorch's
/// `RowwiseParallel`): each rank holds `input / tp` columns of the
/// weight, takes its part of the input's last dimension (a
/// column-parallel layer's output) and gives the whole output, the
/// ranks' partial sums added; the bias is replicated and added once,
/// after the sum. Its placement: `Shard(1)`, the bias `Replicate`.
#[derive(Debug, Clone)]
pub struct RowLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    tp: TensorParallel,
}

impl RowLinear {
    /// The piece of `nn.Linear(input, output)` on this rank, its weight
    /// drawn with `init` and its bias (when `bias`) zero.
    ///
    /// # Errors
    ///
    /// `input` does not divide among the ranks; the `VarBuilder`'s.
    pub fn new(
        input: usize,
        output: usize,
        init: Init,
        bias: bool,
        tp: &TensorParallel,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let local = tp
            .share(input, &format!("the inputs of `{}`", vb.prefix()))
            .map_err(candle_core::Error::wrap)?;
        let (weight, bias) = weight_and_bias(&vb, (output, local), init, bias.then_some(output))?;
        Ok(Self {
            weight,
            bias,
            tp: tp.clone(),
        })
    }
}

impl Module for RowLinear {
    /// This rank's part of the input to the whole output (with sequence
    /// parallelism, this rank's part of the sequence).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let partial = crate::ops::linear(x, &self.weight, None)?;
        let y = self.tp.leave(&partial)?;
        match &self.bias {
            Some(bias) => y.broadcast_add(&self.tp.replicated(bias)?),
            None => Ok(y),
        }
    }
}

/// `nn.Embedding(vocab, width)` split by its rows (PyTorch's
/// `RowwiseParallel` on an embedding): rank `r` holds rows `r * vocab /
/// tp ..`; each rank looks up the ids in its rows, zeros for the others,
/// and the ranks' rows are added (with sequence parallelism, added and
/// split along the sequence). Its placement: `Shard(0)`; the same piece
/// serves as a tied head ([`rows`](Self::rows)).
#[derive(Debug, Clone)]
pub struct VocabEmbedding {
    rows: Tensor,
    tp: TensorParallel,
}

impl VocabEmbedding {
    /// The piece of `nn.Embedding(vocab, width)` named `name` on this
    /// rank, drawn with `init`.
    ///
    /// # Errors
    ///
    /// `vocab` does not divide among the ranks; the `VarBuilder`'s.
    pub fn new(
        vocab: usize,
        width: usize,
        name: &str,
        init: Init,
        tp: &TensorParallel,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let local = tp
            .share(vocab, &format!("the vocabulary of `{name}`"))
            .map_err(candle_core::Error::wrap)?;
        Ok(Self {
            rows: vb.get_with_hints((local, width), name, init)?,
            tp: tp.clone(),
        })
    }

    /// This rank's rows of the table.
    pub fn rows(&self) -> &Tensor {
        &self.rows
    }
}

impl Module for VocabEmbedding {
    /// Token ids (batch x time) to their rows (batch x time x width; with
    /// sequence parallelism this rank's part of the time).
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (local, width) = self.rows.dims2()?;
        // Every rank sees the same ids: an id no rank holds fails them all
        // alike, as one device's lookup would.
        let all = ids_of(ids)?;
        let vocab = local * self.tp.size();
        if let Some((i, id)) = all
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as u64 >= vocab as u64)
        {
            candle_core::bail!(
                "vocab-parallel embedding: token id {id} at position {i} is not one of the \
                 {vocab} rows"
            );
        }
        let (index, mask) = local_ids(&all, self.tp.rank() * local, local, ids.device())?;
        let rows = crate::ops::embedding(&self.rows, &index)?;
        let rows = rows.broadcast_mul(&mask.to_dtype(rows.dtype())?)?;
        self.tp.leave(&rows.reshape((b, t, width))?)
    }
}

/// A linear layer's `weight` of `shape` drawn with `init`, and its zero
/// `bias` of `bias` values when it has one.
fn weight_and_bias(
    vb: &VarBuilder,
    shape: (usize, usize),
    init: Init,
    bias: Option<usize>,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let weight = vb.get_with_hints(shape, "weight", init)?;
    let bias = bias
        .map(|n| vb.get_with_hints(n, "bias", Init::Const(0.0)))
        .transpose()?;
    Ok((weight, bias))
}

/// The ids (or classes) of `ids`, flattened, on the host.
pub(super) fn ids_of(ids: &Tensor) -> candle_core::Result<Vec<i64>> {
    ids.flatten_all()?.to_dtype(DType::I64)?.to_vec1()
}

/// `all` as indices into the rows `start .. start + count` (0 for the
/// others), and a column of 1 where an id is one of them, 0 elsewhere.
pub(super) fn local_ids(
    all: &[i64],
    start: usize,
    count: usize,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let mine = |id: i64| id >= start as i64 && id < (start + count) as i64;
    let index: Vec<u32> = all
        .iter()
        .map(|&id| {
            if mine(id) {
                (id - start as i64) as u32
            } else {
                0
            }
        })
        .collect();
    let mask: Vec<f32> = all
        .iter()
        .map(|&id| f32::from(u8::from(mine(id))))
        .collect();
    let n = all.len();
    Ok((
        Tensor::from_vec(index, n, device)?,
        Tensor::from_vec(mask, (n, 1), device)?,
    ))
}
