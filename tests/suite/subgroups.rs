//! Sub-groups (`split`, `new_group`) and point-to-point messages (`send`,
//! `recv`) on thread ranks: who lands in which group, what its collectives
//! compute, and that a failure anywhere in the family ends every wait,
//! naming the rank by its rank in the world. Everything that could hang
//! runs on ranks with a timeout, inside a deadline.

use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_dp::comm::{Color, CommError, FailureCause, GroupOptions, ProcessGroup, ReduceOp};

use crate::common::{on_own_threads, within};

fn options(seconds: u64) -> GroupOptions {
    GroupOptions {
        timeout: Some(Duration::from_secs(seconds)),
        ..GroupOptions::default()
    }
}

fn scalar(x: f32) -> Tensor {
    Tensor::new(&[x], &Device::Cpu).unwrap()
}

fn value(t: &Tensor) -> f32 {
    t.to_vec1::<f32>().unwrap()[0]
}

#[test]
fn ranks_of_one_colour_form_a_group_ordered_by_key_then_by_rank() {
    let seen = within(60, || {
        on_own_threads(6, options(20), |pg| {
            let rank = pg.rank();
            // Colours 0, 1, 0, 1, none, 1; keys put rank 5 first in colour 1.
            let color = match rank {
                4 => Color::NONE,
                r => Color::new(r as u32 % 2),
            };
            let key = if rank == 5 { -1 } else { 0 };
            let group = pg.split(color, key).unwrap()?;
            let x = scalar(10f32.powi(rank as i32));
            let sum = value(&group.all_reduce(&x, ReduceOp::Sum).unwrap());
            let order = group
                .all_gather(&scalar(rank as f32))
                .unwrap()
                .iter()
                .map(|t| value(t) as usize)
                .collect::<Vec<_>>();
            Some((group.rank(), group.world_size(), sum, order))
        })
    });
    assert_eq!(seen[5], Some((0, 3, 101_010., vec![5, 1, 3])));
    assert_eq!(seen[1], Some((1, 3, 101_010., vec![5, 1, 3])));
    assert_eq!(seen[3], Some((2, 3, 101_010., vec![5, 1, 3])));
    assert_eq!(seen[0], Some((0, 2, 101., vec![0, 2])));
    assert_eq!(seen[2], Some((1, 2, 101., vec![0, 2])));
    assert_eq!(seen[4], None);
}

#[test]
fn a_sub_group_reduces_large_buffers_to_a_fresh_groups_bytes() {
    // The ring path (a buffer above the threshold) in a sub-group of 3,
    // against a group of 3 made directly: the same bytes.
    let input = |r: usize| {
        let values: Vec<f32> = (0..100_000)
            .map(|i| ((i * 7 + r * 13) % 97) as f32 / 7.)
            .collect();
        Tensor::new(values, &Device::Cpu).unwrap()
    };
    let split = within(60, move || {
        on_own_threads(4, options(20), move |pg| {
            let g = pg
                .split(Color::new(u32::from(pg.rank() < 3)), 0)
                .unwrap()
                .unwrap();
            let sum = g.all_reduce(&input(g.rank()), ReduceOp::Sum).unwrap();
            crate::common::bits(&sum)
        })
    });
    let direct = within(60, move || {
        on_own_threads(3, options(20), move |pg| {
            crate::common::bits(&pg.all_reduce(&input(pg.rank()), ReduceOp::Sum).unwrap())
        })
    });
    assert_eq!(split[0], direct[0]);
    assert_eq!(split[2], direct[2]);
}

#[test]
fn new_group_takes_the_listed_ranks_in_the_lists_order() {
    let seen = within(60, || {
        on_own_threads(4, options(20), |pg| {
            pg.new_group(&[3, 1])
                .unwrap()
                .map(|g| (g.rank(), g.world_size()))
        })
    });
    assert_eq!(seen, [None, Some((1, 2)), None, Some((0, 2))]);
}

#[test]
fn new_group_refuses_lists_that_differ_repeat_or_leave_the_group_on_every_rank() {
    let errors = within(60, || {
        on_own_threads(3, options(20), |pg| {
            let differ = if pg.rank() == 2 {
                vec![0, 2]
            } else {
                vec![0, 1]
            };
            let a = pg.new_group(&differ).unwrap_err().to_string();
            let b = pg.new_group(&[0, 5]).unwrap_err().to_string();
            let c = pg.new_group(&[1, 0, 1]).unwrap_err().to_string();
            // The group is still usable after each refusal.
            let ok = pg.new_group(&[0, 1, 2]).unwrap().is_some();
            (a, b, c, ok)
        })
    });
    for (rank, (a, b, c, ok)) in errors.iter().enumerate() {
        assert!(
            a.contains("invalid input on rank 2") && a.contains("[0, 2]"),
            "{rank}: {a}"
        );
        assert!(b.contains("rank 5 is not in a group of 3"), "{rank}: {b}");
        assert!(c.contains("rank 1 is listed twice"), "{rank}: {c}");
        assert!(ok);
    }
}

