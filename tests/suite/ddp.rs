//! DistributedDataParallel on thread ranks: equivalence with single-device
//! training, no_sync, buffers, unused parameters, hooks, join, faults.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use candle_dp::comm::{
    Failure, GroupOptions, Membership, ProcessGroup, ReduceOp, Result as CommResult,
};
use candle_dp::launch::{spawn_with, LaunchError};
use candle_dp::{CommHook, DdpConfig, DistributedDataParallel, JoinDivisor};
use candle_nn::{linear, loss, AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use common::*;

/// Every test's group gives up after 20 s instead of hanging.
fn bounded() -> GroupOptions {
    GroupOptions {
        timeout: Some(Duration::from_secs(20)),
        ..Default::default()
    }
}

const SIZES: (usize, usize, usize) = DDP_SIZES;

fn batches(steps: usize, rows: usize) -> Vec<(Tensor, Tensor)> {
    (0..steps)
        .map(|s| {
            let x = Tensor::randn(0f32, 1., (rows, SIZES.0), &Device::Cpu).unwrap();
            let y = Tensor::from_vec(
                (0..rows as u32).map(|i| (i * 3 + s as u32) % 5).collect(),
                rows,
                &Device::Cpu,
            )
            .unwrap();
            (x, y)
        })
        .collect()
}

fn init_mlp() -> HashMap<String, Tensor> {
    let varmap = VarMap::new();
    Mlp::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        SIZES,
    )
    .unwrap();
    snapshot(&varmap)
}

/// A rank's group as DDP sees it: the thread rank itself, or wrapped.
type Wrap = fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup>;

