//! Reproduces real PyTorch nn.DataParallel runs (tests/data/dp_reference.safetensors,
//! see tests/data/FIXTURES.md): BatchNorm in training mode, replica 0's buffer
//! updates kept, the others' discarded, gradients summed into the master.

use crate::common;

use candle_core::{DType, Tensor};
use candle_dp::{cpu_devices, DataParallel, LossReduction};
use candle_nn::{loss, ModuleT, Optimizer, SGD};
use common::*;

#[derive(Clone, Copy, Debug)]
enum Path {
    DropIn,
    ParallelFromLoss,
    ReplicaLoss,
}

fn run(batch: usize, devices: usize, path: Path) -> std::collections::HashMap<String, Tensor> {
    let file = load_fixture("dp_reference.safetensors");
    let varmap = varmap_from(&fixture_tensors(&file, "init."));
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(devices), BnNet::new).unwrap();
    let mut sgd = SGD::new(varmap.all_vars(), 0.05).unwrap();
    let (x, y) = (&file["x"], &file["y"]);
    for step in 0..6 {
        let xb = x.narrow(0, step * batch, batch).unwrap();
        let yb = y.narrow(0, step * batch, batch).unwrap();
        match path {
            Path::DropIn => {
                let logits = dp.forward_t(&xb, true).unwrap();
                sgd.backward_step(&loss::cross_entropy(&logits, &yb).unwrap())
                    .unwrap();
            }
            Path::ParallelFromLoss => {
                let logits = dp.forward_t(&xb, true).unwrap();
                let step = dp
                    .backward_from_loss(&logits, |o| loss::cross_entropy(o, &yb))
                    .unwrap();
                sgd.step(&step.grads).unwrap();
            }
            Path::ReplicaLoss => {
                let step = dp
                    .forward_backward((xb, yb), LossReduction::Mean, |m: &BnNet, (x, y)| {
                        loss::cross_entropy(&m.forward_t(&x, true)?, &y)
                    })
                    .unwrap();
                sgd.step(&step.grads).unwrap();
            }
        }
    }
    snapshot(&varmap)
}

fn check(run_name: &str, batch: usize, devices: usize) {
    let expected = fixture_tensors(
        &load_fixture("dp_reference.safetensors"),
        &format!("final_{run_name}."),
    );
    assert_eq!(expected.len(), 8, "weights, biases and BN buffers");
    for path in [Path::DropIn, Path::ParallelFromLoss, Path::ReplicaLoss] {
        let got = run(batch, devices, path);
        let diff = max_rel_diff(&got, &expected);
        assert!(
            diff < 1e-5,
            "run {run_name} via {path:?}: max relative difference {diff}\n{}",
            diff_report(&got, &expected)
        );
    }
}

#[test]
fn pytorch_run_p_batch_8_on_3_devices_is_reproduced_with_bn_buffers() {
    check("P", 8, 3);
}

#[test]
fn pytorch_run_q_batch_5_on_2_devices_is_reproduced_with_bn_buffers() {
    check("Q", 5, 2);
}

#[test]
fn bn_buffers_of_replicas_other_than_zero_are_discarded() {
    // Keeping every replica's statistics (or none) would not match PyTorch:
    // the fixture's buffers differ from both alternatives.
    let file = load_fixture("dp_reference.safetensors");
    let init = fixture_tensors(&file, "init.");
    let expected = fixture_tensors(&file, "final_P.");
    let got = run(8, 3, Path::DropIn);
    for name in ["bn.running_mean", "bn.running_var"] {
        let moved = (&got[name] - &init[name])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(
            moved.to_scalar::<f32>().unwrap() > 1e-3,
            "{name} was updated"
        );
        let d = (&got[name] - &expected[name])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(
            d.to_scalar::<f32>().unwrap() < 1e-5,
            "{name} matches PyTorch"
        );
    }
}
