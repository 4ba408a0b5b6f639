//! `NcclGroup` on thread ranks, one GPU each (or two ranks on one GPU with
//! `NCCL_MULTI_RANK_GPU_ENABLE=1`, NCCL 2.30): collectives against the host
//! group's, errors agreed on every rank, a lost rank named within the
//! timeout, DDP on NCCL against one device. Needs a GPU and NCCL
//! (`scripts/gpu_check.sh`).
#![cfg(feature = "nccl")]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::comm::{GroupOptions, NcclGroup, ProcessGroup, ReduceOp};
use candle_dp::launch::spawn_with;
use candle_dp::{DdpConfig, DistributedDataParallel};
use candle_nn::{loss, Optimizer, VarBuilder, VarMap, SGD};
use common::*;

fn bounded() -> GroupOptions {
    GroupOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    }
}

/// Rank `rank`'s GPU, with a stream of its own.
fn gpu(rank: usize) -> Device {
    let gpus = CudaContext::device_count().unwrap() as usize;
    Device::new_cuda_with_stream(rank % gpus).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-5 * (1. + y.abs()))
}

#[test]
fn collectives_on_gpu_tensors_match_the_host_group() {
    // NCCL's initialisation has no timeout of its own.
    within(180, move || {
        let checked = spawn_with(2, bounded(), |ctx| {
            let device = gpu(ctx.rank);
            let nccl = NcclGroup::new(ctx.process_group(), &device)?;
            let host = ctx.process_group();
            let cpu = Tensor::new(
                &[ctx.rank as f32 + 0.5, -2.0, 3.0 * ctx.rank as f32],
                &Device::Cpu,
            )?;
            let x = cpu.to_device(&device)?;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let got = nccl.all_reduce(&x, op)?;
                assert!(
                    got.device().same_device(&device),
                    "the result stays on the GPU"
                );
                let want = host.all_reduce(&cpu, op)?;
                assert!(close(&values(&got), &values(&want)), "{op}");
            }
            let b = nccl.broadcast(&x, 1)?;
            assert!(close(&values(&b), &values(&host.broadcast(&cpu, 1)?)));
            let all = nccl.all_gather(&x)?;
            let want = host.all_gather(&cpu)?;
            for (g, w) in all.iter().zip(&want) {
                assert!(close(&values(g), &values(w)));
            }
            let gathered = nccl.gather(&x, 0)?;
            assert_eq!(gathered.is_some(), ctx.rank == 0);
            let reduced = nccl.reduce(&x, 1, ReduceOp::Sum)?;
            let want = host.reduce(&cpu, 1, ReduceOp::Sum)?;
            assert_eq!(reduced.is_some(), ctx.rank == 1);
            if let (Some(r), Some(w)) = (reduced, want) {
                assert!(close(&values(&r), &values(&w)));
            }
            // CPU tensors and dtypes NCCL lacks go through the host group.
            let on_host = nccl.all_reduce(&cpu, ReduceOp::Sum)?;
            assert!(on_host.device().is_cpu());
            let ints = Tensor::new(&[ctx.rank as i64 + 1], &device)?;
            let avg = nccl.all_reduce(&ints, ReduceOp::Avg)?;
            assert_eq!(
                avg.to_vec1::<i64>()?,
                vec![1],
                "(1 + 2) / 2 truncated, as the host groups"
            );
            Ok(())
        });
        checked.unwrap();
    })
}

#[test]
fn mismatched_shapes_give_every_rank_the_same_error_and_the_group_goes_on() {
    // NCCL's initialisation has no timeout of its own.
    within(180, move || {
        let results = spawn_with(2, bounded(), |ctx| {
            let device = gpu(ctx.rank);
            let nccl = NcclGroup::new(ctx.process_group(), &device)?;
            let x = Tensor::zeros(3 + ctx.rank, DType::F32, &device)?;
            let err = nccl.all_reduce(&x, ReduceOp::Sum).unwrap_err();
            let ok = nccl.all_reduce(&Tensor::ones(2, DType::F32, &device)?, ReduceOp::Sum)?;
            Ok((err.to_string(), values(&ok)))
        })
        .unwrap();
        for (err, ok) in &results {
            assert!(err.contains("rank(s) [1]: f32 [4]"), "{err}");
            assert_eq!(ok, &vec![2.0, 2.0]);
        }
    })
}

#[test]
fn a_rank_that_never_arrives_is_named_within_the_timeout() {
    // NCCL's initialisation has no timeout of its own.
    within(180, move || {
        let options = GroupOptions {
            timeout: Some(Duration::from_secs(3)),
            ..Default::default()
        };
        let results = spawn_with(2, options, |ctx| {
            let device = gpu(ctx.rank);
            let nccl = NcclGroup::new(ctx.process_group(), &device)?;
            if ctx.rank == 1 {
                std::thread::sleep(Duration::from_secs(6));
                return Ok(None);
            }
            let x = Tensor::ones(4, DType::F32, &device)?;
            Ok(Some(
                nccl.all_reduce(&x, ReduceOp::Sum).map(|_| ()).unwrap_err(),
            ))
        });
        // spawn fails the run once a rank fails; either way rank 1 is named.
        let text = match results {
            Ok(r) => format!("{:?}", r[0]),
            Err(e) => e.to_string(),
        };
        assert!(text.contains("[1]") || text.contains("rank 1"), "{text}");
    })
}

