//! The process group on MPI: real processes started with `mpirun`.
//!
//! Each test starts `mpirun` on this very test binary, which runs the
//! ignored `mpi_worker` test with a scenario named in the environment. A
//! scenario is one function of a rank context, run through
//! [`candle_dp::launch::run`], so the same code runs on thread ranks (in
//! the test, for the expected results) and as MPI processes (which write
//! their results to files). Every `mpirun` is bounded by a deadline.
//!
//! Needs the `mpi` feature and Open MPI (`mpirun`); `.ci/run` installs it.
#![cfg(feature = "mpi")]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use candle_dp::comm::{all_gather_object, GroupOptions, ReduceOp};
use candle_dp::launch::{report, run, spawn_with, RankContext};
use candle_dp::{CommHook, DdpConfig, DistributedDataParallel, JoinDivisor};
use candle_nn::{loss, AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use common::*;

const SCENARIO: &str = "CANDLE_DP_TEST_SCENARIO";
const OUT_DIR: &str = "CANDLE_DP_TEST_OUT";

/// Where each process's output goes too, one folder per rank.
const RANK_OUTPUT: &str = "output";

/// The longest any `mpirun` of these tests may take.
const DEADLINE: Duration = Duration::from_secs(180);

/// Every group gives up after 30 s instead of hanging.
fn bounded() -> GroupOptions {
    GroupOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    }
}

// ---------------------------------------------------------------------
// The worker side: what each MPI process runs.
// ---------------------------------------------------------------------

#[test]
#[ignore = "the entry point of the processes that the tests below start with mpirun"]
fn mpi_worker() {
    // As a program's main would: report a failure as whole lines (once:
    // `run` prints its own) and exit non-zero, rather than letting the test
    // harness print it in pieces.
    if let Err(error) = worker() {
        report::eprint_error(&error);
        std::process::exit(1);
    }
}

fn worker() -> anyhow::Result<()> {
    let scenario = std::env::var(SCENARIO).context("no scenario named")?;
    let out = PathBuf::from(std::env::var(OUT_DIR).context("no output directory")?);
    // A Fabric launches its ranks itself.
    if let Some(stage) = scenario.strip_prefix("fabric_pipeline_zero") {
        return fabric_worker(pipeline_zero_config(stage.parse()?), &out, fabric_results);
    }
    if let Some(mesh) = scenario.strip_prefix("fabric_tp@") {
        return fabric_worker(tp_config(mesh), &out, tp_results);
    }
    if let Some(strategy) = scenario.strip_prefix("fabric_deterministic_lm@") {
        return fabric_worker(
            deterministic_lm_config(strategy.parse()?),
            &out,
            deterministic_lm,
        );
    }
    if let Some(strategy) = scenario.strip_prefix("fabric_deterministic@") {
        let chunks = Some(common::fabric_loop::CHUNKS);
        let config = common::fabric_loop::deterministic_config(strategy.parse()?, 2, chunks);
        return fabric_worker(config, &out, deterministic_results);
    }
    if let Some(run) = scenario.strip_prefix("fabric-") {
        let (strategy, precision) = run.split_once('@').context("fabric-STRATEGY@PRECISION")?;
        let config = fabric_config(strategy.parse()?, precision.parse()?);
        return fabric_worker(config, &out, fabric_results);
    }
    let results = run(0, bounded(), |ctx| {
        let rank = ctx.rank;
        let outcome = scenario_by_name(&scenario, ctx, &out)?;
        Ok((rank, outcome))
    })?;
    for (rank, outcome) in results {
        if let Some(tensors) = outcome {
            candle_core::safetensors::save(&tensors, out.join(format!("rank{rank}.safetensors")))?;
        }
    }
    Ok(())
}

type Tensors = HashMap<String, Tensor>;

/// The one loop of the Fabric tests under `strategy` in `precision` on
/// this MPI process (two ranks' worth of devices: under mpirun the
/// launcher decides), f16's first scale one that no step overflows at, as
/// on thread ranks.
fn fabric_config(
    strategy: candle_dp::fabric::Strategy,
    precision: candle_dp::fabric::Precision,
) -> candle_dp::fabric::FabricConfig {
    candle_dp::fabric::FabricConfig {
        timeout_secs: Some(30.0),
        init_scale: 1024.0,
        ..candle_dp::fabric::FabricConfig::new(strategy, 2).precision(precision)
    }
}

/// Two pipelines of two stage ranks (a 2 x 2 mesh), ZeRO at `stage`
/// across them (3: FSDP).
fn pipeline_zero_config(stage: u8) -> candle_dp::fabric::FabricConfig {
    use candle_dp::fabric::{FabricConfig, Strategy};
    FabricConfig {
        stages: 2,
        zero: Some(stage),
        timeout_secs: Some(30.0),
        ..FabricConfig::new(Strategy::PipelineRanks, 4)
    }
}

/// The language model on `mesh` (with a `tp` degree), clipped.
fn tp_config(mesh: &str) -> candle_dp::fabric::FabricConfig {
    let config = candle_dp::fabric::FabricConfig {
        gradient_clip: Some(1.0),
        timeout_secs: Some(60.0),
        ..Default::default()
    };
    config
        .with_mesh(mesh.parse().expect("a mesh"))
        .expect("the mesh")
}

/// [`common::gpt_loop::adamw_run`]'s whole model and losses.
fn tp_results(fabric: candle_dp::fabric::Fabric) -> anyhow::Result<Tensors> {
    let run = common::gpt_loop::adamw_run(&fabric, 6)?;
    let mut weights = run.weights;
    let n = run.losses.len();
    weights.insert(
        "losses".into(),
        Tensor::from_vec(run.losses, n, &Device::Cpu)?,
    );
    Ok(weights)
}

/// [`common::fabric_loop::train_chunked`]'s whole model and losses,
/// deterministic.
fn deterministic_results(fabric: candle_dp::fabric::Fabric) -> anyhow::Result<Tensors> {
    let data = common::fabric_loop::dataset();
    let (mut weights, losses) = common::fabric_loop::train_chunked(fabric, data, true)?;
    let n = losses.len();
    weights.insert("losses".into(), Tensor::from_vec(losses, n, &Device::Cpu)?);
    Ok(weights)
}

/// The language model, deterministic over 8 chunks, clipped.
fn deterministic_lm_config(
    strategy: candle_dp::fabric::Strategy,
) -> candle_dp::fabric::FabricConfig {
    candle_dp::fabric::FabricConfig {
        gradient_clip: Some(1.0),
        ..common::fabric_loop::deterministic_config(strategy, 2, Some(8))
    }
}

/// 30 AdamW steps of the language model with dropout 0.1: its whole
/// model and losses.
fn deterministic_lm(fabric: candle_dp::fabric::Fabric) -> anyhow::Result<Tensors> {
    let gpt = candle_dp_examples::gpt::GptConfig {
        dropout: 0.1,
        ..common::gpt_loop::GPT
    };
    let run = common::gpt_loop::adamw_run_of(&fabric, gpt, 30)?;
    let mut weights = run.weights;
    let n = run.losses.len();
    weights.insert(
        "losses".into(),
        Tensor::from_vec(run.losses, n, &Device::Cpu)?,
    );
    Ok(weights)
}

/// Runs a Fabric loop (`results`) and saves this rank's weights and
/// losses.
fn fabric_worker(
    config: candle_dp::fabric::FabricConfig,
    out: &Path,
    results: fn(candle_dp::fabric::Fabric) -> anyhow::Result<Tensors>,
) -> anyhow::Result<()> {
    use candle_dp::fabric::Fabric;
    let results = Fabric::launch(config, |fabric| {
        let rank = fabric.rank();
        Ok((rank, results(fabric)?))
    })?;
    for (rank, tensors) in results {
        candle_core::safetensors::save(&tensors, out.join(format!("rank{rank}.safetensors")))?;
    }
    Ok(())
}

/// The loop's weights, and its losses as the tensor `losses`.
fn fabric_results(fabric: candle_dp::fabric::Fabric) -> anyhow::Result<Tensors> {
    let (mut weights, losses) = common::fabric_loop::train(fabric, common::fabric_loop::dataset())?;
    let n = losses.len();
    weights.insert("losses".into(), Tensor::from_vec(losses, n, &Device::Cpu)?);
    Ok(weights)
}

/// Runs scenario `name` on this rank; `Some` results are saved for the test.
fn scenario_by_name(name: &str, ctx: RankContext, out: &Path) -> anyhow::Result<Option<Tensors>> {
    let input = || load(&out.join("input.safetensors"));
    Ok(Some(match name {
        "collectives" => collectives(&ctx)?,
        "reference_A" => reference_run(&ctx, "A")?,
        "reference_B" => reference_run(&ctx, "B")?,
        "ddp_sgd" => ddp_train(&ctx, &input()?, false)?,
        "ddp_adamw" => ddp_train(&ctx, &input()?, true)?,
        "no_sync" => no_sync(&ctx, &input()?)?,
        "join_initial" => join(&ctx, &input()?, JoinDivisor::InitialWorldSize)?,
        "join_active" => join(&ctx, &input()?, JoinDivisor::ActiveRanks)?,
        "join_no_sync" => join_accumulating(&ctx, &init_of(&input()?), &batches(&input()?))?,
        "hook_fp16" => hooked(&ctx, &input()?, CommHook::Fp16Compress)?,
        "hook_bf16" => hooked(&ctx, &input()?, CommHook::Bf16Compress)?,
        "buffers" => buffers(&ctx, &input()?)?,
        "pipeline_ddp" => pipeline_ddp(&ctx, &input()?)?,
        "overlap_units" => overlap(&ctx, &input()?, true)?,
        "overlap_whole" => overlap(&ctx, &input()?, false)?,
        "fsdp" => fsdp(&ctx, &input()?)?,
        "subgroups" => subgroups(&ctx)?,
        "groups_in_a_loop" => groups_in_a_loop(&ctx)?,
        "hsdp" => hsdp(&ctx, &input()?)?,
        "zero_mesh" => zero_on_mesh(&ctx, &input()?, (2, 2))?,
        "rank_pipeline" => rank_pipeline(&ctx)?,
        "recv_after_another_left" => recv_after_another_left(&ctx)?,
        fault => {
            run_fault(fault, &ctx)?;
            return Ok(None);
        }
    }))
}

fn load(path: &Path) -> anyhow::Result<Tensors> {
    Ok(candle_core::safetensors::load(path, &Device::Cpu)?)
}

/// Deterministic, rank-dependent values in about [-100, 100].
fn values(rank: usize, n: usize, salt: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (((rank * 7919 + i * 31 + salt) as f64) * 0.618).sin() * 100.0)
        .collect()
}

/// A tensor of `dtype` (non-negative for unsigned types) from [`values`].
fn input(rank: usize, n: usize, salt: usize, dtype: DType) -> anyhow::Result<Tensor> {
    let mut v = values(rank, n, salt);
    if !dtype.is_float() {
        v.iter_mut().for_each(|x| *x = x.abs().floor());
    }
    Ok(Tensor::from_vec(v, n, &Device::Cpu)?.to_dtype(dtype)?)
}