#[test]
fn a_rank_failing_in_a_sub_group_ends_the_waits_of_every_group_naming_its_world_rank() {
    // Pairs {0, 1} and {2, 3}. Rank 3 aborts in its pair; rank 2 waits in
    // the pair, ranks 0 and 1 in the world's all_reduce: all four end
    // with the failure, rank 3 named as rank 3 (it is rank 1 of its pair).
    let errors = within(60, || {
        on_own_threads(4, options(30), |pg| {
            let pair = pg
                .split(Color::new(pg.rank() as u32 / 2), 0)
                .unwrap()
                .unwrap();
            match pg.rank() {
                3 => {
                    pair.abort("the data loader broke");
                    None
                }
                2 => Some(pair.all_reduce(&scalar(1.), ReduceOp::Sum).unwrap_err()),
                _ => Some(pg.all_reduce(&scalar(1.), ReduceOp::Sum).unwrap_err()),
            }
        })
    });
    for error in errors.into_iter().flatten() {
        match &error {
            CommError::GroupFailed { failure, .. } => {
                assert_eq!(failure.rank, 3, "{error}");
                assert_eq!(
                    failure.cause,
                    FailureCause::Aborted("the data loader broke".into())
                );
            }
            other => panic!("expected the group's failure, got {other}"),
        }
    }
}

