//! A decoder-only transformer in the GPT-2 mould, written with candle-nn,
//! given as units (the embedding, each block, the head) so that every
//! strategy applies: the pipeline takes the units as its layers, the other
//! strategies run them in order ([`Gpt`]).
//!
//! Variable names and shapes are GPT-2's (`wte.weight`, `h.0.attn.c_attn.
//! weight`, ...), with PyTorch's `nn.Linear` layout (out x in), so that
//! `scripts/train_lm_torch.py` loads the initial weights as they are:
//!
//! - `wte.weight` (vocab x width), `wpe.weight` (context x width);
//! - per block `h.{i}`: `ln_1.{weight,bias}`, `attn.c_attn.{weight,bias}`
//!   (3 width x width: q, k, v), `attn.c_proj.{weight,bias}`,
//!   `ln_2.{weight,bias}`, `mlp.c_fc.{weight,bias}` (4 width x width),
//!   `mlp.c_proj.{weight,bias}`;
//! - `ln_f.{weight,bias}`; the head is `wte.weight` itself (tied).
//!
//! The forward: token plus position embeddings; per block
//! `x + attn(ln_1(x))` then `x + mlp(ln_2(x))`, attention causal with
//! `heads` heads scaled by 1/sqrt(head width), the MLP with the tanh GELU;
//! `ln_f`, then logits = x wte^T. LayerNorm eps 1e-5, computed in f32
//! (`candle_nn::ops::layer_norm_slow`: candle's fused LayerNorm has no
//! backward). No dropout. Initialisation as GPT-2: weights N(0, 0.02)
//! (the residual projections N(0, 0.02 / sqrt(2 layers))), biases 0, norms 1.

use candle_core::{DType, Module, ModuleT, Tensor};
use candle_dp::fabric::ModelRecipe;
use candle_dp::ops::Activation;
use candle_dp::pipeline::{unit, UnitFactory};
use candle_dp::tensor_parallel::{
    ColumnLinear, Placement, RowLinear, TensorParallel, TpPlan, VocabEmbedding,
};
use candle_nn::{Init, Linear, VarBuilder};

/// The model's size.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Tokens (256: bytes).
    pub vocab: usize,
    /// The longest sequence (the position table's rows).
    pub context: usize,
    pub width: usize,
    pub layers: usize,
    pub heads: usize,
    /// The fused training ops of `candle_dp::ops` (linear layers, LayerNorm,
    /// causal attention, GELU) instead of candle's composite ones: the
    /// same model, a faster step. (The loss: [`lm_loss`] is fused,
    /// [`lm_loss_composite`] not.)
    #[serde(default)]
    pub fused_ops: bool,
    /// Dropout on each block's attention and MLP outputs, in training
    /// (GPT-2's residual dropout), keyed by the sample
    /// (`candle_dp::ops::dropout`), so that deterministic training keeps
    /// its bits with it on; 0 for none.
    #[serde(default)]
    pub dropout: f64,
}

impl GptConfig {
    /// Parameters, the tied head counted once.
    pub fn parameters(&self) -> usize {
        let (v, c, w, l) = (self.vocab, self.context, self.width, self.layers);
        let block = 2 * w
            + (3 * w * w + 3 * w)
            + (w * w + w)
            + 2 * w
            + (4 * w * w + 4 * w)
            + (4 * w * w + w);
        v * w + c * w + l * block + 2 * w
    }
}

/// Whether the parameter named `name` is one of the model's weight
/// matrices (embeddings and linear weights: every parameter of two
/// dimensions or more), which the GPT-2 recipe decays; biases and the
/// LayerNorms' weights are not. By name, so that ZeRO's and FSDP's pieces
/// (named as their parameters) are judged as their parameters.
pub fn is_weight_matrix(name: &str) -> bool {
    let norm = name.starts_with("ln_f.") || name.contains(".ln_1.") || name.contains(".ln_2.");
    name.ends_with(".weight") && !norm
}