/// Records a result (as f64, which holds every value of every dtype used
/// here exactly) or the error's message, under `label`.
fn record(
    results: &mut Tensors,
    errors: &mut Vec<String>,
    label: String,
    result: Result<Tensor, String>,
) -> anyhow::Result<()> {
    match result {
        Ok(t) => {
            results.insert(label, t.to_dtype(DType::F64)?);
        }
        Err(message) => errors.push(format!("{label}: {message}")),
    }
    Ok(())
}

/// Every collective, every supported dtype, sizes 0, 1, small and above the
/// ring threshold, and calls that do not fit together.
fn collectives(ctx: &RankContext) -> anyhow::Result<Tensors> {
    let pg = ctx.pg.as_ref();
    let (rank, world) = (ctx.rank, ctx.world_size);
    let mut results = Tensors::new();
    let mut errors = Vec::new();
    let dtypes = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::U8,
        DType::U32,
        DType::I64,
    ];
    let sizes = [0, 1, 7, 5_003, 70_001];
    for dtype in dtypes {
        for (s, n) in sizes.into_iter().enumerate() {
            let x = input(rank, n, s, dtype)?;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let label = format!("all_reduce {op} {dtype:?} {n}");
                let r = pg.all_reduce(&x, op).map_err(|e| e.to_string());
                record(&mut results, &mut errors, label, r)?;
            }
            // The same elements in three parts (one a strided view), as a
            // DDP bucket hands them over.
            if n >= 3 {
                let parts = [
                    x.narrow(0, 0, 1)?,
                    Tensor::stack(&[&x.narrow(0, 1, n - 2)?; 2], 1)?.narrow(1, 0, 1)?,
                    x.narrow(0, n - 1, 1)?,
                ];
                let label = format!("all_reduce_concat {dtype:?} {n}");
                let r = pg
                    .all_reduce_concat(&parts, ReduceOp::Sum)
                    .map_err(|e| e.to_string());
                record(&mut results, &mut errors, label, r)?;
            }
            // A bucket of many parts read in place (one empty; the ring's
            // chunk boundaries fall inside parts), then the same elements
            // cut differently on each rank, which processes concatenate
            // before the ring.
            if n >= 70_000 {
                let same = [0, 10, 10, 23_331, 46_000, n];
                let by_rank = [0, 1_000 * (rank + 1), n];
                for (name, cuts) in [("same", &same[..]), ("by rank", &by_rank[..])] {
                    let parts = cuts
                        .windows(2)
                        .map(|w| x.narrow(0, w[0], w[1] - w[0]))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    for op in [ReduceOp::Avg, ReduceOp::Max] {
                        let label =
                            format!("all_reduce_concat {op} {dtype:?} {n}, parts cut {name}");
                        let r = pg.all_reduce_concat(&parts, op).map_err(|e| e.to_string());
                        record(&mut results, &mut errors, label, r)?;
                    }
                }
            }
            let root = world - 1;
            let r = pg
                .reduce(&x, root, ReduceOp::Sum)
                .map_err(|e| e.to_string());
            if let Some(r) = r.transpose() {
                record(
                    &mut results,
                    &mut errors,
                    format!("reduce {dtype:?} {n}"),
                    r,
                )?;
            }
            let r = pg.broadcast(&x, root).map_err(|e| e.to_string());
            record(
                &mut results,
                &mut errors,
                format!("broadcast {dtype:?} {n}"),
                r,
            )?;
            let gathered = pg.all_gather(&x).map_err(|e| e.to_string());
            let r = gathered.and_then(|g| Tensor::cat(&g, 0).map_err(|e| e.to_string()));
            record(
                &mut results,
                &mut errors,
                format!("all_gather {dtype:?} {n}"),
                r,
            )?;
            // ZeRO's: uneven pieces of a reduction, and the flat all-gather.
            let mut counts = vec![n / (world + 1); world];
            counts[world - 1] = n - n / (world + 1) * (world - 1);
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let r = pg
                    .reduce_scatter(&x, op, &counts)
                    .map_err(|e| e.to_string());
                let label = format!("reduce_scatter {op} {dtype:?} {n}");
                record(&mut results, &mut errors, label, r)?;
            }
            let r = pg.all_gather_into(&x).map_err(|e| e.to_string());
            let label = format!("all_gather_into {dtype:?} {n}");
            record(&mut results, &mut errors, label, r)?;
        }
    }
    // NaN wins in max and min, on both paths.
    for n in [3, 70_001] {
        let mut v = values(rank, n, 9);
        if rank == 1 {
            v[n / 2] = f64::NAN;
        }
        let x = Tensor::from_vec(v, n, &Device::Cpu)?.to_dtype(DType::F32)?;
        let r = pg.all_reduce(&x, ReduceOp::Max).map_err(|e| e.to_string());
        record(&mut results, &mut errors, format!("max with nan {n}"), r)?;
    }
    // A 3-d tensor, gather, scatter of different shapes, reduce with max.
    let x = input(rank, 24, 3, DType::F32)?.reshape((2, 3, 4))?;
    let r = pg.all_reduce(&x, ReduceOp::Sum).map_err(|e| e.to_string());
    record(&mut results, &mut errors, "all_reduce 3-d".into(), r)?;
    if let Some(parts) = pg.gather(&x, 1 % world)? {
        results.insert(
            "gather".into(),
            Tensor::cat(&parts, 0)?.to_dtype(DType::F64)?,
        );
    }
    let parts: Vec<Tensor> = (0..world)
        .map(|r| {
            input(r, (r + 1) * 2, 4, DType::F32)?
                .reshape((r + 1, 2))
                .map_err(Into::into)
        })
        .collect::<anyhow::Result<_>>()?;
    let r = pg
        .scatter((rank == 0).then_some(&parts[..]), 0)
        .map_err(|e| e.to_string());
    record(&mut results, &mut errors, "scatter".into(), r)?;
    let big = input(rank, 70_001, 5, DType::F32)?;
    if let Some(r) = pg.reduce(&big, 0, ReduceOp::Max)? {
        results.insert("reduce max large".into(), r.to_dtype(DType::F64)?);
    }
    pg.barrier()?;
    let names = all_gather_object(pg, &format!("rank-{rank}"))?;
    errors.push(format!("objects: {names:?}"));
    // Calls that do not fit together: every rank gets the same error, and
    // the group stays usable.
    let shape = Tensor::zeros(rank + 1, DType::F32, &Device::Cpu)?;
    let r = pg
        .all_reduce(&shape, ReduceOp::Sum)
        .map_err(|e| e.to_string());
    record(&mut results, &mut errors, "shapes differ".into(), r)?;
    let r = pg.broadcast(&x, world + 5).map_err(|e| e.to_string());
    record(&mut results, &mut errors, "root out of range".into(), r)?;
    let r = if rank == 0 {
        pg.all_reduce(&x, ReduceOp::Sum).map_err(|e| e.to_string())
    } else {
        pg.barrier().map(|_| x.clone()).map_err(|e| e.to_string())
    };
    record(&mut results, &mut errors, "different collectives".into(), r)?;
    let r = pg.all_reduce(&x, ReduceOp::Min).map_err(|e| e.to_string());
    record(&mut results, &mut errors, "usable after errors".into(), r)?;
    // The messages, as bytes.
    let messages = errors.join("\n").into_bytes();
    let len = messages.len();
    results.insert(
        "messages".into(),
        Tensor::from_vec(messages, len, &Device::Cpu)?,
    );
    Ok(results)
}

/// The PyTorch fixture's runs (see tests/ddp_reference.rs).
fn reference_run(ctx: &RankContext, name: &str) -> anyhow::Result<Tensors> {
    match name {
        "A" => ddp_reference_run(ctx, 96, 3, 6),
        _ => ddp_reference_run(ctx, 90, 1, 5),
    }
}

const SIZES: (usize, usize, usize) = DDP_SIZES;

/// The global batches of `input` (`x0`, `y0`, `x1`, …).
fn batches(input: &Tensors) -> Vec<(Tensor, Tensor)> {
    (0..)
        .map_while(|s| {
            Some((
                input.get(&format!("x{s}"))?.clone(),
                input.get(&format!("y{s}"))?.clone(),
            ))
        })
        .collect()
}

fn init_of(input: &Tensors) -> Tensors {
    fixture_tensors(input, "init.")
}

/// DDP training, rank r taking its contiguous share of every global batch;
/// ranks other than 0 start from their own random init.
fn ddp_train(ctx: &RankContext, input: &Tensors, adamw: bool) -> anyhow::Result<Tensors> {
    let varmap = if ctx.rank == 0 {
        varmap_from(&init_of(input))
    } else {
        VarMap::new()
    };
    let mut ddp = mlp_ddp(ctx, &varmap, DdpConfig::default())?;
    let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    let mut adam = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    for (x, y) in batches(input) {
        let b = x.dim(0)? / ctx.world_size;
        let (x, y) = (x.narrow(0, ctx.rank * b, b)?, y.narrow(0, ctx.rank * b, b)?);
        let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
        if adamw {
            ddp.backward_step(&loss, &mut adam)?;
        } else {
            ddp.backward_step(&loss, &mut sgd)?;
        }
    }
    Ok(snapshot(&varmap))
}

/// A pipeline of 2 stages (3 micro-batches) in each rank, SGD 0.1: the
/// MLP of `ddp_train` as a list of layers.
fn pipeline_ddp(ctx: &RankContext, input: &Tensors) -> anyhow::Result<Tensors> {
    use candle_dp::pipeline::{unit, Pipeline};
    use candle_dp::{cpu_devices, LossReduction};
    let varmap = if ctx.rank == 0 {
        varmap_from(&init_of(input))
    } else {
        VarMap::new()
    };
    let (i, h, o) = SIZES;
    let layers = vec![
        unit(move |vb| candle_nn::linear(i, h, vb.pp("l1"))),
        unit(|_| Ok(candle_nn::Activation::Relu)),
        unit(move |vb| candle_nn::linear(h, o, vb.pp("l2"))),
    ];
    let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
        .chunks(3)
        .timeout(Duration::from_secs(30))
        .build(layers)?;
    let mut ddp = DistributedDataParallel::from_module(
        ctx.process_group(),
        &varmap,
        pipe,
        DdpConfig::default(),
    )?;
    let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    for (x, y) in batches(input) {
        let b = x.dim(0)? / ctx.world_size;
        let (x, y) = (x.narrow(0, ctx.rank * b, b)?, y.narrow(0, ctx.rank * b, b)?);
        let step = ddp.forward_backward(&x, &y, LossReduction::Mean, |o, y| {
            loss::cross_entropy(o, y)
        })?;
        sgd.step(&step.grads)?;
    }
    Ok(snapshot(&varmap))
}

