//! ZeRO: the reduce-scatter and flat all-gather collectives, and stages 1
//! and 2 on DDP trained to DDP's very bytes on 1-4 thread ranks, with
//! parameters that do not divide by the world size and worlds larger than
//! the number of parameters; the shards of the optimizer state saved and
//! loaded on the same and another world size; what ZeRO refuses.

use crate::common;

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_dp::comm::{Color, CommError, DeviceMesh, ReduceOp};
use candle_dp::launch::{spawn, RankContext};
use candle_dp::optim::{AdamW, AdamWConfig, OptimizerState, StatefulOptimizer};
use candle_dp::zero::{grad_bytes, ZeroOptimizer, ZeroStage};
use candle_dp::{DistributedDataParallel, Error};
use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder, VarMap, SGD};
use common::*;

/// Deterministic, varied values (not multiples of powers of two, so that
/// summation order shows in the bits).
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 37.0).sin() * 3.3)
        .collect()
}

#[test]
fn reduce_scatter_pieces_are_bitwise_slices_of_the_all_reduce() {
    within(120, || {
        // Primes, so no piece size divides them evenly: 1031 elements
        // reduce in rank order, 40 009 (160 KB) by the ring, where each
        // rank reduces only its piece.
        for (world, n) in (1..=4).flat_map(|w| [(w, 1031), (w, 40_009)]) {
            let results = spawn(world, move |ctx| {
                let x = Tensor::new(values(n, ctx.rank), &Device::Cpu)?;
                // Uneven pieces, the last rank's the largest.
                let mut counts: Vec<usize> = (0..world).map(|r| n / world - r).collect();
                let rest = n - counts.iter().sum::<usize>();
                counts[world - 1] += rest;
                let mut out = Vec::new();
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                    let full = ctx.pg.all_reduce(&x, op)?.to_vec1::<f32>()?;
                    let piece = ctx.pg.reduce_scatter(&x, op, &counts)?.to_vec1::<f32>()?;
                    let start: usize = counts[..ctx.rank].iter().sum();
                    let want = &full[start..start + counts[ctx.rank]];
                    out.push(
                        piece.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                            == want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    );
                }
                Ok(out)
            })
            .unwrap();
            for (rank, ok) in results.iter().enumerate() {
                assert_eq!(
                    ok,
                    &vec![true; 3],
                    "world {world}, {n} elements, rank {rank}"
                );
            }
        }
    });
}

#[test]
fn all_gather_into_concatenates_every_rank_in_rank_order() {
    within(120, || {
        let results = spawn(3, |ctx| {
            let x = Tensor::new(&[[ctx.rank as f32, 10. + ctx.rank as f32]], &Device::Cpu)?;
            Ok(ctx.pg.all_gather_into(&x)?.to_vec1::<f32>()?)
        })
        .unwrap();
        for got in results {
            assert_eq!(got, [0., 10., 1., 11., 2., 12.]);
        }
    });
}

#[test]
fn reduce_scatter_counts_that_differ_name_the_rank_on_every_rank_and_the_group_goes_on() {
    within(60, || {
        let results = spawn(2, |ctx| {
            let x = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu)?;
            let counts: &[usize] = if ctx.rank == 1 { &[1, 3] } else { &[2, 2] };
            let err = ctx
                .pg
                .reduce_scatter(&x, ReduceOp::Sum, counts)
                .unwrap_err();
            let ok = ctx.pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?;
            Ok((
                err.to_string(),
                matches!(err, CommError::InvalidInput { culprit: 1, .. }),
                ok,
            ))
        })
        .unwrap();
        for (message, names_rank_1, after) in results {
            assert!(names_rank_1, "{message}");
            assert!(message.contains("[1, 3]"), "{message}");
            assert_eq!(after, [2., 4., 6., 8.], "the group still works");
        }
    });
}

#[test]
fn reduce_scatter_counts_whose_sum_overflows_are_refused_naming_the_rank_and_the_group_goes_on() {
    within(60, || {
        let results = spawn(2, |ctx| {
            let x = Tensor::new(&[1f32], &Device::Cpu)?;
            let counts: &[usize] = if ctx.rank == 1 {
                &[usize::MAX, 2]
            } else {
                &[1, 0]
            };
            let err = ctx
                .pg
                .reduce_scatter(&x, ReduceOp::Sum, counts)
                .unwrap_err();
            let ok = ctx.pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?;
            Ok((
                err.to_string(),
                matches!(err, CommError::InvalidInput { culprit: 1, .. }),
                ok,
            ))
        })
        .unwrap();
        for (message, names_rank_1, after) in results {
            assert!(names_rank_1, "{message}");
            assert!(message.contains("add up to more than"), "{message}");
            assert_eq!(after, [2.], "the group still works");
        }
    });
}

#[test]
fn reduce_scatter_counts_that_do_not_add_up_are_an_error_on_every_rank() {
    within(60, || {
        let results = spawn(2, |ctx| {
            let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
            Ok(ctx
                .pg
                .reduce_scatter(&x, ReduceOp::Sum, &[2, 2])
                .unwrap_err()
                .to_string())
        })
        .unwrap();
        for message in results {
            assert!(
                message.contains("sum to 4 but the tensor has 3"),
                "{message}"
            );
        }
    });
}

/// An MLP 5-7-3 and a lone 1x1 parameter: sizes 35, 7, 21, 3 and 1
/// elements, none of which divides evenly among 2-4 ranks.
struct Net {
    l1: Linear,
    l2: Linear,
    scale: Tensor,
    /// 0-dim: its one element lives in rank 0's piece.
    shift: Tensor,
}

impl Net {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            l1: linear(5, 7, vb.pp("l1"))?,
            l2: linear(7, 3, vb.pp("l2"))?,
            scale: vb.get_with_hints(1, "scale", candle_nn::Init::Const(1.0))?,
            shift: vb.get_with_hints((), "shift", candle_nn::Init::Const(0.1))?,
        })
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2
            .forward(&self.l1.forward(x)?.broadcast_add(&self.shift)?.tanh()?)?
            .broadcast_mul(&self.scale)
    }
}

