//! The batching `Loader`: batch boundaries, prefetch, shutdown, errors,
//! even batches, and `drop_padding` against the `DistributedSampler`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_dp::loader::{
    batches_per_rank, collate, drop_padding, Batch, Dataset, Loader, LoaderError, Sample,
    TensorDataset,
};
use candle_dp::sampler::DistributedSampler;
use proptest::prelude::*;

/// Sample `i` is `(x = [i, 10 i], y = i)`, loaded one by one (no fast path).
/// Counts the samples fetched, fails at `fail_at` and panics at `panic_at`.
#[derive(Default)]
struct Counting {
    len: usize,
    gets: AtomicUsize,
    fail_at: Option<usize>,
    panic_at: Option<usize>,
}

impl Counting {
    fn new(len: usize) -> Self {
        Self {
            len,
            ..Self::default()
        }
    }
}

impl Dataset for Counting {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> candle_core::Result<Sample> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        if self.fail_at == Some(index) {
            candle_core::bail!("sample {index} is corrupt");
        }
        if self.panic_at == Some(index) {
            panic!("dataset panicked at {index}");
        }
        let x = Tensor::new(&[index as f32, 10. * index as f32], &Device::Cpu)?;
        let y = Tensor::new(index as u32, &Device::Cpu)?;
        Ok(vec![x, y])
    }
}

/// `x` of shape (n, 2) with row i = [i, 10 i], `y` = 0..n.
fn tensor_dataset(n: usize) -> TensorDataset {
    let x: Vec<f32> = (0..n).flat_map(|i| [i as f32, 10. * i as f32]).collect();
    let x = Tensor::from_vec(x, (n, 2), &Device::Cpu).unwrap();
    let y = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap();
    TensorDataset::new(vec![x, y]).unwrap()
}

/// The `y` field of every batch; panics on an error item.
fn labels(loader: &Loader) -> Vec<Vec<u32>> {
    loader
        .iter()
        .map(|batch| batch.unwrap()[1].to_vec1::<u32>().unwrap())
        .collect()
}

fn assert_same_batches(a: &[Batch], b: &[Batch]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        for (u, v) in x.iter().zip(y) {
            assert_eq!(u.dims(), v.dims());
            assert_eq!(u.dtype(), v.dtype());
            let u = u.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            let v = v.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            assert_eq!(u.to_vec1::<f64>().unwrap(), v.to_vec1::<f64>().unwrap());
        }
    }
}

fn collect_ok(loader: &Loader) -> Vec<Batch> {
    loader.iter().collect::<Result<_, _>>().unwrap()
}

#[test]
fn loaders_and_their_iterators_can_move_to_other_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<Loader>();
    assert_send::<candle_dp::loader::LoaderIter>();
}

#[test]
fn batches_follow_the_indices_and_the_last_one_is_short() {
    let loader = Loader::new(Arc::new(tensor_dataset(10)), 4).unwrap();
    assert_eq!(loader.len(), 3);
    assert_eq!(
        labels(&loader),
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
    );
    let batches = collect_ok(&loader);
    assert_eq!(batches[0][0].dims(), &[4, 2]);
    assert_eq!(batches[2][0].dims(), &[2, 2]);
    assert_eq!(
        batches[2][0].to_vec2::<f32>().unwrap(),
        vec![vec![8., 80.], vec![9., 90.]]
    );

    let loader = loader.indices(vec![9, 0, 5]);
    assert_eq!(labels(&loader), vec![vec![9, 0, 5]]);
}

#[test]
fn drop_last_drops_the_short_batch() {
    let loader = Loader::new(Arc::new(tensor_dataset(10)), 4)
        .unwrap()
        .drop_last(true);
    assert_eq!(loader.len(), 2);
    assert_eq!(labels(&loader), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);

    let loader = Loader::new(Arc::new(tensor_dataset(3)), 4)
        .unwrap()
        .drop_last(true);
    assert!(loader.is_empty());
    assert_eq!(loader.iter().count(), 0);
}