/// The MLP given as units, each bucket reduced during the backward
/// (`units`), or whole with the same buckets, reduced after it; AdamW.
fn overlap(ctx: &RankContext, input: &Tensors, units: bool) -> anyhow::Result<Tensors> {
    use candle_dp::pipeline::unit;
    let varmap = varmap_from(&init_of(input));
    let (i, h, o) = SIZES;
    let layers = vec![
        unit(move |vb| candle_nn::linear(i, h, vb.pp("l1"))),
        unit(|_| Ok(candle_nn::Activation::Relu)),
        unit(move |vb| candle_nn::linear(h, o, vb.pp("l2"))),
    ];
    // Small buckets: one per layer, so one goes while the other computes.
    let config = DdpConfig {
        first_bucket_cap_bytes: 128,
        bucket_cap_bytes: 512,
        bucket_order: Some(
            ["l2.bias", "l2.weight", "l1.bias", "l1.weight"]
                .map(String::from)
                .to_vec(),
        ),
        ..Default::default()
    };
    let mut adam = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    let share = |x: &Tensor, y: &Tensor| -> candle_core::Result<(Tensor, Tensor)> {
        let b = x.dim(0)? / ctx.world_size;
        Ok((x.narrow(0, ctx.rank * b, b)?, y.narrow(0, ctx.rank * b, b)?))
    };
    if units {
        let mut ddp = DistributedDataParallel::from_units(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            layers,
            config,
        )?;
        anyhow::ensure!(ddp.buckets().len() >= 2, "{:?}", ddp.buckets());
        for (x, y) in batches(input) {
            let (x, y) = share(&x, &y)?;
            let step = ddp.forward_backward(&x, &y, loss::cross_entropy)?;
            adam.step(&step.grads)?;
        }
    } else {
        let mut ddp = mlp_ddp(ctx, &varmap, config)?;
        for (x, y) in batches(input) {
            let (x, y) = share(&x, &y)?;
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            ddp.backward_step(&loss, &mut adam)?;
        }
    }
    Ok(snapshot(&varmap))
}

/// The MLP given as units under FSDP (AdamW 0.01): the whole weights
/// gathered at the end, on every rank.
fn fsdp(ctx: &RankContext, input: &Tensors) -> anyhow::Result<Tensors> {
    sharded(ctx, input, None)
}

/// Rank 2 is done and leaves at once; rank 1 sends to rank 0 only 2.5 s
/// later. Rank 0's wait depends on rank 1 alone, and must not end because
/// rank 2 left (as the last stage of a pipeline leaves first).
fn recv_after_another_left(ctx: &RankContext) -> anyhow::Result<Tensors> {
    let x = Tensor::new(&[ctx.rank as f32], &Device::Cpu)?;
    let mut out = Tensors::new();
    match ctx.rank {
        0 => {
            out.insert("got".into(), ctx.pg.recv(&x, 1)?);
        }
        1 => {
            std::thread::sleep(Duration::from_millis(2500));
            ctx.pg.send(&x, 0)?;
        }
        _ => {}
    }
    Ok(out)
}

/// ZeRO-2 on a `replicas x shards` mesh, the crate's AdamW over each
/// rank's pieces: the weights.
fn zero_on_mesh(
    ctx: &RankContext,
    input: &Tensors,
    (replicas, shards): (usize, usize),
) -> anyhow::Result<Tensors> {
    use candle_dp::comm::{DeviceMesh, ShardGroups};
    use candle_dp::optim::{AdamW, AdamWConfig};
    use candle_dp::zero::{ZeroOptimizer, ZeroStage};
    let varmap = varmap_from(&init_of(input));
    let mesh = DeviceMesh::new(
        ctx.process_group(),
        &[("replicate", replicas), ("shard", shards)],
    )?;
    let config = DdpConfig {
        zero: Some(ZeroStage::Two),
        zero_groups: Some(ShardGroups::from_mesh(&mesh)?),
        ..Default::default()
    };
    let mut ddp = mlp_ddp(ctx, &varmap, config)?;
    let adamw = AdamWConfig {
        lr: 0.01,
        ..Default::default()
    };
    let mut opt = ZeroOptimizer::new(&ddp, |mine| AdamW::new_named(mine, adamw))?;
    for (x, y) in batches(input) {
        let b = x.dim(0)? / ctx.world_size;
        let (x, y) = (x.narrow(0, ctx.rank * b, b)?, y.narrow(0, ctx.rank * b, b)?);
        let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
        opt.step(&ddp.backward(&loss)?)?;
    }
    Ok(snapshot(&varmap))
}

/// HSDP on a 2 x 2 mesh: the weights after AdamW steps.
fn hsdp(ctx: &RankContext, input: &Tensors) -> anyhow::Result<Tensors> {
    sharded(ctx, input, Some((2, 2)))
}

/// FSDP over every rank, or HSDP on a `replicas x shards` mesh: the
/// weights after AdamW steps.
fn sharded(
    ctx: &RankContext,
    input: &Tensors,
    mesh: Option<(usize, usize)>,
) -> anyhow::Result<Tensors> {
    use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
    use candle_dp::pipeline::unit;
    let varmap = varmap_from(&init_of(input));
    let (i, h, o) = SIZES;
    let layers = vec![
        unit(move |vb| candle_nn::linear(i, h, vb.pp("l1"))),
        unit(|_| Ok(candle_nn::Activation::Relu)),
        unit(move |vb| candle_nn::linear(h, o, vb.pp("l2"))),
    ];
    let (dtype, device, config) = (DType::F32, Device::Cpu, FsdpConfig::default());
    let mut fsdp = match mesh {
        Some((r, s)) => {
            let dims = [("replicate", r), ("shard", s)];
            let mesh = candle_dp::comm::DeviceMesh::new(ctx.process_group(), &dims)?;
            FullyShardedDataParallel::from_units_on_mesh(
                &mesh, &varmap, dtype, &device, layers, config,
            )?
        }
        None => FullyShardedDataParallel::from_units(
            ctx.process_group(),
            &varmap,
            dtype,
            &device,
            layers,
            config,
        )?,
    };
    let mut adam = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    for (x, y) in batches(input) {
        let b = x.dim(0)? / ctx.world_size;
        let (x, y) = (x.narrow(0, ctx.rank * b, b)?, y.narrow(0, ctx.rank * b, b)?);
        let step = fsdp.forward_backward(&x, &y, loss::cross_entropy)?;
        adam.step(&step.grads)?;
    }
    Ok(fsdp.full_state()?)
}

/// Sub-groups on 4 ranks: a split by parity (small and ring-sized
/// reductions), `new_group`, a 2 x 2 mesh, a split of a split, and
/// messages passed around each pair and around the world.
/// More sub-groups than Open MPI has communicator ids (without the
/// freeing this loop aborted in `MPI_Comm_split`), made and dropped one
/// after another: each freed when its last handle goes. Every thousandth
/// sums the ranks' numbers plus one.
const GROUPS_IN_A_LOOP: usize = 70_000;

fn groups_in_a_loop(ctx: &RankContext) -> anyhow::Result<Tensors> {
    use candle_dp::comm::Color;
    let mut sums = Vec::new();
    for i in 0..GROUPS_IN_A_LOOP {
        let group = ctx
            .pg
            .split(Color::new(0), 0)?
            .with_context(|| format!("group {i}: every rank has the colour"))?;
        if i % 1000 == 0 {
            let mine = Tensor::new(&[ctx.rank as f32 + 1.], &Device::Cpu)?;
            sums.push(group.all_reduce(&mine, ReduceOp::Sum)?);
        }
    }
    let mut out = Tensors::new();
    out.insert("sums".into(), Tensor::cat(&sums, 0)?);
    Ok(out)
}

fn subgroups(ctx: &RankContext) -> anyhow::Result<Tensors> {
    use candle_dp::comm::{Color, DeviceMesh};
    let pg = ctx.pg.as_ref();
    let rank = ctx.rank;
    let mut out = Tensors::new();
    let small = input(rank, 5, 1, DType::F32)?;
    let large = input(rank, 70_001, 2, DType::F32)?;
    // Keys reverse the order within each colour.
    let parity = pg
        .split(Color::new(rank as u32 % 2), -(rank as i64))?
        .context("a coloured rank gets a group")?;
    out.insert(
        "parity.rank".into(),
        Tensor::new(&[parity.rank() as u32], &Device::Cpu)?,
    );
    out.insert(
        "parity.small".into(),
        parity.all_reduce(&small, ReduceOp::Sum)?,
    );
    out.insert(
        "parity.large".into(),
        parity.all_reduce(&large, ReduceOp::Avg)?,
    );
    let pieces = parity.reduce_scatter(&large, ReduceOp::Sum, &[35_000, 35_001])?;
    out.insert("parity.reduce_scatter".into(), pieces);
    let none = pg.split(
        if rank == 0 {
            Color::NONE
        } else {
            Color::new(7)
        },
        0,
    )?;
    anyhow::ensure!(
        none.is_some() == (rank != 0),
        "rank {rank}: NONE gives no group"
    );
    if let Some(g) = pg.new_group(&[3, 1])? {
        out.insert("pair.broadcast".into(), g.broadcast(&small, 0)?);
    }
    let mesh = DeviceMesh::new(ctx.process_group(), &[("dp", 2), ("shard", 2)])?;
    for dim in ["dp", "shard"] {
        let g = mesh.group(dim)?;
        out.insert(format!("mesh.{dim}"), g.all_reduce(&large, ReduceOp::Sum)?);
        let inner = g.split(Color::new(0), 0)?.context("one colour")?;
        out.insert(format!("mesh.{dim}.inner"), inner.all_gather_into(&small)?);
    }
    // Each pair passes its ranks' tensors both ways; the world passes one
    // around its ring, a large one (past MPI's eager sends).
    let other = 1 - parity.rank();
    if parity.rank() == 0 {
        parity.send(&small, other)?;
        out.insert("p2p.pair".into(), parity.recv(&small, other)?);
    } else {
        let got = parity.recv(&small, other)?;
        parity.send(&small, other)?;
        out.insert("p2p.pair".into(), got);
    }
    let world = ctx.world_size;
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    if rank == 0 {
        pg.send(&large, next)?;
        out.insert("p2p.ring".into(), pg.recv(&large, prev)?);
    } else {
        let got = pg.recv(&large, prev)?;
        pg.send(&(got.clone() + 1.0)?, next)?;
        out.insert("p2p.ring".into(), got);
    }
    Ok(out)
}

/// A pipeline of 9 layers with stages on the ranks, 1F1B (one stage a
/// rank) and interleaved (two a rank), activations of 64 KiB per
/// micro-batch (past MPI's eager sends): each rank's own variables after
/// two SGD steps, and the last stage's losses.
fn rank_pipeline(ctx: &RankContext) -> anyhow::Result<Tensors> {
    use candle_dp::pipeline::{unit, RankPipeline, RankPipelineConfig, Schedule};
    use candle_dp::LossReduction;
    const WIDE: usize = 256;
    let layers = || {
        let mut layers = vec![unit(|vb| candle_nn::linear(6, WIDE, vb.pp("l0")))];
        for l in 1..4 {
            layers.push(unit(|_| Ok(candle_nn::Activation::Relu)));
            layers.push(unit(move |vb| {
                candle_nn::linear(WIDE, WIDE, vb.pp(format!("l{l}")))
            }));
        }
        layers.push(unit(|_| Ok(candle_nn::Activation::Relu)));
        layers.push(unit(|vb| candle_nn::linear(WIDE, 5, vb.pp("l4"))));
        layers
    };
    let rows = 256;
    let x = Tensor::from_vec(
        (0..rows * 6)
            .map(|i| ((i * 37 % 101) as f32 - 50.) / 25.)
            .collect(),
        (rows, 6),
        &Device::Cpu,
    )?;
    let y = Tensor::from_vec(
        (0..rows as u32).map(|i| i * 7 % 5).collect(),
        rows,
        &Device::Cpu,
    )?;
    let mut out = Tensors::new();
    let schedules = [
        ("1f1b", Schedule::OneFOneB),
        (
            "interleaved",
            Schedule::Interleaved1F1B {
                stages_per_device: 2,
            },
        ),
    ];
    for (name, schedule) in schedules {
        // The whole model's initial weights, the same on every rank.
        let varmap = candle_dp::seeded_varmap(0, DType::F32, &Device::Cpu, |vb| {
            layers().iter().try_for_each(|f| f(vb.clone()).map(drop))
        })?;
        let config = RankPipelineConfig {
            chunks: Some(4),
            schedule,
            ..Default::default()
        };
        let pipe = RankPipeline::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            layers(),
            config,
        )?;
        let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
        for step in 0..2 {
            let got = pipe.forward_backward(
                Some(&x),
                Some(&y),
                LossReduction::Mean,
                loss::cross_entropy,
            )?;
            if let Some(l) = got.loss {
                out.insert(format!("{name}.loss{step}"), l);
            }
            sgd.step(&got.grads)?;
        }
        for (var, value) in varmap.data().lock().unwrap().iter() {
            out.insert(format!("{name}.{var}"), value.as_tensor().copy()?);
        }
    }
    Ok(out)
}