/// Tiny: two parameters (4 and 2 elements), so that 3 and 4 ranks
/// outnumber them.
struct Tiny {
    l: Linear,
}

impl Module for Tiny {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l.forward(x)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Opt {
    CandleSgd,
    AdamW,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Model {
    Net,
    Tiny,
    Mixed,
}

/// Each rank's batches: 4 steps of 3 rows.
fn batches(model: Model, rank: usize) -> Vec<(Tensor, Tensor)> {
    let (inputs, classes) = match model {
        Model::Net | Model::Mixed => (5, 3),
        Model::Tiny => (2, 2),
    };
    (0..4)
        .map(|step| {
            let x = Tensor::new(values(3 * inputs, 31 * rank + step), &Device::Cpu)
                .and_then(|t| t.reshape((3, inputs)))
                .unwrap();
            let y = Tensor::new(
                (0..3)
                    .map(|i| ((i + step + rank) % classes) as u32)
                    .collect::<Vec<_>>(),
                &Device::Cpu,
            )
            .unwrap();
            (x, y)
        })
        .collect()
}

/// `Net` times a `(1, 3)` scale of another dtype (initially 0.5): two
/// dtypes, so two buckets and two all-gathers.
struct Mixed {
    net: Net,
    scale: Tensor,
}

impl Mixed {
    fn new(vb: VarBuilder, dtype: DType) -> candle_core::Result<Self> {
        Ok(Self {
            net: Net::new(vb.clone())?,
            scale: vb.get_with_hints_dtype(
                (1, 3),
                "mixed_scale",
                candle_nn::Init::Const(0.5),
                dtype,
            )?,
        })
    }
}

impl Module for Mixed {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.net
            .forward(x)?
            .broadcast_mul(&self.scale.to_dtype(DType::F32)?)
    }
}

/// Either model, behind one type.
enum AnyNet {
    Net(Net),
    Tiny(Tiny),
    Mixed(Mixed),
}

impl Module for AnyNet {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            AnyNet::Net(n) => n.forward(x),
            AnyNet::Tiny(t) => t.forward(x),
            AnyNet::Mixed(m) => m.forward(x),
        }
    }
}

fn build(model: Model, vb: VarBuilder) -> candle_core::Result<AnyNet> {
    Ok(match model {
        Model::Net => AnyNet::Net(Net::new(vb)?),
        Model::Tiny => AnyNet::Tiny(Tiny {
            l: linear(2, 2, vb.pp("l"))?,
        }),
        Model::Mixed => AnyNet::Mixed(Mixed::new(vb, DType::F64)?),
    })
}

/// Initial values of `model`, drawn once so that every run starts from
/// them.
fn init_of(model: Model) -> HashMap<String, Tensor> {
    let varmap = VarMap::new();
    build(
        model,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    snapshot(&varmap)
}

type StepFn = Box<dyn FnMut(&mut DistributedDataParallel<AnyNet>, &Tensor) -> anyhow::Result<()>>;

/// `world` thread ranks train `model` from `init` with DDP (`zero: None`)
/// or ZeRO, on a `(replicas, shards)` mesh if given; rank 0's trained
/// variables.
fn train(
    model: Model,
    init: &HashMap<String, Tensor>,
    opt: Opt,
    world: usize,
    zero: Option<ZeroStage>,
    mesh: Option<(usize, usize)>,
) -> HashMap<String, Tensor> {
    let init = init.clone();
    let mut ranks = spawn(world, move |ctx| {
        let varmap = varmap_from(&init);
        let mut builder = DistributedDataParallel::builder(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
        );
        match (zero, mesh) {
            (Some(stage), Some((replicas, shards))) => {
                let dims = [("replicate", replicas), ("shard", shards)];
                let mesh = DeviceMesh::new(ctx.process_group(), &dims)?;
                builder = builder.zero_on_mesh(stage, &mesh)?;
            }
            (Some(stage), None) => builder = builder.zero(stage),
            (None, _) => {}
        }
        let mut ddp = builder.build(|vb| build(model, vb))?;
        let adamw = AdamWConfig {
            lr: 0.05,
            ..Default::default()
        };
        let mut step: StepFn = match (zero, opt) {
            (None, Opt::CandleSgd) => {
                let mut o = SGD::new(varmap.all_vars(), 0.1)?;
                Box::new(move |ddp, loss| Ok(ddp.backward_step(loss, &mut o)?))
            }
            (None, Opt::AdamW) => {
                let mut o = AdamW::from_varmap(&varmap, adamw)?;
                Box::new(move |ddp, loss| Ok(ddp.backward_step(loss, &mut o)?))
            }
            (Some(_), Opt::CandleSgd) => {
                let mut o = ZeroOptimizer::new(&ddp, |mine| {
                    SGD::new(mine.into_iter().map(|(_, v)| v).collect(), 0.1)
                })?;
                Box::new(move |ddp, loss| Ok(o.step(&ddp.backward(loss)?)?))
            }
            (Some(_), Opt::AdamW) => {
                let mut o = ZeroOptimizer::new(&ddp, |mine| AdamW::new_named(mine, adamw))?;
                Box::new(move |ddp, loss| Ok(o.step(&ddp.backward(loss)?)?))
            }
        };
        for (x, y) in batches(model, ctx.rank) {
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            step(&mut ddp, &loss)?;
        }
        // Every rank holds the same weights.
        let mine = snapshot(&varmap);
        let flat: std::collections::BTreeMap<String, Vec<u32>> = mine
            .iter()
            .map(|(k, t)| {
                let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                (k.clone(), v.iter().map(|x| x.to_bits()).collect())
            })
            .collect();
        let all = candle_dp::comm::all_gather_object(ctx.pg.as_ref(), &flat)?;
        anyhow::ensure!(
            all.iter().all(|w| w == &all[0]),
            "ranks hold different weights"
        );
        Ok(mine)
    })
    .unwrap();
    ranks.swap_remove(0)
}

/// Asserts that `run` at ZeRO stages 1 and 2 ends with `ddp`'s bytes.
fn assert_both_stages_give(
    ddp: &HashMap<String, Tensor>,
    what: &str,
    run: impl Fn(ZeroStage) -> HashMap<String, Tensor>,
) {
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let zero = run(stage);
        assert!(
            identical(&zero, ddp),
            "{what} {stage:?}: {}",
            diff_report(&zero, ddp)
        );
    }
}