/// Fresh initial values of the MLP of `DDP_SIZES`, on the CPU.
fn mlp_init() -> std::collections::HashMap<String, Tensor> {
    let varmap = VarMap::new();
    Mlp::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        DDP_SIZES,
    )
    .unwrap();
    snapshot(&varmap)
}

#[test]
fn ddp_on_nccl_matches_one_gpu_and_the_ranks_agree_bitwise() {
    // NCCL's initialisation has no timeout of its own.
    within(180, move || {
        let init = mlp_init();
        let data: Vec<(Tensor, Tensor)> = (0..8)
            .map(|s| {
                let x = Tensor::randn(0f32, 1., (8, DDP_SIZES.0), &Device::Cpu).unwrap();
                let y = Tensor::from_vec((0..8u32).map(|i| (i + s) % 5).collect(), 8, &Device::Cpu)
                    .unwrap();
                (x, y)
            })
            .collect();
        let on = |values: &std::collections::HashMap<String, Tensor>, device: &Device| {
            let moved = values
                .iter()
                .map(|(n, t)| (n.clone(), t.to_device(device).unwrap()))
                .collect();
            varmap_from(&moved)
        };
        // One GPU, the whole batch.
        let device = gpu(0);
        let varmap = on(&init, &device);
        let net = Mlp::new(
            VarBuilder::from_varmap(&varmap, DType::F32, &device),
            DDP_SIZES,
        )
        .unwrap();
        let mut sgd = SGD::new(varmap.all_vars(), 0.1).unwrap();
        for (x, y) in &data {
            let l = loss::cross_entropy(
                &net.forward(&x.to_device(&device).unwrap()).unwrap(),
                &y.to_device(&device).unwrap(),
            )
            .unwrap();
            sgd.backward_step(&l).unwrap();
        }
        let reference = snapshot(&varmap);

        let (init2, data2) = (init.clone(), data.clone());
        let ranks = spawn_with(2, bounded(), move |ctx| {
            let device = gpu(ctx.rank);
            let pg: Arc<dyn ProcessGroup> = Arc::new(NcclGroup::new(ctx.process_group(), &device)?);
            let varmap = on(&init2, &device);
            let mut ddp = DistributedDataParallel::new(
                pg,
                &varmap,
                DType::F32,
                &device,
                |vb| Mlp::new(vb, DDP_SIZES),
                DdpConfig::default(),
            )?;
            let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
            for (x, y) in &data2 {
                let (x, y) = (
                    x.narrow(0, ctx.rank * 4, 4)?.to_device(&device)?,
                    y.narrow(0, ctx.rank * 4, 4)?.to_device(&device)?,
                );
                let l = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                ddp.backward_step(&l, &mut sgd)?;
            }
            Ok(snapshot(&varmap))
        })
        .unwrap();
        assert!(identical(&ranks[0], &ranks[1]), "the ranks drifted apart");
        let diff = max_rel_diff(&ranks[0], &reference);
        assert!(
            diff < 1e-4,
            "{diff}\n{}",
            diff_report(&ranks[0], &reference)
        );
    })
}

#[test]
fn run_on_gpus_gives_every_rank_a_gpu_and_a_group_that_reduces_there() {
    // NCCL's initialisation has no timeout of its own.
    within(180, move || {
        let results = candle_dp::launch::run_on_gpus(2, bounded(), |ctx, device| {
            assert!(ctx.pg.reduces_on_device());
            let x = Tensor::new(&[ctx.rank as f32 + 1.], &device)?;
            let sum = ctx.pg.all_reduce(&x, ReduceOp::Sum)?;
            assert!(sum.device().same_device(&device));
            Ok(sum.to_vec1::<f32>()?)
        })
        .unwrap();
        assert_eq!(results, vec![vec![3.0], vec![3.0]]);
    })
}

