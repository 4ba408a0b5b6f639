//! DistributedDataParallel over a model given as units: each gradient
//! bucket reduced while the backward of the earlier units runs. The core
//! promise: the same bytes as DDP without units given the same buckets.

use crate::common;
use crate::example_gpt::{self, GptConfig};

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use candle_dp::comm::{
    Failure, GroupOptions, Membership, ProcessGroup, ReduceOp, Result as CommResult,
};
use candle_dp::launch::{spawn_with, RankContext};
use candle_dp::pipeline::{unit, UnitFactory};
use candle_dp::precision::MixedPrecision;
use candle_dp::units::Units;
use candle_dp::zero::{ZeroOptimizer, ZeroStage};
use candle_dp::{Activity, DdpConfig, DistributedDataParallel, Error, JoinDivisor};
use candle_nn::{linear, loss, AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use common::*;

pub(crate) fn bounded() -> GroupOptions {
    GroupOptions {
        timeout: Some(Duration::from_secs(20)),
        ..Default::default()
    }
}

/// A deep MLP 6 -> 12 x 4 -> 5: five linear layers, ReLU between.
const DEPTH: usize = 5;
const WIDTH: usize = 12;

pub(crate) fn deep_units() -> Vec<UnitFactory> {
    let mut units = Vec::new();
    for l in 0..DEPTH {
        let (i, o) = (
            if l == 0 { 6 } else { WIDTH },
            if l + 1 == DEPTH { 5 } else { WIDTH },
        );
        units.push(unit(move |vb| linear(i, o, vb.pp(format!("l{l}")))));
        if l + 1 < DEPTH {
            units.push(unit(|_| Ok(candle_nn::Activation::Relu)));
        }
    }
    units
}

/// The same model written as one module: no units.
pub(crate) struct DeepMlp(Vec<Linear>);

impl DeepMlp {
    pub(crate) fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        (0..DEPTH)
            .map(|l| {
                let i = if l == 0 { 6 } else { WIDTH };
                let o = if l + 1 == DEPTH { 5 } else { WIDTH };
                linear(i, o, vb.pp(format!("l{l}")))
            })
            .collect::<candle_core::Result<_>>()
            .map(DeepMlp)
    }
}

impl Module for DeepMlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (l, layer) in self.0.iter().enumerate() {
            h = layer.forward(&h)?;
            if l + 1 < self.0.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Small buckets, so that a step has several and the overlap spreads.
fn small_buckets() -> DdpConfig {
    DdpConfig {
        first_bucket_cap_bytes: 256,
        bucket_cap_bytes: 700,
        ..Default::default()
    }
}

/// The bucket order a model given as `units` gets.
pub(crate) fn order_of(units: &[UnitFactory]) -> Vec<String> {
    let varmap = VarMap::new();
    Units::build(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        units,
    )
    .unwrap()
    .bucket_order()
}

pub(crate) fn init_deep() -> HashMap<String, Tensor> {
    let varmap = VarMap::new();
    DeepMlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    snapshot(&varmap)
}

pub(crate) fn batches(steps: usize, rows: usize, seed: u32) -> Vec<(Tensor, Tensor)> {
    (0..steps)
        .map(|s| {
            let x = Tensor::randn(0f32, 1., (rows, 6), &Device::Cpu).unwrap();
            let y = (0..rows as u32)
                .map(|i| (i * 3 + s as u32 + seed) % 5)
                .collect();
            (x, Tensor::from_vec(y, rows, &Device::Cpu).unwrap())
        })
        .collect()
}

pub(crate) fn adamw(varmap: &VarMap) -> candle_core::Result<AdamW> {
    AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        },
    )
}

/// This rank's rows of a global batch.
pub(crate) fn share(
    ctx: &RankContext,
    x: &Tensor,
    y: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let b = x.dim(0)? / ctx.world_size;
    Ok((x.narrow(0, ctx.rank * b, b)?, y.narrow(0, ctx.rank * b, b)?))
}

