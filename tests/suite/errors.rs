//! Bad input and failing replicas give typed errors naming the culprit, and
//! leave the master variables untouched.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_dp::{cpu_devices, DataParallel, Error, LossReduction};
use candle_nn::{loss, VarBuilder, VarMap};
use common::*;

/// A BatchNorm net that fails (or panics) when a replica sees a marker
/// value (999) in the first column of its chunk.
struct Fragile {
    net: BnNet,
    panic: bool,
}

impl ModuleT for Fragile {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let out = self.net.forward_t(x, train)?; // runs BatchNorm first: buffers move
        let first = x.narrow(1, 0, 1)?.flatten_all()?.to_vec1::<f32>()?;
        if first.contains(&999.) {
            if self.panic {
                panic!("marker row reached the model");
            }
            candle_core::bail!("marker row reached the model");
        }
        Ok(out)
    }
}

fn batch_with_marker_in_row(rows: usize, marker_row: usize) -> Tensor {
    let x = Tensor::randn(0f32, 1., (rows, 12), &Device::Cpu).unwrap();
    let mut v = x.to_vec2::<f32>().unwrap();
    v[marker_row][0] = 999.;
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn fragile_dp(panic: bool) -> (VarMap, DataParallel<Fragile>) {
    let varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(3), move |vb| {
        Ok(Fragile {
            net: BnNet::new(vb)?,
            panic,
        })
    })
    .unwrap();
    (varmap, dp)
}

#[test]
fn no_devices_is_an_error() {
    let err = DataParallel::new(&VarMap::new(), DType::F32, &[], |vb| BnNet::new(vb))
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::NoDevices), "{err}");
    assert!(err.to_string().contains("no devices"), "{err}");
}

#[test]
fn failing_replica_is_named_and_master_vars_are_unchanged() {
    let (varmap, dp) = fragile_dp(false);
    let before = snapshot(&varmap);
    // 9 rows on 3 replicas: rows 6..9 go to replica 2.
    let x = batch_with_marker_in_row(9, 7);
    let err = dp.forward_t(&x, true).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::Replica { replica: 2, .. }), "{err}");
    assert!(
        err.to_string().starts_with("in replica 2 on device cpu"),
        "{err}"
    );
    assert!(err.to_string().contains("marker row"), "{err}");
    // Replica 0 ran BatchNorm in training mode, but the failed step is not committed.
    assert!(
        identical(&snapshot(&varmap), &before),
        "master vars and buffers unchanged"
    );
}

#[test]
fn panicking_replica_is_caught_named_and_the_engine_keeps_working() {
    let (varmap, dp) = fragile_dp(true);
    let before = snapshot(&varmap);
    let x = batch_with_marker_in_row(9, 4);
    let err = dp
        .forward_backward(x, LossReduction::Mean, |m: &Fragile, x| {
            m.forward_t(&x, true)?.mean_all()
        })
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(err, Error::ReplicaPanic { replica: 1, .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("replica 1 on device cpu panicked: marker row"),
        "{err}"
    );
    assert!(
        identical(&snapshot(&varmap), &before),
        "master vars and buffers unchanged"
    );
    // The worker survived the panic: the next step works and updates the buffers.
    let ok = Tensor::randn(0f32, 1., (9, 12), &Device::Cpu).unwrap();
    dp.forward_t(&ok, true).unwrap();
    assert!(
        !identical(&snapshot(&varmap), &before),
        "BN buffers move after a good step"
    );
}

#[test]
fn model_factory_failing_on_one_device_names_the_replica() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    // Call 0 builds the master, calls 1.. the replicas: fail on replica 2.
    let err = DataParallel::new(&VarMap::new(), DType::F32, &cpu_devices(4), move |vb| {
        if counter.fetch_add(1, Ordering::SeqCst) == 3 {
            candle_core::bail!("out of memory (simulated)");
        }
        BnNet::new(vb)
    })
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(err, Error::ReplicaBuild { replica: 2, .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("building replica 2 on device cpu failed: out of memory (simulated)"),
        "{err}"
    );
}

#[test]
fn a_factory_that_builds_different_vars_per_replica_is_rejected() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let err = DataParallel::new(
        &VarMap::new(),
        DType::F32,
        &cpu_devices(2),
        move |vb: VarBuilder| {
            let width = if counter.fetch_add(1, Ordering::SeqCst) == 2 {
                5
            } else {
                4
            };
            candle_nn::linear(3, width, vb)
        },
    )
    .map(|_| ())
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::ReplicaBuild { replica: 1, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("`weight`") && msg.contains("[5, 3]") && msg.contains("[4, 3]"),
        "{msg}"
    );
}