#[test]
fn zero_stages_1_and_2_train_to_the_bytes_of_ddp_on_1_to_4_ranks() {
    within(300, || {
        for model in [Model::Net, Model::Tiny, Model::Mixed] {
            let init = init_of(model);
            for opt in [Opt::CandleSgd, Opt::AdamW] {
                for world in 1..=4 {
                    let ddp = train(model, &init, opt, world, None, None);
                    assert!(
                        max_rel_diff(&ddp, &init) > 1e-4,
                        "training moved the weights"
                    );
                    let what = format!("{model:?} {opt:?} {world} ranks");
                    assert_both_stages_give(&ddp, &what, |stage| {
                        train(model, &init, opt, world, Some(stage), None)
                    });
                }
            }
        }
    });
}

/// ZeRO on a mesh of 4 ranks (pieces split within each shard group,
/// replicated across): stage 1 reduces as DDP does, so every mesh gives
/// DDP's bytes; at stage 2 one replica of four shards is flat ZeRO's
/// reduce-scatter (DDP's bytes), and more replicas average their pieces
/// in another order: within rounding of DDP. Every rank ends with the
/// same weights (`train` checks).
#[test]
fn zero_on_a_mesh_trains_to_ddps_weights_and_stage_1_to_its_bytes() {
    within(300, || {
        for model in [Model::Net, Model::Tiny, Model::Mixed] {
            let init = init_of(model);
            for opt in [Opt::CandleSgd, Opt::AdamW] {
                let ddp = train(model, &init, opt, 4, None, None);
                for mesh in [(1, 4), (2, 2), (4, 1)] {
                    let what = format!("{model:?} {opt:?} mesh {mesh:?}");
                    let one = train(model, &init, opt, 4, Some(ZeroStage::One), Some(mesh));
                    assert!(
                        identical(&one, &ddp),
                        "{what} stage 1: {}",
                        diff_report(&one, &ddp)
                    );
                    let two = train(model, &init, opt, 4, Some(ZeroStage::Two), Some(mesh));
                    let diff = max_rel_diff(&two, &ddp);
                    match mesh {
                        (1, _) => {
                            assert!(identical(&two, &ddp), "{what}: {}", diff_report(&two, &ddp))
                        }
                        _ => assert!(
                            diff < 1e-5,
                            "{what} stage 2: {diff:e}: {}",
                            diff_report(&two, &ddp)
                        ),
                    }
                }
            }
        }
    });
}

/// A mesh's ranks split the pieces within their shard group: each holds
/// half of the weight's rows on a 2 x 2 mesh; a mesh of three dimensions,
/// a mesh that is not the DDP's group, and a mesh without a stage are
/// refused, naming why.
#[test]
fn zero_on_a_mesh_holds_a_shard_groups_pieces_and_refuses_what_does_not_fit() {
    let seen = within(60, || {
        spawn(4, |ctx| {
            let build = |builder: candle_dp::DdpBuilder<Net>| -> anyhow::Result<_> {
                Ok(builder.build(Net::new)?)
            };
            let mesh = DeviceMesh::new(ctx.process_group(), &[("replicate", 2), ("shard", 2)])?;
            let varmap = VarMap::new();
            let ddp = build(
                DistributedDataParallel::builder(
                    mesh.world().clone(),
                    &varmap,
                    DType::F32,
                    &Device::Cpu,
                )
                .zero_on_mesh(ZeroStage::Two, &mesh)?,
            )?;
            let opt =
                ZeroOptimizer::new(&ddp, |mine| AdamW::new_named(mine, AdamWConfig::default()))?;
            let pieces: Vec<(String, Vec<usize>)> = opt
                .shard_vars()
                .iter()
                .map(|(name, v)| (name.clone(), v.dims().to_vec()))
                .collect();
            let whole: Vec<(String, Vec<usize>)> = ddp
                .params()
                .iter()
                .map(|(name, v)| (name.clone(), v.dims().to_vec()))
                .collect();
            let three = DeviceMesh::new(ctx.process_group(), &[("a", 1), ("b", 2), ("c", 2)])?;
            let builder = DistributedDataParallel::<Net>::builder(
                ctx.process_group(),
                &VarMap::new(),
                DType::F32,
                &Device::Cpu,
            );
            let three = builder
                .zero_on_mesh(ZeroStage::One, &three)
                .unwrap_err()
                .to_string();
            // A mesh over a sub-group of 2 ranks, given to DDP over all 4.
            let pair = ctx
                .process_group()
                .split(Color::new((ctx.rank / 2) as u32), 0)?;
            let pair = pair.ok_or_else(|| anyhow::anyhow!("no pair"))?;
            let small = DeviceMesh::new(pair, &[("shard", 2)])?;
            let other = build(
                DistributedDataParallel::builder(
                    ctx.process_group(),
                    &VarMap::new(),
                    DType::F32,
                    &Device::Cpu,
                )
                .zero_on_mesh(ZeroStage::Two, &small)?,
            )
            .unwrap_err()
            .to_string();
            let config = candle_dp::DdpConfig {
                zero_groups: Some(candle_dp::comm::ShardGroups::flat(ctx.process_group())),
                ..Default::default()
            };
            let no_stage = DistributedDataParallel::new(
                ctx.process_group(),
                &VarMap::new(),
                DType::F32,
                &Device::Cpu,
                Net::new,
                config,
            )
            .unwrap_err()
            .to_string();
            Ok((
                pieces,
                whole,
                opt.replica_rank(),
                opt.shard_rank(),
                three,
                other,
                no_stage,
            ))
        })
        .unwrap()
    });
    for (rank, (pieces, whole, replica, shard, three, other, no_stage)) in
        seen.into_iter().enumerate()
    {
        assert_eq!((replica, shard), (rank / 2, rank % 2), "rank {rank}");
        let mut split = 0;
        for ((name, piece), (_, dims)) in pieces.iter().zip(&whole) {
            // A 0-dim parameter is one row, held by the shard group's rank 0.
            if let (Some(rows), Some(all)) = (piece.first(), dims.first()) {
                assert_eq!(*rows, all.div_ceil(2), "rank {rank}: {name}");
                split += 1;
            }
        }
        assert!(split >= 2, "rank {rank}: {whole:?}");
        assert!(three.contains("this one has 3"), "{three}");
        assert!(other.contains("not this DDP's group"), "{other}");
        assert!(no_stage.contains("without a ZeRO stage"), "{no_stage}");
    }
}