/// Gradient accumulation over 3 micro-batches of 2 rows per rank.
fn no_sync(ctx: &RankContext, input: &Tensors) -> anyhow::Result<Tensors> {
    let (k, micro, world) = (3, 2, ctx.world_size);
    let varmap = varmap_from(&init_of(input));
    let mut ddp = mlp_ddp(ctx, &varmap, DdpConfig::default())?;
    let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    for (x, y) in batches(input) {
        let part = |m: usize| -> candle_core::Result<(Tensor, Tensor)> {
            let start = (m * world + ctx.rank) * micro;
            Ok((x.narrow(0, start, micro)?, y.narrow(0, start, micro)?))
        };
        ddp.no_sync(|ddp| -> anyhow::Result<()> {
            for m in 0..k - 1 {
                let (x, y) = part(m)?;
                let loss = (loss::cross_entropy(&ddp.forward(&x)?, &y)? / k as f64)?;
                let grads = ddp.backward(&loss)?;
                anyhow::ensure!(
                    grads.get_ids().next().is_none(),
                    "no_sync returned gradients"
                );
            }
            Ok(())
        })?;
        let (x, y) = part(k - 1)?;
        let loss = (loss::cross_entropy(&ddp.forward(&x)?, &y)? / k as f64)?;
        ddp.backward_step(&loss, &mut sgd)?;
    }
    Ok(snapshot(&varmap))
}

/// Rank r has 2 + 2r batches of 2 rows: uneven inputs inside `join`.
#[allow(clippy::result_large_err)] // the closure returns candle_dp::Result, as join requires
fn join(ctx: &RankContext, input: &Tensors, divisor: JoinDivisor) -> anyhow::Result<Tensors> {
    let varmap = varmap_from(&init_of(input));
    let config = DdpConfig {
        join_divisor: divisor,
        ..Default::default()
    };
    let mut ddp = mlp_ddp(ctx, &varmap, config)?;
    let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    let data = batches(input);
    let mine = &data[..(2 + 2 * ctx.rank).min(data.len())];
    ddp.join(|ddp| {
        for (x, y) in mine {
            let (x, y) = (x.narrow(0, ctx.rank * 2, 2)?, y.narrow(0, ctx.rank * 2, 2)?);
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            ddp.backward_step(&loss, &mut sgd)?;
        }
        Ok(())
    })?;
    Ok(snapshot(&varmap))
}

fn hooked(ctx: &RankContext, input: &Tensors, hook: CommHook) -> anyhow::Result<Tensors> {
    let varmap = varmap_from(&init_of(input));
    let config = DdpConfig {
        comm_hook: hook,
        ..Default::default()
    };
    let mut ddp = mlp_ddp(ctx, &varmap, config)?;
    let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    for (x, y) in batches(input) {
        let b = x.dim(0)? / ctx.world_size;
        let (x, y) = (x.narrow(0, ctx.rank * b, b)?, y.narrow(0, ctx.rank * b, b)?);
        let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
        ddp.backward_step(&loss, &mut sgd)?;
    }
    Ok(snapshot(&varmap))
}

/// BatchNorm statistics after training on different data per rank, with
/// and without `broadcast_buffers`.
fn buffers(ctx: &RankContext, input: &Tensors) -> anyhow::Result<Tensors> {
    let mut out = Tensors::new();
    for broadcast in [true, false] {
        let varmap = VarMap::new();
        let config = DdpConfig {
            broadcast_buffers: broadcast,
            ..Default::default()
        };
        let mut ddp = DistributedDataParallel::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            BnNet::new,
            config,
        )?;
        let x = input["bn_x"].narrow(0, ctx.rank * 4, 4)?;
        ddp.forward_t(&x, true)?;
        ddp.forward_t(&x, false)?; // the broadcast happens before each forward
        let mean = varmap.data().lock().unwrap()["bn.running_mean"]
            .as_tensor()
            .copy()?;
        out.insert(format!("running_mean broadcast={broadcast}"), mean);
    }
    Ok(out)
}

/// The ways a rank can fail; rank 1 is the one that fails.
fn run_fault(fault: &str, ctx: &RankContext) -> anyhow::Result<()> {
    let pg = ctx.pg.as_ref();
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let culprit = ctx.rank == 1;
    match fault {
        "fail_before" => {
            if culprit {
                bail!("out of data before the first all_reduce");
            }
            pg.all_reduce(&x, ReduceOp::Sum)?;
        }
        "fail_during" => {
            if culprit {
                // Another thread of this rank fails it while it waits in
                // the collective that the others never join.
                std::thread::scope(|s| {
                    s.spawn(|| {
                        std::thread::sleep(Duration::from_millis(300));
                        pg.abort("a data loader thread failed");
                    });
                    pg.all_reduce(&x, ReduceOp::Sum)
                })?;
            } else {
                // Late: rank 1 fails while it waits for them.
                std::thread::sleep(Duration::from_secs(2));
                pg.all_reduce(&x, ReduceOp::Sum)?;
            }
        }
        "fail_after" => {
            pg.all_reduce(&x, ReduceOp::Sum)?;
            if culprit {
                bail!("failed after the first all_reduce");
            }
            pg.all_reduce(&x, ReduceOp::Sum)?;
        }
        "panic" => {
            if culprit {
                panic!("rank 1 panics in its training loop");
            }
            pg.all_reduce(&x, ReduceOp::Sum)?;
        }
        "stage_fails" => {
            // Three stages on three processes; the layer of stage 1 (rank 1)
            // fails in the forward of micro-batch 2.
            use candle_dp::pipeline::{unit, RankPipeline, RankPipelineConfig};
            struct Breaks(std::sync::atomic::AtomicUsize);
            impl candle_core::Module for Breaks {
                fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                    if self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 2 {
                        candle_core::bail!("stage 1's layer broke");
                    }
                    Ok(x.clone())
                }
            }
            let layers = vec![
                unit(|vb| candle_nn::linear(4, 4, vb.pp("a"))),
                unit(|_| Ok(Breaks(Default::default()))),
                unit(|vb| candle_nn::linear(4, 2, vb.pp("b"))),
            ];
            let config = RankPipelineConfig {
                chunks: Some(4),
                ..Default::default()
            };
            let pipe = RankPipeline::new(
                ctx.process_group(),
                &VarMap::new(),
                DType::F32,
                &Device::Cpu,
                layers,
                config,
            )?;
            let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
            let y = Tensor::zeros(8, DType::U32, &Device::Cpu)?;
            pipe.forward_backward(
                Some(&x),
                Some(&y),
                candle_dp::LossReduction::Mean,
                loss::cross_entropy,
            )?;
        }
        "subgroup_abort" => {
            // Pairs {0, 1} and {2}: rank 1 fails in its pair while rank 0
            // waits there and rank 2 waits in the world.
            let pair = pg
                .split(candle_dp::comm::Color::new(u32::from(ctx.rank == 2)), 0)?
                .context("a group")?;
            match ctx.rank {
                1 => {
                    std::thread::sleep(Duration::from_millis(300));
                    pair.abort("its pair's data ran out");
                    pair.barrier()?;
                }
                0 => pair.barrier()?,
                _ => pg.barrier()?,
            }
        }
        "sigkill" => {
            if culprit {
                let pid = std::process::id().to_string();
                Command::new("kill").args(["-9", &pid]).status()?;
                std::thread::sleep(Duration::from_secs(30));
            }
            pg.all_reduce(&x, ReduceOp::Sum)?;
        }
        "mismatched_model" => {
            let varmap = VarMap::new();
            let sizes = if culprit { (6, 17, 5) } else { SIZES };
            DistributedDataParallel::new(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                |vb| Mlp::new(vb, sizes),
                DdpConfig::default(),
            )?;
        }
        "timeout" => {
            pg.set_timeout(Some(Duration::from_secs(2)));
            if culprit {
                // Stuck outside any collective for longer than the timeout.
                std::thread::sleep(Duration::from_secs(20));
            }
            pg.all_reduce(&x, ReduceOp::Sum)?;
        }
        "keeps_handle" => {
            // Rank 1 returns while something still holds its handle (as a
            // returned model would); the others wait in a barrier.
            if culprit {
                std::mem::forget(ctx.process_group());
                return Ok(());
            }
            pg.barrier()?;
        }
        "early_exit" => {
            // Rank 1 finishes after one collective; the others call a second.
            pg.all_reduce(&x, ReduceOp::Sum)?;
            if !culprit {
                pg.all_reduce(&x, ReduceOp::Sum)?;
            }
        }
        other => bail!("unknown scenario {other}"),
    }
    Ok(())
}

// ---------------------------------------------------------------------
// The test side: start mpirun, check what the processes wrote.
// ---------------------------------------------------------------------

/// What one bounded `mpirun` left behind.
struct Job {
    output: Output,
    dir: tempdir::Dir,
}

impl Job {
    fn text(&self) -> String {
        format!(
            "{}{}",
            String::from_utf8_lossy(&self.output.stdout),
            String::from_utf8_lossy(&self.output.stderr)
        )
    }

    /// What the process of `rank` wrote to its standard error, from the
    /// files of `mpirun --output-filename` (`<dir>/<job>/rank.<rank>/`).
    fn rank_stderr(&self, rank: usize) -> String {
        let jobs = std::fs::read_dir(self.dir.path().join(RANK_OUTPUT)).into_iter();
        jobs.flatten()
            .flatten()
            .map(|job| job.path().join(format!("rank.{rank}/stderr")))
            .map(|file| std::fs::read_to_string(file).unwrap_or_default())
            .collect()
    }

    fn rank(&self, rank: usize) -> Tensors {
        load(&self.dir.path().join(format!("rank{rank}.safetensors"))).unwrap_or_else(|e| {
            panic!(
                "rank {rank} wrote no results ({e}); output:\n{}",
                self.text()
            )
        })
    }
}