#[test]
fn tensor_dataset_fast_path_equals_stacking_samples() {
    let dataset = tensor_dataset(12);
    let indices = [7, 3, 3, 11, 0];
    let fast = dataset.get_batch(&indices).unwrap();
    let samples: Vec<Sample> = indices.iter().map(|&i| dataset.get(i).unwrap()).collect();
    let stacked = collate(&samples).unwrap();
    assert_same_batches(&[fast], &[stacked]);

    // The same batches as a dataset without the fast path.
    let slow = Loader::new(Arc::new(Counting::new(12)), 5).unwrap();
    let fast = Loader::new(Arc::new(tensor_dataset(12)), 5).unwrap();
    assert_same_batches(&collect_ok(&slow), &collect_ok(&fast));
}

#[test]
fn prefetch_yields_the_same_batches_as_loading_inline() {
    let order = DistributedSampler::new(37, 1, 0).unwrap().seed(3).indices();
    for dataset in [
        Arc::new(tensor_dataset(37)) as Arc<dyn Dataset>,
        Arc::new(Counting::new(37)),
    ] {
        let inline = Loader::new(Arc::clone(&dataset), 5)
            .unwrap()
            .indices(order.clone());
        let expected = collect_ok(&inline);
        assert_eq!(expected.len(), 8);
        for depth in [1, 2, 16] {
            let prefetched = inline.clone().prefetch(depth);
            assert_same_batches(&collect_ok(&prefetched), &expected);
        }
    }
}