#[test]
fn stage_2_keeps_only_this_ranks_pieces_of_the_gradients_and_stage_1_all_of_them() {
    within(120, || {
        for (stage, world) in [
            (ZeroStage::One, 3),
            (ZeroStage::Two, 3),
            (ZeroStage::Two, 4),
        ] {
            let kept = spawn(world, move |ctx| {
                let varmap = VarMap::new();
                let mut ddp = DistributedDataParallel::builder(
                    ctx.process_group(),
                    &varmap,
                    DType::F32,
                    &Device::Cpu,
                )
                .zero(stage)
                .build(Net::new)?;
                let (x, y) = batches(Model::Net, ctx.rank).remove(0);
                let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                let grads = ddp.backward(&loss)?;
                let all: usize = ddp.params().iter().map(|(_, v)| v.elem_count() * 4).sum();
                // A piece: ceil(rows / world) rows of each parameter.
                let piece: usize = ddp
                    .params()
                    .iter()
                    .map(|(_, v)| {
                        // A 0-dim parameter is one row of one element.
                        let dims = v.dims();
                        let rows = dims.first().map_or(1, |r| r.div_ceil(world));
                        rows * dims.iter().skip(1).product::<usize>() * 4
                    })
                    .sum();
                Ok((
                    grad_bytes(&grads),
                    piece,
                    all,
                    ddp.vars_without_grad().len(),
                ))
            })
            .unwrap();
            for (rank, (held, piece, all, without)) in kept.into_iter().enumerate() {
                let want = if stage == ZeroStage::Two { piece } else { all };
                assert_eq!(held, want, "{stage:?} on {world} ranks, rank {rank}");
                assert_eq!(without, 0, "every parameter got a gradient somewhere");
            }
        }
    });
}

/// This rank's DDP of `Net` over `varmap` with ZeRO `stage` and, over the
/// parameters it owns, the crate's AdamW.
fn net_with_zero(
    ctx: &RankContext,
    varmap: &VarMap,
    stage: ZeroStage,
) -> anyhow::Result<(DistributedDataParallel<Net>, ZeroOptimizer<AdamW>)> {
    let ddp = net_ddp(ctx, varmap, stage)?;
    let opt = ZeroOptimizer::new(&ddp, |mine| AdamW::new_named(mine, AdamWConfig::default()))?;
    Ok((ddp, opt))
}

/// This rank's DDP of `Net` over `varmap` with ZeRO `stage`.
fn net_ddp(
    ctx: &RankContext,
    varmap: &VarMap,
    stage: ZeroStage,
) -> anyhow::Result<DistributedDataParallel<Net>> {
    Ok(
        DistributedDataParallel::builder(ctx.process_group(), varmap, DType::F32, &Device::Cpu)
            .zero(stage)
            .build(Net::new)?,
    )
}

/// `world` ranks train `steps` steps of `Net` with ZeRO stage 2 and AdamW,
/// from `shards` if given; the weights of rank 0 and every rank's shard.
fn zero_adamw_run(
    world: usize,
    steps: std::ops::Range<usize>,
    init: HashMap<String, Tensor>,
    shards: Option<Vec<OptimizerState>>,
) -> (HashMap<String, Tensor>, Vec<OptimizerState>) {
    let ranks = spawn(world, move |ctx: RankContext| {
        let varmap = varmap_from(&init);
        let (mut ddp, mut opt) = net_with_zero(&ctx, &varmap, ZeroStage::Two)?;
        if let Some(shards) = &shards {
            opt.load_shards(shards)?;
        }
        for step in steps.clone() {
            // The same global batch at every world size: rank r takes rows r, r + world, ...
            let (x, y) = batches(Model::Net, step % 2).remove(step % 4);
            let rows: Vec<u32> = (ctx.rank..3)
                .step_by(ctx.world_size)
                .map(|r| r as u32)
                .collect();
            if rows.is_empty() {
                anyhow::bail!("more ranks than rows");
            }
            let rows = Tensor::new(rows, &Device::Cpu)?;
            let (x, y) = (x.index_select(&rows, 0)?, y.index_select(&rows, 0)?);
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            let grads = ddp.backward(&loss)?;
            opt.step(&grads)?;
        }
        Ok((snapshot(&varmap), opt.shard_state()?))
    })
    .unwrap();
    let weights = ranks[0].0.clone();
    (weights, ranks.into_iter().map(|(_, s)| s).collect())
}