/// How a run builds and steps its DDP.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    /// From units, `forward_backward` (overlapped).
    Overlapped,
    /// The same layers as one module, `forward` then `backward`, with the
    /// units' bucket order.
    Whole,
}

/// Trains the deep MLP with AdamW on `world` ranks; every rank's weights.
fn train_deep(
    world: usize,
    data: Vec<(Tensor, Tensor)>,
    init: HashMap<String, Tensor>,
    way: Way,
    config: DdpConfig,
) -> Vec<HashMap<String, Tensor>> {
    spawn_with(world, bounded(), move |ctx| {
        let varmap = varmap_from(&init);
        let mut opt = adamw(&varmap)?;
        match way {
            Way::Overlapped => {
                let mut ddp = DistributedDataParallel::from_units(
                    ctx.process_group(),
                    &varmap,
                    DType::F32,
                    &Device::Cpu,
                    deep_units(),
                    config.clone(),
                )?;
                for (x, y) in &data {
                    let (x, y) = share(&ctx, x, y)?;
                    let step = ddp.forward_backward(&x, &y, loss::cross_entropy)?;
                    opt.step(&step.grads)?;
                }
            }
            Way::Whole => {
                let config = DdpConfig {
                    bucket_order: Some(order_of(&deep_units())),
                    ..config.clone()
                };
                let mut ddp = DistributedDataParallel::new(
                    ctx.process_group(),
                    &varmap,
                    DType::F32,
                    &Device::Cpu,
                    DeepMlp::new,
                    config,
                )?;
                for (x, y) in &data {
                    let (x, y) = share(&ctx, x, y)?;
                    let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                    ddp.backward_step(&loss, &mut opt)?;
                }
            }
        }
        Ok(snapshot(&varmap))
    })
    .unwrap()
}

