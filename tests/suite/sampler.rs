//! `DistributedSampler` against PyTorch: the recorded reference cases, and
//! the sampler's invariants.

use std::collections::BTreeSet;

use candle_dp::sampler::{randperm, DistributedSampler, SamplerError};
use proptest::prelude::*;
use serde::Deserialize;

/// One case of `tests/data/sampler_reference.json`, recorded from
/// `torch.utils.data.distributed.DistributedSampler`.
#[derive(Debug, Deserialize)]
struct Case {
    len: usize,
    num_replicas: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    indices_per_rank: Vec<Vec<usize>>,
}

fn reference_cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/sampler_reference.json");
    let text = std::fs::read_to_string(path).expect("read sampler_reference.json");
    serde_json::from_str(&text).expect("parse sampler_reference.json")
}

fn sampler(
    len: usize,
    replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
) -> DistributedSampler {
    DistributedSampler::new(len, replicas, rank)
        .expect("valid rank")
        .shuffle(shuffle)
        .seed(seed)
        .drop_last(drop_last)
}

fn all_ranks(
    len: usize,
    replicas: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
) -> Vec<Vec<usize>> {
    (0..replicas)
        .map(|rank| {
            let mut s = sampler(len, replicas, rank, shuffle, seed, drop_last);
            s.set_epoch(epoch);
            s.indices()
        })
        .collect()
}

#[test]
fn every_pytorch_reference_case_is_reproduced_exactly() {
    let cases = reference_cases();
    assert!(!cases.is_empty());
    for case in &cases {
        assert_eq!(case.indices_per_rank.len(), case.num_replicas, "{case:?}");
        for (rank, expected) in case.indices_per_rank.iter().enumerate() {
            let mut s = sampler(
                case.len,
                case.num_replicas,
                rank,
                case.shuffle,
                case.seed,
                case.drop_last,
            );
            s.set_epoch(case.epoch);
            assert_eq!(&s.indices(), expected, "rank {rank} of {case:?}");
            assert_eq!(s.len(), expected.len(), "len of rank {rank} of {case:?}");
            assert_eq!(s.iter().collect::<Vec<_>>(), *expected);
        }
    }
}

#[test]
fn rank_outside_the_world_is_an_error_naming_rank_and_world_size() {
    let err = DistributedSampler::new(10, 3, 3).unwrap_err();
    assert_eq!(
        err,
        SamplerError::InvalidRank {
            rank: 3,
            num_replicas: 3
        }
    );
    let msg = err.to_string();
    assert!(msg.contains("rank 3"), "{msg}");
    assert!(msg.contains("[0, 2]"), "{msg}");
    assert!(msg.contains("world size (num_replicas) of 3"), "{msg}");

    let err = DistributedSampler::new(10, 0, 0).unwrap_err();
    assert_eq!(err, SamplerError::NoReplicas { rank: 0 });
    assert!(err
        .to_string()
        .contains("num_replicas must be at least 1, got 0"));
}

#[test]
fn padding_wraps_around_as_many_times_as_needed() {
    let ranks = all_ranks(2, 5, false, 0, false, 0);
    assert_eq!(ranks, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);

    // 3 samples on 8 ranks: the list 0,1,2 is repeated almost three times.
    let ranks = all_ranks(3, 8, false, 0, false, 0);
    let flat: Vec<usize> = ranks.iter().map(|r| r[0]).collect();
    assert_eq!(flat, vec![0, 1, 2, 0, 1, 2, 0, 1]);

    // Shuffled: the padding repeats the start of the permutation.
    let order = randperm(3, 9);
    let ranks = all_ranks(3, 8, true, 9, false, 0);
    let flat: Vec<usize> = ranks.iter().map(|r| r[0]).collect();
    let expected: Vec<usize> = (0..8).map(|p| order[p % 3]).collect();
    assert_eq!(flat, expected);
}

#[test]
fn drop_last_truncates_to_a_multiple_of_the_world_size() {
    let ranks = all_ranks(10, 3, false, 0, true, 0);
    assert_eq!(ranks, vec![vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]);
    let s = sampler(10, 3, 0, true, 0, true);
    assert_eq!((s.len(), s.total_size()), (3, 9));

    // Fewer samples than ranks: nothing at all.
    let s = sampler(2, 5, 4, true, 0, true);
    assert!(s.is_empty());
    assert_eq!(s.total_size(), 0);

    // Shuffled: the first total_size positions of the permutation, no repeat.
    let ranks = all_ranks(100, 7, true, 3, true, 2);
    let flat: Vec<usize> = ranks.concat();
    assert_eq!(flat.len(), 98);
    assert_eq!(flat.iter().collect::<BTreeSet<_>>().len(), 98);
}

