//! The core guarantee: training through DataParallel on R replicas equals
//! single-device training on the same global batch, for every backward path.

use crate::common;

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::{cpu_devices, DataParallel, LossReduction};
use candle_nn::{loss, AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use common::*;

#[derive(Clone, Copy, Debug)]
enum Path {
    DropIn,
    ParallelFromLoss,
    ParallelFromGradOutput,
    ReplicaLoss,
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    Sgd,
    /// SGD at a tenth of `Sgd`'s rate: many steps of a wide model stay
    /// stable, so that rounding differences between equivalent runs are
    /// not amplified into different weights.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    SlowSgd,
    AdamW,
}

#[derive(Clone, Copy, Debug)]
enum Model {
    Mlp,
    Conv,
    /// Wide enough that the GPU's kernels take longer than their launch: a
    /// missing ordering between streams shows as wrong values.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    WideMlp,
}

const STEPS: usize = 10;
const BATCH: usize = 13; // uneven on 2, 3 and 4 replicas

enum Net {
    Mlp(Mlp),
    Conv(ConvNet),
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(m) => m.forward(x),
            Net::Conv(m) => m.forward(x),
        }
    }
}

fn build(model: Model, vb: VarBuilder) -> candle_core::Result<Net> {
    Ok(match model {
        Model::Mlp => Net::Mlp(Mlp::new(vb, (6, 16, 5))?),
        Model::Conv => Net::Conv(ConvNet::new(vb)?),
        Model::WideMlp => Net::Mlp(Mlp::new(vb, (256, 1024, 5))?),
    })
}

/// Either optimizer, behind one interface.
enum AnyOpt {
    Sgd(SGD),
    AdamW(AdamW),
}

impl AnyOpt {
    fn new(opt: Opt, varmap: &VarMap) -> Self {
        match opt {
            Opt::Sgd => AnyOpt::Sgd(SGD::new(varmap.all_vars(), 0.1).unwrap()),
            Opt::SlowSgd => AnyOpt::Sgd(SGD::new(varmap.all_vars(), 0.01).unwrap()),
            Opt::AdamW => AnyOpt::AdamW(
                AdamW::new(
                    varmap.all_vars(),
                    ParamsAdamW {
                        lr: 0.01,
                        ..Default::default()
                    },
                )
                .unwrap(),
            ),
        }
    }

    fn backward_step(&mut self, loss: &Tensor) {
        match self {
            AnyOpt::Sgd(o) => o.backward_step(loss).unwrap(),
            AnyOpt::AdamW(o) => o.backward_step(loss).unwrap(),
        }
    }

    fn step(&mut self, grads: &GradStore) {
        match self {
            AnyOpt::Sgd(o) => o.step(grads).unwrap(),
            AnyOpt::AdamW(o) => o.step(grads).unwrap(),
        }
    }
}

struct Data {
    init: HashMap<String, Tensor>,
    xs: Vec<Tensor>,
    ys: Vec<Tensor>,
}

fn data(model: Model) -> Data {
    data_sized(model, BATCH, STEPS)
}

