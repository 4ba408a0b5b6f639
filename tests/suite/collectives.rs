//! Collectives of the in-process group: values against a plain sequential
//! computation, bitwise agreement between ranks and runs, and the errors
//! every rank gets for inconsistent calls.
//!
//! Every group runs with a 10 s timeout, so a bug shows up as an error, not
//! as a hung test.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dp::comm::{
    all_gather_object, CommError, FailureCause, GroupOptions, ProcessGroup, ReduceOp, ThreadGroup,
    DEFAULT_RING_THRESHOLD_BYTES,
};
use candle_dp::launch::{spawn_with, RankContext};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
const SIZES: [usize; 4] = [0, 1, 7, 100];
/// `ring_threshold_bytes` that sends every reduction through one path.
const SMALL_PATH: usize = usize::MAX;
const RING_PATH: usize = 0;

fn options(ring_threshold_bytes: usize) -> GroupOptions {
    GroupOptions {
        timeout: Some(Duration::from_secs(10)),
        ring_threshold_bytes,
    }
}

/// Runs `f` on every rank with a 10 s timeout; every rank must succeed.
fn run<T: Send>(
    world: usize,
    ring_threshold_bytes: usize,
    f: impl Fn(RankContext) -> anyhow::Result<T> + Sync,
) -> Vec<T> {
    spawn_with(world, options(ring_threshold_bytes), f).unwrap()
}

/// Small integers in [-16, 16]: every sum over at most 8 ranks is exact in
/// bf16 and f16, so any reduction order gives the sequential result exactly.
fn int_values(rank: usize, len: usize, salt: usize) -> Vec<f64> {
    (0..len)
        .map(|i| ((i * 7 + rank * 13 + salt * 5) % 33) as f64 - 16.0)
        .collect()
}

fn input(rank: usize, len: usize, dtype: DType, salt: usize) -> candle_core::Result<Tensor> {
    Tensor::new(int_values(rank, len, salt), &Device::Cpu)?.to_dtype(dtype)
}

/// Values that do not add up exactly, so the reduction order shows.
fn random_f32(rank: usize, len: usize) -> Vec<f32> {
    let mut state =
        0x9E37_79B9_7F4A_7C15u64 ^ (rank as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn as_f64(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1())
        .unwrap()
}

/// The tensor's elements as bit patterns, to compare results bitwise.
fn bits(t: &Tensor) -> Vec<u64> {
    let flat = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        DType::F64 => flat
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        DType::F16 => flat
            .to_vec1::<f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        DType::U32 => flat
            .to_vec1::<u32>()
            .unwrap()
            .iter()
            .map(|&v| v.into())
            .collect(),
        DType::I64 => flat
            .to_vec1::<i64>()
            .unwrap()
            .iter()
            .map(|&v| v as u64)
            .collect(),
        other => panic!("no bits for {other:?}"),
    }
}

/// `sum / world` computed in `dtype`, as `Avg` documents.
fn divide_in(dtype: DType, sum: f64, world: usize) -> f64 {
    match dtype {
        DType::F32 => (sum as f32 / world as f32) as f64,
        DType::F64 => sum / world as f64,
        DType::BF16 => (bf16::from_f64(sum) / bf16::from_f64(world as f64)).to_f64(),
        DType::F16 => (f16::from_f64(sum) / f16::from_f64(world as f64)).to_f64(),
        other => panic!("no division for {other:?}"),
    }
}

/// The element-wise reduction of [`int_values`] over `world` ranks.
fn expected_reduction(
    world: usize,
    len: usize,
    dtype: DType,
    op: ReduceOp,
    salt: usize,
) -> Vec<f64> {
    let inputs: Vec<Vec<f64>> = (0..world).map(|r| int_values(r, len, salt)).collect();
    (0..len)
        .map(|i| {
            let column = inputs.iter().map(|x| x[i]);
            match op {
                ReduceOp::Sum => column.sum(),
                ReduceOp::Avg => divide_in(dtype, column.sum(), world),
                ReduceOp::Max => column.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => column.fold(f64::INFINITY, f64::min),
            }
        })
        .collect()
}