/// Runs `scenario` on `np` MPI processes with `input`, within [`DEADLINE`].
fn mpirun(np: usize, scenario: &str, input: Option<&Tensors>) -> Job {
    let dir = tempdir::Dir::new(scenario);
    if let Some(input) = input {
        candle_core::safetensors::save(input, dir.path().join("input.safetensors")).unwrap();
    }
    let rank_output = dir.path().join(RANK_OUTPUT);
    let mut command = mpirun_command(np, &std::env::current_exe().unwrap(), Some(&rank_output));
    command
        .args([
            "--ignored",
            "--exact",
            "mpi_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCENARIO, scenario)
        .env(OUT_DIR, dir.path());
    let output = run_bounded(command, scenario);
    Job { output, dir }
}

/// `mpirun` (as root too, more ranks than cores allowed) of `program`,
/// each process's output copied under `rank_output` when given.
fn mpirun_command(np: usize, program: &Path, rank_output: Option<&Path>) -> Command {
    let mut command = Command::new("mpirun");
    command.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ]);
    if let Some(dir) = rank_output {
        command.arg("--output-filename").arg(dir);
    }
    command.arg(program);
    command
}

/// How long `mpirun` may go on once every process it started has exited.
const MPIRUN_OUTLIVES_WORKERS: Duration = Duration::from_secs(10);

/// Watches the processes `mpirun` started (its children, from `/proc`).
#[derive(Default)]
struct Workers {
    /// Whether a live child was ever seen (none exist before the launch).
    seen: bool,
    /// Since when none is alive.
    gone_since: Option<Instant>,
}

impl Workers {
    /// How long no child of `parent` has been alive (zombies count as
    /// exited), once some child was; zero otherwise.
    fn all_gone_for(&mut self, parent: u32) -> Duration {
        let live = live_children(parent);
        if live > 0 {
            self.seen = true;
            self.gone_since = None;
            return Duration::ZERO;
        }
        if !self.seen {
            return Duration::ZERO;
        }
        self.gone_since.get_or_insert_with(Instant::now).elapsed()
    }
}

/// The children of `parent` that have not exited, from `/proc/*/stat`.
fn live_children(parent: u32) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path().join("stat")).ok())
        .filter(|stat| {
            // "pid (comm) state ppid ...": comm may hold spaces, so read
            // after its closing parenthesis.
            let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
            let mut fields = rest.split_whitespace();
            let state = fields.next();
            let ppid = fields.next().and_then(|p| p.parse::<u32>().ok());
            ppid == Some(parent) && state != Some("Z") && state != Some("X")
        })
        .count()
}

/// Runs `command` to the end, or fails the test after [`DEADLINE`]; one
/// at a time (the tests of this file run in parallel otherwise).
fn run_bounded(mut command: Command, what: &str) -> Output {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the command starts (is Open MPI installed?)");
    // Read the pipes on threads, so that a chatty child never blocks, and
    // wait for them with a deadline too: a process that outlives mpirun
    // could keep a pipe open.
    let pipe = |mut from: Box<dyn std::io::Read + Send>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = from.read_to_end(&mut buf);
            let _ = tx.send(buf);
        });
        rx
    };
    let out = pipe(Box::new(child.stdout.take().unwrap()));
    let err = pipe(Box::new(child.stderr.take().unwrap()));
    let read = |rx: &std::sync::mpsc::Receiver<Vec<u8>>| {
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| b"(output not closed within 30 s)".to_vec())
    };
    let start = Instant::now();
    let mut workers = Workers::default();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if workers.all_gone_for(child.id()) > MPIRUN_OUTLIVES_WORKERS {
            // Open MPI 4.1's mpirun can deadlock in its own shutdown
            // (`PMIx_server_finalize`, seen under CPU load) after every
            // process of the job has exited and it has printed its
            // verdict. The job is over: end mpirun, and report it as
            // failed, so a job that should have succeeded still fails.
            let _ = child.kill();
            let status = child.wait().unwrap();
            let stdout = read(&out);
            let mut stderr = read(&err);
            stderr.extend_from_slice(
                format!(
                    "\n(mpirun was still running {MPIRUN_OUTLIVES_WORKERS:?} after its last \
                     process exited, and was killed)\n"
                )
                .as_bytes(),
            );
            return Output {
                status,
                stdout,
                stderr,
            };
        }
        if start.elapsed() > DEADLINE {
            // SIGTERM first: mpirun then ends its processes too.
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let _ = child.wait();
            let text = String::from_utf8_lossy(&read(&out)).to_string()
                + &String::from_utf8_lossy(&read(&err));
            panic!("{what} ran past {DEADLINE:?}:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: read(&out),
        stderr: read(&err),
    }
}

/// Runs a scenario that must succeed on every rank.
fn mpirun_ok(np: usize, scenario: &str, input: Option<&Tensors>) -> Job {
    let job = mpirun(np, scenario, input);
    assert!(
        job.output.status.success(),
        "mpirun -np {np} {scenario} failed:\n{}",
        job.text()
    );
    job
}

/// The scenario's results on `world` thread ranks.
fn on_threads(
    world: usize,
    f: impl Fn(&RankContext) -> anyhow::Result<Tensors> + Sync,
) -> Vec<Tensors> {
    spawn_with(world, bounded(), |ctx| f(&ctx)).unwrap()
}

/// Bitwise equality of every tensor of two result sets.
fn assert_bitwise_equal(got: &Tensors, expected: &Tensors, what: &str) {
    let mut names: Vec<&String> = expected.keys().collect();
    names.sort();
    let got_names: Vec<&String> = {
        let mut n: Vec<&String> = got.keys().collect();
        n.sort();
        n
    };
    assert_eq!(got_names, names, "{what}: different results");
    for name in names {
        let (g, e) = (common::bits(&got[name]), common::bits(&expected[name]));
        if g != e && name == "messages" {
            let text = |t: &Tensor| String::from_utf8(t.to_vec1::<u8>().unwrap()).unwrap();
            assert_eq!(text(&got[name]), text(&expected[name]), "{what}: messages");
        }
        assert_eq!(got[name].dims(), expected[name].dims(), "{what}: {name}");
        assert!(g == e, "{what}: {name} differs from the thread group's");
    }
}

#[test]
fn every_collective_on_2_and_3_processes_equals_the_thread_group_bit_for_bit() {
    for np in [2, 3] {
        let job = mpirun_ok(np, "collectives", None);
        let expected = on_threads(np, collectives);
        for (rank, expected) in expected.iter().enumerate() {
            let got = job.rank(rank);
            assert_bitwise_equal(&got, expected, &format!("{np} processes, rank {rank}"));
        }
    }
}

#[test]
fn pytorch_ddp_runs_a_and_b_are_reproduced_by_mpi_processes() {
    let file = load_fixture("ddp_reference.safetensors");
    for (name, np) in [("A", 2), ("B", 4)] {
        let expected = fixture_tensors(&file, &format!("final_{name}."));
        let job = mpirun_ok(np, &format!("reference_{name}"), None);
        for rank in 0..np {
            let got = job.rank(rank);
            let diff = max_rel_diff(&got, &expected);
            assert!(
                diff < 1e-5,
                "run {name}, rank {rank}: {diff}\n{}",
                diff_report(&got, &expected)
            );
        }
    }
}

/// An initial model, 4 global batches of `rows`, and BatchNorm inputs.
fn training_input(rows: usize) -> Tensors {
    let varmap = VarMap::new();
    Mlp::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        SIZES,
    )
    .unwrap();
    let mut input: Tensors = snapshot(&varmap)
        .into_iter()
        .map(|(k, v)| (format!("init.{k}"), v))
        .collect();
    for s in 0..4 {
        let x = Tensor::randn(0f32, 1., (rows, SIZES.0), &Device::Cpu).unwrap();
        let y: Vec<u32> = (0..rows as u32).map(|i| (i * 3 + s) % 5).collect();
        input.insert(format!("x{s}"), x);
        input.insert(
            format!("y{s}"),
            Tensor::from_vec(y, rows, &Device::Cpu).unwrap(),
        );
    }
    let bn = Tensor::randn(0f32, 1., (12, 12), &Device::Cpu)
        .unwrap()
        .broadcast_add(
            &Tensor::arange(0f32, 12., &Device::Cpu)
                .unwrap()
                .reshape((12, 1))
                .unwrap(),
        )
        .unwrap();
    input.insert("bn_x".into(), bn);
    input
}

/// Plain candle on one device over the global batches.
fn single_device(input: &Tensors, adamw: bool) -> Tensors {
    single_device_mlp(&init_of(input), &batches(input), adamw)
}

#[test]
fn ddp_on_2_and_3_processes_matches_single_device_training_of_the_global_batch() {
    let input = training_input(12);
    for adamw in [false, true] {
        let reference = single_device(&input, adamw);
        let scenario = if adamw { "ddp_adamw" } else { "ddp_sgd" };
        for np in [2, 3] {
            let job = mpirun_ok(np, scenario, Some(&input));
            for rank in 0..np {
                let got = job.rank(rank);
                let diff = max_rel_diff(&got, &reference);
                assert!(
                    diff < 1e-5,
                    "{scenario} on {np} processes, rank {rank}: {diff}\n{}",
                    diff_report(&got, &reference)
                );
            }
            let threads = on_threads(np, |ctx| ddp_train(ctx, &input, adamw));
            assert!(
                identical(&job.rank(0), &threads[0]),
                "{scenario}: processes and threads differ"
            );
        }
    }
}

/// The reduction overlapped with the backward gives the bytes of the one
/// after it, on 1 to 4 processes, and of thread ranks.
#[test]
fn overlapped_ddp_on_1_to_4_processes_saves_the_bytes_of_ddp_without_units() {
    let input = training_input(12);
    let reference = single_device(&input, true);
    for np in 1..=4 {
        let units = mpirun_ok(np, "overlap_units", Some(&input));
        let whole = mpirun_ok(np, "overlap_whole", Some(&input));
        for rank in 0..np {
            assert!(
                identical(&units.rank(rank), &whole.rank(rank)),
                "{np} processes, rank {rank}: {}",
                diff_report(&units.rank(rank), &whole.rank(rank))
            );
        }
        let diff = max_rel_diff(&units.rank(0), &reference);
        assert!(diff < 1e-5, "{np} processes against one device: {diff}");
        let threads = on_threads(np, |ctx| overlap(ctx, &input, true));
        assert!(
            identical(&units.rank(0), &threads[0]),
            "{np}: processes and threads differ"
        );
    }
}

/// The one loop of the Fabric tests, unchanged, under `ddp`, `zero2`,
/// `fsdp` and `pipeline-ranks` (a stage per process) on two MPI
/// processes, in f32, bf16 and f16: the thread ranks'
/// bytes, every rank the same, one device's weights within the thread
/// tests' tolerance of each precision.
#[test]
fn the_fabric_loop_under_mpirun_saves_the_bytes_of_thread_ranks() {
    use candle_dp::fabric::{Fabric, Precision, Strategy};
    for (precision, tolerance) in [
        (Precision::F32, 1e-6),
        (Precision::Bf16Mixed, 1e-2),
        (Precision::F16Mixed, 1e-3),
    ] {
        let one = candle_dp::fabric::FabricConfig {
            devices: candle_dp::fabric::Devices::Count(1),
            ..fabric_config(Strategy::Single, precision)
        };
        let single = Fabric::launch(one, fabric_results).unwrap().swap_remove(0);
        for strategy in [
            Strategy::Ddp,
            Strategy::Zero2,
            Strategy::Fsdp,
            Strategy::PipelineRanks,
        ] {
            let job = mpirun_ok(2, &format!("fabric-{strategy}@{precision}"), None);
            let threads =
                Fabric::launch(fabric_config(strategy, precision), fabric_results).unwrap();
            for (rank, threads) in threads.iter().enumerate() {
                let what = format!("{strategy} {precision} rank {rank}");
                assert_bitwise_equal(&job.rank(rank), threads, &what);
            }
            let weights = max_rel_diff(&job.rank(0), &single);
            assert!(
                weights <= tolerance,
                "{strategy} {precision}: {weights:.2e} from one device's"
            );
        }
    }
}

