//! nn.DataParallel behaviours at the DataParallel level: how many replicas
//! run, what they receive, what comes back.

use candle_core::{DType, Device, Module, Tensor};
use candle_dp::{cpu_devices, DataParallel, Split};
use candle_nn::{linear, seq, Linear, VarMap};

fn dp(replicas: usize) -> DataParallel<Linear> {
    DataParallel::new(&VarMap::new(), DType::F32, &cpu_devices(replicas), |vb| {
        linear(3, 2, vb)
    })
    .unwrap()
}

fn rows_per_replica(dp: &DataParallel<Linear>, x: Tensor) -> Vec<u32> {
    dp.apply(x, |_, x| Tensor::new(&[x.dim(0)? as u32], &Device::Cpu))
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn nine_rows_on_four_devices_run_three_replicas() {
    let x = Tensor::zeros((9, 3), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(rows_per_replica(&dp(4), x), vec![3, 3, 3]);
}

#[test]
fn ten_rows_on_four_devices_split_like_torch_chunk() {
    let x = Tensor::zeros((10, 3), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(rows_per_replica(&dp(4), x), vec![3, 3, 3, 1]);
}

#[test]
fn a_batch_smaller_than_the_device_count_runs_one_replica_per_row() {
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(rows_per_replica(&dp(8), x), vec![1, 1]);
}

#[test]
fn an_empty_batch_runs_the_model_once_and_returns_zero_rows() {
    let dp = dp(3);
    let out = dp
        .forward(&Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    assert_eq!(out.dims(), &[0, 2]);
    assert_eq!(
        rows_per_replica(
            &dp,
            Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap()
        ),
        vec![0]
    );
}

#[test]
fn input_without_tensors_runs_once_on_the_first_replica() {
    let calls = dp(3)
        .apply((7u32, "x".to_string()), |_, (n, s)| {
            Tensor::new(&[n + s.len() as u32], &Device::Cpu)
        })
        .unwrap();
    assert_eq!(calls.to_vec1::<u32>().unwrap(), vec![8]);
}

#[test]
fn scalar_outputs_become_one_entry_per_replica() {
    let x = Tensor::arange(0f32, 12., &Device::Cpu)
        .unwrap()
        .reshape((4, 3))
        .unwrap();
    let sums = dp(2).apply(x, |_, x| x.sum_all()).unwrap();
    assert_eq!(sums.to_vec1::<f32>().unwrap(), vec![15., 51.]);
}

#[test]
fn explicit_chunk_sizes_are_honoured() {
    let x = Tensor::zeros((7, 3), DType::F32, &Device::Cpu).unwrap();
    let rows: Vec<u32> = dp(3)
        .apply_split(x, &Split::Sizes(vec![1, 6]), |_, x| {
            Tensor::new(&[x.dim(0)? as u32], &Device::Cpu)
        })
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(rows, vec![1, 6]);
}

#[test]
fn outputs_gather_along_dim_1_when_asked() {
    let varmap = VarMap::new();
    let dp = DataParallel::builder(&varmap, DType::F32, &cpu_devices(2))
        .dim(1)
        .build(|vb| linear(3, 2, vb))
        .unwrap();
    // [batch 2, seq 5, features 3], split along the sequence dim.
    let x = Tensor::randn(0f32, 1., (2, 5, 3), &Device::Cpu).unwrap();
    let out = dp.forward(&x).unwrap();
    let single = linear(
        3,
        2,
        candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let expected = single.forward(&x).unwrap();
    assert_eq!(out.dims(), &[2, 5, 2]);
    let d = (out - expected)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(d < 1e-6, "{d}");
}

#[test]
fn models_that_are_not_send_work_because_each_replica_lives_on_its_worker() {
    // candle_nn::Sequential holds Box<dyn Module>, which is not Send.
    let varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), |vb| {
        Ok(seq()
            .add(linear(3, 4, vb.pp("a"))?)
            .add_fn(|x| x.relu())
            .add(linear(4, 2, vb.pp("b"))?))
    })
    .unwrap();
    let out = dp
        .forward(&Tensor::ones((5, 3), DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    assert_eq!(out.dims(), &[5, 2]);
    assert_eq!(dp.vars().len(), 4);
}

/// Keyed dropout on the replicas draws, for each row, the mask one device
/// draws for it: each replica's part carries the caller's sample keys
/// moved on by the rows before it. Without keys it fails, naming them.
#[test]
fn keyed_dropout_on_the_replicas_draws_one_devices_masks_row_by_row() {
    use candle_dp::ops::dropout::{keyed_dropout, with_sample_keys, SampleKeys};
    let x = Tensor::ones((9, 5), DType::F32, &Device::Cpu).unwrap();
    let keys = SampleKeys {
        seed: 3,
        step: 2,
        first: 4,
    };
    let one = with_sample_keys(keys, || keyed_dropout(&x, 0.5, 1, true)).unwrap();
    let one = one.to_vec2::<f32>().unwrap();
    assert!(one.iter().flatten().any(|&v| v == 0.0));
    for replicas in [2, 3, 4] {
        let dp = dp(replicas);
        let split = with_sample_keys(keys, || {
            dp.apply(x.clone(), |_, x: Tensor| keyed_dropout(&x, 0.5, 1, true))
                .map_err(|e| e.to_string())
        })
        .unwrap();
        assert_eq!(split.to_vec2::<f32>().unwrap(), one, "{replicas} replicas");
    }
    let err = dp(2)
        .apply(x, |_, x: Tensor| keyed_dropout(&x, 0.5, 1, true))
        .unwrap_err();
    assert!(err.to_string().contains("no sample keys"), "{err}");
}