/// AdamW's parameter groups as the GPT-2 recipe (nanoGPT's
/// `configure_optimizers`) makes them: the weight matrices in group 0 with
/// `weight_decay`, everything else in group 1 without; `decay_all` puts
/// every parameter in one group with `weight_decay`.
pub fn adamw_groups(
    params: Vec<(String, candle_core::Var)>,
    config: candle_dp::optim::AdamWConfig,
    decay_all: bool,
) -> candle_core::Result<candle_dp::optim::AdamW> {
    use candle_dp::optim::{AdamW, AdamWConfig};
    if decay_all {
        return AdamW::new_named(params, config);
    }
    let none = AdamWConfig {
        weight_decay: 0.0,
        ..config
    };
    AdamW::with_groups(params, vec![config, none], |name| {
        usize::from(!is_weight_matrix(name))
    })
}

const EPS: f32 = 1e-5;

fn normal(stdev: f64) -> Init {
    Init::Randn { mean: 0.0, stdev }
}

/// `nn.Linear(input, output)` with GPT-2's initialisation.
fn linear(input: usize, output: usize, stdev: f64, vb: VarBuilder) -> candle_core::Result<Linear> {
    let weight = vb.get_with_hints((output, input), "weight", normal(stdev))?;
    let bias = vb.get_with_hints(output, "bias", Init::Const(0.0))?;
    Ok(Linear::new(weight, Some(bias)))
}

/// A LayerNorm that trains: `candle_dp::ops::layer_norm`, or the plain-op
/// form (in f32 inside).
struct Norm {
    weight: Tensor,
    bias: Tensor,
    fused_ops: bool,
    /// Replicated over the tensor-parallel ranks (with sequence
    /// parallelism its gradient summed over them).
    tp: Option<TensorParallel>,
}