/// Every rank of `a` holds the very bytes of the same rank of `b`.
fn assert_same_bytes(a: &[HashMap<String, Tensor>], b: &[HashMap<String, Tensor>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (rank, (a, b)) in a.iter().zip(b).enumerate() {
        assert!(
            identical(a, b),
            "{what}, rank {rank}: {}",
            diff_report(a, b)
        );
    }
}

#[test]
fn units_fill_the_buckets_last_unit_first() {
    // Bounded: a hang fails the test instead of stalling CI.
    within(60, || {
        let ddp_buckets = spawn_with(1, bounded(), |ctx| {
            let varmap = VarMap::new();
            let ddp = DistributedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                deep_units(),
                small_buckets(),
            )?;
            Ok(ddp
                .buckets()
                .iter()
                .map(|b| b.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .collect::<Vec<_>>())
        })
        .unwrap()
        .remove(0);
        assert!(ddp_buckets.len() >= 3, "{ddp_buckets:?}");
        let flat: Vec<String> = ddp_buckets.concat();
        let expected: Vec<String> = (0..DEPTH)
            .rev()
            .flat_map(|l| [format!("l{l}.bias"), format!("l{l}.weight")])
            .collect();
        assert_eq!(flat, expected);
    });
}

#[test]
fn overlapped_reduction_trains_to_the_bytes_of_ddp_without_units_on_1_to_4_ranks() {
    within(240, || {
        let init = init_deep();
        let data = batches(3, 12, 0);
        for world in 1..=4 {
            let overlapped = train_deep(
                world,
                data.clone(),
                init.clone(),
                Way::Overlapped,
                small_buckets(),
            );
            let whole = train_deep(
                world,
                data.clone(),
                init.clone(),
                Way::Whole,
                small_buckets(),
            );
            assert_same_bytes(&overlapped, &whole, &format!("world {world}"));
            // The weights moved: the comparison is not of two untrained models.
            assert!(!identical(&overlapped[0], &init), "world {world}");
        }
    });
}

#[test]
fn overlapped_reduction_with_one_bucket_and_default_caps_matches_too() {
    within(120, || {
        let init = init_deep();
        let data = batches(2, 8, 1);
        let a = train_deep(
            2,
            data.clone(),
            init.clone(),
            Way::Overlapped,
            DdpConfig::default(),
        );
        let b = train_deep(2, data, init, Way::Whole, DdpConfig::default());
        assert!(identical(&a[1], &b[1]), "{}", diff_report(&a[1], &b[1]));
    });
}

pub(crate) const TINY: GptConfig = GptConfig {
    vocab: 256,
    context: 8,
    width: 16,
    layers: 2,
    heads: 2,
    fused_ops: true,
    dropout: 0.0,
};

/// Windows of token ids `(i * 37 + step * 11) % modulus`: with 251, every
/// id of a batch is distinct; with a small modulus, ids repeat.
pub(crate) fn tokens(steps: usize, rows: usize, modulus: usize) -> Vec<(Tensor, Tensor)> {
    (0..steps)
        .map(|s| {
            let ids: Vec<u32> = (0..rows * (TINY.context + 1))
                .map(|i| ((i * 37 + s * 11) % modulus) as u32)
                .collect();
            let ids = Tensor::from_vec(ids, (rows, TINY.context + 1), &Device::Cpu).unwrap();
            (
                ids.narrow(1, 0, TINY.context).unwrap(),
                ids.narrow(1, 1, TINY.context).unwrap(),
            )
        })
        .collect()
}

/// The language model on `world` ranks, AdamW, from `init`: given as units
/// (`overlapped`) or whole, with the units' bucket order.
fn train_gpt(
    world: usize,
    init: &HashMap<String, Tensor>,
    data: &[(Tensor, Tensor)],
    overlapped: bool,
) -> Vec<HashMap<String, Tensor>> {
    let (init, data) = (init.clone(), data.to_vec());
    let order = order_of(&example_gpt::units(TINY));
    spawn_with(world, bounded(), move |ctx| {
        let varmap = varmap_from(&init);
        let mut opt = adamw(&varmap)?;
        let config = DdpConfig {
            first_bucket_cap_bytes: 4096,
            bucket_cap_bytes: 8192,
            bucket_order: Some(order.clone()),
            ..Default::default()
        };
        if overlapped {
            let mut ddp = DistributedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                example_gpt::units(TINY),
                config,
            )?;
            for (x, y) in &data {
                let (x, y) = share(&ctx, x, y)?;
                let step = ddp.forward_backward(&x, &y, example_gpt::lm_loss)?;
                anyhow::ensure!(step.vars_without_grad().is_empty());
                opt.step(&step.grads)?;
            }
        } else {
            let mut ddp = DistributedDataParallel::new(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                |vb| example_gpt::Gpt::new(TINY, vb),
                config,
            )?;
            for (x, y) in &data {
                let (x, y) = share(&ctx, x, y)?;
                let loss = example_gpt::lm_loss(&ddp.forward(&x)?, &y)?;
                ddp.backward_step(&loss, &mut opt)?;
            }
        }
        Ok(snapshot(&varmap))
    })
    .unwrap()
}

