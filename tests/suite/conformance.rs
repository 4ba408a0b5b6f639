//! Behaviours that PyTorch's own `test/distributed/test_data_parallel.py`
//! pins, in candle terms (see the README's conformance table for the map
//! to PyTorch's tests and for what lives in other test files).

use crate::common;

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Device, ModuleT, Tensor};
use candle_dp::{cpu_devices, DataParallel};
use candle_nn::{linear, Linear, Module, VarBuilder, VarMap};
use common::*;

fn linear_dp(replicas: usize) -> (VarMap, DataParallel<Linear>) {
    let varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(replicas), |vb| {
        linear(4, 2, vb)
    })
    .unwrap();
    (varmap, dp)
}

fn the_module(varmap: &VarMap) -> Linear {
    linear(
        4,
        2,
        VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu),
    )
    .unwrap()
}

/// `test_data_parallel_multiple_input`: tensors are split, numbers and
/// strings reach every replica unchanged.
#[test]
fn mixed_tensor_number_and_string_inputs_reach_every_replica() {
    let (varmap, dp) = linear_dp(3);
    let x = Tensor::randn(0f32, 1., (7, 4), &Device::Cpu).unwrap();
    let input = (x.clone(), 2.5f64, "scale".to_string());
    let out = dp
        .apply(input, |m, (x, factor, tag): (Tensor, f64, String)| {
            assert_eq!(tag, "scale");
            m.forward(&x)?.affine(factor, 0.)
        })
        .unwrap();
    let expected = (the_module(&varmap).forward(&x).unwrap() * 2.5).unwrap();
    assert_eq!(
        out.to_vec2::<f32>().unwrap(),
        expected.to_vec2::<f32>().unwrap()
    );
}

/// `test_data_parallel_nested_output` and `_nested_input`: tuples, vectors
/// and maps, in and out, gathered element by element.
#[test]
fn nested_inputs_and_outputs_are_split_and_gathered_element_by_element() {
    let (varmap, dp) = linear_dp(2);
    let a = Tensor::randn(0f32, 1., (5, 4), &Device::Cpu).unwrap();
    let b = Tensor::randn(0f32, 1., (5, 4), &Device::Cpu).unwrap();
    let mut named = HashMap::new();
    named.insert("b".to_string(), b.clone());
    type Out = (Tensor, Vec<Tensor>, BTreeMap<String, Tensor>);
    let (first, list, map): Out = dp
        .apply(
            (a.clone(), vec![b.clone()], named),
            |m, (a, list, named)| {
                let mut map = BTreeMap::new();
                map.insert(
                    "sum".to_string(),
                    (m.forward(&a)? + m.forward(&named["b"])?)?,
                );
                Ok((m.forward(&a)?, vec![m.forward(&list[0])?], map))
            },
        )
        .unwrap();
    let module = the_module(&varmap);
    let (fa, fb) = (module.forward(&a).unwrap(), module.forward(&b).unwrap());
    let close = |x: &Tensor, y: &Tensor| {
        let d = max_abs_diff(x, y);
        assert!(d < 1e-6, "{d}");
    };
    close(&first, &fa);
    close(&list[0], &fb);
    close(&map["sum"], &(fa + fb).unwrap());
}

/// `test_data_parallel_no_grad` (inference): evaluation equals the module's
/// and changes no buffer.
#[test]
fn inference_equals_the_module_and_leaves_buffers_alone() {
    let varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), BnNet::new).unwrap();
    let module = BnNet::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    let stats = || {
        varmap.data().lock().unwrap()["bn.running_mean"]
            .to_vec1::<f32>()
            .unwrap()
    };
    let before = stats();
    let x = Tensor::randn(3f32, 2., (6, 12), &Device::Cpu).unwrap();
    let out = dp.forward_t(&x.detach(), false).unwrap();
    let expected = module.forward_t(&x, false).unwrap();
    let d = max_abs_diff(&out, &expected);
    assert!(d < 1e-6, "{d}");
    assert_eq!(stats(), before);
    // Training mode moves them (replica 0's statistics, as in PyTorch).
    dp.forward_t(&x, true).unwrap();
    assert_ne!(stats(), before);
}

/// `test_data_parallel_small_back` / `test_gather_cpu`: the output lands on
/// the output device (here the CPU), with the batch in replica order.
#[test]
fn outputs_land_on_the_output_device_in_replica_order() {
    let varmap = VarMap::new();
    let dp = DataParallel::builder(&varmap, DType::F32, &cpu_devices(3))
        .output_device(Device::Cpu)
        .build(|vb| linear(4, 2, vb))
        .unwrap();
    let x = Tensor::arange(0f32, 28., &Device::Cpu)
        .unwrap()
        .reshape((7, 4))
        .unwrap();
    let rows = dp
        .apply(x.clone(), |_, part: Tensor| part.narrow(1, 0, 1))
        .unwrap();
    let firsts: Vec<f32> = rows.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(firsts, vec![0., 4., 8., 12., 16., 20., 24.]);
}