#[test]
fn shards_of_the_optimizer_state_resume_exactly_and_reshard_on_another_world_size() {
    within(120, || {
        let init = init_of(Model::Net);
        // Uninterrupted: 6 steps on 3 ranks.
        let (whole, _) = zero_adamw_run(3, 0..6, init.clone(), None);
        // 3 steps, saved as shards, then 3 more from them on 3 ranks.
        let (half, shards) = zero_adamw_run(3, 0..3, init, None);
        let (resumed, _) = zero_adamw_run(3, 3..6, half.clone(), Some(shards.clone()));
        assert!(
            identical(&resumed, &whole),
            "{}",
            diff_report(&resumed, &whole)
        );
        // On 2 ranks: each takes its piece of every saved entry under the
        // new split, so together they hold exactly the saved state...
        let (_, resharded) = zero_adamw_run(2, 3..3, half.clone(), Some(shards.clone()));
        let numel: HashMap<String, usize> = half
            .iter()
            .map(|(k, t)| (k.clone(), t.elem_count()))
            .collect();
        let whole_entries = |states: &[OptimizerState]| {
            let mut all: Vec<(String, Vec<f32>)> = states[0]
                .tensors
                .keys()
                .map(|key| {
                    // The pieces in rank order, the padding (at the end)
                    // dropped; a step count is every rank's.
                    let param = key.rsplit_once('.').map_or(key.as_str(), |(p, _)| p);
                    let ranks = if key.ends_with(".step") {
                        1
                    } else {
                        states.len()
                    };
                    let mut values: Vec<f32> = states[..ranks]
                        .iter()
                        .flat_map(|s| {
                            s.tensors[key]
                                .flatten_all()
                                .unwrap()
                                .to_dtype(DType::F32)
                                .unwrap()
                                .to_vec1::<f32>()
                                .unwrap()
                        })
                        .collect();
                    values.truncate(numel[param]);
                    (key.clone(), values)
                })
                .collect();
            all.sort_by(|a, b| a.0.cmp(&b.0));
            all
        };
        assert_eq!(whole_entries(&resharded), whole_entries(&shards));
        assert!(!whole_entries(&shards).is_empty());
        // ...and their saves, resharded back onto 3 ranks, resume to the
        // very bytes of the run that was not interrupted.
        let (round_trip, _) = zero_adamw_run(3, 3..6, half, Some(resharded));
        assert!(
            identical(&round_trip, &whole),
            "{}",
            diff_report(&round_trip, &whole)
        );
    });
}

#[test]
fn shards_of_different_runs_are_refused_and_nothing_is_loaded() {
    within(120, || {
        let results = spawn(2, |ctx| {
            let varmap = VarMap::new();
            let (_ddp, mut opt) = net_with_zero(&ctx, &varmap, ZeroStage::One)?;
            let mut a = opt.shard_state()?;
            a.steps = 3;
            let mut b = opt.shard_state()?;
            b.steps = 4;
            let err = opt.load_shards(&[a, b]).unwrap_err();
            Ok((err.to_string(), opt.inner().state()?.steps))
        })
        .unwrap();
        for (message, steps) in results {
            assert!(message.contains("not of one run"), "{message}");
            assert_eq!(steps, 0, "nothing loaded");
        }
    });
}

#[test]
fn a_zero_optimizer_over_a_ddp_without_zero_is_refused() {
    within(120, || {
        let results = spawn(1, |ctx| {
            let varmap = VarMap::new();
            let ddp = DistributedDataParallel::builder(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
            )
            .build(Net::new)?;
            Ok(
                ZeroOptimizer::new(&ddp, |mine| AdamW::new_named(mine, AdamWConfig::default()))
                    .unwrap_err(),
            )
        })
        .unwrap();
        assert!(
            matches!(&results[0], Error::Zero(m) if m.contains(".zero(ZeroStage::One)")),
            "{}",
            results[0]
        );
    });
}

#[test]
#[allow(clippy::result_large_err)] // the closure returns candle_dp::Result, as join requires
fn join_with_zero_is_refused_with_the_reason() {
    within(120, || {
        let results = spawn(2, |ctx| {
            let varmap = VarMap::new();
            let mut ddp = net_ddp(&ctx, &varmap, ZeroStage::Two)?;
            Ok(ddp.join(|_| Ok(())).unwrap_err())
        })
        .unwrap();
        for err in results {
            assert!(
                matches!(&err, Error::Zero(m) if m.contains("all-gather")),
                "{err}"
            );
        }
    });
}

/// What a DDP setting does in `as_in_ddp`'s runs.
#[derive(Clone, Copy, Debug)]
enum Setting {
    /// Every other backward inside `no_sync` (accumulated).
    NoSync,
    /// Buckets reduced in bf16.
    Bf16Hook,
    /// A BatchNorm model: its buffers broadcast from rank 0 every forward.
    Buffers,
}

/// 3 thread ranks, 6 backward passes of `setting` with AdamW: DDP's or
/// ZeRO's weights and buffers (rank 0's).
fn with_setting(
    setting: Setting,
    zero: Option<ZeroStage>,
    init: HashMap<String, Tensor>,
) -> HashMap<String, Tensor> {
    let mut ranks = spawn(3, move |ctx| {
        let varmap = varmap_from(&init);
        let mut builder = DistributedDataParallel::builder(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
        );
        if let Setting::Bf16Hook = setting {
            builder = builder.comm_hook(candle_dp::CommHook::Bf16Compress);
        }
        if let Some(stage) = zero {
            builder = builder.zero(stage);
        }
        let mut ddp = builder.build(BnNet::new)?;
        let config = AdamWConfig {
            lr: 0.02,
            ..Default::default()
        };
        let mut whole = AdamW::from_varmap(&varmap, config)?;
        let mut sharded = match zero {
            Some(_) => Some(ZeroOptimizer::new(&ddp, |mine| {
                AdamW::new_named(mine, config)
            })?),
            None => None,
        };
        for step in 0..6 {
            let x =
                Tensor::new(values(4 * 12, 5 * ctx.rank + step), &Device::Cpu)?.reshape((4, 12))?;
            let y = Tensor::new(vec![(step % 4) as u32, 1, 2, 3], &Device::Cpu)?;
            let accumulate = matches!(setting, Setting::NoSync) && step % 2 == 0;
            let grads = if accumulate {
                ddp.no_sync(|d| -> anyhow::Result<_> {
                    let loss = loss::cross_entropy(&d.forward_t(&x, true)?, &y)?;
                    Ok(d.backward(&loss)?)
                })?
            } else {
                let loss = loss::cross_entropy(&ddp.forward_t(&x, true)?, &y)?;
                ddp.backward(&loss)?
            };
            if accumulate {
                continue;
            }
            match &mut sharded {
                Some(opt) => opt.step(&grads)?,
                None => whole.step(&grads)?,
            }
        }
        Ok(snapshot(&varmap))
    })
    .unwrap();
    ranks.swap_remove(0)
}