pub(crate) fn init_gpt() -> HashMap<String, Tensor> {
    let varmap = VarMap::new();
    example_gpt::Gpt::new(
        TINY,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    snapshot(&varmap)
}

/// The language model, its head tied to the token embedding: `wte` gets
/// a contribution from the head (the last unit) and the embedding (the
/// first), and its bucket may go only after both. With every token of a
/// batch distinct, the bytes are those without units.
#[test]
fn a_weight_tied_across_units_is_reduced_after_its_last_contribution() {
    within(240, || {
        let order = order_of(&example_gpt::units(TINY));
        assert_eq!(
            order.last().map(String::as_str),
            Some("wte.weight"),
            "{order:?}"
        );
        let init = init_gpt();
        let data = tokens(2, 6, 251);
        for world in [2, 3] {
            let overlapped = train_gpt(world, &init, &data, true);
            let whole = train_gpt(world, &init, &data, false);
            assert_same_bytes(&overlapped, &whole, &format!("world {world}"));
        }
    });
}

/// Where a token repeats in a batch, unit by unit the embedding's rows
/// meet the tied head's gradient only after the embedding's backward; the
/// whole backward's order is the same because the model's lookup
/// (`ops::embedding`) sums a token's rows before adding them to the
/// table's other gradients (candle's `index_select` would add them one by
/// one onto the head's, other bits). So every weight is the same bytes.
#[test]
fn a_tied_weight_with_repeated_tokens_is_reduced_to_the_same_bytes() {
    within(120, || {
        let init = init_gpt();
        let data = tokens(1, 6, 13);
        let overlapped = train_gpt(2, &init, &data, true);
        let whole = train_gpt(2, &init, &data, false);
        assert_same_bytes(&overlapped, &whole, "repeated tokens");
    });
}

/// Gradient accumulation: two micro-batches inside `no_sync`, the third
/// reduces the sum, as without units.
#[test]
fn no_sync_accumulates_unit_by_unit_and_the_next_step_reduces_the_sum() {
    within(120, || {
        let init = init_deep();
        let data = batches(3, 8, 2);
        let runs: Vec<_> = [Way::Overlapped, Way::Whole]
            .into_iter()
            .map(|way| {
                let (init, data) = (init.clone(), data.clone());
                spawn_with(2, bounded(), move |ctx| {
                    let varmap = varmap_from(&init);
                    let mut opt = adamw(&varmap)?;
                    let config = DdpConfig {
                        bucket_order: Some(order_of(&deep_units())),
                        ..small_buckets()
                    };
                    let parts: Vec<(Tensor, Tensor)> = data
                        .iter()
                        .map(|(x, y)| share(&ctx, x, y))
                        .collect::<candle_core::Result<_>>()?;
                    let scaled = |l: Tensor| l / 3.0;
                    if way == Way::Overlapped {
                        let mut ddp = DistributedDataParallel::from_units(
                            ctx.process_group(),
                            &varmap,
                            DType::F32,
                            &Device::Cpu,
                            deep_units(),
                            config,
                        )?;
                        ddp.no_sync(|ddp| -> anyhow::Result<()> {
                            for (x, y) in &parts[..2] {
                                let step = ddp.forward_backward(x, y, |o, y| {
                                    scaled(loss::cross_entropy(o, y)?)
                                })?;
                                anyhow::ensure!(step.grads.get_ids().next().is_none());
                            }
                            Ok(())
                        })?;
                        let (x, y) = &parts[2];
                        let step =
                            ddp.forward_backward(x, y, |o, y| scaled(loss::cross_entropy(o, y)?))?;
                        opt.step(&step.grads)?;
                    } else {
                        let mut ddp = DistributedDataParallel::new(
                            ctx.process_group(),
                            &varmap,
                            DType::F32,
                            &Device::Cpu,
                            DeepMlp::new,
                            config,
                        )?;
                        ddp.no_sync(|ddp| -> anyhow::Result<()> {
                            for (x, y) in &parts[..2] {
                                let l = scaled(loss::cross_entropy(&ddp.forward(x)?, y)?)?;
                                ddp.backward(&l)?;
                            }
                            Ok(())
                        })?;
                        let (x, y) = &parts[2];
                        let l = scaled(loss::cross_entropy(&ddp.forward(x)?, y)?)?;
                        ddp.backward_step(&l, &mut opt)?;
                    }
                    Ok(snapshot(&varmap))
                })
                .unwrap()
            })
            .collect();
        assert!(
            identical(&runs[0][0], &runs[1][0]),
            "{}",
            diff_report(&runs[0][0], &runs[1][0])
        );
    });
}

/// ZeRO-2 over units: each rank keeps its own parameters' reduced
/// gradients; the weights are those of ZeRO-2 without units.
#[test]
fn zero_stage_2_over_units_trains_to_the_bytes_of_zero_without_units() {
    within(180, || {
        let init = init_deep();
        let data = batches(3, 12, 3);
        let runs: Vec<_> = [Way::Overlapped, Way::Whole]
            .into_iter()
            .map(|way| {
                let (init, data) = (init.clone(), data.clone());
                spawn_with(3, bounded(), move |ctx| {
                    let varmap = varmap_from(&init);
                    let config = DdpConfig {
                        zero: Some(ZeroStage::Two),
                        bucket_order: Some(order_of(&deep_units())),
                        ..small_buckets()
                    };
                    let sgd = |mine: Vec<(String, candle_core::Var)>| {
                        candle_nn::SGD::new(mine.into_iter().map(|(_, v)| v).collect(), 0.1)
                    };
                    if way == Way::Overlapped {
                        let mut ddp = DistributedDataParallel::from_units(
                            ctx.process_group(),
                            &varmap,
                            DType::F32,
                            &Device::Cpu,
                            deep_units(),
                            config,
                        )?;
                        let mut opt = ZeroOptimizer::new(&ddp, sgd)?;
                        for (x, y) in &data {
                            let (x, y) = share(&ctx, x, y)?;
                            let step = ddp.forward_backward(&x, &y, loss::cross_entropy)?;
                            opt.step(&step.grads)?;
                        }
                    } else {
                        let mut ddp = DistributedDataParallel::new(
                            ctx.process_group(),
                            &varmap,
                            DType::F32,
                            &Device::Cpu,
                            DeepMlp::new,
                            config,
                        )?;
                        let mut opt = ZeroOptimizer::new(&ddp, sgd)?;
                        for (x, y) in &data {
                            let (x, y) = share(&ctx, x, y)?;
                            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                            opt.step(&ddp.backward(&loss)?)?;
                        }
                    }
                    Ok(snapshot(&varmap))
                })
                .unwrap()
            })
            .collect();
        assert_same_bytes(&runs[0], &runs[1], "3 ranks");
    });
}

/// Uneven inputs inside `join`: the ranks that ran out answer the
/// overlapped buckets with zeros, in the same order.
#[test]
#[allow(clippy::result_large_err)]
fn join_with_uneven_inputs_matches_join_without_units() {
    within(180, || {
        let init = init_deep();
        let data = batches(6, 6, 4);
        let runs: Vec<_> = [Way::Overlapped, Way::Whole]
            .into_iter()
            .map(|way| {
                let (init, data) = (init.clone(), data.clone());
                spawn_with(3, bounded(), move |ctx| {
                    let varmap = varmap_from(&init);
                    let mut opt = adamw(&varmap)?;
                    let config = DdpConfig {
                        join_divisor: JoinDivisor::ActiveRanks,
                        bucket_order: Some(order_of(&deep_units())),
                        ..small_buckets()
                    };
                    let mine: Vec<(Tensor, Tensor)> = data[..2 + 2 * ctx.rank]
                        .iter()
                        .map(|(x, y)| share(&ctx, x, y))
                        .collect::<candle_core::Result<_>>()?;
                    if way == Way::Overlapped {
                        let mut ddp = DistributedDataParallel::from_units(
                            ctx.process_group(),
                            &varmap,
                            DType::F32,
                            &Device::Cpu,
                            deep_units(),
                            config,
                        )?;
                        ddp.join(|ddp| {
                            for (x, y) in &mine {
                                let step = ddp.forward_backward(x, y, loss::cross_entropy)?;
                                opt.step(&step.grads)?;
                            }
                            Ok(())
                        })?;
                    } else {
                        let mut ddp = DistributedDataParallel::new(
                            ctx.process_group(),
                            &varmap,
                            DType::F32,
                            &Device::Cpu,
                            DeepMlp::new,
                            config,
                        )?;
                        ddp.join(|ddp| {
                            for (x, y) in &mine {
                                let l = loss::cross_entropy(&ddp.forward(x)?, y)?;
                                ddp.backward_step(&l, &mut opt)?;
                            }
                            Ok(())
                        })?;
                    }
                    Ok(snapshot(&varmap))
                })
                .unwrap()
            })
            .collect();
        assert_same_bytes(&runs[0], &runs[1], "3 ranks");
    });
}

/// bf16 compute, the buckets in bf16 too: the same bytes as without units
/// (no weight is tied here; a tied weight's contributions are summed in
/// f32 with units, in bf16 without).
#[test]
fn mixed_precision_over_units_matches_mixed_precision_without() {
    within(120, || {
        let init = init_deep();
        let data = batches(2, 8, 5);
        let config = DdpConfig {
            mixed_precision: Some(MixedPrecision::bf16().reduce_dtype(DType::BF16)),
            ..small_buckets()
        };
        let a = train_deep(
            2,
            data.clone(),
            init.clone(),
            Way::Overlapped,
            config.clone(),
        );
        let b = train_deep(2, data, init.clone(), Way::Whole, config);
        assert!(identical(&a[0], &b[0]), "{}", diff_report(&a[0], &b[0]));
        assert!(!identical(&a[0], &init));
    });
}

/// A thread rank whose `fail_at`-th all-reduce of a bucket aborts the
/// group, as a rank dying in the middle of the backward would.
#[derive(Debug)]
pub(crate) struct FailingAt {
    pub(crate) inner: Arc<dyn ProcessGroup>,
    /// The call (counting from 0) of `all_reduce_concat`,
    /// `all_gather_into` and `all_gather` together that aborts the group.
    pub(crate) fail_at: Option<usize>,
    pub(crate) calls: AtomicUsize,
}

impl FailingAt {
    fn tick(&self) {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        if Some(call) == self.fail_at {
            self.inner
                .abort(&format!("rank {} lost its network", self.inner.rank()));
        }
    }
}

impl ProcessGroup for FailingAt {
    fn membership(&self) -> &Membership {
        self.inner.membership()
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> CommResult<Tensor> {
        self.inner.all_reduce(t, op)
    }
    fn all_reduce_concat(&self, ts: &[Tensor], op: ReduceOp) -> CommResult<Tensor> {
        self.tick();
        self.inner.all_reduce_concat(ts, op)
    }
    fn all_gather_into(&self, t: &Tensor) -> CommResult<Tensor> {
        self.tick();
        self.inner.all_gather_into(t)
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, counts: &[usize]) -> CommResult<Tensor> {
        self.inner.reduce_scatter(t, op, counts)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> CommResult<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn all_gather(&self, t: &Tensor) -> CommResult<Vec<Tensor>> {
        self.tick();
        self.inner.all_gather(t)
    }
    fn gather(&self, t: &Tensor, root: usize) -> CommResult<Option<Vec<Tensor>>> {
        self.inner.gather(t, root)
    }
    fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> CommResult<Tensor> {
        self.inner.scatter(ts, root)
    }
    fn reduce(&self, t: &Tensor, root: usize, op: ReduceOp) -> CommResult<Option<Tensor>> {
        self.inner.reduce(t, root, op)
    }
    fn barrier(&self) -> CommResult<()> {
        self.inner.barrier()
    }
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> CommResult<Vec<Vec<u8>>> {
        self.inner.all_gather_bytes(bytes)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn failure(&self) -> Option<Failure> {
        self.inner.failure()
    }
}

#[test]
fn a_reduction_failing_mid_backward_is_named_on_every_rank_and_changes_nothing() {
    within(60, || {
        let init = init_deep();
        let data = batches(2, 8, 6);
        // Not `spawn_with`: it reports the aborted group itself, where
        // this test reads what each rank's step returned.
        let ranks = candle_dp::comm::ThreadGroup::with_options(2, bounded());
        let outcomes: Vec<(String, bool, bool)> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|rank_pg| {
                    let (init, data) = (&init, &data);
                    s.spawn(move || {
                        let rank = rank_pg.rank();
                        let pg: Arc<dyn ProcessGroup> = Arc::new(FailingAt {
                            fail_at: (rank == 1).then_some(1), // the second bucket
                            inner: Arc::new(rank_pg),
                            calls: AtomicUsize::new(0),
                        });
                        let varmap = varmap_from(init);
                        let mut ddp = DistributedDataParallel::from_units(
                            pg,
                            &varmap,
                            DType::F32,
                            &Device::Cpu,
                            deep_units(),
                            small_buckets(),
                        )
                        .unwrap();
                        let before = snapshot(&varmap);
                        let b = data[0].0.dim(0).unwrap() / 2;
                        let x = data[0].0.narrow(0, rank * b, b).unwrap();
                        let y = data[0].1.narrow(0, rank * b, b).unwrap();
                        let err = ddp
                            .forward_backward(&x, &y, loss::cross_entropy)
                            .expect_err("the step must fail");
                        let unchanged = identical(&before, &snapshot(&varmap));
                        (
                            err.to_string(),
                            matches!(err, Error::OverlappedReduction { .. }),
                            unchanged,
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (message, typed, unchanged)) in outcomes.into_iter().enumerate() {
            println!("rank {rank}: {message}");
            assert!(typed, "rank {rank}: {message}");
            assert!(unchanged, "rank {rank}: the weights changed");
            assert!(message.contains(&format!("on rank {rank}")), "{message}");
            assert!(message.contains("bucket 1"), "{message}");
            assert!(message.contains("unit "), "{message}");
            assert!(message.contains("rank 1 lost its network"), "{message}");
        }
    });
}

#[test]
fn a_unit_using_a_parameter_it_did_not_ask_for_is_refused() {
    // Bounded: a hang fails the test instead of stalling CI.
    within(60, || {
        let varmap = VarMap::new();
        let outside = varmap.clone();
        // Unit 0 reads the head's weight behind its VarBuilder's back: unit 2
        // is the first to ask for it, so its bucket could leave before unit
        // 0's contribution.
        struct Peek(Linear, Tensor);
        impl Module for Peek {
            fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                self.0.forward(x)?.broadcast_add(&self.1.sum_all()?)
            }
        }
        let units = vec![
            unit(move |vb| {
                let w = outside.get(
                    (5, WIDTH),
                    "l1.weight",
                    candle_nn::init::ZERO,
                    DType::F32,
                    &Device::Cpu,
                )?;
                Ok(Peek(linear(6, WIDTH, vb.pp("l0"))?, w))
            }),
            unit(|_| Ok(candle_nn::Activation::Relu)),
            unit(|vb| linear(WIDTH, 5, vb.pp("l1"))),
        ];
        let err = spawn_with(1, bounded(), move |ctx| {
            let mut ddp = DistributedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                units.clone(),
                DdpConfig::default(),
            )?;
            let (x, y) = batches(1, 4, 0).remove(0);
            Ok(ddp
                .forward_backward(&x, &y, loss::cross_entropy)
                .expect_err("must be refused")
                .to_string())
        })
        .unwrap()
        .remove(0);
        assert!(err.contains("unit 0") && err.contains("l1.weight"), "{err}");
    });
}

#[test]
fn the_timeline_shows_each_unit_and_each_bucket_once() {
    // Bounded: a hang fails the test instead of stalling CI.
    within(60, || {
        let timings = spawn_with(2, bounded(), |ctx| {
            let varmap = VarMap::new();
            let mut ddp = DistributedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                deep_units(),
                small_buckets(),
            )?;
            let (x, y) = batches(1, 8, 7).remove(0);
            let (x, y) = share(&ctx, &x, &y)?;
            ddp.forward_backward(&x, &y, loss::cross_entropy)?;
            Ok((ddp.last_timings(), ddp.buckets().len()))
        })
        .unwrap()
        .remove(0);
        let (timings, buckets) = timings;
        let count = |f: &dyn Fn(&Activity) -> bool| {
            timings.timeline.iter().filter(|s| f(&s.activity)).count()
        };
        assert_eq!(count(&|a| *a == Activity::Forward), 1);
        assert_eq!(
            count(&|a| matches!(a, Activity::Backward { .. })),
            deep_units().len()
        );
        assert_eq!(count(&|a| matches!(a, Activity::Reduce { .. })), buckets);
        assert_eq!(count(&|a| *a == Activity::Wait), 1);
        assert!(timings
            .timeline
            .windows(2)
            .all(|w| w[0].start <= w[1].start));
        let hidden = timings.hidden_fraction();
        assert!((0.0..=1.0).contains(&hidden), "{hidden}");
    });
}

/// A communication hook (f16 compression) reduces each overlapped bucket
/// as it reduces the buckets after the backward: the same bytes.
#[test]
fn a_comm_hook_compresses_overlapped_buckets_as_it_does_the_others() {
    within(120, || {
        let init = init_deep();
        let data = batches(2, 12, 17);
        for world in [2, 3] {
            let config = DdpConfig {
                comm_hook: candle_dp::CommHook::Fp16Compress,
                ..small_buckets()
            };
            let a = train_deep(
                world,
                data.clone(),
                init.clone(),
                Way::Overlapped,
                config.clone(),
            );
            let b = train_deep(world, data.clone(), init.clone(), Way::Whole, config);
            assert_same_bytes(&a, &b, &format!("world {world}"));
        }
    });
}

/// A linear layer then BatchNorm (training statistics), as one unit.
pub(crate) struct LinearNorm(Linear, candle_nn::BatchNorm);

impl LinearNorm {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let config = candle_nn::BatchNormConfig::default();
        Ok(Self(
            linear(6, 12, vb.pp("l0"))?,
            candle_nn::batch_norm(12, config, vb.pp("bn0"))?,
        ))
    }
}

impl Module for LinearNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.1.forward_train(&self.0.forward(x)?)
    }
}

pub(crate) fn normed_units() -> Vec<UnitFactory> {
    vec![
        unit(LinearNorm::new),
        unit(|_| Ok(candle_nn::Activation::Relu)),
        unit(|vb| linear(12, 5, vb.pp("l1"))),
    ]
}

/// The same model as one module.
pub(crate) struct Normed(LinearNorm, Linear);

impl Module for Normed {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.1.forward(&self.0.forward(x)?.relu()?)
    }
}

