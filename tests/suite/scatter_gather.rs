//! Scatter and gather: torch.chunk sizes, nested inputs, round trips, errors.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Device, Tensor};
use candle_dp::{chunk_sizes, gather, scatter, Error, Replicated, Scatter, ScatterPlan, Split};
use proptest::prelude::*;

/// torch.chunk as `aten/src/ATen/native/TensorShape.cpp` computes it:
/// `split_size = ceil(N / k)`; N = 0 goes through `split_with_sizes` with k
/// zero sizes; otherwise `split(split_size)`, which makes
/// `max(ceil(N / split_size), 1)` chunks, the last one
/// `split_size - (split_size * num_splits - N)` long.
fn torch_chunk(n: i64, k: i64) -> Vec<usize> {
    let split_size = (n + k - 1) / k;
    if split_size == 0 && n == 0 {
        let mut sizes = vec![split_size; k as usize];
        sizes[k as usize - 1] = split_size - (split_size * k - n);
        return sizes.into_iter().map(|s| s as usize).collect();
    }
    let num_splits = ((n + split_size - 1) / split_size).max(1);
    let last = split_size - (split_size * num_splits - n);
    let mut sizes = vec![split_size as usize; num_splits as usize];
    sizes[num_splits as usize - 1] = last as usize;
    sizes
}

#[test]
fn chunk_sizes_equal_torch_chunk_for_every_n_up_to_40_and_k_up_to_8() {
    for n in 0..=40 {
        for k in 1..=8 {
            assert_eq!(
                chunk_sizes(n, k),
                torch_chunk(n as i64, k as i64),
                "N={n} k={k}"
            );
        }
    }
}

#[test]
fn nine_rows_on_four_devices_uses_three_replicas() {
    assert_eq!(chunk_sizes(9, 4), vec![3, 3, 3]);
    assert_eq!(chunk_sizes(10, 4), vec![3, 3, 3, 1]);
    assert_eq!(chunk_sizes(2, 8), vec![1, 1]);
}

fn devices(n: usize) -> Vec<Device> {
    vec![Device::Cpu; n]
}

fn plan_for<I: Scatter>(input: &I, dim: usize, k: usize) -> ScatterPlan {
    ScatterPlan::for_input(input, dim, &Split::Even, &devices(k))
        .unwrap()
        .unwrap()
}

#[test]
fn nested_inputs_split_tensors_and_replicate_everything_else() {
    let x = Tensor::arange(0f32, 10., &Device::Cpu)
        .unwrap()
        .reshape((5, 2))
        .unwrap();
    let mut map = HashMap::new();
    map.insert(
        "mask".to_string(),
        Tensor::ones(5, DType::U8, &Device::Cpu).unwrap(),
    );
    let input = (
        x.clone(),
        vec![x.clone()],
        map,
        Some(x.clone()),
        (0.5f64, "tag".to_string()),
        Replicated(x.clone()),
    );
    let plan = plan_for(&input, 0, 2);
    assert_eq!(plan.sizes, vec![3, 2]);
    let parts = scatter(&input, &plan).unwrap();
    assert_eq!(parts.len(), 2);
    for (part, rows) in parts.iter().zip([3, 2]) {
        assert_eq!(part.0.dims(), &[rows, 2]);
        assert_eq!(part.1[0].dims(), &[rows, 2]);
        assert_eq!(part.2["mask"].dims(), &[rows]);
        assert_eq!(part.3.as_ref().unwrap().dims(), &[rows, 2]);
        assert_eq!(part.4, (0.5, "tag".to_string()));
        assert_eq!(
            part.5 .0.dims(),
            &[5, 2],
            "Replicated tensors are not split"
        );
    }
    assert_eq!(
        parts[1].0.to_vec2::<f32>().unwrap(),
        vec![vec![6., 7.], vec![8., 9.]]
    );
}

#[test]
fn input_without_tensors_has_no_plan_and_runs_once() {
    let plan =
        ScatterPlan::for_input(&(1u32, "x".to_string()), 0, &Split::Even, &devices(3)).unwrap();
    assert!(plan.is_none());
}

#[test]
fn empty_batch_runs_on_a_single_replica() {
    let x = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap();
    let plan = plan_for(&x, 0, 4);
    assert_eq!(plan.sizes, vec![0]);
}

#[test]
fn explicit_sizes_are_used_and_validated() {
    let x = Tensor::zeros((7, 3), DType::F32, &Device::Cpu).unwrap();
    let plan = ScatterPlan::for_input(&x, 0, &Split::Sizes(vec![5, 2]), &devices(3))
        .unwrap()
        .unwrap();
    assert_eq!(plan.sizes, vec![5, 2]);
    for (sizes, why) in [
        (vec![5, 1], "add up"),
        (vec![2, 2, 2, 1], "more chunks than devices"),
        (vec![7, 0], "empty chunk"),
        (vec![], "no chunk"),
    ] {
        let err =
            ScatterPlan::for_input(&x, 0, &Split::Sizes(sizes.clone()), &devices(3)).unwrap_err();
        assert!(matches!(err, Error::InvalidChunkSizes { .. }), "{sizes:?}");
        assert!(err.to_string().contains(why), "{sizes:?}: {err}");
    }
}