#[test]
fn dropping_the_iterator_early_stops_the_prefetch_thread() {
    let dataset = Arc::new(Counting::new(1000));
    let loader = Loader::new(dataset.clone(), 1).unwrap().prefetch(2);
    let mut iter = loader.iter();
    let first = iter.next().unwrap().unwrap();
    assert_eq!(first[1].to_vec1::<u32>().unwrap(), vec![0]);
    drop(iter);

    // The thread held a clone of the dataset: wait (bounded) for it to go.
    let deadline = Instant::now() + Duration::from_secs(60);
    while Arc::strong_count(&dataset) > 2 {
        assert!(
            Instant::now() < deadline,
            "the prefetch thread did not exit after the iterator was dropped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // One batch taken, at most two in the channel, one being sent.
    let gets = dataset.gets.load(Ordering::SeqCst);
    assert!((1..=4).contains(&gets), "{gets} samples loaded");
    drop(loader);
    assert_eq!(Arc::strong_count(&dataset), 1);
}

#[test]
fn a_dataset_error_comes_back_as_an_item_and_ends_the_pass() {
    for depth in [0, 1, 3] {
        let dataset = Arc::new(Counting {
            fail_at: Some(5),
            ..Counting::new(20)
        });
        let loader = Loader::new(dataset.clone(), 2).unwrap().prefetch(depth);
        let items: Vec<_> = loader.iter().collect();
        assert_eq!(items.len(), 3, "prefetch {depth}");
        assert!(items[0].is_ok() && items[1].is_ok());
        match &items[2] {
            Err(err @ LoaderError::Sample { index: 5, .. }) => {
                assert!(err.to_string().contains("sample 5 is corrupt"), "{err}");
            }
            other => panic!("expected a Sample error, got {other:?}"),
        }
        // Nothing was loaded past the failing batch.
        assert_eq!(dataset.gets.load(Ordering::SeqCst), 6, "prefetch {depth}");
    }
}

#[test]
fn a_panic_in_the_prefetch_thread_comes_back_as_an_error() {
    let dataset = Arc::new(Counting {
        panic_at: Some(3),
        ..Counting::new(10)
    });
    let loader = Loader::new(dataset, 2).unwrap().prefetch(2);
    let items: Vec<_> = loader.iter().collect();
    assert_eq!(items.len(), 2);
    match &items[1] {
        Err(LoaderError::WorkerPanicked { message }) => {
            assert!(message.contains("dataset panicked at 3"), "{message}");
        }
        other => panic!("expected WorkerPanicked, got {other:?}"),
    }
}

#[test]
fn out_of_range_indices_are_an_error_item() {
    for depth in [0, 2] {
        let loader = Loader::new(Arc::new(tensor_dataset(4)), 2)
            .unwrap()
            .indices(vec![0, 1, 2, 9])
            .prefetch(depth);
        let items: Vec<_> = loader.iter().collect();
        assert_eq!(items.len(), 2);
        assert!(matches!(
            items[1],
            Err(LoaderError::IndexOutOfRange { index: 9, len: 4 })
        ));
    }
}

#[test]
fn bad_configurations_are_typed_errors() {
    assert!(matches!(
        Loader::new(Arc::new(tensor_dataset(4)), 0),
        Err(LoaderError::ZeroBatchSize)
    ));
    assert!(matches!(
        TensorDataset::new(vec![]),
        Err(LoaderError::NoFields)
    ));
    let scalar = Tensor::new(1f32, &Device::Cpu).unwrap();
    assert!(matches!(
        TensorDataset::new(vec![scalar]),
        Err(LoaderError::ScalarField { field: 0 })
    ));

    let x = Tensor::zeros((5, 3), DType::F32, &Device::Cpu).unwrap();
    let y = Tensor::zeros(5, DType::U32, &Device::Cpu).unwrap();
    let w = Tensor::zeros(4, DType::U32, &Device::Cpu).unwrap();
    let err = TensorDataset::new(vec![x, y, w]).unwrap_err();
    assert!(matches!(
        err,
        LoaderError::FieldSizeMismatch {
            field: 2,
            expected: 5,
            found: 4
        }
    ));
    assert!(err.to_string().contains("field 2 has 4"), "{err}");

    assert!(matches!(collate(&[]), Err(LoaderError::EmptyBatch)));
    let a = vec![Tensor::new(1f32, &Device::Cpu).unwrap()];
    let b = vec![a[0].clone(), a[0].clone()];
    assert!(matches!(
        collate(&[a, b]),
        Err(LoaderError::FieldCount {
            position: 1,
            expected: 1,
            found: 2
        })
    ));
}

#[test]
fn even_batches_complete_the_last_batch_from_the_start() {
    let loader = Loader::new(Arc::new(tensor_dataset(10)), 2)
        .unwrap()
        .indices(vec![5, 6, 7, 8, 9])
        .even_batches(true);
    assert_eq!(loader.len(), 3);
    assert_eq!(labels(&loader), vec![vec![5, 6], vec![7, 8], vec![9, 5]]);
}

#[test]
fn num_batches_pads_by_cycling_and_cuts_extra_batches() {
    let base = Loader::new(Arc::new(tensor_dataset(10)), 2)
        .unwrap()
        .indices(vec![0, 1, 2]);
    let padded = base.clone().num_batches(4).prefetch(1);
    assert_eq!(padded.len(), 4);
    assert_eq!(
        labels(&padded),
        vec![vec![0, 1], vec![2, 0], vec![1, 2], vec![0, 1]]
    );
    let cut = base.clone().num_batches(1);
    assert_eq!(labels(&cut), vec![vec![0, 1]]);

    let empty = base.indices(vec![]).num_batches(2);
    let items: Vec<_> = empty.iter().collect();
    assert_eq!(items.len(), 1);
    assert!(matches!(
        items[0],
        Err(LoaderError::NothingToCycle { num_batches: 2 })
    ));
}

#[test]
fn batches_per_rank_is_the_max_or_the_min_with_drop_last() {
    assert_eq!(batches_per_rank(&[5, 4, 4], 2, false).unwrap(), 3);
    assert_eq!(batches_per_rank(&[5, 4, 3], 2, true).unwrap(), 1);
    assert_eq!(batches_per_rank(&[], 2, false).unwrap(), 0);
    assert!(matches!(
        batches_per_rank(&[3], 0, false),
        Err(LoaderError::ZeroBatchSize)
    ));
}

#[test]
fn drop_padding_interleaves_ranks_and_drops_the_tail() {
    // 7 samples on 3 ranks: positions 7 and 8 are padding.
    let per_rank = vec![
        vec!['a', 'd', 'g'],
        vec!['b', 'e', 'x'],
        vec!['c', 'f', 'y'],
    ];
    assert_eq!(
        drop_padding(&per_rank, 7),
        vec!['a', 'b', 'c', 'd', 'e', 'f', 'g']
    );
    assert!(drop_padding::<u8>(&[], 5).is_empty());
}

/// What each rank's loader produces (the `y` labels, flattened), with every
/// rank running the same number of batches.
fn per_rank_labels(
    n: usize,
    replicas: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
) -> (Vec<Vec<u32>>, Vec<usize>) {
    let dataset: Arc<dyn Dataset> = Arc::new(tensor_dataset(n));
    let samplers: Vec<DistributedSampler> = (0..replicas)
        .map(|rank| {
            DistributedSampler::new(n, replicas, rank)
                .unwrap()
                .shuffle(shuffle)
                .seed(seed)
                .drop_last(drop_last)
        })
        .collect();
    let counts: Vec<usize> = samplers.iter().map(DistributedSampler::len).collect();
    let k = batches_per_rank(&counts, batch_size, false).unwrap();
    let per_rank = samplers
        .iter()
        .map(|s| {
            let loader = Loader::new(Arc::clone(&dataset), batch_size)
                .unwrap()
                .indices(s.indices())
                .num_batches(k);
            labels(&loader).concat()
        })
        .collect();
    (per_rank, samplers[0].global_order())
}

#[test]
fn drop_padding_counts_every_sample_exactly_once_without_shuffle() {
    let (per_rank, _) = per_rank_labels(10, 3, 3, false, 0, false);
    // Ranks produced 4 samples each, padded up to two batches of 3.
    assert!(per_rank.iter().all(|r| r.len() == 6));
    let all = drop_padding(&per_rank, 10);
    assert_eq!(all, (0..10u32).collect::<Vec<_>>());
}

#[test]
fn drop_padding_counts_every_sample_exactly_once_with_shuffle() {
    let (per_rank, order) = per_rank_labels(23, 4, 4, true, 11, false);
    let all = drop_padding(&per_rank, 23);
    let expected: Vec<u32> = order.iter().map(|&i| i as u32).collect();
    assert_eq!(all, expected);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn drop_padding_restores_the_sampler_order(
        n in 1usize..60, replicas in 1usize..6, batch_size in 1usize..7,
        shuffle: bool, seed in 0u64..100, drop_last: bool,
    ) {
        let (per_rank, order) =
            per_rank_labels(n, replicas, batch_size, shuffle, seed, drop_last);
        // Without drop_last every sample once; with it, the first total_size
        // positions (which is what drop_padding must be told to keep).
        let kept = if drop_last { (n / replicas) * replicas } else { n };
        let all = drop_padding(&per_rank, kept);
        let expected: Vec<u32> = order[..kept].iter().map(|&i| i as u32).collect();
        prop_assert_eq!(all, expected);
    }
}

/// A resumed epoch: `skip_batches(k)` yields exactly the batches after the
/// first `k` of a full pass, with or without prefetch, even batches or a
/// sampler's shard, and loads none of the skipped samples.
#[test]
fn skip_batches_yields_the_rest_of_a_pass_without_loading_the_skipped_ones() {
    let ys = |loader: &Loader| -> Vec<Vec<f32>> {
        loader
            .iter()
            .map(|b| {
                b.unwrap()[1]
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    };
    for prefetch in [0, 2] {
        for even in [false, true] {
            let indices = DistributedSampler::new(23, 2, 1).unwrap().seed(4).indices();
            let make = || {
                Loader::new(Arc::new(Counting::new(23)), 3)
                    .unwrap()
                    .indices(indices.clone())
                    .even_batches(even)
                    .prefetch(prefetch)
            };
            let full = ys(&make());
            for k in [0, 1, 2, full.len(), full.len() + 5] {
                let dataset = Arc::new(Counting::new(23));
                let loader = Loader::new(dataset.clone(), 3)
                    .unwrap()
                    .indices(indices.clone())
                    .even_batches(even)
                    .prefetch(prefetch)
                    .skip_batches(k);
                let rest = ys(&loader);
                let case = format!("prefetch {prefetch}, even {even}, skip {k}");
                assert_eq!(rest, full[k.min(full.len())..], "{case}");
                let loaded: usize = rest.iter().map(Vec::len).sum();
                assert_eq!(dataset.gets.load(Ordering::SeqCst), loaded, "{case}");
            }
        }
    }
}