#[test]
fn all_reduce_matches_a_sequential_reduction_for_every_dtype_op_size_and_world_size() {
    for path in [SMALL_PATH, RING_PATH] {
        for world in 1..=8 {
            let results = run(world, path, |ctx| {
                let mut out = Vec::new();
                for dtype in DTYPES {
                    for op in OPS {
                        for len in SIZES {
                            out.push(ctx.pg.all_reduce(&input(ctx.rank, len, dtype, 0)?, op)?);
                        }
                    }
                }
                Ok(out)
            });
            let mut case = 0;
            for dtype in DTYPES {
                for op in OPS {
                    for len in SIZES {
                        let expected = expected_reduction(world, len, dtype, op, 0);
                        for (rank, result) in results.iter().enumerate() {
                            let t = &result[case];
                            let at = format!("world {world}, path {path}, {dtype:?} {op:?} len {len}, rank {rank}");
                            assert_eq!(t.dtype(), dtype, "{at}");
                            assert_eq!(t.dims(), &[len], "{at}");
                            assert_eq!(as_f64(t), expected, "{at}");
                            assert_eq!(bits(t), bits(&results[0][case]), "{at}");
                        }
                        case += 1;
                    }
                }
            }
        }
    }
}

#[test]
fn all_reduce_keeps_the_shape_dtype_and_device_of_any_tensor() {
    let results = run(3, SMALL_PATH, |ctx| {
        let mut out = Vec::new();
        for dims in [&[][..], &[2, 3, 4], &[0, 5], &[4, 1]] {
            let len = dims.iter().product();
            let x = input(ctx.rank, len, DType::F32, 1)?.reshape(dims)?;
            out.push((x.clone(), ctx.pg.all_reduce(&x, ReduceOp::Sum)?));
        }
        Ok(out)
    });
    for (x, y) in &results[0] {
        assert_eq!(y.dims(), x.dims());
        assert_eq!(y.dtype(), x.dtype());
        assert!(y.device().same_device(x.device()));
    }
}

#[test]
fn all_reduce_of_a_large_buffer_not_divisible_by_world_size_matches_the_sequential_sum() {
    const LEN: usize = 1_000_003;
    for world in [3, 8] {
        // Default options: 4 MB is far above the ring threshold.
        let results = spawn_with(
            world,
            GroupOptions {
                timeout: Some(Duration::from_secs(60)),
                ..GroupOptions::default()
            },
            |ctx| {
                Ok(ctx
                    .pg
                    .all_reduce(&input(ctx.rank, LEN, DType::F32, 2)?, ReduceOp::Sum)?)
            },
        )
        .unwrap();
        let expected = expected_reduction(world, LEN, DType::F32, ReduceOp::Sum, 2);
        assert_eq!(as_f64(&results[0]), expected, "world {world}");
        for result in &results[1..] {
            assert_eq!(bits(result), bits(&results[0]), "world {world}");
        }
    }
}

/// The reduction order `ThreadGroup` documents, for `Sum` of f32.
fn documented_sum(inputs: &[Vec<f32>], ring: bool) -> Vec<f32> {
    let world = inputs.len();
    let len = inputs[0].len();
    let chunk_of = |i: usize| {
        (0..world)
            .find(|&c| {
                let start = |c: usize| c * (len / world) + c.min(len % world);
                (start(c)..start(c + 1)).contains(&i)
            })
            .unwrap()
    };
    (0..len)
        .map(|i| {
            // Small path: ranks 0, 1, …; ring: chunk c starts on rank c+1.
            let first = if ring { (chunk_of(i) + 1) % world } else { 0 };
            let mut acc = inputs[first][i];
            for step in 1..world {
                acc += inputs[(first + step) % world][i];
            }
            acc
        })
        .collect()
}

#[test]
fn sums_follow_the_documented_reduction_order_bit_for_bit_on_both_paths() {
    const LEN: usize = 1001;
    for world in [2, 3, 5, 8] {
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| random_f32(r, LEN)).collect();
        for (path, ring) in [(SMALL_PATH, false), (RING_PATH, true)] {
            let results = run(world, path, |ctx| {
                let x = Tensor::new(random_f32(ctx.rank, LEN), &Device::Cpu)?;
                Ok(ctx.pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?)
            });
            let expected = documented_sum(&inputs, ring);
            for result in &results {
                let got: Vec<u32> = result.iter().map(|v| v.to_bits()).collect();
                let want: Vec<u32> = expected.iter().map(|v| v.to_bits()).collect();
                assert!(got == want, "world {world}, ring {ring}");
            }
        }
    }
}