#[test]
fn scatter_dim_out_of_range_names_the_tensor_and_its_shape() {
    let input = (
        Tensor::zeros((4, 2, 3), DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap(),
    );
    let err = ScatterPlan::for_input(&input, 2, &Split::Even, &devices(2)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ScatterDimOutOfRange {
                dim: 2,
                leaf: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("tensor #1 of shape [4]"), "{err}");
}

#[test]
fn tensors_that_disagree_on_the_scatter_dim_are_an_error_naming_the_tensor() {
    let input = vec![
        Tensor::zeros((6, 2), DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros((5, 2), DType::F32, &Device::Cpu).unwrap(),
    ];
    let err = ScatterPlan::for_input(&input, 0, &Split::Even, &devices(2)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ScatterSizeMismatch {
                expected: 6,
                found: 5,
                leaf: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn scalar_outputs_gather_into_one_entry_per_replica() {
    let parts: Vec<Tensor> = (0..3)
        .map(|i| Tensor::new(i as f32, &Device::Cpu).unwrap())
        .collect();
    let v = gather(parts, 0, &Device::Cpu).unwrap();
    assert_eq!(v.to_vec1::<f32>().unwrap(), vec![0., 1., 2.]);
}

#[test]
fn gather_shape_mismatch_names_the_replica() {
    let parts = vec![
        Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap(),
    ];
    let err = gather(parts, 0, &Device::Cpu).unwrap_err();
    assert!(matches!(err, Error::Gather { replica: 2, .. }), "{err}");
    assert!(err.to_string().contains("replica 2"), "{err}");
}

#[test]
fn gather_of_maps_with_different_keys_names_the_replica() {
    let t = || Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    let a: BTreeMap<String, Tensor> = [("x".to_string(), t())].into();
    let b: BTreeMap<String, Tensor> = [("y".to_string(), t())].into();
    let err = gather(vec![a, b], 0, &Device::Cpu).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::Gather { replica: 1, .. }), "{err}");
}

#[test]
fn none_outputs_gather_to_none_and_a_mix_is_an_error() {
    let nones: Vec<Option<Tensor>> = vec![None, None];
    assert!(gather(nones, 0, &Device::Cpu).unwrap().is_none());
    let mixed = vec![
        Some(Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap()),
        None,
    ];
    let err = gather(mixed, 0, &Device::Cpu).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::Gather { replica: 1, .. }), "{err}");
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn scatter_then_gather_returns_the_input(
        dims in prop::collection::vec(0usize..5, 1..4),
        dim_pick in 0usize..4,
        k in 1usize..6,
    ) {
        let dim = dim_pick % dims.len();
        let n: usize = dims.iter().product();
        let x = Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap().reshape(dims.as_slice()).unwrap();
        let plan = plan_for(&x, dim, k);
        prop_assert_eq!(plan.sizes.iter().sum::<usize>(), dims[dim]);
        let parts = scatter(&x, &plan).unwrap();
        let back = gather(parts, dim, &Device::Cpu).unwrap();
        prop_assert_eq!(back.dims(), x.dims());
        prop_assert_eq!(values(&back), values(&x));
    }

    #[test]
    fn nested_scatter_then_gather_returns_every_leaf(
        rows in 0usize..12,
        cols in 1usize..4,
        k in 1usize..6,
    ) {
        let x = Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu).unwrap().reshape((rows, cols)).unwrap();
        let y = Tensor::arange(0f32, rows as f32, &Device::Cpu).unwrap();
        let mut map = HashMap::new();
        map.insert("y".to_string(), y.clone());
        let input = (x.clone(), vec![y.clone(), x.clone()], map, Some(y.clone()));
        let plan = plan_for(&input, 0, k);
        let parts = scatter(&input, &plan).unwrap();
        let back: (Tensor, Vec<Tensor>, HashMap<String, Tensor>, Option<Tensor>) = gather(parts, 0, &Device::Cpu).unwrap();
        prop_assert_eq!(values(&back.0), values(&x));
        prop_assert_eq!(values(&back.1[0]), values(&y));
        prop_assert_eq!(values(&back.1[1]), values(&x));
        prop_assert_eq!(values(&back.2["y"]), values(&y));
        prop_assert_eq!(values(back.3.as_ref().unwrap()), values(&y));
    }
}

/// A replica on another device receives a storage of exactly its rows: a
/// narrowed view moved with `to_device` would carry the whole batch's
/// storage along (candle copies a view's entire storage across devices).
#[cfg(feature = "cuda")]
#[test]
fn a_replica_on_a_gpu_receives_only_its_rows() -> anyhow::Result<()> {
    use candle_core::Storage;
    let gpu = Device::new_cuda(0)?;
    let x = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((6, 4))?;
    let devices = [Device::Cpu, gpu.clone()];
    let plan = ScatterPlan::for_input(&x, 0, &Split::Even, &devices)?
        .ok_or_else(|| anyhow::anyhow!("no plan"))?;
    let parts = scatter(&x, &plan)?;
    assert_eq!(parts[1].device().location(), gpu.location());
    assert_eq!(
        parts[1].to_device(&Device::Cpu)?.to_vec2::<f32>()?,
        x.narrow(0, 3, 3)?.to_vec2::<f32>()?
    );
    let (storage, _) = parts[1].storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        anyhow::bail!("replica 1 is not on the GPU");
    };
    assert_eq!(cuda.as_cuda_slice::<f32>()?.len(), 3 * 4);
    Ok(())
}