fn as_is(pg: Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> {
    pg
}

/// A thread rank that says it reduces on the GPUs, as an `NcclGroup` does:
/// DDP then sums the gradients' presence flags once per step on the host
/// instead of carrying them in every bucket. Everything else is the thread
/// rank's, so that path runs and is checked on CPU.
#[derive(Debug)]
struct FlagsApart {
    inner: Arc<dyn ProcessGroup>,
    /// The element count of every all-reduce, in call order.
    all_reduces: std::sync::Mutex<Vec<usize>>,
}

impl FlagsApart {
    fn new(inner: Arc<dyn ProcessGroup>) -> Self {
        Self {
            inner,
            all_reduces: Default::default(),
        }
    }
}

fn flags_apart(pg: Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> {
    Arc::new(FlagsApart::new(pg))
}

impl ProcessGroup for FlagsApart {
    fn membership(&self) -> &Membership {
        self.inner.membership()
    }
    fn reduces_on_device(&self) -> bool {
        true
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> CommResult<Tensor> {
        self.all_reduces.lock().unwrap().push(t.elem_count());
        self.inner.all_reduce(t, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> CommResult<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn all_gather(&self, t: &Tensor) -> CommResult<Vec<Tensor>> {
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

/// Trains on `world` ranks, rank r taking rows `r*b..(r+1)*b` of every
/// global batch, each rank's group passed through `wrap`.
fn ddp_train_over(
    init: &HashMap<String, Tensor>,
    data: &[(Tensor, Tensor)],
    world: usize,
    adamw: bool,
    wrap: Wrap,
) -> Vec<HashMap<String, Tensor>> {
    spawn_with(world, bounded(), move |mut ctx| {
        ctx.pg = wrap(ctx.pg);
        // Every rank starts from its own random init: construction must broadcast rank 0's.
        let varmap = if ctx.rank == 0 {
            varmap_from(init)
        } else {
            VarMap::new()
        };
        let mut ddp = mlp_ddp(&ctx, &varmap, DdpConfig::default())?;
        let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
        let mut adam = AdamW::new(
            varmap.all_vars(),
            ParamsAdamW {
                lr: 0.01,
                ..Default::default()
            },
        )?;
        for (x, y) in data {
            let b = x.dim(0)? / world;
            let (x, y) = (x.narrow(0, ctx.rank * b, b)?, y.narrow(0, ctx.rank * b, b)?);
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            if adamw {
                ddp.backward_step(&loss, &mut adam)?;
            } else {
                ddp.backward_step(&loss, &mut sgd)?;
            }
        }
        Ok(snapshot(&varmap))
    })
    .unwrap()
}

#[test]
fn ddp_on_1_to_4_ranks_matches_single_device_training_of_the_global_batch() {
    matches_single_device_over(as_is);
}

#[test]
fn with_presence_flags_summed_on_the_host_ddp_still_matches_single_device_training() {
    matches_single_device_over(flags_apart);
}

fn matches_single_device_over(wrap: Wrap) {
    let init = init_mlp();
    let data = batches(10, 12);
    for adamw in [false, true] {
        let reference = single_device_mlp(&init, &data, adamw);
        for world in 1..=4 {
            let ranks = ddp_train_over(&init, &data, world, adamw, wrap);
            for (rank, got) in ranks.iter().enumerate() {
                assert!(
                    identical(got, &ranks[0]),
                    "world {world}: rank {rank} drifted from rank 0"
                );
            }
            let diff = max_rel_diff(&ranks[0], &reference);
            assert!(
                diff < 1e-5,
                "world {world} adamw {adamw}: {diff}\n{}",
                diff_report(&ranks[0], &reference)
            );
        }
    }
}

#[test]
fn no_sync_over_k_steps_matches_one_step_on_k_times_the_batch() {
    let init = init_mlp();
    let (world, k, micro) = (2, 3, 2);
    let data = batches(4, world * k * micro);
    let reference = single_device_mlp(&init, &data, false);
    let ranks = spawn_with(world, bounded(), |ctx| {
        let varmap = varmap_from(&init);
        let mut ddp = mlp_ddp(&ctx, &varmap, DdpConfig::default())?;
        let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
        for (x, y) in &data {
            let part = |m: usize| -> candle_core::Result<(Tensor, Tensor)> {
                let start = (m * world + ctx.rank) * micro;
                Ok((x.narrow(0, start, micro)?, y.narrow(0, start, micro)?))
            };
            ddp.no_sync(|ddp| -> anyhow::Result<()> {
                for m in 0..k - 1 {
                    let (x, y) = part(m)?;
                    let loss = (loss::cross_entropy(&ddp.forward(&x)?, &y)? / k as f64)?;
                    let grads = ddp.backward(&loss)?;
                    assert!(
                        grads.get_ids().next().is_none(),
                        "no_sync returns no gradients"
                    );
                }
                Ok(())
            })?;
            let (x, y) = part(k - 1)?;
            let loss = (loss::cross_entropy(&ddp.forward(&x)?, &y)? / k as f64)?;
            ddp.backward_step(&loss, &mut sgd)?;
        }
        Ok(snapshot(&varmap))
    })
    .unwrap();
    assert!(identical(&ranks[0], &ranks[1]));
    let diff = max_rel_diff(&ranks[0], &reference);
    assert!(
        diff < 1e-5,
        "{diff}\n{}",
        diff_report(&ranks[0], &reference)
    );
}

#[test]
fn a_model_that_differs_across_ranks_is_an_error_naming_the_rank_and_var() {
    let err = spawn_with(3, bounded(), |ctx| {
        let width = if ctx.rank == 2 { 17 } else { 16 };
        let varmap = VarMap::new();
        DistributedDataParallel::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            |vb| Mlp::new(vb, (6, width, 5)),
            DdpConfig::default(),
        )?;
        Ok(())
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("rank 2")
            && msg.contains("l1.bias")
            && msg.contains("[17]")
            && msg.contains("[16]"),
        "{msg}"
    );
}

/// Two heads: `a` used by every rank, `b` only by rank 1, `c` by nobody.
struct Heads {
    a: Linear,
    b: Linear,
    _c: Linear,
}

#[test]
fn parameters_unused_on_some_ranks_average_as_zero_and_unused_everywhere_get_no_gradient() {
    unused_parameters_over(as_is);
}

#[test]
fn with_presence_flags_summed_on_the_host_unused_parameters_are_still_told_apart() {
    unused_parameters_over(flags_apart);
}

#[test]
fn a_group_that_reduces_on_device_gets_the_presence_flags_in_one_host_call_per_step() {
    let init = init_mlp();
    let params = init.len();
    let elements: usize = init.values().map(Tensor::elem_count).sum();
    let calls = spawn_with(2, bounded(), move |ctx| {
        let group = Arc::new(FlagsApart::new(ctx.process_group()));
        let varmap = if ctx.rank == 0 {
            varmap_from(&init)
        } else {
            VarMap::new()
        };
        let mut ddp = DistributedDataParallel::new(
            group.clone(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            |vb| Mlp::new(vb, SIZES),
            DdpConfig::default(),
        )?;
        let before = group.all_reduces.lock().unwrap().len();
        let (x, y) = &batches(1, 4)[0];
        let loss = loss::cross_entropy(&ddp.forward(x)?, y)?;
        ddp.backward(&loss)?;
        let calls = group.all_reduces.lock().unwrap()[before..].to_vec();
        Ok(calls)
    })
    .unwrap();
    for calls in calls {
        // One call with a flag per parameter, then the buckets: gradients only.
        assert_eq!(calls[0], params, "{calls:?}");
        assert_eq!(calls[1..].iter().sum::<usize>(), elements, "{calls:?}");
    }
}

fn unused_parameters_over(wrap: Wrap) {
    let grads = spawn_with(2, bounded(), move |ctx| {
        let varmap = VarMap::new();
        let ddp = DistributedDataParallel::new(
            wrap(ctx.process_group()),
            &varmap,
            DType::F32,
            &Device::Cpu,
            |vb| {
                Ok(Heads {
                    a: linear(2, 1, vb.pp("a"))?,
                    b: linear(2, 1, vb.pp("b"))?,
                    _c: linear(2, 1, vb.pp("c"))?,
                })
            },
            DdpConfig::default(),
        );
        let mut ddp = ddp?;
        let x = Tensor::ones((1, 2), DType::F32, &Device::Cpu)?;
        let m = ddp.module();
        let mut loss = m.a.forward(&x)?.sum_all()?;
        if ctx.rank == 1 {
            loss = (loss + m.b.forward(&x)?.sum_all()?)?;
        }
        let store = ddp.backward(&loss)?;
        let get = |name: &str| -> Option<Vec<f32>> {
            let var = &ddp.params().iter().find(|(n, _)| n == name).unwrap().1;
            store
                .get(var.as_tensor())
                .map(|g| g.to_vec1::<f32>().unwrap())
        };
        Ok((get("a.bias"), get("b.bias"), get("c.bias")))
    })
    .unwrap();
    for (a, b, c) in grads {
        assert_eq!(a, Some(vec![1.0]), "used everywhere: average of 1 and 1");
        assert_eq!(b, Some(vec![0.5]), "used on one rank of two: (0 + 1) / 2");
        assert_eq!(
            c, None,
            "unused everywhere: no gradient, optimizers skip it"
        );
    }
}

#[test]
fn buffers_follow_rank_0_unless_broadcast_is_off() {
    for broadcast in [true, false] {
        let buffers = spawn_with(2, bounded(), |ctx| {
            let varmap = VarMap::new();
            let mut ddp = DistributedDataParallel::builder(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
            )
            .broadcast_buffers(broadcast)
            .build(BnNet::new)?;
            // Different data per rank: the running statistics diverge in training.
            let x = Tensor::full(ctx.rank as f32 + 1., (4, 12), &Device::Cpu)?
                .add(&Tensor::randn(0f32, 1., (4, 12), &Device::Cpu)?)?;
            ddp.forward_t(&x, true)?;
            ddp.forward_t(&x, false)?; // the broadcast happens before each forward
            let v = varmap.data().lock().unwrap()["bn.running_mean"].to_vec1::<f32>()?;
            Ok(v)
        })
        .unwrap();
        assert_eq!(
            buffers[0] == buffers[1],
            broadcast,
            "broadcast_buffers = {broadcast}"
        );
    }
}

#[test]
fn compression_hooks_stay_close_to_the_plain_average_and_identical_across_ranks() {
    let init = init_mlp();
    let data = batches(3, 8);
    let run = |hook: CommHook| {
        spawn_with(2, bounded(), |ctx| {
            let varmap = varmap_from(&init);
            let config = DdpConfig {
                comm_hook: hook,
                ..Default::default()
            };
            let mut ddp = mlp_ddp(&ctx, &varmap, config)?;
            let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
            for (x, y) in &data {
                let (x, y) = (x.narrow(0, ctx.rank * 4, 4)?, y.narrow(0, ctx.rank * 4, 4)?);
                let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                ddp.backward_step(&loss, &mut sgd)?;
            }
            Ok(snapshot(&varmap))
        })
        .unwrap()
    };
    let plain = run(CommHook::Average);
    for hook in [CommHook::Fp16Compress, CommHook::Bf16Compress] {
        let ranks = run(hook);
        assert!(identical(&ranks[0], &ranks[1]), "{hook:?}");
        let diff = max_rel_diff(&ranks[0], &plain[0]);
        assert!(diff < 2e-2, "{hook:?}: {diff}");
        assert!(diff > 0.0, "{hook:?} actually compressed");
    }
}

/// Rank 0 has 2 batches, rank 1 has 4: inside `join` the run completes, and
/// the last two updates are rank 1's gradient divided by the initial world size.
#[test]
#[allow(clippy::result_large_err)] // the closure returns candle_dp::Result, as join requires
fn join_lets_a_rank_run_out_of_data_and_divides_by_the_initial_world_size() {
    let init = init_mlp();
    let data = batches(4, 4);
    for divisor in [JoinDivisor::InitialWorldSize, JoinDivisor::ActiveRanks] {
        let ranks = spawn_with(2, bounded(), |ctx| {
            let varmap = varmap_from(&init);
            let config = DdpConfig {
                join_divisor: divisor,
                ..Default::default()
            };
            let mut ddp = mlp_ddp(&ctx, &varmap, config)?;
            let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
            let mine = if ctx.rank == 0 { &data[..2] } else { &data[..] };
            ddp.join(|ddp| {
                for (x, y) in mine {
                    let (x, y) = (x.narrow(0, ctx.rank * 2, 2)?, y.narrow(0, ctx.rank * 2, 2)?);
                    let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                    ddp.backward_step(&loss, &mut sgd)?;
                }
                Ok(())
            })?;
            Ok(snapshot(&varmap))
        })
        .unwrap();
        assert!(identical(&ranks[0], &ranks[1]), "{divisor:?}");

        // The same updates computed on one device.
        let varmap = varmap_from(&init);
        let net = Mlp::new(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            SIZES,
        )
        .unwrap();
        let mut sgd = SGD::new(varmap.all_vars(), 0.1).unwrap();
        for (step, (x, y)) in data.iter().enumerate() {
            let rank_loss = |r: usize| {
                loss::cross_entropy(
                    &net.forward(&x.narrow(0, r * 2, 2).unwrap()).unwrap(),
                    &y.narrow(0, r * 2, 2).unwrap(),
                )
                .unwrap()
            };
            let loss = if step < 2 {
                ((rank_loss(0) + rank_loss(1)).unwrap() / 2.).unwrap()
            } else if divisor == JoinDivisor::InitialWorldSize {
                (rank_loss(1) / 2.).unwrap()
            } else {
                rank_loss(1)
            };
            sgd.backward_step(&loss).unwrap();
        }
        let diff = max_rel_diff(&ranks[0], &snapshot(&varmap));
        assert!(diff < 1e-5, "{divisor:?}: {diff}");
    }
}

/// Rank 0 has 2 batches, rank 1 has 4, both accumulating over pairs with
/// `no_sync`: after rank 0 joined, it answers rank 1's synchronised steps
/// only, and the result is one device's training.
#[test]
fn a_joined_rank_skips_the_all_reduce_of_a_step_inside_no_sync() {
    let init = init_mlp();
    let data = batches(4, 4);
    let ranks = within(60, {
        let (init, data) = (init.clone(), data.clone());
        move || {
            spawn_with(2, bounded(), |ctx| {
                join_accumulating(&ctx, &init, &data[..])
            })
        }
    })
    .unwrap();
    assert!(identical(&ranks[0], &ranks[1]));

    // One device: each pair's update is the mean of its losses over the
    // ranks that had the data, divided by the initial world size.
    let varmap = varmap_from(&init);
    let net = Mlp::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        SIZES,
    )
    .unwrap();
    let mut sgd = SGD::new(varmap.all_vars(), 0.1).unwrap();
    let rank_loss = |step: usize, r: usize| {
        let (x, y) = &data[step];
        loss::cross_entropy(
            &net.forward(&x.narrow(0, r * 2, 2).unwrap()).unwrap(),
            &y.narrow(0, r * 2, 2).unwrap(),
        )
        .unwrap()
    };
    for pair in [0, 2] {
        let ranks: &[usize] = if pair == 0 { &[0, 1] } else { &[1] };
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for &r in ranks {
            for step in [pair, pair + 1] {
                loss = (loss + rank_loss(step, r)).unwrap();
            }
        }
        sgd.backward_step(&(loss / 4.).unwrap()).unwrap();
    }
    let diff = max_rel_diff(&ranks[0], &snapshot(&varmap));
    assert!(diff < 1e-5, "{diff}");
}

/// Inside `join`, whether a step synchronises is decided at its forward
/// (the joined ranks act on it then): a backward moved into `no_sync`
/// after a synchronised forward still synchronises, as in PyTorch, instead
/// of leaving the joined rank waiting in an all-reduce.
#[test]
#[allow(clippy::result_large_err)] // the closures return candle_dp::Result, as join requires
fn inside_join_a_step_synchronises_as_agreed_at_its_forward() {
    let data = batches(2, 4);
    let ranks = within(60, move || {
        spawn_with(2, bounded(), |ctx| {
            let varmap = VarMap::new();
            let mut ddp = mlp_ddp(&ctx, &varmap, DdpConfig::default())?;
            let mine = &data[..1 + ctx.rank];
            let mut reduced = Vec::new();
            ddp.join(|ddp| {
                for (x, y) in mine {
                    let loss = loss::cross_entropy(&ddp.forward(x)?, y)?;
                    let grads = ddp.no_sync(|ddp| ddp.backward(&loss))?;
                    reduced.push(ddp.params().iter().all(|(_, v)| grads.get(v).is_some()));
                }
                Ok(())
            })?;
            Ok(reduced)
        })
    })
    .unwrap();
    assert_eq!(ranks, [vec![true], vec![true, true]]);
}

/// Outside `join` the same rule as inside: the forward decides. A
/// backward moved into `no_sync` after a forward outside it synchronises;
/// a backward after `no_sync` of a forward inside it only accumulates,
/// and the next synchronised step reduces the sum.
#[test]
#[allow(clippy::result_large_err)] // no_sync's closure returns candle_dp::Result
fn whether_a_step_synchronises_is_decided_at_its_forward_as_in_pytorch() {
    let data = batches(3, 4);
    let ranks = within(60, move || {
        spawn_with(2, bounded(), |ctx| {
            let varmap = VarMap::new();
            let mut ddp = mlp_ddp(&ctx, &varmap, DdpConfig::default())?;
            let reduced = |grads: &candle_core::backprop::GradStore,
                           ddp: &DistributedDataParallel<Mlp>| {
                ddp.params().iter().all(|(_, v)| grads.get(v).is_some())
            };
            let (x, y) = &data[0];
            let loss = loss::cross_entropy(&ddp.forward(x)?, y)?;
            let grads = ddp.no_sync(|ddp| ddp.backward(&loss))?;
            let moved_in = reduced(&grads, &ddp);

            let (x, y) = &data[1];
            let loss = ddp.no_sync(|ddp| -> anyhow::Result<Tensor> {
                Ok(loss::cross_entropy(&ddp.forward(x)?, y)?)
            })?;
            let grads = ddp.backward(&loss)?;
            let moved_out = reduced(&grads, &ddp);
            let accumulated_sum = {
                let (x, y) = &data[2];
                let loss = loss::cross_entropy(&ddp.forward(x)?, y)?;
                ddp.backward(&loss)?
            };
            Ok((moved_in, moved_out, reduced(&accumulated_sum, &ddp)))
        })
    })
    .unwrap();
    for (rank, outcome) in ranks.into_iter().enumerate() {
        assert_eq!(outcome, (true, false, true), "rank {rank}");
    }
}

#[test]
#[allow(clippy::result_large_err)] // the closures return candle_dp::Result, as join requires
fn ranks_that_disagree_on_no_sync_inside_join_fail_the_step_alike() {
    let data = batches(1, 4);
    let said = within(60, move || {
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        // Rank 0 runs its step inside no_sync, rank 1 does not. Each rank
        // sends its own error (the launcher returns only one).
        let _ = spawn_with(2, bounded(), |ctx| {
            let varmap = VarMap::new();
            let mut ddp = mlp_ddp(&ctx, &varmap, DdpConfig::default())?;
            let (x, y) = &data[0];
            let result = ddp.join(|ddp| {
                let step = |ddp: &mut DistributedDataParallel<Mlp>| {
                    let loss = loss::cross_entropy(&ddp.forward(x)?, y)?;
                    ddp.backward(&loss).map(|_| ())
                };
                match ctx.rank {
                    0 => ddp.no_sync(step),
                    _ => step(ddp),
                }
            });
            let text = match &result {
                Ok(()) => "ok".to_string(),
                Err(e @ candle_dp::Error::JoinSyncMismatch { .. }) => e.to_string(),
                Err(other) => format!("another error: {other}"),
            };
            tx.lock().unwrap().send((ctx.rank, text)).unwrap();
            Ok(())
        });
        let mut said: Vec<(usize, String)> = rx.try_iter().collect();
        said.sort();
        said
    });
    assert_eq!(said.len(), 2, "{said:?}");
    for (rank, text) in said {
        assert!(
            text.starts_with("inside join, rank(s) [0] ran this step inside no_sync while rank(s) [1] synchronise it"),
            "rank {rank}: {text}"
        );
    }
}

#[test]
fn uneven_inputs_without_join_end_with_an_error_naming_the_rank_that_left() {
    let data = batches(4, 4);
    let err = spawn_with(2, bounded(), |ctx| {
        let varmap = VarMap::new();
        let mut ddp = mlp_ddp(&ctx, &varmap, DdpConfig::default())?;
        let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
        let mine = if ctx.rank == 0 { &data[..2] } else { &data[..] };
        for (x, y) in mine {
            let loss = loss::cross_entropy(&ddp.forward(x)?, y)?;
            ddp.backward_step(&loss, &mut sgd)?;
        }
        Ok(())
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LaunchError::Failed { rank: 1, .. }), "{msg}");
    assert!(msg.contains("rank 0"), "names the rank that left: {msg}");
}

#[test]
fn a_rank_failing_mid_training_is_reported_and_nobody_hangs() {
    let data = batches(5, 4);
    let err = spawn_with(3, bounded(), |ctx| {
        let varmap = VarMap::new();
        let mut ddp = mlp_ddp(&ctx, &varmap, DdpConfig::default())?;
        let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
        for (step, (x, y)) in data.iter().enumerate() {
            if ctx.rank == 2 && step == 3 {
                anyhow::bail!("data file corrupt at step {step}");
            }
            let loss = loss::cross_entropy(&ddp.forward(x)?, y)?;
            ddp.backward_step(&loss, &mut sgd)?;
        }
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(err, LaunchError::Failed { rank: 2, .. }), "{err}");
    assert!(
        err.to_string().contains("data file corrupt at step 3"),
        "{err}"
    );
}

#[test]
fn a_rank_panicking_during_backward_is_reported_and_nobody_hangs() {
    struct Bomb(Mlp, usize);
    impl Module for Bomb {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            if self.1 == 1 {
                panic!("bad kernel on rank 1");
            }
            self.0.forward(x)
        }
    }
    let data = batches(2, 4);
    let err = spawn_with(2, bounded(), |ctx| {
        let varmap = VarMap::new();
        let rank = ctx.rank;
        let mut ddp = DistributedDataParallel::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            |vb| Ok(Bomb(Mlp::new(vb, SIZES)?, rank)),
            DdpConfig::default(),
        )?;
        let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
        for (x, y) in &data {
            let loss = loss::cross_entropy(&ddp.forward(x)?, y)?;
            ddp.backward_step(&loss, &mut sgd)?;
        }
        Ok(())
    })
    .unwrap_err();
    assert!(
        matches!(err, LaunchError::Panicked { rank: 1, .. }),
        "{err}"
    );
}