#[test]
fn no_sync_comm_hooks_and_buffers_with_zero_give_the_bytes_of_ddp() {
    within(120, || {
        let varmap = VarMap::new();
        BnNet::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        let init = snapshot(&varmap);
        for setting in [Setting::NoSync, Setting::Bf16Hook, Setting::Buffers] {
            let ddp = with_setting(setting, None, init.clone());
            assert!(
                max_rel_diff(&ddp, &init) > 1e-4,
                "{setting:?}: training moved the weights"
            );
            assert_both_stages_give(&ddp, &format!("{setting:?}"), |stage| {
                with_setting(setting, Some(stage), init.clone())
            });
        }
    });
}

#[test]
fn a_rank_whose_optimizer_step_fails_is_named_on_every_rank_and_no_parameter_changes() {
    within(120, || {
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let results = spawn(3, move |ctx| {
                let varmap = VarMap::new();
                let (mut ddp, mut opt) = net_with_zero(&ctx, &varmap, stage)?;
                let before = snapshot(&varmap);
                let (x, y) = batches(Model::Net, ctx.rank).remove(0);
                let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                let mut grads = ddp.backward(&loss)?;
                if ctx.rank == 1 {
                    // Not this DDP's gradient: the step of rank 1 alone fails.
                    let p = &ddp.params()[0].1;
                    grads.insert(p.as_tensor(), Tensor::zeros(13, DType::F32, &Device::Cpu)?);
                }
                let err = opt.step(&grads).unwrap_err();
                Ok((err.to_string(), identical_bits(&snapshot(&varmap), &before)))
            })
            .unwrap();
            for (rank, (message, unchanged)) in results.into_iter().enumerate() {
                assert!(
                    message.contains("the optimizer step of rank 1 failed")
                        && message.contains("has shape [13]"),
                    "{stage:?}, rank {rank}: {message}"
                );
                assert!(unchanged, "{stage:?}, rank {rank}: a parameter changed");
            }
        }
    });
}

/// Whether two snapshots hold the same bits (any dtype).
fn identical_bits(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> bool {
    a.len() == b.len()
        && a.iter()
            .all(|(n, t)| b.get(n).is_some_and(|u| bits(t) == bits(u)))
}

#[test]
fn shards_named_by_position_are_refused_rather_than_dropped() {
    within(60, || {
        let results = spawn(1, |ctx| {
            let varmap = VarMap::new();
            let ddp = net_ddp(&ctx, &varmap, ZeroStage::One)?;
            // Built through candle's Optimizer::new: state named by position.
            let mut opt = ZeroOptimizer::new(&ddp, |mine| {
                <AdamW as Optimizer>::new(
                    mine.into_iter().map(|(_, v)| v).collect(),
                    AdamWConfig::default(),
                )
            })?;
            let (x, y) = batches(Model::Net, 0).remove(0);
            let mut ddp = ddp;
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            opt.step(&ddp.backward(&loss)?)?;
            let shard = opt.shard_state()?;
            Ok(opt.load_shards(&[shard]).unwrap_err().to_string())
        })
        .unwrap();
        assert!(
            results[0].contains("names no parameter of this model"),
            "{}",
            results[0]
        );
    });
}

#[test]
fn backward_step_with_a_plain_optimizer_is_refused_at_stage_2() {
    within(60, || {
        let results = spawn(2, |ctx| {
            let varmap = VarMap::new();
            let mut ddp = net_ddp(&ctx, &varmap, ZeroStage::Two)?;
            let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
            let (x, y) = batches(Model::Net, ctx.rank).remove(0);
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            Ok(ddp.backward_step(&loss, &mut sgd).unwrap_err())
        })
        .unwrap();
        for err in results {
            assert!(
                matches!(&err, Error::Zero(m) if m.contains("ZeroOptimizer")),
                "{err}"
            );
        }
    });
}

/// `Net` and a zero-element `f64` parameter, alone in its dtype (a group
/// with nothing to reduce or gather); it joins the loss as its empty sum.
struct WithEmpty {
    net: Net,
    empty: Tensor,
}

impl Module for WithEmpty {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.net
            .forward(x)?
            .broadcast_add(&self.empty.sum_all()?.to_dtype(DType::F32)?)
    }
}

/// `world` ranks train `WithEmpty` 3 steps with the crate's SGD (momentum),
/// under DDP or ZeRO `zero`; rank 0's weights.
fn train_with_empty(world: usize, zero: Option<ZeroStage>) -> HashMap<String, Tensor> {
    use candle_dp::optim::{Sgd, SgdConfig};
    let config = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    };
    let mut ranks = spawn(world, move |ctx| {
        let make = |vb: VarBuilder| -> candle_core::Result<WithEmpty> {
            Ok(WithEmpty {
                net: Net::new(vb.clone())?,
                empty: vb.get_with_hints_dtype(
                    0,
                    "empty",
                    candle_nn::Init::Const(0.),
                    DType::F64,
                )?,
            })
        };
        let varmap =
            candle_dp::seeded_varmap(3, DType::F32, &Device::Cpu, |vb| make(vb).map(|_| ()))?;
        let mut builder = DistributedDataParallel::builder(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
        );
        if let Some(stage) = zero {
            builder = builder.zero(stage);
        }
        let mut ddp = builder.build(make)?;
        let mut zero_opt = match zero {
            Some(_) => Some(ZeroOptimizer::new(&ddp, |mine| {
                Sgd::new_named(mine, config)
            })?),
            None => None,
        };
        let mut plain = Sgd::from_varmap(&varmap, config)?;
        for (x, y) in batches(Model::Net, ctx.rank).into_iter().take(3) {
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            match zero_opt.as_mut() {
                Some(opt) => opt.step(&ddp.backward(&loss)?)?,
                None => ddp.backward_step(&loss, &mut plain)?,
            }
        }
        // `identical` reads f32: the empty f64 parameter converts exactly.
        Ok(snapshot(&varmap)
            .into_iter()
            .map(|(name, t)| (name, t.to_dtype(DType::F32).unwrap()))
            .collect::<HashMap<_, _>>())
    })
    .unwrap();
    ranks.swap_remove(0)
}