impl Norm {
    fn new(
        width: usize,
        fused_ops: bool,
        tp: Option<&TensorParallel>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(width, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(width, "bias", Init::Const(0.0))?,
            fused_ops,
            tp: tp.cloned(),
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (weight, bias) = match &self.tp {
            Some(tp) => (tp.replicated(&self.weight)?, tp.replicated(&self.bias)?),
            None => (self.weight.clone(), self.bias.clone()),
        };
        match self.fused_ops {
            true => candle_dp::ops::layer_norm(x, &weight, &bias, EPS.into()),
            false => candle_nn::ops::layer_norm_slow(x, &weight, &bias, EPS),
        }
    }
}

/// A linear layer whole, or split over the tensor-parallel ranks by its
/// outputs (column) or its inputs (row).
enum Proj {
    Whole(Linear, bool),
    Column(ColumnLinear),
    Row(RowLinear),
}

impl Proj {
    /// `nn.Linear(input, output)`: whole, or split as `column` says.
    fn new(
        (input, output): (usize, usize),
        stdev: f64,
        (tp, column): (Option<&TensorParallel>, bool),
        fused_ops: bool,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let init = normal(stdev);
        Ok(match (tp, column) {
            (None, _) => Proj::Whole(linear(input, output, stdev, vb)?, fused_ops),
            (Some(tp), true) => Proj::Column(ColumnLinear::new(input, output, init, true, tp, vb)?),
            (Some(tp), false) => Proj::Row(RowLinear::new(input, output, init, true, tp, vb)?),
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Proj::Whole(layer, fused_ops) => apply(layer, x, *fused_ops),
            Proj::Column(layer) => layer.forward(x),
            Proj::Row(layer) => layer.forward(x),
        }
    }
}

/// `linear`'s layer through `candle_dp::ops::linear` (one matrix product
/// of every row, the bias's gradient one column sum), or candle-nn's.
fn apply(layer: &Linear, x: &Tensor, fused_ops: bool) -> candle_core::Result<Tensor> {
    match fused_ops {
        true => candle_dp::ops::linear(x, layer.weight(), layer.bias()),
        false => layer.forward(x),
    }
}

/// The first unit: token and position embeddings of token ids (batch x
/// time, u32).
pub struct Embeddings {
    wte: Tokens,
    wpe: Tensor,
    tp: Option<TensorParallel>,
}

/// The token table, whole or split by the vocabulary.
enum Tokens {
    Whole(Tensor),
    Split(VocabEmbedding),
}

impl Embeddings {
    pub fn new(
        config: GptConfig,
        tp: Option<&TensorParallel>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let (v, w) = (config.vocab, config.width);
        let wte = match tp {
            None => Tokens::Whole(vb.get_with_hints((v, w), "wte.weight", normal(0.02))?),
            Some(tp) => Tokens::Split(VocabEmbedding::new(
                v,
                w,
                "wte.weight",
                normal(0.02),
                tp,
                vb.clone(),
            )?),
        };
        Ok(Self {
            wte,
            wpe: vb.get_with_hints((config.context, w), "wpe.weight", normal(0.02))?,
            tp: tp.cloned(),
        })
    }
}

impl ModuleT for Embeddings {
    fn forward_t(&self, ids: &Tensor, _train: bool) -> candle_core::Result<Tensor> {
        let (_, t) = ids.dims2()?;
        let tokens = match &self.wte {
            Tokens::Whole(wte) => {
                // Its backward sums a repeated token's rows before the tied
                // head's gradient: the same bytes whole or unit by unit.
                candle_dp::ops::embedding(wte, ids)?
            }
            Tokens::Split(wte) => wte.forward(ids)?,
        };
        // With sequence parallelism, this rank's part of the time.
        let (local, start) = match &self.tp {
            Some(tp) if tp.sequence_parallel() => {
                let local = tokens.dim(1)?;
                (local, tp.rank() * local)
            }
            _ => (t, 0),
        };
        let wpe = match &self.tp {
            Some(tp) => tp.replicated(&self.wpe)?,
            None => self.wpe.clone(),
        };
        tokens.broadcast_add(&wpe.narrow(0, start, local)?)
    }
}

/// One transformer block.
/// With tensor parallelism (Megatron's block): q, k and v split by heads
/// (column), the attention's output projection by its inputs (row), the
/// MLP column then row; the norms replicated.
pub struct Block {
    ln_1: Norm,
    c_attn: Proj,
    attn_proj: Proj,
    ln_2: Norm,
    c_fc: Proj,
    mlp_proj: Proj,
    /// This rank's heads.
    heads: usize,
    fused_ops: bool,
    /// The block's number and its dropout (its masks' layer keys).
    index: usize,
    dropout: f64,
}

impl Block {
    pub fn new(
        config: GptConfig,
        i: usize,
        tp: Option<&TensorParallel>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let vb = vb.pp(format!("h.{i}"));
        let (w, fused) = (config.width, config.fused_ops);
        let residual = 0.02 / ((2 * config.layers) as f64).sqrt();
        let heads = match tp {
            Some(tp) => tp
                .share(config.heads, &format!("the heads of block {i}"))
                .map_err(candle_core::Error::wrap)?,
            None => config.heads,
        };
        let (column, row) = ((tp, true), (tp, false));
        Ok(Self {
            ln_1: Norm::new(w, fused, tp, vb.pp("ln_1"))?,
            c_attn: Proj::new((w, 3 * w), 0.02, column, fused, vb.pp("attn.c_attn"))?,
            attn_proj: Proj::new((w, w), residual, row, fused, vb.pp("attn.c_proj"))?,
            ln_2: Norm::new(w, fused, tp, vb.pp("ln_2"))?,
            c_fc: Proj::new((w, 4 * w), 0.02, column, fused, vb.pp("mlp.c_fc"))?,
            mlp_proj: Proj::new((4 * w, w), residual, row, fused, vb.pp("mlp.c_proj"))?,
            heads,
            fused_ops: fused,
            index: i,
            dropout: config.dropout,
        })
    }