pub(crate) fn normed_whole(vb: VarBuilder) -> candle_core::Result<Box<dyn Module>> {
    Ok(Box::new(Normed(
        LinearNorm::new(vb.clone())?,
        linear(12, 5, vb.pp("l1"))?,
    )))
}

/// Overlapped DDP's step whose loss fails after the forward updated
/// BatchNorm's running statistics (on rank 0; rank 1 then fails at the
/// first reduction): every rank's buffers are as before the step, as
/// plain DDP, FSDP and the pipeline leave them.
#[test]
fn an_overlapped_step_whose_loss_fails_leaves_the_batch_norm_statistics_untouched() {
    within(60, || {
        let varmap = VarMap::new();
        normed_whole(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        let init = snapshot(&varmap);
        let data = batches(2, 12, 4);
        let outcomes = spawn_with(2, bounded(), move |ctx| {
            let varmap = varmap_from(&init);
            let mut ddp = DistributedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                normed_units(),
                DdpConfig::default(),
            )?;
            let mut opt = adamw(&varmap)?;
            let (x, y) = share(&ctx, &data[0].0, &data[0].1)?;
            opt.step(&ddp.forward_backward(&x, &y, loss::cross_entropy)?.grads)?;
            let before = snapshot(&varmap);
            let rank = ctx.rank;
            let (x, y) = share(&ctx, &data[1].0, &data[1].1)?;
            let failed = ddp.forward_backward(&x, &y, |o, y| match rank {
                0 => candle_core::bail!("the loss failed"),
                _ => loss::cross_entropy(o, y),
            });
            anyhow::ensure!(failed.is_err(), "rank {rank}: the step succeeded");
            Ok(identical(&before, &snapshot(&varmap)))
        })
        .unwrap();
        assert_eq!(outcomes, [true, true]);
    });
}