/// ZeRO on NCCL: the reduce-scatter's pieces are bitwise slices of the
/// NCCL all-reduce, the flat all-gather is every rank's tensor in order,
/// and ZeRO stage 2 with candle's AdamW trains to the bytes of DDP on NCCL.
#[test]
fn zero_on_nccl_matches_its_all_reduce_and_ddp_bit_for_bit() {
    within(180, move || {
        let init = mlp_init();
        let train = move |zero: Option<candle_dp::zero::ZeroStage>| {
            let init = init.clone();
            spawn_with(2, bounded(), move |ctx| {
                let device = gpu(ctx.rank);
                let pg: Arc<dyn ProcessGroup> =
                    Arc::new(NcclGroup::new(ctx.process_group(), &device)?);
                // The collectives first.
                let x = Tensor::new(&[1.5f32, -2.25, 3.0, 0.125, 7.0], &Device::Cpu)?
                    .affine(ctx.rank as f64 + 1.0, 0.3)?
                    .to_device(&device)?;
                let full = values(&pg.all_reduce(&x, ReduceOp::Sum)?);
                let piece = values(&pg.reduce_scatter(&x, ReduceOp::Sum, &[2, 3])?);
                let start = if ctx.rank == 0 { 0 } else { 2 };
                anyhow::ensure!(
                    piece
                        .iter()
                        .map(|v| v.to_bits())
                        .eq(full[start..start + piece.len()].iter().map(|v| v.to_bits())),
                    "reduce_scatter {piece:?} is not a slice of {full:?}"
                );
                let gathered = values(&pg.all_gather_into(&x)?);
                let all: Vec<f32> = pg.all_gather(&x)?.iter().flat_map(values).collect();
                anyhow::ensure!(
                    gathered == all,
                    "all_gather_into {gathered:?}, all_gather {all:?}"
                );
                // Then training.
                let moved = init
                    .iter()
                    .map(|(n, t)| Ok((n.clone(), t.to_device(&device)?)))
                    .collect::<candle_core::Result<_>>()?;
                let varmap = varmap_from(&moved);
                let mut builder =
                    DistributedDataParallel::builder(pg, &varmap, DType::F32, &device);
                if let Some(stage) = zero {
                    builder = builder.zero(stage);
                }
                let mut ddp = builder.build(|vb| Mlp::new(vb, DDP_SIZES))?;
                let params = candle_nn::ParamsAdamW {
                    lr: 0.01,
                    ..Default::default()
                };
                let mut whole = candle_nn::AdamW::new(varmap.all_vars(), params.clone())?;
                let mut sharded = match zero {
                    Some(_) => Some(candle_dp::zero::ZeroOptimizer::new(&ddp, |mine| {
                        candle_nn::AdamW::new(mine.into_iter().map(|(_, v)| v).collect(), params)
                    })?),
                    None => None,
                };
                for s in 0..5u32 {
                    let x = Tensor::new(
                        (0..4 * DDP_SIZES.0)
                            .map(|i| {
                                ((i as u32 * 37 + s * 11 + ctx.rank as u32 * 5) % 17) as f32 / 8.0
                                    - 1.0
                            })
                            .collect::<Vec<_>>(),
                        &device,
                    )?
                    .reshape((4, DDP_SIZES.0))?;
                    let y = Tensor::new(vec![s % 5, 1, 2, 3], &device)?;
                    let l = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                    let grads = ddp.backward(&l)?;
                    match &mut sharded {
                        Some(opt) => opt.step(&grads)?,
                        None => whole.step(&grads)?,
                    }
                }
                Ok(snapshot(&varmap))
            })
            .unwrap()
        };
        let ddp = train(None);
        let zero = train(Some(candle_dp::zero::ZeroStage::Two));
        assert!(identical(&ddp[0], &ddp[1]), "the DDP ranks drifted apart");
        assert!(
            identical(&zero[0], &zero[1]),
            "the ZeRO ranks drifted apart"
        );
        assert!(
            identical(&zero[0], &ddp[0]),
            "{}",
            diff_report(&zero[0], &ddp[0])
        );
    })
}

#[test]
fn nccl_sub_groups_reduce_on_the_gpu_and_messages_arrive_on_the_receivers_gpu() {
    within(180, move || {
        let seen = spawn_with(4, bounded(), |ctx| {
            let device = gpu(ctx.rank);
            let nccl = NcclGroup::new(ctx.process_group(), &device)?;
            let pair = nccl
                .split(candle_dp::comm::Color::new(ctx.rank as u32 % 2), 0)?
                .expect("a coloured rank gets a group");
            let x = Tensor::new(&[ctx.rank as f32, 1.0], &Device::Cpu)?.to_device(&device)?;
            let sum = pair.all_reduce(&x, ReduceOp::Sum)?;
            assert!(
                sum.device().same_device(&device),
                "the sum stays on the GPU"
            );
            let other = 1 - pair.rank();
            let got = if pair.rank() == 0 {
                pair.send(&x, other)?;
                pair.recv(&x, other)?
            } else {
                let got = pair.recv(&x, other)?;
                pair.send(&x, other)?;
                got
            };
            assert!(
                got.device().same_device(&device),
                "the message lands on the GPU"
            );
            Ok((values(&sum), values(&got)))
        })
        .unwrap();
        assert_eq!(seen[0], (vec![2.0, 2.0], vec![2.0, 1.0]));
        assert_eq!(seen[3], (vec![4.0, 2.0], vec![1.0, 1.0]));
    });
}