    /// `x` through the block's dropout number `k` (in training).
    fn dropout(&self, x: Tensor, k: usize, train: bool) -> candle_core::Result<Tensor> {
        let layer = (2 * self.index + k) as u64;
        candle_dp::ops::dropout::keyed_dropout(&x, self.dropout, layer, train)
    }

    fn attention(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let qkv = self.c_attn.forward(x)?;
        let y = match self.fused_ops {
            true => candle_dp::ops::causal_attention(&qkv, self.heads)?,
            false => candle_dp::ops::causal_attention_unfused(&qkv, self.heads)?,
        };
        self.attn_proj.forward(&y)
    }
}

impl ModuleT for Block {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let x = (x + self.dropout(self.attention(&self.ln_1.forward(x)?)?, 0, train)?)?;
        let ln = self.ln_2.forward(&x)?;
        let hidden = match (&self.c_fc, self.fused_ops) {
            // The GELU inside the layer's op: no tensor of its own to
            // accumulate a gradient into, the same bytes.
            (Proj::Whole(fc, true), true) => {
                candle_dp::ops::fused_linear(&ln, fc.weight(), fc.bias(), Activation::Gelu)?
            }
            (fc, true) => candle_dp::ops::gelu(&fc.forward(&ln)?)?,
            (fc, false) => fc.forward(&ln)?.gelu()?,
        };
        &x + self.dropout(self.mlp_proj.forward(&hidden)?, 1, train)?
    }
}

/// The last unit: the final LayerNorm and the head tied to `wte`.
/// With tensor parallelism the head is column-parallel over the
/// vocabulary: each rank gives its columns of the logits, for
/// [`lm_loss_tp`].
pub struct Head {
    ln_f: Norm,
    wte: Tensor,
    fused_ops: bool,
    tp: Option<TensorParallel>,
}

impl Head {
    pub fn new(
        config: GptConfig,
        tp: Option<&TensorParallel>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let rows = match tp {
            Some(tp) => tp
                .share(config.vocab, "the vocabulary of `wte.weight`")
                .map_err(candle_core::Error::wrap)?,
            None => config.vocab,
        };
        Ok(Self {
            ln_f: Norm::new(config.width, config.fused_ops, tp, vb.pp("ln_f"))?,
            wte: vb.get_with_hints((rows, config.width), "wte.weight", normal(0.02))?,
            fused_ops: config.fused_ops,
            tp: tp.cloned(),
        })
    }
}

impl ModuleT for Head {
    fn forward_t(&self, x: &Tensor, _train: bool) -> candle_core::Result<Tensor> {
        let mut x = self.ln_f.forward(x)?;
        if let Some(tp) = &self.tp {
            x = tp.enter(&x)?;
        }
        match self.fused_ops {
            true => candle_dp::ops::linear(&x, &self.wte, None),
            false => x.broadcast_matmul(&self.wte.t()?),
        }
    }
}

/// The units, for a `Pipeline` (or any driver of units).
pub fn units(config: GptConfig) -> Vec<UnitFactory> {
    tp_units(config, None)
}

/// The units, each rank's pieces with tensor parallelism `tp` (whole
/// without), placed as [`tp_plan`] says.
pub fn tp_units(config: GptConfig, tp: Option<&TensorParallel>) -> Vec<UnitFactory> {
    let tp = tp.cloned();
    let (t0, t1, t2) = (tp.clone(), tp.clone(), tp);
    let mut units = vec![unit(move |vb| Embeddings::new(config, t0.as_ref(), vb))];
    for i in 0..config.layers {
        let tp = t1.clone();
        units.push(unit(move |vb| Block::new(config, i, tp.as_ref(), vb)));
    }
    units.push(unit(move |vb| Head::new(config, t2.as_ref(), vb)));
    units
}

/// The model as a rank of a Fabric builds it: its pieces with tensor
/// parallelism `tp` (placed by [`tp_plan`]), whole without.
pub fn model_recipe(config: GptConfig, tp: Option<&TensorParallel>) -> ModelRecipe {
    match tp {
        Some(tp) => ModelRecipe::units(tp_units(config, Some(tp))).with_tp_plan(tp_plan()),
        None => ModelRecipe::units(units(config)),
    }
}

/// The loss of a rank's output: `whole` (such as [`lm_loss`]), or with
/// tensor parallelism `tp` the vocabulary-parallel [`lm_loss_tp`].
pub fn loss_on(
    tp: Option<&TensorParallel>,
    whole: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static {
    let tp = tp.cloned();
    move |out: &Tensor, y: &Tensor| match &tp {
        Some(tp) => lm_loss_tp(out, y, tp),
        None => whole(out, y),
    }
}

/// How [`tp_units`] split the parameters (PyTorch's plan for GPT-2:
/// `wte` by the vocabulary, `c_attn` colwise by heads within each of q, k
/// and v, `attn.c_proj` rowwise, `c_fc` colwise, `mlp.c_proj` rowwise;
/// the rest replicated).
pub fn tp_plan() -> TpPlan {
    TpPlan::new()
        .with("wte.weight", Placement::Shard(0))
        .with(
            "h.*.attn.c_attn.weight",
            Placement::ShardBlocks { dim: 0, blocks: 3 },
        )
        .with(
            "h.*.attn.c_attn.bias",
            Placement::ShardBlocks { dim: 0, blocks: 3 },
        )
        .with("h.*.attn.c_proj.weight", Placement::Shard(1))
        .with("h.*.mlp.c_fc.weight", Placement::Shard(0))
        .with("h.*.mlp.c_fc.bias", Placement::Shard(0))
        .with("h.*.mlp.c_proj.weight", Placement::Shard(1))
}

/// The whole model on one device: the units in order.
pub struct Gpt {
    embeddings: Embeddings,
    blocks: Vec<Block>,
    head: Head,
}

impl Gpt {
    pub fn new(config: GptConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            embeddings: Embeddings::new(config, None, vb.clone())?,
            blocks: (0..config.layers)
                .map(|i| Block::new(config, i, None, vb.clone()))
                .collect::<candle_core::Result<_>>()?,
            head: Head::new(config, None, vb)?,
        })
    }
}