/// Random batches of `batch` rows for `steps` steps, and initial values.
fn data_sized(model: Model, batch: usize, steps: usize) -> Data {
    let varmap = VarMap::new();
    build(
        model,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let shape: &[usize] = match model {
        Model::Mlp => &[batch, 6],
        Model::Conv => &[batch, 1, 8, 8],
        Model::WideMlp => &[batch, 256],
    };
    let xs = (0..steps)
        .map(|_| Tensor::randn(0f32, 1., shape, &Device::Cpu).unwrap())
        .collect();
    let ys = (0..steps)
        .map(|s| {
            Tensor::from_vec(
                (0..batch as u32).map(|i| (i * 7 + s as u32) % 5).collect(),
                batch,
                &Device::Cpu,
            )
            .unwrap()
        })
        .collect();
    Data {
        init: snapshot(&varmap),
        xs,
        ys,
    }
}

/// The initial values on `device`, as a fresh `VarMap`.
fn varmap_on(d: &Data, device: &Device) -> VarMap {
    let on_device = d
        .init
        .iter()
        .map(|(name, t)| (name.clone(), t.to_device(device).unwrap()))
        .collect();
    varmap_from(&on_device)
}

/// The step's batch on `device`.
fn batch_on(x: &Tensor, y: &Tensor, device: &Device) -> (Tensor, Tensor) {
    (x.to_device(device).unwrap(), y.to_device(device).unwrap())
}

fn single_device(model: Model, opt: Opt, d: &Data, device: &Device) -> HashMap<String, Tensor> {
    let varmap = varmap_on(d, device);
    let net = build(model, VarBuilder::from_varmap(&varmap, DType::F32, device)).unwrap();
    let mut opt = AnyOpt::new(opt, &varmap);
    for (x, y) in d.xs.iter().zip(&d.ys) {
        let (x, y) = batch_on(x, y, device);
        let loss = loss::cross_entropy(&net.forward(&x).unwrap(), &y).unwrap();
        opt.backward_step(&loss);
    }
    snapshot(&varmap)
}

/// Training through a DataParallel on `devices`, the master on `devices[0]`.
fn data_parallel(
    model: Model,
    opt: Opt,
    devices: &[Device],
    path: Path,
    d: &Data,
) -> HashMap<String, Tensor> {
    let varmap = varmap_on(d, &devices[0]);
    let dp = DataParallel::new(&varmap, DType::F32, devices, move |vb| build(model, vb)).unwrap();
    let mut opt = AnyOpt::new(opt, &varmap);
    for (x, y) in d.xs.iter().zip(&d.ys) {
        let (x, y) = &batch_on(x, y, &devices[0]);
        match path {
            Path::DropIn => {
                let loss = loss::cross_entropy(&dp.forward(x).unwrap(), y).unwrap();
                opt.backward_step(&loss);
            }
            Path::ParallelFromLoss => {
                let out = dp.forward(x).unwrap();
                let s = dp
                    .backward_from_loss(&out, |o| loss::cross_entropy(o, y))
                    .unwrap();
                opt.step(&s.grads);
            }
            Path::ParallelFromGradOutput => {
                let out = dp.forward(x).unwrap();
                // d(mean cross-entropy)/d(logits) = (softmax - onehot) / N
                let n = out.dim(0).unwrap() as f64;
                let onehot = candle_nn::encoding::one_hot(y.clone(), 5, 1f32, 0f32).unwrap();
                let sm = candle_nn::ops::softmax_last_dim(&out.detach()).unwrap();
                let grad = ((sm - onehot).unwrap() / n).unwrap();
                let grads = dp.backward(&out, &grad).unwrap();
                opt.step(&grads);
            }
            Path::ReplicaLoss => {
                let s = dp
                    .forward_backward((x.clone(), y.clone()), LossReduction::Mean, |m, (x, y)| {
                        loss::cross_entropy(&m.forward(&x)?, &y)
                    })
                    .unwrap();
                opt.step(&s.grads);
            }
        }
    }
    snapshot(&varmap)
}

/// Every path with 1 to `max_replicas` replicas (`devices(r)`) against one
/// device (`devices(1)[0]`), within `tolerance` (relative).
fn check_on(
    d: &Data,
    model: Model,
    opt: Opt,
    max_replicas: usize,
    devices: impl Fn(usize) -> Vec<Device>,
    tolerance: f32,
) {
    let reference = single_device(model, opt, d, &devices(1)[0]);
    assert!(
        max_rel_diff(&reference, &d.init) > 1e-3,
        "training moved the weights"
    );
    for replicas in 1..=max_replicas {
        for path in [
            Path::DropIn,
            Path::ParallelFromLoss,
            Path::ParallelFromGradOutput,
            Path::ReplicaLoss,
        ] {
            let got = data_parallel(model, opt, &devices(replicas), path, d);
            let diff = max_rel_diff(&got, &reference);
            assert!(
                diff < tolerance,
                "{model:?} {opt:?} {replicas} replicas via {path:?}: relative difference {diff}\n{}",
                diff_report(&got, &reference)
            );
        }
    }
}

fn check(model: Model, opt: Opt) {
    check_on(&data(model), model, opt, 4, cpu_devices, 1e-5);
}

#[test]
fn mlp_with_sgd_on_1_to_4_replicas_matches_single_device() {
    check(Model::Mlp, Opt::Sgd);
}

#[test]
fn mlp_with_adamw_on_1_to_4_replicas_matches_single_device() {
    check(Model::Mlp, Opt::AdamW);
}

#[test]
fn conv_net_with_sgd_on_1_to_4_replicas_matches_single_device() {
    check(Model::Conv, Opt::Sgd);
}

#[test]
fn conv_net_with_adamw_on_1_to_4_replicas_matches_single_device() {
    check(Model::Conv, Opt::AdamW);
}

#[test]
fn all_backward_paths_give_the_same_gradients() {
    let d = data(Model::Mlp);
    let varmap = varmap_from(&d.init);
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(3), |vb| {
        Mlp::new(vb, (6, 16, 5))
    })
    .unwrap();
    let (x, y) = (&d.xs[0], &d.ys[0]);
    let out = dp.forward(x).unwrap();
    let loss = loss::cross_entropy(&out, y).unwrap();
    let drop_in = loss.backward().unwrap();
    let parallel = dp
        .backward_from_loss(&out, |o| loss::cross_entropy(o, y))
        .unwrap();
    let replica = dp
        .forward_backward((x.clone(), y.clone()), LossReduction::Mean, |m, (x, y)| {
            loss::cross_entropy(&m.forward(&x)?, &y)
        })
        .unwrap();
    let l = |t: &Tensor| t.to_scalar::<f32>().unwrap();
    assert!((l(&loss) - l(&parallel.loss)).abs() < 1e-6);
    assert!((l(&loss) - l(&replica.loss)).abs() < 1e-6);
    for (name, var) in dp.vars() {
        let a = drop_in.get(var.as_tensor()).unwrap();
        for (path, store) in [
            ("from loss", &parallel.grads),
            ("replica loss", &replica.grads),
        ] {
            let b = store
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{path}: no gradient for {name}"));
            let d = max_abs_diff(a, b);
            assert!(d < 1e-6, "{path}: {name} differs by {d}");
        }
    }
}

