//! `spawn`: results in rank order, and failing fast on the first failure
//! (an error, an abort, a panic, a departed rank, a timeout), which is
//! reported instead of the errors it causes on the other ranks.
//!
//! Every group runs with a timeout (10 s unless the test is about
//! timeouts): a rank left waiting would end with a `Timeout` error, which the
//! tests reject, rather than hang.

use crate::common;

use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dp::comm::{
    CommError, Failure, FailureCause, GroupOptions, ProcessGroup, ReduceOp, ThreadGroup,
};
use candle_dp::launch::{spawn, spawn_with, LaunchError, RankContext};
use crossbeam::channel;

fn options() -> GroupOptions {
    GroupOptions {
        timeout: Some(Duration::from_secs(10)),
        ..GroupOptions::default()
    }
}

fn one() -> Tensor {
    Tensor::ones(1, DType::F32, &Device::Cpu).unwrap()
}

/// Collects the errors the other ranks get, to check what they were told.
#[derive(Default)]
struct Seen(Mutex<Vec<(usize, CommError)>>);

impl Seen {
    /// Records the error of `rank`'s collective, and passes it on.
    fn check<T>(&self, rank: usize, result: Result<T, CommError>) -> anyhow::Result<T> {
        result.map_err(|err| {
            let message = err.to_string();
            self.0.lock().unwrap().push((rank, err));
            anyhow::anyhow!(message)
        })
    }

    /// Asserts that exactly `ranks` reported that the group failed because
    /// of `failure`.
    fn assert_group_failed(self, ranks: &[usize], failure: &Failure) {
        let mut seen = self.0.into_inner().unwrap();
        seen.sort_by_key(|(rank, _)| *rank);
        let reporters: Vec<usize> = seen.iter().map(|(rank, _)| *rank).collect();
        assert_eq!(reporters, ranks);
        for (rank, err) in seen {
            match &err {
                CommError::GroupFailed {
                    rank: r,
                    failure: f,
                    ..
                } => {
                    assert_eq!((*r, f), (rank, failure), "{err}");
                }
                other => panic!("rank {rank}: unexpected error {other}"),
            }
        }
    }
}

fn aborted(rank: usize, reason: &str) -> Failure {
    Failure {
        rank,
        cause: FailureCause::Aborted(reason.to_string()),
    }
}

#[test]
fn spawn_returns_every_ranks_result_in_rank_order() {
    let results = spawn_with(5, options(), |ctx| {
        let sum = ctx.pg.all_reduce(&one(), ReduceOp::Sum)?;
        Ok((ctx.rank, ctx.world_size, sum.to_vec1::<f32>()?))
    })
    .unwrap();
    let expected: Vec<_> = (0..5).map(|rank| (rank, 5, vec![5.0])).collect();
    assert_eq!(results, expected);
}

#[test]
fn spawn_rejects_world_size_zero() {
    let err = spawn(0, |_| Ok(())).unwrap_err();
    assert!(matches!(err, LaunchError::EmptyWorld));
    assert_eq!(err.to_string(), "world_size must be at least 1, got 0");
}

#[test]
fn the_closure_may_borrow_from_the_caller_and_use_a_trait_object() {
    let shards = [vec![1.0f32, 2.0], vec![3.0, 4.0]];
    let results = spawn_with(2, options(), |ctx| {
        let pg: std::sync::Arc<dyn ProcessGroup> = ctx.process_group();
        let x = Tensor::new(shards[ctx.rank].as_slice(), &Device::Cpu)?;
        Ok(pg.all_reduce(&x, ReduceOp::Avg)?.to_vec1::<f32>()?)
    })
    .unwrap();
    assert_eq!(results, vec![vec![2.0, 3.0]; 2]);
}