impl Module for Gpt {
    /// Token ids (batch x time) to logits (batch x time x vocab), without
    /// dropout (evaluation; the units of [`units`] train with it).
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = self.embeddings.forward_t(ids, false)?;
        for block in &self.blocks {
            x = block.forward_t(&x, false)?;
        }
        self.head.forward_t(&x, false)
    }
}

/// The mean next-token cross-entropy of `logits` (batch x time x vocab)
/// against `targets` (batch x time), computed in f32, with the fused
/// `candle_dp::ops::cross_entropy`.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    let logits = logits.to_dtype(DType::F32)?.reshape((b * t, v))?;
    candle_dp::ops::cross_entropy(&logits, &targets.flatten_all()?)
}

/// [`lm_loss`] with candle-nn's composite cross-entropy (log-softmax,
/// gather, mean): the loss of `--no-fused-ops`.
pub fn lm_loss_composite(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    let logits = logits.to_dtype(DType::F32)?.reshape((b * t, v))?;
    candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
}

/// [`lm_loss`] of logits split by the vocabulary over the
/// tensor-parallel ranks (each rank's columns, batch x time x vocab /
/// tp): `candle_dp::tensor_parallel::vocab_parallel_cross_entropy`.
pub fn lm_loss_tp(
    logits: &Tensor,
    targets: &Tensor,
    tp: &TensorParallel,
) -> candle_core::Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    let logits = logits.reshape((b * t, v))?;
    candle_dp::tensor_parallel::vocab_parallel_cross_entropy(&logits, &targets.flatten_all()?, tp)
}