#[test]
fn results_are_bitwise_identical_on_every_rank_and_across_runs() {
    const LEN: usize = 5003;
    let run_once = |path| {
        run(6, path, |ctx| {
            let x = Tensor::new(random_f32(ctx.rank, LEN), &Device::Cpu)?;
            let mut out = Vec::new();
            for dtype in DTYPES {
                for op in OPS {
                    out.push(bits(&ctx.pg.all_reduce(&x.to_dtype(dtype)?, op)?));
                }
            }
            Ok(out)
        })
    };
    for path in [SMALL_PATH, RING_PATH] {
        let first = run_once(path);
        let second = run_once(path);
        assert!(first.iter().all(|rank| *rank == first[0]), "ranks differ");
        assert_eq!(first, second, "runs differ");
    }
}

#[test]
fn integer_all_reduce_sums_and_takes_extremes_exactly() {
    let results = run(4, SMALL_PATH, |ctx| {
        let r = ctx.rank as u32;
        let u = Tensor::new(&[r, 10 * r, u32::MAX - 3 + r], &Device::Cpu)?;
        let i = Tensor::new(&[-(ctx.rank as i64), 1 << 40], &Device::Cpu)?;
        Ok((
            ctx.pg.all_reduce(&u, ReduceOp::Max)?.to_vec1::<u32>()?,
            ctx.pg.all_reduce(&u, ReduceOp::Min)?.to_vec1::<u32>()?,
            ctx.pg.all_reduce(&i, ReduceOp::Sum)?.to_vec1::<i64>()?,
            ctx.pg.all_reduce(&i, ReduceOp::Avg)?.to_vec1::<i64>()?,
        ))
    });
    for (max, min, sum, avg) in results {
        assert_eq!(max, vec![3, 30, u32::MAX]);
        assert_eq!(min, vec![0, 0, u32::MAX - 3]);
        assert_eq!(sum, vec![-6, 4 << 40]);
        assert_eq!(avg, vec![-1, 1 << 40]);
    }
}

/// One rank's results for every rooted and gathering collective, for one
/// dtype and size.
struct Outputs {
    broadcast: Vec<Tensor>,
    all_gather: Vec<Tensor>,
    gather: Vec<Option<Vec<Tensor>>>,
    scatter: Vec<Tensor>,
    reduce: Vec<Vec<Option<Tensor>>>,
    all_reduce: Vec<Tensor>,
}