#[test]
fn scatter_dim_out_of_range_is_reported_before_any_replica_runs() {
    let varmap = VarMap::new();
    let dp = DataParallel::builder(&varmap, DType::F32, &cpu_devices(2))
        .dim(2)
        .build(|vb| candle_nn::linear(3, 2, vb))
        .unwrap();
    let err = dp
        .forward(&Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ScatterDimOutOfRange {
                dim: 2,
                rank: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn inputs_and_targets_of_different_batch_sizes_are_an_error() {
    let varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), |vb| {
        candle_nn::linear(3, 2, vb)
    })
    .unwrap();
    let x = Tensor::zeros((8, 3), DType::F32, &Device::Cpu).unwrap();
    let y = Tensor::zeros(7, DType::U32, &Device::Cpu).unwrap();
    let err = dp
        .forward_backward((x, y), LossReduction::Mean, |m, (x, y)| {
            loss::cross_entropy(&m.forward(&x)?, &y)
        })
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ScatterSizeMismatch {
                expected: 8,
                found: 7,
                leaf: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn backward_of_a_tensor_that_is_not_the_latest_output_is_an_error() {
    let varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), |vb| {
        candle_nn::linear(3, 2, vb)
    })
    .unwrap();
    let x = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
    let out = dp.forward(&x).unwrap();
    let other = (&out * 2.).unwrap();
    let err = dp
        .backward(&other, &other.ones_like().unwrap())
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::NoMatchingForward(_)), "{err}");
    // The real output still works, once.
    dp.backward(&out, &out.ones_like().unwrap()).unwrap();
    let err = dp
        .backward(&out, &out.ones_like().unwrap())
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("already ran"), "{err}");
}

#[test]
fn a_replica_slower_than_the_timeout_is_named() {
    struct Slow(candle_nn::Linear);
    impl Module for Slow {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            if x.dim(0)? == 1 {
                std::thread::sleep(Duration::from_secs(3));
            }
            self.0.forward(x)
        }
    }
    let varmap = VarMap::new();
    let dp = DataParallel::builder(&varmap, DType::F32, &cpu_devices(2))
        .timeout(Duration::from_millis(200))
        .build(|vb| Ok(Slow(candle_nn::linear(3, 2, vb)?)))
        .unwrap();
    // 3 rows on 2 replicas: 2 + 1, replica 1 sleeps.
    let err = dp
        .forward(&Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(err, Error::ReplicaTimeout { replica: 1, .. }),
        "{err}"
    );
}

#[cfg(feature = "cuda")]
#[test]
fn master_vars_not_on_the_first_device_are_rejected() {
    // Needs a GPU: on CPU every device is the same device.
    let varmap = VarMap::new();
    candle_nn::linear(
        3,
        2,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let gpu = Device::new_cuda_with_stream(0).unwrap();
    let err = DataParallel::new(&varmap, DType::F32, &[gpu], |vb| {
        candle_nn::linear(3, 2, vb)
    })
    .map(|_| ())
    .unwrap_err();
    assert!(matches!(err, Error::MasterVarOnWrongDevice { .. }), "{err}");
    assert!(
        err.to_string().contains("cuda:0") && err.to_string().contains("`bias`"),
        "{err}"
    );
}

/// Needs a GPU: a device on CUDA's per-thread default stream would have the
/// caller's and the workers' work on it run unordered.
#[cfg(feature = "cuda")]
#[test]
fn a_gpu_on_the_per_thread_default_stream_is_refused_with_the_call_to_use() {
    let varmap = VarMap::new();
    let with_stream = Device::new_cuda_with_stream(0).unwrap();
    let per_thread = Device::new_cuda(0).unwrap();
    let err = DataParallel::new(&varmap, DType::F32, &[with_stream, per_thread], |vb| {
        candle_nn::linear(3, 2, vb)
    })
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ImplicitCudaStream {
                role: "replica",
                index: 1,
                ordinal: 0
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("Device::new_cuda_with_stream(0)"),
        "{err}"
    );
    assert!(varmap.all_vars().is_empty(), "nothing was built");
}

/// Needs a GPU: two devices (streams) on one GPU cannot be ordered, since
/// candle's kernels record no events; the same device twice is fine.
#[cfg(feature = "cuda")]
#[test]
fn two_streams_of_one_gpu_are_refused_and_one_device_twice_is_not() {
    let varmap = VarMap::new();
    let a = Device::new_cuda_with_stream(0).unwrap();
    let b = Device::new_cuda_with_stream(0).unwrap();
    let err = DataParallel::new(&varmap, DType::F32, &[a.clone(), b], |vb| {
        candle_nn::linear(3, 2, vb)
    })
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(&err, Error::TwoStreamsOfOneGpu { first, second, ordinal: 0 }
            if first == "replica 0" && second == "replica 1"),
        "{err}"
    );
    DataParallel::new(&varmap, DType::F32, &[a.clone(), a], |vb| {
        candle_nn::linear(3, 2, vb)
    })
    .unwrap();
}