#[test]
fn a_rank_failing_before_any_collective_is_reported_and_fails_the_others_collectives() {
    let seen = Seen::default();
    let err = spawn_with(4, options(), |ctx| {
        anyhow::ensure!(ctx.rank != 1, "no data for rank 1");
        seen.check(ctx.rank, ctx.pg.all_reduce(&one(), ReduceOp::Sum))?;
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(err, LaunchError::Failed { rank: 1, .. }), "{err}");
    assert_eq!(err.to_string(), "rank 1 failed: no data for rank 1");
    seen.assert_group_failed(&[0, 2, 3], &aborted(1, "no data for rank 1"));
}

#[test]
fn a_rank_aborting_while_the_others_wait_wakes_them_with_its_reason() {
    let seen = Seen::default();
    let (entering, entered) = channel::unbounded();
    let err = spawn_with(3, options(), |ctx| {
        if ctx.rank == 2 {
            // Fail once the others are (about to be) waiting in all_reduce.
            entered.recv()?;
            entered.recv()?;
            thread::sleep(Duration::from_millis(20));
            ctx.pg.abort("loss is NaN");
            anyhow::bail!("loss is NaN");
        }
        entering.send(())?;
        seen.check(ctx.rank, ctx.pg.all_reduce(&one(), ReduceOp::Sum))?;
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(err, LaunchError::Failed { rank: 2, .. }), "{err}");
    seen.assert_group_failed(&[0, 1], &aborted(2, "loss is NaN"));
}

#[test]
fn a_rank_failing_after_a_collective_fails_the_others_next_collective() {
    let seen = Seen::default();
    let err = spawn_with(3, options(), |ctx| {
        // Rank 0 may fail while another rank is still in this all_reduce
        // (waiting for a header a third rank has not sent it yet), which
        // then fails too: either call may report the failure.
        let sum = seen.check(ctx.rank, ctx.pg.all_reduce(&one(), ReduceOp::Sum))?;
        anyhow::ensure!(sum.to_vec1::<f32>()? == [3.0], "wrong sum");
        anyhow::ensure!(ctx.rank != 0, "checkpoint write failed");
        seen.check(ctx.rank, ctx.pg.barrier())?;
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(err, LaunchError::Failed { rank: 0, .. }), "{err}");
    assert_eq!(err.to_string(), "rank 0 failed: checkpoint write failed");
    seen.assert_group_failed(&[1, 2], &aborted(0, "checkpoint write failed"));
}

#[test]
fn a_panicking_rank_is_reported_with_its_message_and_fails_the_others() {
    let seen = Seen::default();
    let err = spawn_with(3, options(), |ctx| {
        if ctx.rank == 2 {
            panic!("kaboom");
        }
        seen.check(ctx.rank, ctx.pg.all_reduce(&one(), ReduceOp::Sum))?;
        Ok(())
    })
    .unwrap_err();
    assert!(
        matches!(&err, LaunchError::Panicked { rank: 2, message } if message == "kaboom"),
        "{err}"
    );
    assert_eq!(err.to_string(), "rank 2 panicked: kaboom");
    seen.assert_group_failed(&[0, 1], &aborted(2, "panicked: kaboom"));
}

#[test]
fn a_rank_that_returns_early_fails_the_collectives_that_need_it_naming_it() {
    let seen = Seen::default();
    let err = spawn_with(3, options(), |ctx| {
        if ctx.rank == 1 {
            return Ok(());
        }
        seen.check(ctx.rank, ctx.pg.barrier())?;
        Ok(())
    })
    .unwrap_err();
    // Rank 1 did nothing wrong by itself; the lowest rank it left waiting
    // reports it.
    assert!(matches!(err, LaunchError::Failed { rank: 0, .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "rank 0 failed: rank 0: barrier failed because rank 1 left the group (its handle was dropped)"
    );
    let left = Failure {
        rank: 1,
        cause: FailureCause::Left,
    };
    seen.assert_group_failed(&[0, 2], &left);
}

#[test]
fn dropping_a_handle_fails_pending_and_later_collectives_naming_its_rank() {
    let mut ranks = ThreadGroup::with_options(3, options());
    drop(ranks.remove(1));
    let errors: Vec<CommError> = thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|pg| {
                s.spawn(move || {
                    let pending = pg.all_reduce(&one(), ReduceOp::Sum).unwrap_err();
                    let later = pg.barrier().unwrap_err();
                    [pending, later]
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(errors.len(), 4);
    for err in errors {
        assert!(
            matches!(
                &err,
                CommError::GroupFailed {
                    failure: Failure {
                        rank: 1,
                        cause: FailureCause::Left
                    },
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn a_thread_panicking_with_its_handle_fails_the_group_naming_its_rank() {
    let mut ranks = ThreadGroup::with_options(2, options());
    let survivor = ranks.pop().unwrap();
    let doomed = ranks.pop().unwrap();
    let crashed = thread::spawn(move || {
        let _pg = doomed;
        panic!("worker crashed");
    })
    .join();
    assert!(crashed.is_err());
    let err = survivor.all_reduce(&one(), ReduceOp::Sum).unwrap_err();
    assert_eq!(
        err.to_string(),
        "rank 1: all_reduce failed because rank 0 panicked"
    );
}

#[test]
fn mismatched_shapes_under_spawn_report_the_mismatch_naming_the_odd_rank() {
    let err = spawn_with(3, options(), |ctx| {
        let len = if ctx.rank == 2 { 4 } else { 3 };
        ctx.pg.all_reduce(
            &Tensor::zeros(len, DType::F32, &Device::Cpu)?,
            ReduceOp::Sum,
        )?;
        Ok(())
    })
    .unwrap_err();
    let LaunchError::Failed { source, .. } = &err else {
        panic!("unexpected error {err}");
    };
    let comm = source.downcast_ref::<CommError>().expect("a CommError");
    assert!(
        matches!(comm, CommError::TensorMismatch { ranks, .. } if ranks == &[2]),
        "{err}"
    );
    assert!(err.to_string().contains("rank(s) [2]: f32 [4]"), "{err}");
}

#[test]
fn an_abort_by_a_rank_that_then_returns_ok_is_reported_as_aborted() {
    let err = spawn_with(2, options(), |ctx| {
        if ctx.rank == 0 {
            ctx.pg.abort("stopping early");
            return Ok(());
        }
        ctx.pg.barrier()?;
        Ok(())
    })
    .unwrap_err();
    assert!(
        matches!(&err, LaunchError::Aborted { rank: 0, reason } if reason == "stopping early"),
        "{err}"
    );
    assert_eq!(err.to_string(), "rank 0 aborted the group: stopping early");
}

#[test]
fn the_root_cause_is_reported_whichever_rank_finishes_first() {
    for _ in 0..20 {
        let err = spawn_with(8, options(), |ctx: RankContext| {
            for step in 0..5 {
                anyhow::ensure!(!(ctx.rank == 5 && step == 3), "rank 5 diverged at step 3");
                ctx.pg.all_reduce(&one(), ReduceOp::Sum)?;
            }
            Ok(())
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "rank 5 failed: rank 5 diverged at step 3");
    }
}

#[test]
fn a_timeout_under_spawn_is_the_root_cause_and_names_the_missing_rank() {
    let (timed_out, go) = channel::unbounded();
    let options = GroupOptions {
        timeout: Some(Duration::from_millis(50)),
        ..GroupOptions::default()
    };
    let err = spawn_with(2, options, |ctx| {
        if ctx.rank == 1 {
            // Arrives only after rank 0 has given up.
            go.recv()?;
        }
        let result = ctx.pg.barrier();
        if ctx.rank == 0 {
            timed_out.send(())?;
        }
        Ok(result?)
    })
    .unwrap_err();
    let LaunchError::Failed { rank: 0, source } = &err else {
        panic!("unexpected error {err}");
    };
    assert!(
        matches!(source.downcast_ref::<CommError>(), Some(CommError::Timeout { missing, .. }) if missing == &[1]),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "rank 0 failed: rank 0: barrier timed out after 50ms; rank(s) [1] did not arrive"
    );
}

#[test]
fn ranks_finishing_normally_never_fail_the_others_last_collective() {
    // A rank that is done leaves right after its last collective while the
    // others may still be receiving: that must not look like a failure.
    for _ in 0..30 {
        let results = spawn_with(4, options(), |ctx| {
            let x = Tensor::new(&[ctx.rank as f32], &Device::Cpu)?;
            let gathered = ctx.pg.all_gather(&x)?;
            ctx.pg.barrier()?;
            let sum = ctx.pg.all_reduce(&x, ReduceOp::Sum)?;
            Ok((gathered.len(), sum.to_vec1::<f32>()?))
        })
        .unwrap();
        assert!(results.iter().all(|r| *r == (4, vec![6.0])));
    }
}

#[test]
fn an_abort_in_the_middle_of_large_all_reduces_gives_each_rank_the_sum_or_the_failure() {
    // Large tensors take the ring, where the ranks fill one shared result;
    // rank 2 is aborted from another thread at varying moments, so some
    // calls finish and others are cut off while chunks are being written.
    const LEN: usize = 1 << 20;
    for delay_us in [0u64, 500, 2000, 5000, 10_000, 20_000] {
        let outcomes = Mutex::new(Vec::new());
        let err = spawn_with(3, options(), |ctx| -> anyhow::Result<()> {
            let x = Tensor::full(ctx.rank as f32 + 1.0, LEN, &Device::Cpu)?;
            let aborter = (ctx.rank == 2).then(|| {
                let pg = ctx.pg.clone();
                thread::spawn(move || {
                    thread::sleep(Duration::from_micros(delay_us));
                    pg.abort("stopped mid-reduction");
                })
            });
            let mut failed = false;
            for _ in 0..20 {
                let result = ctx.pg.all_reduce(&x, ReduceOp::Sum);
                failed = result.is_err();
                outcomes.lock().unwrap().push((ctx.rank, result));
                if failed {
                    break;
                }
            }
            if let Some(aborter) = aborter {
                aborter
                    .join()
                    .map_err(|_| anyhow::anyhow!("aborter panicked"))?;
            }
            anyhow::ensure!(failed, "rank {} saw no failure", ctx.rank);
            Ok(())
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("stopped mid-reduction"),
            "delay {delay_us} us: {err}"
        );
        for (rank, result) in outcomes.into_inner().unwrap() {
            match result {
                Ok(sum) => {
                    let values = sum.to_vec1::<f32>().unwrap();
                    assert!(
                        values.iter().all(|&v| v == 6.0),
                        "delay {delay_us} us, rank {rank}"
                    );
                }
                Err(CommError::GroupFailed { failure, .. }) => {
                    assert_eq!(failure, aborted(2, "stopped mid-reduction"), "rank {rank}");
                }
                Err(other) => panic!("delay {delay_us} us, rank {rank}: {other}"),
            }
        }
    }
}

#[test]
#[ignore = "run by the_default_timeout_is_30_minutes_or_what_candle_dp_timeout_says in a child process"]
fn print_the_default_timeout() {
    // What a group built with the defaults has (spawn uses them).
    let ranks = spawn(2, |ctx| Ok(ctx.pg.timeout())).unwrap();
    println!(
        "default timeout: {:?}, ranks: {ranks:?}",
        candle_dp::comm::GroupOptions::default().timeout
    );
}

/// No wait is unbounded unless asked: a group built with the defaults has
/// PyTorch's 30 minutes, or what `CANDLE_DP_TIMEOUT` says (seconds or
/// `none`); a value that is neither is reported and the default used.
#[test]
fn the_default_timeout_is_30_minutes_or_what_candle_dp_timeout_says() {
    let cases = [
        (
            None,
            "default timeout: Some(1800s), ranks: [Some(1800s), Some(1800s)]",
        ),
        (
            Some("7"),
            "default timeout: Some(7s), ranks: [Some(7s), Some(7s)]",
        ),
        (Some("none"), "default timeout: None, ranks: [None, None]"),
        (
            Some("soon"),
            "default timeout: Some(1800s), ranks: [Some(1800s), Some(1800s)]",
        ),
    ];
    for (value, expected) in cases {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child.args([
            "--ignored",
            "--exact",
            "launch::print_the_default_timeout",
            "--nocapture",
        ]);
        match value {
            Some(v) => child.env("CANDLE_DP_TIMEOUT", v),
            None => child.env_remove("CANDLE_DP_TIMEOUT"),
        };
        let output = common::killing::bounded_output(child, std::time::Duration::from_secs(60));
        let (stdout, stderr) = (
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
        assert!(stdout.contains(expected), "{value:?}: {stdout}{stderr}");
        if value == Some("soon") {
            assert!(
                stderr.contains(
                    "CANDLE_DP_TIMEOUT=\"soon\" is neither a positive number of seconds nor `none`"
                ),
                "{stderr}"
            );
        }
    }
}