#[test]
fn broadcast_gather_scatter_and_reduce_match_the_sequential_result_for_every_root() {
    for path in [SMALL_PATH, RING_PATH] {
        for world in 1..=8 {
            let results = run(world, path, |ctx| {
                let pg = &ctx.pg;
                let mut cases = Vec::new();
                for dtype in DTYPES {
                    for len in [0, 1, 7] {
                        let x = input(ctx.rank, len, dtype, 3)?;
                        let mut out = Outputs {
                            broadcast: Vec::new(),
                            all_gather: pg.all_gather(&x)?,
                            gather: Vec::new(),
                            scatter: Vec::new(),
                            reduce: Vec::new(),
                            all_reduce: Vec::new(),
                        };
                        for root in 0..world {
                            out.broadcast.push(pg.broadcast(&x, root)?);
                            out.gather.push(pg.gather(&x, root)?);
                            // The root sends rank i the tensor rank i would make with salt 4.
                            let pieces = (0..world)
                                .map(|i| input(i, len, dtype, 4))
                                .collect::<candle_core::Result<Vec<_>>>()?;
                            let mine = (ctx.rank == root).then_some(pieces.as_slice());
                            out.scatter.push(pg.scatter(mine, root)?);
                            out.reduce.push(
                                OPS.iter()
                                    .map(|&op| pg.reduce(&x, root, op))
                                    .collect::<Result<_, _>>()?,
                            );
                        }
                        for op in OPS {
                            out.all_reduce.push(pg.all_reduce(&x, op)?);
                        }
                        cases.push((dtype, len, out));
                    }
                }
                Ok(cases)
            });
            for (rank, cases) in results.iter().enumerate() {
                for (dtype, len, out) in cases {
                    let at =
                        format!("world {world}, path {path}, {dtype:?} len {len}, rank {rank}");
                    let inputs: Vec<Vec<f64>> =
                        (0..world).map(|r| int_values(r, *len, 3)).collect();
                    let gathered: Vec<Vec<f64>> = out.all_gather.iter().map(as_f64).collect();
                    assert_eq!(gathered, inputs, "all_gather, {at}");
                    for root in 0..world {
                        assert_eq!(
                            as_f64(&out.broadcast[root]),
                            inputs[root],
                            "broadcast {root}, {at}"
                        );
                        assert_eq!(out.broadcast[root].dtype(), *dtype, "{at}");
                        match &out.gather[root] {
                            Some(all) if rank == root => {
                                let all: Vec<_> = all.iter().map(as_f64).collect();
                                assert_eq!(all, inputs, "gather {root}, {at}");
                            }
                            None if rank != root => {}
                            other => panic!("gather to {root} gave {other:?} at {at}"),
                        }
                        assert_eq!(
                            as_f64(&out.scatter[root]),
                            int_values(rank, *len, 4),
                            "scatter {root}, {at}"
                        );
                        for (o, op) in OPS.iter().enumerate() {
                            match &out.reduce[root][o] {
                                Some(t) if rank == root => {
                                    // Bitwise the all_reduce result.
                                    assert_eq!(
                                        bits(t),
                                        bits(&out.all_reduce[o]),
                                        "reduce {op:?} to {root}, {at}"
                                    );
                                    let expected = expected_reduction(world, *len, *dtype, *op, 3);
                                    assert_eq!(
                                        as_f64(t),
                                        expected,
                                        "reduce {op:?} to {root}, {at}"
                                    );
                                }
                                None if rank != root => {}
                                other => panic!("reduce to {root} gave {other:?} at {at}"),
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn results_do_not_share_storage_with_inputs() {
    // A Var's tensor can be updated in place; a result aliasing it would change too.
    let results = run(2, SMALL_PATH, |ctx| {
        let var = candle_core::Var::new(&[ctx.rank as f32 + 1.0], &Device::Cpu)?;
        let broadcast = ctx.pg.broadcast(var.as_tensor(), 0)?;
        let gathered = ctx.pg.all_gather(var.as_tensor())?;
        var.set(&Tensor::new(&[100f32], &Device::Cpu)?)?;
        Ok((
            broadcast.to_vec1::<f32>()?,
            gathered[ctx.rank].to_vec1::<f32>()?,
        ))
    });
    assert_eq!(
        results,
        vec![(vec![1.0], vec![1.0]), (vec![1.0], vec![2.0])]
    );
}

#[test]
fn large_reductions_of_views_and_of_tensors_sharing_storage_match_the_sequential_result() {
    // Contiguous CPU tensors are read in place, from their start offset and
    // under one lock per storage when ranks share one; others are copied.
    const LEN: usize = 1000;
    for world in [2, 3] {
        // Every rank's values side by side in one storage.
        let all: Vec<f64> = (0..world).flat_map(|r| int_values(r, LEN, 6)).collect();
        let shared = Tensor::new(all.clone(), &Device::Cpu).unwrap();
        let root = world - 1;
        let results = run(world, RING_PATH, |ctx| {
            let x = input(ctx.rank, LEN, DType::F64, 6)?;
            let padded = Tensor::cat(&[&x.narrow(0, 0, 3)?, &x, &x.narrow(0, 0, 5)?], 0)?;
            let strided = Tensor::stack(&[&x, &x], 1)?.narrow(1, 0, 1)?.squeeze(1)?;
            anyhow::ensure!(!strided.is_contiguous());
            let views = [
                padded.narrow(0, 3, LEN)?,
                strided,
                shared.narrow(0, ctx.rank * LEN, LEN)?,
            ];
            let mut all_reduced = Vec::new();
            let mut reduced = Vec::new();
            for view in &views {
                for op in OPS {
                    all_reduced.push(ctx.pg.all_reduce(view, op)?);
                    reduced.push(ctx.pg.reduce(view, root, op)?);
                }
            }
            // The very same tensor on every rank.
            let doubled = ctx.pg.all_reduce(&shared, ReduceOp::Sum)?;
            Ok((all_reduced, reduced, doubled))
        });
        for (rank, (all_reduced, reduced, doubled)) in results.iter().enumerate() {
            let expected = OPS.map(|op| expected_reduction(world, LEN, DType::F64, op, 6));
            for (case, (sum, reduced)) in all_reduced.iter().zip(reduced).enumerate() {
                let at = format!("world {world}, rank {rank}, view {}", case / OPS.len());
                assert_eq!(as_f64(sum), expected[case % OPS.len()], "{at}");
                assert_eq!(bits(sum), bits(&results[0].0[case]), "{at}");
                match reduced {
                    Some(t) if rank == root => assert_eq!(bits(t), bits(sum), "{at}"),
                    None if rank != root => {}
                    other => panic!("reduce gave {other:?} at {at}"),
                }
            }
            let times_world: Vec<f64> = all.iter().map(|v| v * world as f64).collect();
            assert_eq!(as_f64(doubled), times_world, "world {world}, rank {rank}");
        }
    }
}

/// Parts of a bucket as DDP hands them over: of several shapes, one empty,
/// one a strided view, one a window into a larger storage; their lengths do
/// not line up with the ring's chunks.
fn bucket_parts(rank: usize) -> candle_core::Result<Vec<Tensor>> {
    let values = |len, salt| Tensor::new(random_f32(rank * 7 + salt, len), &Device::Cpu);
    let strided = values(2 * 333, 1)?.reshape((333, 2))?.narrow(1, 0, 1)?;
    let window = values(1000, 2)?.narrow(0, 17, 901)?;
    Ok(vec![
        values(5 * 41, 3)?.reshape((5, 41))?,
        Tensor::zeros(0, DType::F32, &Device::Cpu)?,
        strided,
        window,
        values(3, 4)?,
    ])
}

#[test]
fn all_reduce_concat_is_bitwise_all_reduce_of_the_concatenation_on_both_paths() {
    for world in [1, 2, 3, 4] {
        for threshold in [SMALL_PATH, RING_PATH] {
            let results = run(world, threshold, |ctx| {
                let parts = bucket_parts(ctx.rank)?;
                let flat: Vec<Tensor> = parts
                    .iter()
                    .map(Tensor::flatten_all)
                    .collect::<candle_core::Result<_>>()?;
                let cat = Tensor::cat(&flat, 0)?;
                let mut pairs = Vec::new();
                for op in OPS {
                    let concat = ctx.pg.all_reduce_concat(&parts, op)?;
                    pairs.push((concat, ctx.pg.all_reduce(&cat, op)?));
                }
                Ok(pairs)
            });
            for (rank, pairs) in results.iter().enumerate() {
                for ((concat, reference), op) in pairs.iter().zip(OPS) {
                    let at = format!("world {world}, threshold {threshold}, rank {rank}, {op:?}");
                    assert_eq!(concat.dims(), reference.dims(), "{at}");
                    assert_eq!(bits(concat), bits(reference), "{at}");
                }
            }
        }
    }
}

#[test]
fn all_reduce_concat_of_differing_dtypes_is_an_error_on_every_rank() {
    for threshold in [SMALL_PATH, RING_PATH] {
        let result = spawn_with(3, options(threshold), |ctx| {
            let mut parts = bucket_parts(ctx.rank)?;
            if ctx.rank == 1 {
                parts[0] = parts[0].to_dtype(DType::F64)?;
            }
            let err = ctx
                .pg
                .all_reduce_concat(&parts, ReduceOp::Sum)
                .expect_err("f64 among f32 parts");
            Ok(err.to_string())
        });
        match (threshold, result) {
            // The ring agrees on the error through the header exchange.
            (RING_PATH, Ok(messages)) => {
                for (rank, message) in messages.iter().enumerate() {
                    assert!(
                        message.contains("rank 1") && message.contains("f64"),
                        "rank {rank}: {message}"
                    );
                }
            }
            // Copying into one buffer fails on rank 1 alone, which then fails
            // the group so that no rank waits for it.
            (SMALL_PATH, Err(err)) => {
                let message = err.to_string();
                assert!(
                    message.contains("rank 1") && message.contains("cannot concatenate"),
                    "{message}"
                );
            }
            (_, other) => panic!("threshold {threshold}: {other:?}"),
        }
    }
}

#[test]
fn a_rank_may_overwrite_its_input_as_soon_as_a_large_reduction_returns() {
    // The ranks read each other's inputs in place: none returns before the
    // others are done with its input (with two ranks, the root of `reduce`
    // reads both inputs while the other rank has nothing to compute).
    const LEN: usize = 1_000_000;
    const ROUNDS: usize = 3;
    for world in [2, 3] {
        let results = run(world, RING_PATH, |ctx| {
            let var = candle_core::Var::from_tensor(&input(ctx.rank, LEN, DType::F32, 0)?)?;
            let mut sums = Vec::new();
            for round in 0..ROUNDS {
                let salt = 2 * round;
                let next = input(ctx.rank, LEN, DType::F32, salt + 1)?;
                sums.push(Some(ctx.pg.all_reduce(var.as_tensor(), ReduceOp::Sum)?));
                var.set(&next)?;
                let next = input(ctx.rank, LEN, DType::F32, salt + 2)?;
                sums.push(ctx.pg.reduce(var.as_tensor(), 0, ReduceOp::Sum)?);
                var.set(&next)?;
            }
            Ok(sums)
        });
        for (rank, sums) in results.iter().enumerate() {
            for (salt, sum) in sums.iter().enumerate() {
                let at = format!("world {world}, rank {rank}, salt {salt}");
                match sum {
                    Some(sum) => {
                        let expected =
                            expected_reduction(world, LEN, DType::F32, ReduceOp::Sum, salt);
                        assert!(as_f64(sum) == expected, "{at}");
                    }
                    None => assert!(rank != 0 && salt % 2 == 1, "{at}"),
                }
            }
        }
    }
}

#[test]
fn barrier_and_all_gather_bytes_of_different_lengths_complete_on_every_rank() {
    let results = run(5, SMALL_PATH, |ctx| {
        ctx.pg.barrier()?;
        let bytes = vec![ctx.rank as u8; ctx.rank];
        Ok(ctx.pg.all_gather_bytes(bytes)?)
    });
    let expected: Vec<Vec<u8>> = (0..5).map(|r| vec![r as u8; r]).collect();
    assert!(results.iter().all(|r| *r == expected));
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Stats {
    rank: usize,
    loss: f64,
    tags: Vec<String>,
}

#[test]
fn all_gather_object_returns_every_ranks_struct_in_rank_order() {
    let stats = |rank: usize| Stats {
        rank,
        loss: 0.5 * rank as f64,
        tags: vec![format!("r{rank}"); rank],
    };
    let results = run(4, SMALL_PATH, |ctx| {
        Ok(all_gather_object(ctx.pg.as_ref(), &stats(ctx.rank))?)
    });
    let expected: Vec<Stats> = (0..4).map(stats).collect();
    assert!(results.iter().all(|r| *r == expected));
}

/// A value that serializes on every rank but rank 1, as one holding
/// something the encoder refuses would.
#[derive(Debug)]
struct RefusedOnRank1(usize);

impl serde::Serialize for RefusedOnRank1 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == 1 {
            return Err(serde::ser::Error::custom(
                "rank 1's value cannot be encoded",
            ));
        }
        s.serialize_u64(self.0 as u64)
    }
}

impl<'de> serde::Deserialize<'de> for RefusedOnRank1 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        u64::deserialize(d).map(|v| RefusedOnRank1(v as usize))
    }
}

#[test]
fn all_gather_object_reports_a_value_that_fails_to_serialize_on_every_rank() {
    let results = run(3, SMALL_PATH, |ctx| {
        let pg: &dyn ProcessGroup = ctx.pg.as_ref();
        let err = all_gather_object(pg, &RefusedOnRank1(ctx.rank)).unwrap_err();
        // The group is still usable.
        pg.barrier()?;
        Ok(err)
    });
    for (rank, err) in results.iter().enumerate() {
        assert!(
            matches!(err, CommError::InvalidInput { rank: r, culprit: 1, .. } if *r == rank),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains("invalid input on rank 1"), "{msg}");
        assert!(msg.contains("cannot be encoded"), "{msg}");
    }
}

/// Runs `f` on every rank and returns each rank's error.
fn errors(
    world: usize,
    f: impl Fn(&RankContext) -> Result<(), CommError> + Sync,
) -> Vec<CommError> {
    run(world, DEFAULT_RING_THRESHOLD_BYTES, |ctx| {
        let err = f(&ctx).expect_err("the collective should fail");
        // The group is still usable after an error every rank agreed on.
        let one = Tensor::new(&[1f32], &Device::Cpu)?;
        let sum = ctx.pg.all_reduce(&one, ReduceOp::Sum)?;
        anyhow::ensure!(sum.to_vec1::<f32>()? == [world as f32]);
        Ok(err)
    })
}

#[test]
fn mismatched_shapes_give_every_rank_an_error_naming_the_odd_rank_and_leave_the_group_usable() {
    let errs = errors(4, |ctx| {
        let len = if ctx.rank == 2 { 4 } else { 3 };
        ctx.pg.all_reduce(
            &Tensor::zeros(len, DType::F32, &Device::Cpu).unwrap(),
            ReduceOp::Sum,
        )?;
        Ok(())
    });
    for (rank, err) in errs.iter().enumerate() {
        match err {
            CommError::TensorMismatch { rank: r, ranks, .. } => {
                assert_eq!((*r, ranks.as_slice()), (rank, &[2][..]));
            }
            other => panic!("unexpected error {other}"),
        }
        assert_eq!(
            err.to_string(),
            format!("rank {rank}: all_reduce: the ranks' tensors differ: rank(s) [0, 1, 3]: f32 [3]; rank(s) [2]: f32 [4]")
        );
    }
}

#[test]
fn mismatched_dtypes_give_every_rank_an_error_naming_the_odd_ranks() {
    for ring in [false, true] {
        let errs = errors(3, |ctx| {
            let dtype = if ctx.rank == 0 {
                DType::F32
            } else {
                DType::F64
            };
            // With 10 000 elements the f64 ranks would take the ring and the
            // f32 rank not: the header exchange must still agree on the error.
            let len = if ring { 10_000 } else { 2 };
            let x = Tensor::zeros(len, dtype, &Device::Cpu).unwrap();
            ctx.pg.all_gather(&x)?;
            ctx.pg.all_reduce(&x, ReduceOp::Sum)?;
            Ok(())
        });
        for err in errs {
            assert!(
                matches!(&err, CommError::TensorMismatch { ranks, .. } if ranks == &[1, 2]),
                "{err}"
            );
        }
    }
}

#[test]
fn ranks_calling_different_collectives_all_get_an_error_naming_them() {
    let errs = errors(3, |ctx| {
        let x = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        match ctx.rank {
            1 => ctx.pg.barrier(),
            2 => ctx.pg.broadcast(&x, 1).map(drop),
            _ => ctx.pg.broadcast(&x, 0).map(drop),
        }
    });
    for err in errs {
        assert!(
            matches!(&err, CommError::OpMismatch { ranks, .. } if ranks == &[1, 2]),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("rank(s) [1]: barrier; rank(s) [2]: broadcast(root=1)"),
            "{text}"
        );
    }
}

#[test]
fn a_root_out_of_range_is_reported_on_every_rank() {
    let errs = errors(2, |ctx| {
        let x = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        ctx.pg.reduce(&x, 2, ReduceOp::Sum).map(drop)
    });
    for err in errs {
        assert!(
            matches!(err, CommError::InvalidInput { culprit: 0, .. }),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("root 2 is out of range for world size 2"),
            "{err}"
        );
    }
}

#[test]
fn scatter_with_the_wrong_number_of_tensors_is_reported_on_every_rank() {
    let errs = errors(3, |ctx| {
        let pieces = vec![Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap(); 2];
        let mine = (ctx.rank == 1).then_some(pieces.as_slice());
        ctx.pg.scatter(mine, 1).map(drop)
    });
    for err in errs {
        assert!(
            matches!(err, CommError::InvalidInput { culprit: 1, .. }),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("the root passed 2 tensors for 3 ranks"),
            "{err}"
        );
    }
}

#[test]
fn an_unsupported_dtype_is_reported_on_every_rank() {
    let errs = errors(2, |ctx| {
        let x = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let x = if ctx.rank == 1 {
            x.to_dtype(DType::F8E4M3).unwrap()
        } else {
            x
        };
        ctx.pg.broadcast(&x, 1).map(drop)
    });
    for err in errs {
        assert!(
            matches!(err, CommError::InvalidInput { culprit: 1, .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("dtype f8e4m3 is not supported"),
            "{err}"
        );
    }
}

#[test]
fn a_timeout_names_the_rank_that_did_not_arrive_and_fails_the_group() {
    let mut ranks = ThreadGroup::with_options(
        2,
        GroupOptions {
            timeout: Some(Duration::from_millis(50)),
            ..GroupOptions::default()
        },
    );
    let late = ranks.pop().unwrap();
    let early = ranks.pop().unwrap();
    let (timed_out, go) = mpsc::channel();
    let late_err = thread::spawn(move || {
        // Arrives only after rank 0 has given up.
        go.recv().unwrap();
        late.barrier().unwrap_err()
    });
    let err = early.barrier().unwrap_err();
    timed_out.send(()).unwrap();
    match &err {
        CommError::Timeout {
            rank: 0,
            op: "barrier",
            missing,
            timeout,
        } => {
            assert_eq!(missing, &[1]);
            assert_eq!(*timeout, Duration::from_millis(50));
        }
        other => panic!("unexpected error {other}"),
    }
    let late_err = late_err.join().unwrap();
    match &late_err {
        CommError::GroupFailed {
            rank: 1, failure, ..
        } => {
            assert_eq!(failure.rank, 0);
            assert_eq!(
                failure.cause,
                FailureCause::TimedOut {
                    op: "barrier",
                    missing: vec![1]
                }
            );
        }
        other => panic!("unexpected error {other}"),
    }
    assert_eq!(
        late_err.to_string(),
        "rank 1: barrier failed because rank 0 timed out in barrier waiting for rank(s) [1]"
    );
}

#[test]
fn a_group_of_zero_ranks_has_no_handles() {
    assert!(ThreadGroup::new(0).is_empty());
}

#[test]
fn set_timeout_replaces_the_groups_timeout_for_this_rank() {
    let ranks = ThreadGroup::with_options(1, options(SMALL_PATH));
    assert_eq!(ranks[0].timeout(), Some(Duration::from_secs(10)));
    ranks[0].set_timeout(None);
    assert_eq!(ranks[0].timeout(), None);
    // A single rank never waits.
    ranks[0].barrier().unwrap();
}

/// Every collective of a group of one rank returns its own values as fresh
/// tensors, where they lie (DDP, ZeRO and FSDP at world size 1 on a GPU
/// then never pass through host memory), and a failed group is reported.
#[test]
fn one_ranks_collectives_return_fresh_copies_and_see_a_failed_group() {
    let pg = ThreadGroup::new(1).remove(0);
    let a = Tensor::new(&[[1f32, -2.5], [3., 4.]], &Device::Cpu).unwrap();
    let var = candle_core::Var::from_tensor(&a).unwrap();
    let x = var.as_tensor().clone();
    let results = vec![
        ("all_reduce", pg.all_reduce(&x, ReduceOp::Avg).unwrap()),
        ("broadcast", pg.broadcast(&x, 0).unwrap()),
        ("all_gather", pg.all_gather(&x).unwrap().remove(0)),
        (
            "reduce_scatter",
            pg.reduce_scatter(&x, ReduceOp::Sum, &[4]).unwrap(),
        ),
        ("all_gather_into", pg.all_gather_into(&x).unwrap()),
    ];
    // The input changes afterwards: no result may share its storage.
    var.set(&a.zeros_like().unwrap()).unwrap();
    for (op, out) in results {
        let got = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, [1., -2.5, 3., 4.], "{op}");
    }
    assert!(pg.broadcast(&x, 1).is_err(), "root 1 of a group of one");
    pg.abort("gone");
    assert!(pg.all_reduce(&x, ReduceOp::Sum).is_err());
    assert!(pg.broadcast(&x, 0).is_err());
    assert!(pg.all_gather(&x).is_err());
}

/// One rank's `all_reduce_concat` is its own values, as a fresh tensor
/// (the reduction of one buffer, which DDP at world size 1 reduces every
/// step), and a failed group is still reported.
#[test]
fn all_reduce_concat_on_one_rank_is_a_fresh_concatenation_and_sees_a_failed_group() {
    let pg = ThreadGroup::new(1).remove(0);
    let a = Tensor::new(&[[1f32, -2.5], [3., 4.]], &Device::Cpu).unwrap();
    let b = Tensor::new(&[f32::NAN], &Device::Cpu).unwrap();
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        let out = pg.all_reduce_concat(&[a.clone(), b.clone()], op).unwrap();
        let got = out.to_vec1::<f32>().unwrap();
        assert_eq!(&got[..4], [1., -2.5, 3., 4.], "{op}");
        assert!(got[4].is_nan(), "{op}");
        // One tensor alone: a copy, not the input (which changes after).
        let var = candle_core::Var::from_tensor(&a).unwrap();
        let alone = pg
            .all_reduce_concat(&[var.as_tensor().clone()], op)
            .unwrap();
        var.set(&a.zeros_like().unwrap()).unwrap();
        assert_eq!(alone.to_vec1::<f32>().unwrap(), [1., -2.5, 3., 4.], "{op}");
    }
    pg.abort("gone");
    assert!(pg.all_reduce_concat(&[a], ReduceOp::Sum).is_err());
}