/// The Fabric loop on 2 pipelines of 2 stage processes with ZeRO-2 and
/// with FSDP (ZeRO-3) across them: the thread ranks' bytes on every rank,
/// FSDP ZeRO-2's, and one device's weights within 1e-6.
#[test]
fn zero_and_fsdp_across_pipelines_on_4_processes_save_the_bytes_of_thread_ranks() {
    use candle_dp::fabric::{Fabric, FabricConfig, Strategy};
    let single = Fabric::launch(FabricConfig::new(Strategy::Single, 1), fabric_results)
        .unwrap()
        .swap_remove(0);
    let mut zero2 = None;
    for stage in [2, 3] {
        let job = mpirun_ok(4, &format!("fabric_pipeline_zero{stage}"), None);
        let threads = Fabric::launch(pipeline_zero_config(stage), fabric_results).unwrap();
        for (rank, threads) in threads.iter().enumerate() {
            let what = format!("ZeRO-{stage}, rank {rank}");
            assert_bitwise_equal(&job.rank(rank), threads, &what);
        }
        let weights = max_rel_diff(&job.rank(0), &single);
        assert!(
            weights <= 1e-6,
            "ZeRO-{stage}: {weights:.2e} from one device's"
        );
        match &zero2 {
            None => zero2 = Some(job.rank(0)),
            Some(two) => assert_bitwise_equal(&job.rank(0), two, "FSDP against ZeRO-2"),
        }
    }
}

/// Tensor parallelism beside FSDP (`dp_shard=2,tp=2`, 4 processes) and
/// beside FSDP across a pipeline's replicas (`pp=2,dp_shard=2,tp=2`, 8):
/// the language model's losses and whole weights are the bytes of as many
/// thread ranks, on every rank.
#[test]
fn tensor_parallel_on_2_and_3_dimensional_meshes_of_processes_saves_the_bytes_of_thread_ranks() {
    use candle_dp::fabric::Fabric;
    for (mesh, np) in [("dp_shard=2,tp=2", 4), ("pp=2,dp_shard=2,tp=2", 8)] {
        let job = mpirun_ok(np, &format!("fabric_tp@{mesh}"), None);
        let threads = Fabric::launch(tp_config(mesh), tp_results).unwrap();
        assert_eq!(threads.len(), np);
        for (rank, threads) in threads.iter().enumerate() {
            assert_bitwise_equal(&job.rank(rank), threads, &format!("{mesh}, rank {rank}"));
        }
    }
}

/// Deterministic training under mpirun: DDP on 2 and 4 processes, FSDP on 2,
/// HSDP on 4 (shard groups of the processes per machine) and
/// ZeRO-2 on 4 end at the bits of one device's thread rank, every rank's
/// losses and weights.
#[test]
fn deterministic_training_on_2_and_4_processes_saves_one_devices_bits() {
    use candle_dp::fabric::{Fabric, Strategy};
    let chunks = Some(common::fabric_loop::CHUNKS);
    let config = common::fabric_loop::deterministic_config(Strategy::Single, 1, chunks);
    let one = Fabric::launch(config, deterministic_results)
        .unwrap()
        .remove(0);
    let cases = [
        ("ddp", 2),
        ("ddp", 4),
        ("zero2", 4),
        ("fsdp", 2),
        ("hsdp", 4),
    ];
    every_rank_has_the_bits_of(&one, "fabric_deterministic", &cases);
}

/// Every rank of `mpirun -np N` of scenario `PREFIX@STRATEGY`, for each
/// `(STRATEGY, N)` of `cases`, saves the bits of `one`.
fn every_rank_has_the_bits_of(one: &Tensors, prefix: &str, cases: &[(&str, usize)]) {
    for &(strategy, np) in cases {
        let job = mpirun_ok(np, &format!("{prefix}@{strategy}"), None);
        for rank in 0..np {
            let what = format!("{strategy} x{np}, rank {rank}");
            assert_bitwise_equal(&job.rank(rank), one, &what);
        }
    }
}

/// The language model with dropout, deterministic: DDP and FSDP on 2,
/// ZeRO-2 and HSDP on 4 processes end at one device's bits.
#[test]
fn the_deterministic_language_model_with_dropout_on_2_and_4_processes_saves_one_devices_bits() {
    use candle_dp::fabric::{Fabric, Strategy};
    let config = candle_dp::fabric::FabricConfig {
        devices: candle_dp::fabric::Devices::Count(1),
        ..deterministic_lm_config(Strategy::Single)
    };
    let one = Fabric::launch(config, deterministic_lm).unwrap().remove(0);
    let cases = [("ddp", 2), ("fsdp", 2), ("zero2", 4), ("hsdp", 4)];
    every_rank_has_the_bits_of(&one, "fabric_deterministic_lm", &cases);
}

/// FSDP on 1 to 4 processes trains to DDP's bytes (AdamW), and to the
/// thread ranks'.
#[test]
fn fsdp_on_1_to_4_processes_saves_the_bytes_of_ddp() {
    let input = training_input(12);
    for np in 1..=4 {
        let job = mpirun_ok(np, "fsdp", Some(&input));
        let ddp = on_threads(np, |ctx| ddp_train(ctx, &input, true));
        for (rank, ddp) in ddp.iter().enumerate() {
            assert!(
                identical(&job.rank(rank), ddp),
                "{np} processes, rank {rank}: {}",
                diff_report(&job.rank(rank), ddp)
            );
        }
        let threads = on_threads(np, |ctx| fsdp(ctx, &input));
        assert!(
            identical(&job.rank(0), &threads[0]),
            "{np}: processes and threads differ"
        );
    }
}

#[test]
fn a_pipeline_in_each_of_2_and_3_processes_matches_single_device_training() {
    let input = training_input(12);
    let reference = single_device(&input, false);
    for np in [2, 3] {
        let job = mpirun_ok(np, "pipeline_ddp", Some(&input));
        for rank in 0..np {
            let got = job.rank(rank);
            let diff = max_rel_diff(&got, &reference);
            assert!(
                diff < 1e-5,
                "pipeline in {np} processes, rank {rank}: {diff}\n{}",
                diff_report(&got, &reference)
            );
        }
        let threads = on_threads(np, |ctx| pipeline_ddp(ctx, &input));
        assert!(
            identical(&job.rank(0), &threads[0]),
            "pipeline_ddp: processes and threads differ"
        );
    }
}

/// The same on 2 simulated machines (`scripts/netcluster.sh`: network
/// namespaces, TCP only) x 1 and x 2 processes; skipped, saying why, where
/// namespaces cannot be made.
#[test]
fn a_pipeline_in_each_rank_on_two_simulated_machines_matches_thread_ranks() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/netcluster.sh");
    let mut check = Command::new("bash");
    check.arg(&script).arg("check");
    let check = common::killing::bounded_output(check, Duration::from_secs(60));
    if !check.status.success() {
        println!("skipped: {}", String::from_utf8_lossy(&check.stdout).trim());
        return;
    }
    let input = training_input(12);
    for per_machine in [1, 2] {
        let np = 2 * per_machine;
        let dir = tempdir::Dir::new("cluster_pipeline");
        candle_core::safetensors::save(&input, dir.path().join("input.safetensors")).unwrap();
        let mut command = Command::new("bash");
        command
            .arg(&script)
            .args([
                "run",
                "--machines",
                "2",
                "--per-machine",
                &per_machine.to_string(),
            ])
            .args(["--export", SCENARIO, "--export", OUT_DIR, "--"])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "mpi_worker",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(SCENARIO, "pipeline_ddp")
            .env(OUT_DIR, dir.path());
        let output = run_bounded(command, "pipeline_ddp on 2 simulated machines");
        let job = Job { output, dir };
        assert!(job.output.status.success(), "{}", job.text());
        let threads = on_threads(np, |ctx| pipeline_ddp(ctx, &input));
        for (rank, expected) in threads.iter().enumerate() {
            assert!(
                identical(&job.rank(rank), expected),
                "2 machines x {per_machine}, rank {rank}: processes and threads differ"
            );
        }
    }
}

#[test]
fn no_sync_join_hooks_and_buffer_broadcast_behave_as_on_threads() {
    let input = training_input(12);
    type Scenario = fn(&RankContext, &Tensors) -> anyhow::Result<Tensors>;
    let scenarios: [(&str, Scenario); 7] = [
        ("no_sync", no_sync),
        ("join_initial", |c, i| {
            join(c, i, JoinDivisor::InitialWorldSize)
        }),
        ("join_active", |c, i| join(c, i, JoinDivisor::ActiveRanks)),
        // Ranks that joined skip the all-reduce of a step inside no_sync.
        ("join_no_sync", |c, i| {
            join_accumulating(c, &init_of(i), &batches(i))
        }),
        ("hook_fp16", |c, i| hooked(c, i, CommHook::Fp16Compress)),
        ("hook_bf16", |c, i| hooked(c, i, CommHook::Bf16Compress)),
        ("buffers", buffers),
    ];
    for (name, scenario) in scenarios {
        let np = if name.starts_with("join") { 3 } else { 2 };
        let job = mpirun_ok(np, name, Some(&input));
        // The BatchNorm net starts from each run's own random init, so only
        // the other scenarios can be compared with threads.
        let threads = on_threads(np, |ctx| scenario(ctx, &input));
        for rank in (0..np).filter(|_| name != "buffers") {
            let got = job.rank(rank);
            let diff = max_rel_diff(&got, &threads[rank]);
            assert!(
                diff < 1e-6,
                "{name}, rank {rank}: processes and threads differ by {diff}"
            );
        }
        match name {
            "buffers" => {
                let mean = |rank: usize, b: bool| {
                    job.rank(rank)[&format!("running_mean broadcast={b}")]
                        .to_vec1::<f32>()
                        .unwrap()
                };
                assert_eq!(
                    mean(0, true),
                    mean(1, true),
                    "broadcast buffers follow rank 0"
                );
                assert_ne!(
                    mean(0, false),
                    mean(1, false),
                    "without broadcast they diverge"
                );
            }
            "no_sync" => {
                let reference = single_device(&input, false);
                // no_sync over 3 micro-batches of 2 rows on 2 ranks = one step on 12 rows.
                let diff = max_rel_diff(&job.rank(0), &reference);
                assert!(diff < 1e-5, "no_sync: {diff}");
            }
            _ => assert!(
                identical(&job.rank(0), &job.rank(np - 1)),
                "{name}: ranks differ"
            ),
        }
    }
}