#[test]
fn a_dtype_group_of_only_an_empty_parameter_trains_to_the_bytes_of_ddp() {
    within(120, || {
        for world in [1, 2, 3] {
            let ddp = train_with_empty(world, None);
            assert_eq!(ddp["empty"].dims(), [0]);
            assert_both_stages_give(&ddp, &format!("{world} ranks"), |stage| {
                train_with_empty(world, Some(stage))
            });
        }
    });
}

#[test]
fn an_incomplete_or_mixed_set_of_shards_is_refused_naming_what_is_missing() {
    within(120, || {
        let init = init_of(Model::Net);
        let (_, three) = zero_adamw_run(3, 0..1, init.clone(), None);
        let (_, two) = zero_adamw_run(2, 0..1, init.clone(), None);
        assert_eq!(three[2].shard.map(|s| (s.rank, s.world_size)), Some((2, 3)));
        let unrecorded = {
            let mut s = three[1].clone();
            s.shard = None;
            s
        };
        let cases: Vec<(Vec<OptimizerState>, &str)> = vec![
            (
                vec![three[0].clone(), three[2].clone()],
                "rank(s) [1] of the 3 that saved the state are missing",
            ),
            (
                vec![three[0].clone(), two[1].clone(), three[2].clone()],
                "saved by rank 1 of 2, shard 0 by a run of 3 ranks",
            ),
            (
                vec![three[0].clone(), three[0].clone(), three[2].clone()],
                "two shards were saved by rank 0",
            ),
            (
                vec![three[0].clone(), unrecorded, three[2].clone()],
                "shard 1 does not record which rank saved it",
            ),
        ];
        let results = spawn(3, move |ctx| {
            let varmap = varmap_from(&init);
            let (_ddp, mut opt) = net_with_zero(&ctx, &varmap, ZeroStage::Two)?;
            let mut messages = Vec::new();
            for (shards, _) in &cases {
                messages.push(opt.load_shards(shards).unwrap_err().to_string());
            }
            // A shard alone is refused by the optimizer's own load_state.
            let alone = opt.inner_mut().load_state(&cases[0].0[0]).unwrap_err();
            messages.push(alone.to_string());
            Ok((messages, opt.inner().state()?.steps, cases.clone()))
        })
        .unwrap();
        for (messages, steps, cases) in results {
            assert_eq!(steps, 0, "nothing loaded");
            for ((_, want), got) in cases.iter().zip(&messages) {
                assert!(got.contains(want), "{got}");
            }
            assert!(
                messages[4].contains("rank 0's shard") && messages[4].contains("load_shards"),
                "{}",
                messages[4]
            );
        }
    });
}

/// `world` ranks train `Net` 3 steps with AdamW, the gradients clipped to
/// a total 2-norm of 0.05 (every step clips): under DDP with the whole
/// gradients on every rank, or at ZeRO `stage` with the shards' norms
/// all-reduced; rank 0's weights and each step's factor.
fn clipped_run(
    init: &HashMap<String, Tensor>,
    world: usize,
    zero: Option<ZeroStage>,
) -> (HashMap<String, Tensor>, Vec<f64>) {
    let init = init.clone();
    let mut ranks = spawn(world, move |ctx| {
        let varmap = varmap_from(&init);
        let mut factors = Vec::new();
        match zero {
            Some(stage) => {
                let (mut ddp, mut opt) = net_with_zero(&ctx, &varmap, stage)?;
                for (x, y) in batches(Model::Net, ctx.rank).into_iter().take(3) {
                    let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                    let mut grads = ddp.backward(&loss)?;
                    factors.push(opt.clip_grad_norm(&mut grads, 0.05, 2.0, true)?.factor);
                    opt.step(&grads)?;
                }
            }
            None => {
                let mut ddp = DistributedDataParallel::builder(
                    ctx.process_group(),
                    &varmap,
                    DType::F32,
                    &Device::Cpu,
                )
                .build(Net::new)?;
                let params: Vec<Var> = ddp.params().iter().map(|(_, v)| v.clone()).collect();
                let mut opt = AdamW::new_named(ddp.params().to_vec(), AdamWConfig::default())?;
                for (x, y) in batches(Model::Net, ctx.rank).into_iter().take(3) {
                    let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                    let mut grads = ddp.backward(&loss)?;
                    let clipped =
                        candle_dp::optim::clip_grad_norm(&mut grads, &params, 0.05, 2.0, true)?;
                    factors.push(clipped.factor);
                    opt.step(&grads)?;
                }
            }
        }
        Ok((snapshot(&varmap), factors))
    })
    .unwrap();
    ranks.swap_remove(0)
}

