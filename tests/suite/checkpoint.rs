//! Checkpoints: save with or without the `module.` prefix, load either, and
//! report what does not match.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::Error;
use candle_nn::{VarBuilder, VarMap};
use common::*;

fn bn_varmap() -> VarMap {
    let varmap = VarMap::new();
    BnNet::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    varmap
}

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "candle_dp_test_{}_{name}.safetensors",
        std::process::id()
    ))
}

#[test]
fn both_prefixes_round_trip_into_a_fresh_model_including_buffers() {
    let source = bn_varmap();
    // Non-trivial buffers, as after training.
    source.data().lock().unwrap()["bn.running_var"]
        .set(&Tensor::full(2f32, 16, &Device::Cpu).unwrap())
        .unwrap();
    for prefix in [Prefix::None, Prefix::Module] {
        let path = temp(&format!("{prefix:?}"));
        checkpoint::save(&source, &path, prefix).unwrap();
        let keys: Vec<String> = candle_core::safetensors::load(&path, &Device::Cpu)
            .unwrap()
            .into_keys()
            .collect();
        assert_eq!(
            keys.iter().all(|k| k.starts_with("module.")),
            prefix == Prefix::Module,
            "{keys:?}"
        );
        let target = bn_varmap();
        let report = checkpoint::load(&target, &path, true).unwrap();
        assert!(report.is_exact(), "{report:?}");
        assert_eq!(report.loaded.len(), 8);
        assert!(
            identical(&snapshot(&target), &snapshot(&source)),
            "{prefix:?}"
        );
        std::fs::remove_file(path).ok();
    }
}

#[test]
fn mismatches_are_reported_and_strict_loading_changes_nothing() {
    let path = temp("mismatch");
    let mut tensors = std::collections::HashMap::new();
    tensors.insert(
        "module.l1.weight".to_string(),
        Tensor::zeros((16, 12), DType::F32, &Device::Cpu).unwrap(),
    );
    tensors.insert(
        "module.l2.weight".to_string(),
        Tensor::zeros((3, 16), DType::F32, &Device::Cpu).unwrap(),
    );
    tensors.insert(
        "module.extra".to_string(),
        Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &path).unwrap();

    let target = bn_varmap();
    let before = snapshot(&target);
    let err = checkpoint::load(&target, &path, true)
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Checkpoint(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("module.extra")
            && msg.contains("l2.weight")
            && msg.contains("bn.running_mean"),
        "{msg}"
    );
    assert!(
        identical(&snapshot(&target), &before),
        "strict failure changes nothing"
    );

    let report = checkpoint::load(&target, &path, false).unwrap();
    assert_eq!(report.loaded, vec!["l1.weight".to_string()]);
    assert_eq!(report.unexpected, vec!["module.extra".to_string()]);
    assert_eq!(
        report.mismatched,
        vec![("l2.weight".to_string(), vec![3, 16], vec![4, 16])]
    );
    assert_eq!(report.missing.len(), 6);
    std::fs::remove_file(path).ok();
}