/// Whether a line of `stderr` starts with the prefix of `rank`'s reports
/// and holds `needle`.
fn reported(stderr: &str, rank: usize, needle: &str) -> bool {
    let prefix = format!("[rank {rank}] ");
    stderr
        .lines()
        .any(|line| line.starts_with(&prefix) && line.contains(needle))
}

/// Where a fault scenario's message must be found.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// On a line of this rank's standard error that starts with its prefix.
    Rank(usize),
    /// In the standard error of some rank (the ones stopped by the failure
    /// report it; mpirun may end all but the first to exit).
    AnyRank,
    /// In mpirun's own output.
    Launcher,
}

/// Runs a fault scenario on 3 processes and checks that it ends, non-zero,
/// with each needle said where it says. Each rank's output is read from
/// its own file (`mpirun --output-filename`), so no check depends on how
/// the processes' writes interleave in mpirun's merged output.
fn assert_fault(scenario: &str, needles: &[(Source, &str)]) {
    let job = mpirun(3, scenario, None);
    let text = job.text();
    assert!(
        !job.output.status.success(),
        "{scenario}: mpirun exited 0:\n{text}"
    );
    for (said, needle) in needles {
        let found = match said {
            Source::Rank(rank) => reported(&job.rank_stderr(*rank), *rank, needle),
            Source::AnyRank => (0..3).any(|rank| job.rank_stderr(rank).contains(needle)),
            Source::Launcher => text.contains(needle),
        };
        let ranks = (0..3)
            .map(|rank| format!("--- rank {rank}:\n{}", job.rank_stderr(rank)))
            .collect::<String>();
        assert!(
            found,
            "{scenario}: {needle:?} not said by {said:?}:\n{ranks}--- mpirun:\n{text}"
        );
    }
}

#[test]
fn a_rank_failing_before_during_or_after_a_collective_stops_every_rank_naming_it() {
    // The other ranks' own messages ("rank 0 stopped because rank 1
    // failed: …") are printed only if they get there before mpirun ends
    // them, so only the failing rank's is required.
    // The failing rank's report is a whole line, prefixed with its rank.
    assert_fault(
        "fail_before",
        &[(Source::Rank(1), "rank 1 failed: out of data")],
    );
    assert_fault(
        "fail_during",
        &[(
            Source::Rank(1),
            "rank 1 failed: a data loader thread failed",
        )],
    );
    assert_fault(
        "fail_after",
        &[(
            Source::Rank(1),
            "rank 1 failed: failed after the first all_reduce",
        )],
    );
}

#[test]
fn a_rank_that_panics_stops_every_rank_naming_it() {
    assert_fault(
        "panic",
        &[
            (
                Source::Rank(1),
                "rank 1 panicked: rank 1 panics in its training loop",
            ),
            // The panic itself, as the standard hook says it, on whole lines.
            (Source::Rank(1), "thread 'mpi_worker' panicked at"),
        ],
    );
}

#[test]
fn a_rank_killed_with_sigkill_ends_the_job_naming_it() {
    assert_fault(
        "sigkill",
        &[(Source::Launcher, "rank 1"), (Source::Launcher, "signal 9")],
    );
}

#[test]
fn a_model_that_differs_across_ranks_is_reported_naming_the_rank_and_variable() {
    assert_fault(
        "mismatched_model",
        &[
            (Source::AnyRank, "the model on rank 1 differs"),
            (Source::AnyRank, "`l1.bias`"),
        ],
    );
}

#[test]
fn a_rank_stuck_outside_collectives_makes_the_others_time_out_naming_it() {
    assert_fault(
        "timeout",
        &[(
            Source::AnyRank,
            "timed out after 2s; rank(s) [1] did not arrive",
        )],
    );
}

#[test]
fn a_rank_that_returns_while_its_handle_lives_on_counts_as_gone() {
    assert_fault(
        "keeps_handle",
        &[(Source::AnyRank, "rank 1 left the group")],
    );
}

#[test]
fn a_rank_failing_in_a_sub_group_stops_the_ranks_of_every_group_naming_it() {
    assert_fault(
        "subgroup_abort",
        &[
            (Source::Rank(1), "rank 1 failed: its pair's data ran out"),
            // Rank 2 is in no group with rank 1 but the world.
            (
                Source::AnyRank,
                "because rank 1 failed: its pair's data ran out",
            ),
        ],
    );
}

#[test]
fn a_recv_waits_for_its_sender_although_another_rank_has_left() {
    let job = mpirun_ok(3, "recv_after_another_left", None);
    assert_eq!(job.rank(0)["got"].to_vec1::<f32>().unwrap(), [1.0]);
}

#[test]
fn a_stage_failing_on_one_process_stops_every_stage_naming_it() {
    assert_fault(
        "stage_fails",
        &[
            (
                Source::Rank(1),
                "in pipeline stage 1 on device rank 1, forward of micro-batch 2",
            ),
            (Source::AnyRank, "stage 1's layer broke"),
        ],
    );
}

#[test]
fn sub_groups_meshes_and_messages_on_4_processes_equal_thread_ranks_bit_for_bit() {
    let job = mpirun_ok(4, "subgroups", None);
    let expected = on_threads(4, subgroups);
    for (rank, expected) in expected.iter().enumerate() {
        assert_bitwise_equal(&job.rank(rank), expected, &format!("rank {rank}"));
    }
}

#[test]
fn sub_groups_made_in_a_loop_past_mpis_communicators_are_freed_as_they_go() {
    let job = mpirun_ok(2, "groups_in_a_loop", None);
    let sums = job.rank(0)["sums"].to_vec1::<f32>().unwrap();
    assert_eq!(sums, vec![3.0; GROUPS_IN_A_LOOP / 1000]);
}

#[test]
fn hsdp_on_4_processes_saves_the_bytes_of_thread_ranks_and_fsdps_weights() {
    let input = training_input(12);
    let job = mpirun_ok(4, "hsdp", Some(&input));
    let threads = on_threads(4, |ctx| hsdp(ctx, &input));
    let fsdp_threads = on_threads(4, |ctx| fsdp(ctx, &input));
    for (rank, threads) in threads.iter().enumerate() {
        assert!(
            identical(&job.rank(rank), threads),
            "rank {rank}: {}",
            diff_report(&job.rank(rank), threads)
        );
        let diff = max_rel_diff(&job.rank(rank), &fsdp_threads[0]);
        assert!(diff < 1e-5, "rank {rank}: {diff}");
    }
}

#[test]
fn zero_on_a_mesh_of_4_processes_saves_the_bytes_of_thread_ranks_and_flat_zeros_weights() {
    let input = training_input(12);
    let job = mpirun_ok(4, "zero_mesh", Some(&input));
    let threads = on_threads(4, |ctx| zero_on_mesh(ctx, &input, (2, 2)));
    // One replica of four shards: plain ZeRO over the four ranks.
    let flat = on_threads(4, |ctx| zero_on_mesh(ctx, &input, (1, 4)));
    for (rank, threads) in threads.iter().enumerate() {
        assert!(
            identical(&job.rank(rank), threads),
            "rank {rank}: {}",
            diff_report(&job.rank(rank), threads)
        );
        let diff = max_rel_diff(&job.rank(rank), &flat[0]);
        assert!(diff < 1e-5, "rank {rank}: {diff}");
    }
}

#[test]
fn a_pipeline_with_stages_on_4_processes_trains_to_the_bytes_of_stages_on_thread_ranks() {
    let job = mpirun_ok(4, "rank_pipeline", None);
    let expected = on_threads(4, rank_pipeline);
    for (rank, expected) in expected.iter().enumerate() {
        assert_bitwise_equal(&job.rank(rank), expected, &format!("rank {rank}"));
    }
    assert!(
        job.rank(3).contains_key("1f1b.loss1"),
        "the last stage's rank has the losses"
    );
}

#[test]
fn a_rank_that_finished_early_makes_a_later_collective_fail_naming_it() {
    assert_fault("early_exit", &[(Source::AnyRank, "rank 1 left the group")]);
}

/// The guard against Open MPI's shutdown deadlock: a launcher that goes on
/// after its last process exited is ended and reported failed, long
/// before the deadline. A shell stands in for mpirun: one child that
/// exits after a second, then the shell becomes a `sleep` with none.
#[test]
fn a_launcher_that_outlives_its_processes_is_ended_and_reported_failed() {
    let mut command = Command::new("sh");
    command.args(["-c", "sleep 1 & wait; exec sleep 600"]);
    let output = run_bounded(command, "a stuck launcher");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("after its last process exited, and was killed"),
        "{stderr}"
    );
}