#[test]
fn a_timeout_in_a_sub_group_names_the_missing_rank_in_the_world_and_fails_the_family() {
    let errors = within(60, || {
        on_own_threads(4, options(30), |pg| {
            let pair = pg
                .split(Color::new(pg.rank() as u32 % 2), 0)
                .unwrap()
                .unwrap();
            match pg.rank() {
                // Rank 1 (pair {1, 3}) waits 1 s for rank 3, which never comes.
                1 => {
                    pair.set_timeout(Some(Duration::from_secs(1)));
                    Some(pair.barrier().unwrap_err())
                }
                // Ranks 0, 2 and 3 wait in the world for rank 1.
                _ => Some(pg.all_reduce(&scalar(1.), ReduceOp::Sum).unwrap_err()),
            }
        })
    });
    match &errors[1] {
        Some(CommError::Timeout { missing, .. }) => assert_eq!(missing, &[1], "pair numbering"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    for e in [&errors[0], &errors[2], &errors[3]] {
        match e {
            Some(CommError::GroupFailed { failure, .. }) => {
                assert_eq!(failure.rank, 1);
                assert_eq!(
                    failure.cause,
                    FailureCause::TimedOut {
                        op: "barrier",
                        missing: vec![3]
                    }
                );
            }
            other => panic!("expected the family's failure, got {other:?}"),
        }
    }
}

#[test]
fn sub_groups_split_again_and_keep_world_numbering_in_failures() {
    let errors = within(60, || {
        on_own_threads(4, options(30), |pg| {
            let half = pg
                .split(Color::new(u32::from(pg.rank() >= 2)), 0)
                .unwrap()
                .unwrap();
            let alone = half
                .split(Color::new(half.rank() as u32), 0)
                .unwrap()
                .unwrap();
            assert_eq!((alone.rank(), alone.world_size()), (0, 1));
            let sum = half
                .all_reduce(&scalar(pg.rank() as f32), ReduceOp::Sum)
                .unwrap();
            assert_eq!(value(&sum), if pg.rank() < 2 { 1. } else { 5. });
            pg.barrier().unwrap();
            if pg.rank() == 2 {
                alone.abort("stop");
                return None;
            }
            Some(pg.barrier().unwrap_err())
        })
    });
    for e in errors.into_iter().flatten() {
        match e {
            CommError::GroupFailed { failure, .. } => assert_eq!(failure.rank, 2),
            other => panic!("{other}"),
        }
    }
}

#[test]
fn send_and_recv_deliver_copies_in_the_order_sent() {
    let got = within(60, || {
        on_own_threads(3, options(20), |pg| {
            let like = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
            match pg.rank() {
                0 => {
                    let var = Var::new(&[1f32, 2.], &Device::Cpu).unwrap();
                    pg.send(var.as_tensor(), 2).unwrap();
                    // Written after the send: the receiver must not see it.
                    var.set(&Tensor::new(&[9f32, 9.], &Device::Cpu).unwrap())
                        .unwrap();
                    pg.send(var.as_tensor(), 2).unwrap();
                    vec![]
                }
                1 => {
                    pg.send(&Tensor::new(&[5f32, 6.], &Device::Cpu).unwrap(), 2)
                        .unwrap();
                    vec![]
                }
                _ => {
                    let next = |src| pg.recv(&like, src).unwrap().to_vec1::<f32>().unwrap();
                    // Rank 1's message first, although rank 0 may have sent earlier.
                    vec![next(1), next(0), next(0)]
                }
            }
        })
    });
    assert_eq!(got[2], [vec![5., 6.], vec![1., 2.], vec![9., 9.]]);
}

#[test]
fn recv_of_another_shape_fails_the_group_naming_both_shapes() {
    let errors = within(60, || {
        on_own_threads(2, options(20), |pg| {
            if pg.rank() == 0 {
                pg.send(&Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(), 1)
                    .unwrap();
                // The receiver's failure reaches this rank's next call.
                pg.barrier().unwrap_err().to_string()
            } else {
                let like = Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap();
                pg.recv(&like, 0).unwrap_err().to_string()
            }
        })
    });
    assert!(
        errors[1].contains("rank 0 sent f32 [2, 3], rank 1 expected f32 [6]"),
        "{}",
        errors[1]
    );
    assert!(errors[0].contains("failed because rank 1"), "{}", errors[0]);
}

#[test]
fn recv_from_a_rank_that_never_sends_times_out_naming_it() {
    let errors = within(60, || {
        on_own_threads(2, options(20), |pg| {
            if pg.rank() == 1 {
                pg.set_timeout(Some(Duration::from_millis(300)));
                let like = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
                Some(pg.recv(&like, 0).unwrap_err())
            } else {
                // Waits in a collective the other rank never joins.
                Some(pg.barrier().unwrap_err())
            }
        })
    });
    match &errors[1] {
        Some(CommError::Timeout { op, missing, .. }) => {
            assert_eq!((*op, missing.as_slice()), ("recv", &[0][..]))
        }
        other => panic!("{other:?}"),
    }
    match &errors[0] {
        Some(CommError::GroupFailed { failure, .. }) => assert_eq!(failure.rank, 1),
        other => panic!("{other:?}"),
    }
}

#[test]
fn recv_from_a_rank_that_left_ends_naming_it() {
    let errors = within(60, || {
        on_own_threads(2, options(20), |pg| {
            if pg.rank() == 0 {
                drop(pg);
                None
            } else {
                let like = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
                Some(pg.recv(&like, 0).unwrap_err())
            }
        })
    });
    match &errors[1] {
        Some(CommError::GroupFailed { failure, .. }) => {
            assert_eq!((failure.rank, &failure.cause), (0, &FailureCause::Left))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn send_to_itself_or_outside_the_group_is_refused_and_the_group_stays_usable() {
    let seen = within(60, || {
        on_own_threads(2, options(20), |pg| {
            let x = scalar(1.);
            let me = pg.send(&x, pg.rank()).unwrap_err().to_string();
            let out = pg.recv(&x, 7).unwrap_err().to_string();
            let sum = value(&pg.all_reduce(&x, ReduceOp::Sum).unwrap());
            (me, out, sum)
        })
    });
    for (me, out, sum) in seen {
        assert!(me.contains("cannot send to or receive from itself"), "{me}");
        assert!(out.contains("rank 7 is not in a group of 2"), "{out}");
        assert_eq!(sum, 2.);
    }
}

#[test]
fn point_to_point_in_a_sub_group_uses_its_own_numbering() {
    let got = within(60, || {
        on_own_threads(4, options(20), |pg| {
            // Pair {1, 3}: rank 3 is its rank 1 and sends to its rank 0.
            let pair = pg
                .split(Color::new(pg.rank() as u32 % 2), 0)
                .unwrap()
                .unwrap();
            let x = scalar(pg.rank() as f32);
            if pair.rank() == 1 {
                pair.send(&x, 0).unwrap();
                None
            } else {
                Some(value(&pair.recv(&x, 1).unwrap()))
            }
        })
    });
    assert_eq!((got[0], got[1]), (Some(2.), Some(3.)));
}