#[test]
fn set_epoch_changes_the_order_but_not_the_samples() {
    let mut s = sampler(50, 1, 0, true, 0, false);
    let epoch0 = s.indices();
    s.set_epoch(1);
    assert_eq!(s.epoch(), 1);
    let epoch1 = s.indices();
    assert_ne!(epoch0, epoch1);
    let mut sorted = epoch1.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..50).collect::<Vec<_>>());
    // Back to epoch 0: the same order again.
    s.set_epoch(0);
    assert_eq!(s.indices(), epoch0);
}

#[test]
fn the_permutation_seed_is_seed_plus_epoch() {
    let mut a = sampler(40, 2, 1, true, 5, false);
    a.set_epoch(2);
    let b = sampler(40, 2, 1, true, 7, false);
    assert_eq!(a.indices(), b.indices());
    assert_eq!(a.global_order(), randperm(40, 7));
}

#[test]
fn without_shuffle_the_epoch_does_not_matter() {
    let mut s = sampler(10, 2, 1, false, 3, false);
    let before = s.indices();
    s.set_epoch(7);
    assert_eq!(s.indices(), before);
    assert_eq!(before, vec![1, 3, 5, 7, 9]);
}

#[test]
fn accessors_report_the_configuration() {
    let s = sampler(10, 4, 2, true, 0, false);
    assert_eq!(s.rank(), 2);
    assert_eq!(s.num_replicas(), 4);
    assert_eq!(s.dataset_len(), 10);
    assert_eq!((s.len(), s.total_size()), (3, 12));
    assert_eq!((&s).into_iter().collect::<Vec<_>>(), s.indices());
}

/// PyTorch's formula, in floating point as Python computes it.
fn torch_num_samples(n: usize, r: usize, drop_last: bool) -> usize {
    if drop_last && !n.is_multiple_of(r) {
        ((n as f64 - r as f64) / r as f64).ceil() as usize
    } else {
        (n as f64 / r as f64).ceil() as usize
    }
}

proptest! {
    #[test]
    fn num_samples_follows_the_pytorch_formula(
        n in 0usize..500, r in 1usize..17, drop_last: bool,
    ) {
        let s = sampler(n, r, r - 1, true, 0, drop_last);
        let expected = torch_num_samples(n, r, drop_last);
        prop_assert_eq!(s.len(), expected);
        prop_assert_eq!(s.total_size(), expected * r);
    }

    #[test]
    fn union_of_all_ranks_covers_every_index(
        n in 1usize..300, r in 1usize..9, shuffle: bool, seed in 0u64..1000, epoch in 0u64..5,
    ) {
        let ranks = all_ranks(n, r, shuffle, seed, false, epoch);
        let len = ranks[0].len();
        prop_assert!(ranks.iter().all(|indices| indices.len() == len));
        let union: BTreeSet<usize> = ranks.iter().flatten().copied().collect();
        prop_assert_eq!(union, (0..n).collect::<BTreeSet<_>>());
        // Only the padding repeats: exactly total_size - n duplicates.
        prop_assert_eq!(len * r - n, len * r - ranks.iter().flatten().collect::<BTreeSet<_>>().len());
    }

    #[test]
    fn with_drop_last_no_index_repeats(
        n in 0usize..300, r in 1usize..9, shuffle: bool, seed in 0u64..1000,
    ) {
        let flat: Vec<usize> = all_ranks(n, r, shuffle, seed, true, 0).concat();
        prop_assert_eq!(flat.len(), (n / r) * r);
        prop_assert_eq!(flat.iter().collect::<BTreeSet<_>>().len(), flat.len());
    }

    #[test]
    fn randperm_is_a_permutation(n in 0usize..2000, seed: u64) {
        let mut perm = randperm(n, seed);
        perm.sort_unstable();
        prop_assert_eq!(perm, (0..n).collect::<Vec<_>>());
    }
}