/// The main job, `train_digits --strategy ddp`, trains to the same bytes
/// on 2 thread ranks and on 2 MPI processes, and only rank 0 prints.
#[test]
fn train_digits_on_threads_and_on_mpi_processes_saves_the_same_weights() {
    // target/<profile>/deps/mpi-… -> target/<profile>/examples/train_digits
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/train_digits");
    assert!(
        example.exists(),
        "{} is missing: run `cargo build --features mpi --example train_digits` first (.ci/run does)",
        example.display()
    );
    let dir = tempdir::Dir::new("train_digits");
    let args = |file: &str| {
        let path = dir.path().join(file);
        [
            "--strategy",
            "ddp",
            "--epochs",
            "3",
            "--seed",
            "5",
            "--save",
        ]
        .map(Into::into)
        .into_iter()
        .chain([path.into_os_string()])
        .collect::<Vec<std::ffi::OsString>>()
    };
    let mut threads = Command::new(&example);
    threads.args(args("threads.safetensors"));
    let threads = run_bounded(threads, "train_digits on threads");
    let mut processes = mpirun_command(2, &example, None);
    processes.args(args("mpi.safetensors"));
    let processes = run_bounded(processes, "train_digits under mpirun");
    for (what, output) in [("threads", &threads), ("mpirun", &processes)] {
        assert!(
            output.status.success(),
            "{what}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let printed = String::from_utf8_lossy(&processes.stdout);
    assert_eq!(
        printed.matches("| DDP, 2 MPI processes |").count(),
        1,
        "{printed}"
    );
    assert_eq!(
        printed.matches("data: ").count(),
        1,
        "only rank 0 prints:\n{printed}"
    );
    let saved = |file: &str| std::fs::read(dir.path().join(file)).unwrap();
    assert!(
        saved("threads.safetensors") == saved("mpi.safetensors"),
        "threads and processes saved different weights"
    );
}

/// ZeRO under `mpirun` (`train_digits --zero`) trains to the bytes of
/// plain DDP on as many thread ranks: stage 2 on 1 to 4 processes, stage 1
/// on 2.
#[test]
fn train_digits_with_zero_under_mpirun_saves_the_bytes_of_plain_ddp() {
    let example = common::killing::example("train_digits");
    let dir = tempdir::Dir::new("train_digits_zero");
    let args = |file: &str, ranks: usize, zero: Option<&str>| {
        let path = dir.path().join(file);
        let mut args: Vec<std::ffi::OsString> = [
            "--strategy",
            "ddp",
            "--epochs",
            "2",
            "--seed",
            "3",
            "--no-reference",
            "--replicas",
        ]
        .map(Into::into)
        .into();
        args.push(ranks.to_string().into());
        if let Some(stage) = zero {
            args.extend(["--zero".into(), stage.into()]);
        }
        args.extend(["--save".into(), path.into_os_string()]);
        args
    };
    let succeeded = |what: &str, output: &std::process::Output| {
        assert!(
            output.status.success(),
            "{what}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let saved = |file: &str| std::fs::read(dir.path().join(file)).unwrap();
    for (ranks, stage) in [(1, "2"), (2, "1"), (2, "2"), (3, "2"), (4, "2")] {
        let plain_file = format!("ddp{ranks}.safetensors");
        if !dir.path().join(&plain_file).exists() {
            let mut plain = Command::new(&example);
            plain.args(args(&plain_file, ranks, None));
            succeeded("plain DDP on threads", &run_bounded(plain, "plain DDP"));
        }
        let zero_file = format!("zero{stage}-{ranks}.safetensors");
        let mut zero = mpirun_command(ranks, &example, None);
        zero.args(args(&zero_file, ranks, Some(stage)));
        let output = run_bounded(zero, "ZeRO under mpirun");
        succeeded("ZeRO under mpirun", &output);
        let printed = String::from_utf8_lossy(&output.stdout);
        assert!(
            printed.contains(&format!(
                "| DDP with ZeRO stage {stage}, {ranks} MPI processes |"
            )),
            "{printed}"
        );
        assert!(
            saved(&zero_file) == saved(&plain_file),
            "ZeRO stage {stage} on {ranks} MPI processes saved other weights than DDP on {ranks} thread ranks"
        );
    }
}

/// The main job under FSDP (`--strategy fsdp`, the conv net's layers as
/// units) on 2 and 3 MPI processes saves the bytes of plain DDP on as many
/// thread ranks.
#[test]
fn train_digits_with_fsdp_under_mpirun_saves_the_bytes_of_plain_ddp() {
    let example = common::killing::example("train_digits");
    let dir = tempdir::Dir::new("train_digits_fsdp");
    let args = |strategy: &str, file: &str, ranks: usize| -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = ["--strategy", strategy, "--epochs", "2"]
            .map(Into::into)
            .into();
        args.extend(["--seed", "3", "--no-reference", "--replicas"].map(Into::into));
        args.push(ranks.to_string().into());
        args.extend(["--save".into(), dir.path().join(file).into_os_string()]);
        args
    };
    for ranks in [2, 3] {
        let mut plain = Command::new(&example);
        plain.args(args("ddp", "ddp.safetensors", ranks));
        let output = run_bounded(plain, "plain DDP");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let mut fsdp = mpirun_command(ranks, &example, None);
        fsdp.args(args("fsdp", "fsdp.safetensors", ranks));
        let output = run_bounded(fsdp, "FSDP under mpirun");
        let printed = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{printed}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            printed.contains(&format!("| FSDP, {ranks} MPI processes |")),
            "{printed}"
        );
        let saved = |file: &str| std::fs::read(dir.path().join(file)).unwrap();
        assert!(
            saved("fsdp.safetensors") == saved("ddp.safetensors"),
            "FSDP on {ranks} MPI processes saved other weights than DDP on {ranks} thread ranks"
        );
    }
}

/// The training recipe under `mpirun`: f16 with its loss scaler, gradient
/// clipping and a warm-up + cosine schedule, at ZeRO stage 2 on 2 MPI
/// processes, saves the bytes of the same run on 2 thread ranks (the scaler's
/// check of every rank's shard is one all-reduce on either group).
#[test]
fn train_digits_in_f16_with_clipping_and_a_schedule_under_mpirun_saves_the_bytes_of_threads() {
    let example = common::killing::example("train_digits");
    let dir = tempdir::Dir::new("train_digits_f16");
    let args = |file: &str| {
        let path = dir.path().join(file);
        let mut args: Vec<std::ffi::OsString> = [
            "--strategy",
            "ddp",
            "--zero",
            "2",
            "--model",
            "mlp",
            "--epochs",
            "2",
            "--no-reference",
            "--precision",
            "f16",
            "--clip-grad-norm",
            "0.5",
            "--lr-schedule",
            "warmup-cosine",
            "--save",
        ]
        .map(Into::into)
        .into();
        args.push(path.into_os_string());
        args
    };
    let mut threads = Command::new(&example);
    threads.args(args("threads.safetensors"));
    let threads = run_bounded(threads, "f16 on threads");
    let mut processes = mpirun_command(2, &example, None);
    processes.args(args("mpi.safetensors"));
    let processes = run_bounded(processes, "f16 under mpirun");
    for (what, output) in [("threads", &threads), ("mpirun", &processes)] {
        assert!(
            output.status.success(),
            "{what}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let saved = |file: &str| std::fs::read(dir.path().join(file)).unwrap();
    assert!(
        saved("threads.safetensors") == saved("mpi.safetensors"),
        "threads and processes saved different weights"
    );
}

/// The main job under `mpirun -np 2`, killed five times (one rank with
/// SIGKILL, which ends the job: at pseudo-random moments, and rank 0 in
/// the middle of a save) and resumed with `--resume` each time, saves the
/// same bytes as an uninterrupted run.
/// The elastic supervisor (`train_lm --hosts localhost:2 --max-restarts
/// 2`): rank 0 killed as soon as a save is under way (inside it, or just
/// after it, as the kill lands), mpirun ends the job, the supervisor
/// starts it again on the same two slots, and it resumes from the newest
/// complete state to the bytes of two thread ranks that were never killed.
#[test]
fn a_supervised_job_whose_rank_is_killed_as_it_saves_restarts_to_the_bytes_of_an_uninterrupted_run()
{
    use common::killing::{example, ranks_of, run_and_kill, KillAt};
    let exe = example("train_lm");
    let dir = tempdir::Dir::new("elastic");
    let states = dir.path().join("states");
    let lm = |save: &str| {
        let mut command = Command::new(&exe);
        command
            .args(["--strategy", "ddp", "--steps", "40", "--eval-every", "40"])
            .args(["--width", "32", "--context", "32", "--sample", "0"])
            .arg("--chart")
            .arg(dir.path().join("chart.svg"))
            .arg("--save")
            .arg(dir.path().join(save));
        command
    };
    let mut straight = lm("straight.safetensors");
    straight.args(["--replicas", "2"]);
    let output = run_bounded(straight, "train_lm on 2 thread ranks");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut supervised = lm("elastic.safetensors");
    supervised
        .args([
            "--hosts",
            "localhost:2",
            "--max-restarts",
            "2",
            "--timeout",
            "60",
        ])
        .args(["--checkpoint-every", "5", "--checkpoint-dir"])
        .arg(&states)
        .args([
            "--launcher-option=--allow-run-as-root",
            "--launcher-option=--oversubscribe",
        ]);
    // Rank 0 writes the states: it is killed inside one. The supervisor's
    // children are its probes and its mpirun; the ranks are mpirun's.
    let killed = run_and_kill(supervised, KillAt::DuringSave, &states, |supervisor| {
        ranks_of(supervisor.id())
            .into_iter()
            .flat_map(|(launcher, _)| ranks_of(launcher))
            .find(|(_, rank)| *rank == Some(0))
            .map(|(pid, _)| pid)
    });
    assert!(
        killed.interrupted,
        "the job ended before the kill: {killed:?}"
    );
    assert!(
        killed.resumed.is_some(),
        "the restarted job did not resume from a state: {killed:?}"
    );
    let read = |name: &str| std::fs::read(dir.path().join(name)).unwrap_or_default();
    assert!(
        !read("elastic.safetensors").is_empty()
            && read("elastic.safetensors") == read("straight.safetensors"),
        "the restarted job saved other weights (or none): {killed:?}"
    );
    println!("killed and restarted: {killed:?}");
}

#[test]
fn train_digits_under_mpirun_killed_five_times_resumes_to_the_same_bytes() {
    use common::killing::{example, fractions, ranks_of, run_and_kill, KillAt};
    let exe = example("train_digits");
    let dir = tempdir::Dir::new("resume");
    let states = dir.path().join("states");
    let job = |states: &Path, save: &Path| {
        let mut command = mpirun_command(2, &exe, None);
        command
            .args(["--strategy", "ddp", "--epochs", "3", "--seed", "3"])
            .args(["--checkpoint-every", "2", "--resume", "--chart"])
            .arg(dir.path().join("chart.svg"))
            .arg("--checkpoint-dir")
            .arg(states)
            .arg("--save")
            .arg(save);
        command
    };
    let (straight, resumed) = (
        dir.path().join("straight.safetensors"),
        dir.path().join("resumed.safetensors"),
    );
    let start = Instant::now();
    let output = run_bounded(
        job(&dir.path().join("straight-states"), &straight),
        "mpirun",
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let window = start.elapsed().div_f64(6.0);
    let mut report = Vec::new();
    for (i, fraction) in fractions(11, 5).into_iter().enumerate() {
        // Rank 0 writes the states: it is the one killed inside a save.
        // The others die once their run has saved a state: the processes'
        // start can take longer than a short run's window (the dev build
        // trains this job in under a second).
        let (at, victim) = if i == 2 {
            (KillAt::DuringSave, 0)
        } else {
            (KillAt::AfterItsFirstSave(window.mul_f64(fraction)), 1)
        };
        let killed = run_and_kill(job(&states, &resumed), at, &states, |child| {
            ranks_of(child.id())
                .into_iter()
                .find(|(_, rank)| *rank == Some(victim))
                .map(|(pid, _)| pid)
        });
        report.push(format!("rank {victim} {at:?}: {killed:?}"));
    }
    let output = run_bounded(job(&states, &resumed), "mpirun --resume");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        std::fs::read(&resumed).unwrap() == std::fs::read(&straight).unwrap(),
        "the resumed job saved other weights; kills: {report:#?}"
    );
    assert!(
        report.iter().any(|r| r.contains("resumed: Some(")),
        "no run resumed from a saved state: {report:#?}"
    );
    println!("mpirun -np 2: same bytes after 5 kills: {report:#?}");
}

/// A directory removed when dropped.
mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(name: &str) -> Dir {
            let path = std::env::temp_dir().join(format!(
                "candle-dp-mpi-{name}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The seed's demonstration under `mpirun -np 2`: `torchrun`'s script
/// (`launch::run`), Fabric's and Accelerate's print what the real tools
/// printed (`scripts/gen_fabric_reference.py`). `mp.spawn` is the
/// in-process launcher, tested on thread ranks only.
#[test]
fn the_demonstration_under_mpirun_prints_what_pytorch_fabric_and_accelerate_print() {
    let example = common::killing::example("which_batch");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/data/fabric_reference.json"
        ))
        .unwrap(),
    )
    .unwrap();
    for script in ["torchrun", "fabric", "accelerate"] {
        let mut command = mpirun_command(2, &example, None);
        command.args(["--script", script]);
        let output = run_bounded(command, script);
        assert!(output.status.success(), "{script}: {output:?}");
        let mut lines: Vec<String> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|line| line.starts_with("rank "))
            .map(str::to_owned)
            .collect();
        lines.sort();
        let want: Vec<String> = serde_json::from_value(reference["demo"][script].clone()).unwrap();
        assert_eq!(lines, want, "{script} under mpirun");
    }
}