/// The same checks with replicas on CUDA devices: one GPU per replica where
/// the machine has them, replicas sharing a GPU otherwise
/// (`scripts/gpu_check.sh`).
#[cfg(feature = "cuda")]
mod on_gpus {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::CudaContext;

    /// Replica `i` on GPU `i % gpus`; replicas on one GPU share its device
    /// (one stream per GPU).
    fn gpu_devices(replicas: usize) -> Vec<Device> {
        let gpus = CudaContext::device_count().unwrap() as usize;
        let per_gpu: Vec<Device> = (0..gpus.min(replicas))
            .map(|i| Device::new_cuda_with_stream(i).unwrap())
            .collect();
        (0..replicas).map(|i| per_gpu[i % gpus].clone()).collect()
    }

    // GPU kernels sum in another order than the CPU's and than each other
    // at other batch sizes: a looser bound than on CPU.
    const TOLERANCE: f32 = 1e-4;

    /// Every path on 1 to 3 GPU replicas against one GPU.
    fn on_gpus(model: Model, opt: Opt) {
        check_on(&data(model), model, opt, 3, gpu_devices, TOLERANCE);
    }

    #[test]
    fn mlp_with_sgd_on_gpu_replicas_matches_one_gpu() {
        within(300, || on_gpus(Model::Mlp, Opt::Sgd));
    }

    #[test]
    fn mlp_with_adamw_on_gpu_replicas_matches_one_gpu() {
        within(300, || on_gpus(Model::Mlp, Opt::AdamW));
    }

    #[test]
    fn conv_net_with_sgd_on_gpu_replicas_matches_one_gpu() {
        within(300, || on_gpus(Model::Conv, Opt::Sgd));
    }

    #[test]
    fn conv_net_with_adamw_on_gpu_replicas_matches_one_gpu() {
        within(300, || on_gpus(Model::Conv, Opt::AdamW));
    }

    /// Many steps of a model whose kernels outlast their launch: the
    /// optimizer's update (caller thread) and the next refresh and forward
    /// (worker threads, other GPUs' streams) must be ordered, or a replica
    /// reads half-updated weights and the result drifts from one device's.
    #[test]
    fn many_steps_of_a_wide_mlp_on_gpu_replicas_match_one_gpu() {
        within(300, || {
            let d = data_sized(Model::WideMlp, 1024, 40);
            // At `Sgd`'s rate these 40 steps are chaotic: on the CPU too,
            // 2 replicas end 84% away from one device (rounding differences
            // amplified, measured 2026-11-25); at a tenth of it they stay
            // within 1.2e-7, so a race shows as a large difference.
            check_on(&d, Model::WideMlp, Opt::SlowSgd, 2, gpu_devices, TOLERANCE);
        });
    }
}