#[test]
fn clipping_over_zero_shards_takes_one_all_reduce_and_trains_like_ddp() {
    within(120, || {
        let init = init_of(Model::Net);
        for world in [2, 3] {
            let (ddp, ddp_factors) = clipped_run(&init, world, None);
            assert!(
                ddp_factors.iter().all(|&f| f < 1.0),
                "every step clips: {ddp_factors:?}"
            );
            for stage in [ZeroStage::One, ZeroStage::Two] {
                let (zero, factors) = clipped_run(&init, world, Some(stage));
                for (a, b) in factors.iter().zip(&ddp_factors) {
                    assert!(
                        (a - b).abs() <= 1e-6 * b,
                        "{world} ranks, {stage:?}: factor {a} against {b}"
                    );
                }
                let diff = max_rel_diff(&zero, &ddp);
                assert!(
                    diff < 1e-5,
                    "{world} ranks, {stage:?}: {diff}\n{}",
                    diff_report(&zero, &ddp)
                );
            }
        }
    });
}

/// `world` ranks train one 256x64 linear layer (its weight 98% of the
/// model, 64 KiB: the ring's size) for 3 AdamW steps, under DDP or ZeRO
/// stage 2: rank 0's weights and each rank's optimizer-state bytes.
fn huge_parameter_run(world: usize, zero: bool) -> (HashMap<String, Tensor>, Vec<usize>) {
    let init: HashMap<String, Tensor> = [("big.weight", 256, 64, 1), ("big.bias", 256, 1, 2)]
        .into_iter()
        .map(|(name, rows, cols, seed)| {
            let t = Tensor::from_vec(values(rows * cols, seed), rows * cols, &Device::Cpu)
                .and_then(|t| t * 0.05)
                .and_then(|t| match cols {
                    1 => Ok(t),
                    _ => t.reshape((rows, cols)),
                })
                .unwrap();
            (name.to_string(), t)
        })
        .collect();
    let ranks = spawn(world, move |ctx| {
        let varmap = varmap_from(&init);
        let builder = DistributedDataParallel::builder(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
        );
        let builder = if zero {
            builder.zero(ZeroStage::Two)
        } else {
            builder
        };
        let mut ddp = builder.build(|vb| linear(64, 256, vb.pp("big")))?;
        let mut zero_opt = match zero {
            true => Some(ZeroOptimizer::new(&ddp, |mine| {
                AdamW::new_named(mine, AdamWConfig::default())
            })?),
            false => None,
        };
        let mut ddp_opt = AdamW::new_named(ddp.params().to_vec(), AdamWConfig::default())?;
        for step in 0..3 {
            let x = Tensor::from_vec(values(4 * 64, ctx.rank * 10 + step), (4, 64), &Device::Cpu)?;
            let y: Vec<u32> = (0..4)
                .map(|i| ((ctx.rank * 61 + step * 17 + i * 5) % 256) as u32)
                .collect();
            let y = Tensor::new(y, &Device::Cpu)?;
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            let grads = ddp.backward(&loss)?;
            match &mut zero_opt {
                Some(opt) => opt.step(&grads)?,
                None => ddp_opt.step(&grads)?,
            }
        }
        let state = match &zero_opt {
            Some(opt) => opt.state_bytes()?,
            None => ddp_opt
                .state()?
                .tensors
                .values()
                .map(|t| t.elem_count() * t.dtype().size_in_bytes())
                .sum(),
        };
        Ok((snapshot(&varmap), state))
    })
    .unwrap();
    let weights = ranks[0].0.clone();
    (weights, ranks.into_iter().map(|(_, s)| s).collect())
}

#[test]
fn one_huge_parameter_shards_its_optimizer_state_evenly_and_trains_like_ddp() {
    within(120, || {
        for world in [2, 4] {
            let (ddp, ddp_state) = huge_parameter_run(world, false);
            let (zero, zero_state) = huge_parameter_run(world, true);
            // Adam's two moments of (256 x 64 + 256) f32 elements, split
            // in `world` equal pieces (256 rows divide evenly); the step
            // counts are a few bytes more.
            let moments = 2 * 4 * (256 * 64 + 256);
            for (rank, &bytes) in zero_state.iter().enumerate() {
                assert!(
                    bytes >= moments / world && bytes <= moments / world + 64,
                    "{world} ranks, rank {rank}: {bytes} bytes of state, DDP's {}",
                    ddp_state[rank]
                );
            }
            // Two ranks add in one order either way round; four sum the
            // rank-by-rank layout from other ranks than DDP's ring does.
            let diff = max_rel_diff(&zero, &ddp);
            match world {
                2 => assert!(identical(&zero, &ddp), "{}", diff_report(&zero, &ddp)),
                _ => assert!(
                    diff < 1e-5,
                    "{world} ranks: {diff}\n{}",
                    diff_report(&zero, &ddp)
                ),
            }
            eprintln!("{world} ranks: ZeRO-2 against DDP {diff:e}, state {zero_state:?} against {ddp_state:?}");
        }
    });
}

/// A set of shards in which one rank's lacks a parameter's moments (rank
/// 0's or another's) is refused naming that rank and the entry, and
/// nothing is loaded: before, rank 0's entries alone decided, and the
/// parameter silently restarted from no state when rank 0's lacked it.
#[test]
fn shards_of_which_one_lacks_a_parameters_moments_are_refused_naming_the_rank() {
    within(120, || {
        let init = init_of(Model::Net);
        let (half, shards) = zero_adamw_run(2, 0..2, init, None);
        let key = shards[0]
            .tensors
            .keys()
            .find(|k| k.ends_with(".exp_avg"))
            .cloned()
            .expect("AdamW's moments");
        for lacking in 0..2 {
            let mut set = shards.clone();
            set[lacking].tensors.remove(&key);
            let key = key.clone();
            let init = half.clone();
            let results = spawn(2, move |ctx| {
                let varmap = varmap_from(&init);
                let (_ddp, mut opt) = net_with_zero(&ctx, &varmap, ZeroStage::Two)?;
                let err = opt.load_shards(&set).unwrap_err();
                Ok((err.to_string(), opt.inner().state()?.steps))
            })
            .unwrap();
            for (message, steps) in results {
                assert!(
                    message.contains(&format!("rank {lacking}'s state lacks `{key}`")),
                    "{message}"
                );
                assert_eq!(steps, 0, "nothing loaded");
            }
        }
    });
}
