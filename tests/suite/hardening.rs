//! What adversarial use found (issue 8): concurrent callers, handles that
//! outlive their rank, failed steps, hostile sizes, poisoned locks, panics
//! inside `no_sync` / `join`, factories that never return, bad files.
//! Everything that could hang runs on a thread with a deadline.
// Closures here return `candle_dp::Result` as the API requires.
#![allow(clippy::result_large_err)]

use crate::common;
// Example code shared with the examples; each user needs only part of it.
use crate::example_datasets as datasets;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::comm::{Membership, ProcessGroup, ReduceOp, Result as CommResult};
use candle_dp::launch::{spawn, LaunchError};
use candle_dp::loader::{Loader, LoaderError, TensorDataset};
use candle_dp::sampler::{DistributedSampler, SamplerError};
use candle_dp::{
    cpu_devices, seeded_varmap, DataParallel, DdpConfig, DistributedDataParallel, Error, Scatter,
    ScatterPlan, Split,
};
use candle_nn::{linear, Linear, Module, VarBuilder, VarMap};
use common::*;
use datasets::{load_digits, load_mnist};

fn running_stats(varmap: &VarMap) -> Vec<Vec<f32>> {
    let data = varmap.data().lock().unwrap();
    ["bn.running_mean", "bn.running_var"]
        .iter()
        .map(|n| data[*n].to_vec1::<f32>().unwrap())
        .collect()
}

/// A `DataParallel` around `BnNet` with initial values from `seed`.
fn seeded_bn_dp(seed: u64) -> (VarMap, DataParallel<BnNet>) {
    let varmap = seeded_varmap(seed, DType::F32, &Device::Cpu, BnNet::new).unwrap();
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), BnNet::new).unwrap();
    (varmap, dp)
}

#[test]
fn four_threads_calling_forward_t_on_a_batch_norm_model_do_not_deadlock() {
    let (concurrent, sequential) = within(120, || {
        let x = Tensor::randn(1f32, 2., (6, 12), &Device::Cpu).unwrap();
        let (varmap, dp) = seeded_bn_dp(7);
        let dp = Arc::new(dp);
        std::thread::scope(|s| {
            for _ in 0..4 {
                let (dp, x) = (Arc::clone(&dp), x.clone());
                s.spawn(move || {
                    for _ in 0..25 {
                        dp.forward_t(&x, true).unwrap();
                    }
                });
            }
        });
        // The same 100 steps one after another: with the same input in
        // every step, the statistics do not depend on the order, only on
        // every step being whole.
        let (alone, dp) = seeded_bn_dp(7);
        for _ in 0..100 {
            dp.forward_t(&x, true).unwrap();
        }
        (running_stats(&varmap), running_stats(&alone))
    });
    assert_eq!(concurrent, sequential);
}

#[test]
fn spawn_returns_when_a_rank_returns_a_live_handle_while_another_waits() {
    // No timeout: only the returning rank counting as finished ends the wait.
    let err = within(60, || {
        spawn(2, |ctx| {
            if ctx.rank == 0 {
                return Ok(Some(ctx.process_group()));
            }
            std::thread::sleep(Duration::from_millis(200));
            ctx.pg.barrier()?;
            Ok(None)
        })
        .map(|_| ())
        .unwrap_err()
    });
    assert!(matches!(err, LaunchError::Failed { rank: 1, .. }), "{err}");
    assert!(err.to_string().contains("rank 0 left the group"), "{err}");
}

#[test]
fn spawn_returns_when_a_rank_returns_its_trained_ddp() {
    let result = within(60, || {
        spawn(2, |ctx| {
            let varmap = VarMap::new();
            let ddp = linear_ddp(ctx.process_group(), &varmap)?;
            if ctx.rank == 1 {
                ctx.pg.all_reduce(
                    &Tensor::ones(2, DType::F32, &Device::Cpu)?,
                    candle_dp::comm::ReduceOp::Sum,
                )?;
            }
            Ok(ddp)
        })
        .map(|ranks| ranks.len())
    });
    let err = result.unwrap_err();
    assert!(err.to_string().contains("rank 0 left the group"), "{err}");
}

/// This rank's DDP around a 3 -> 2 linear layer.
fn linear_ddp(
    pg: Arc<dyn ProcessGroup>,
    varmap: &VarMap,
) -> candle_dp::Result<DistributedDataParallel<Linear>> {
    DistributedDataParallel::new(
        pg,
        varmap,
        DType::F32,
        &Device::Cpu,
        |vb| linear(3, 2, vb),
        DdpConfig::default(),
    )
}

/// Rows of the output depend on the part: 3x3 and 2x2 cannot be concatenated.
fn ungatherable(model: &BnNet, x: Tensor) -> candle_core::Result<Tensor> {
    use candle_core::ModuleT;
    model.forward_t(&x, true)?;
    let rows = x.dim(0)?;
    Tensor::zeros((rows, rows), DType::F32, x.device())
}

#[test]
fn a_step_that_fails_to_gather_leaves_the_master_buffers_untouched() {
    let varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), BnNet::new).unwrap();
    let before = running_stats(&varmap);
    let x = Tensor::full(3f32, (5, 12), &Device::Cpu).unwrap();
    let err = dp.apply(x, ungatherable).unwrap_err();
    assert!(matches!(err, Error::Gather { .. }), "{err}");
    assert_eq!(
        running_stats(&varmap),
        before,
        "the failed step changed the buffers"
    );
}

/// A user's `Scatter` that returns one part whatever the plan says.
struct OnePart(Tensor);

impl Scatter for OnePart {
    fn for_each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a Tensor)) {
        f(&self.0)
    }

    fn scatter_parts(&self, _plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
        Ok(vec![OnePart(self.0.clone())])
    }
}

fn linear_dp(replicas: usize) -> DataParallel<Linear> {
    let varmap = VarMap::new();
    DataParallel::new(&varmap, DType::F32, &cpu_devices(replicas), |vb| {
        linear(4, 2, vb)
    })
    .unwrap()
}

#[test]
fn a_scatter_impl_returning_the_wrong_number_of_parts_is_an_error() {
    let dp = linear_dp(2);
    let x = Tensor::zeros((6, 4), DType::F32, &Device::Cpu).unwrap();
    let err = dp
        .apply(OnePart(x.clone()), |m, p: OnePart| m.forward(&p.0))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ScatterParts {
                expected: 2,
                found: 1
            }
        ),
        "{err}"
    );
    // Nested in a tuple and a Vec, too.
    let err = dp
        .apply((OnePart(x.clone()), x.clone()), |m, (p, _)| m.forward(&p.0))
        .unwrap_err();
    assert!(err.to_string().contains("1 parts for 2 replicas"), "{err}");
    let err = dp
        .apply(vec![OnePart(x)], |m, p: Vec<OnePart>| m.forward(&p[0].0))
        .unwrap_err();
    assert!(err.to_string().contains("1 parts for 2 replicas"), "{err}");
}

#[test]
fn chunk_sizes_whose_sum_overflows_are_rejected() {
    let dp = linear_dp(2);
    let x = Tensor::zeros((1, 4), DType::F32, &Device::Cpu).unwrap();
    // usize::MAX + 2 wraps to 1 = the batch size.
    let err = dp
        .apply_split(x, &Split::Sizes(vec![usize::MAX, 2]), |m, x: Tensor| {
            m.forward(&x)
        })
        .unwrap_err();
    assert!(matches!(err, Error::InvalidChunkSizes { .. }), "{err}");
    assert!(err.to_string().contains("more than usize::MAX"), "{err}");
}

fn tiny_dataset() -> Arc<TensorDataset> {
    let x = Tensor::arange(0f32, 10., &Device::Cpu)
        .unwrap()
        .reshape((10, 1))
        .unwrap();
    Arc::new(TensorDataset::new(vec![x]).unwrap())
}

#[test]
fn prefetch_of_usize_max_batches_works() {
    let loader = Loader::new(tiny_dataset(), 3).unwrap().prefetch(usize::MAX);
    let batches: Vec<_> = loader.iter().collect::<Result<_, _>>().unwrap();
    assert_eq!(batches.len(), 4);
}

#[test]
fn even_batches_of_usize_max_samples_is_an_error_not_a_crash() {
    let loader = Loader::new(tiny_dataset(), usize::MAX)
        .unwrap()
        .even_batches(true);
    let first = loader.iter().next().expect("one batch");
    assert!(
        matches!(first, Err(LoaderError::BatchTooLarge { .. })),
        "{first:?}"
    );
}

#[test]
fn selecting_an_index_beyond_u32_is_an_error() {
    let images = load_digits(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/digits/digits.csv.gz"
    ))
    .unwrap();
    let wraps_to_zero = 1usize << 32;
    let err = images.select(&[1, wraps_to_zero]).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("index {wraps_to_zero} (position 1)")),
        "{err}"
    );
    assert!(images.select(&[images.len()]).is_err());
}

#[test]
fn a_sampler_whose_padded_length_overflows_is_an_error() {
    let err = DistributedSampler::new(usize::MAX, 2, 0).unwrap_err();
    assert!(matches!(err, SamplerError::TooLarge { .. }), "{err}");
    assert!(DistributedSampler::new(usize::MAX - 1, 2, 1).is_ok());
}

/// An IDX pair whose image header claims `dims`.
fn write_idx(dir: &std::path::Path, dims: [u32; 3]) {
    let mut images = 0x0803u32.to_be_bytes().to_vec();
    dims.iter().for_each(|d| images.extend(d.to_be_bytes()));
    images.extend([0u8; 64]);
    let mut labels = 0x0801u32.to_be_bytes().to_vec();
    labels.extend(dims[0].to_be_bytes());
    labels.extend([0u8; 4]);
    std::fs::write(dir.join("train-images-idx3-ubyte"), images).unwrap();
    std::fs::write(dir.join("train-labels-idx1-ubyte"), labels).unwrap();
}

#[test]
fn idx_headers_whose_sizes_overflow_are_an_error() {
    let dir = std::env::temp_dir().join(format!("candle-dp-idx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // 2^31 * 2^31 * 4 wraps to 0 in 64 bits: it must not pass as 0 pixels.
    for dims in [
        [1 << 31, 1 << 31, 4],
        [u32::MAX, u32::MAX, u32::MAX],
        [2, 1 << 31, 1 << 31],
    ] {
        write_idx(&dir, dims);
        let err = load_mnist(&dir, true).unwrap_err();
        assert!(err.to_string().contains("train-images-idx3-ubyte"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn poisoned_varmap() -> VarMap {
    let varmap = VarMap::new();
    linear(
        3,
        2,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let shared = varmap.clone();
    let _ = std::thread::spawn(move || {
        let _guard = shared.data().lock().unwrap();
        panic!("a training thread crashes holding the VarMap");
    })
    .join();
    assert!(varmap.data().is_poisoned());
    varmap
}

fn temp_file(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("candle-dp-{}-{name}", std::process::id()))
}

#[test]
fn a_poisoned_varmap_still_saves_and_loads() {
    let varmap = poisoned_varmap();
    let path = temp_file("poisoned.safetensors");
    checkpoint::save(&varmap, &path, Prefix::None).unwrap();
    let report = checkpoint::load(&varmap, &path, true).unwrap();
    assert_eq!(
        report.loaded,
        vec!["bias".to_string(), "weight".to_string()]
    );
    let _ = std::fs::remove_file(path);
}

/// A process group that counts the collectives it runs.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn ProcessGroup>,
    calls: AtomicUsize,
}

impl Counting {
    fn count(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }
}

impl ProcessGroup for Counting {
    fn membership(&self) -> &Membership {
        self.inner.membership()
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> CommResult<Tensor> {
        self.count();
        self.inner.all_reduce(t, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> CommResult<Tensor> {
        self.count();
        self.inner.broadcast(t, root)
    }
    fn all_gather(&self, t: &Tensor) -> CommResult<Vec<Tensor>> {
        self.count();
        self.inner.all_gather(t)
    }
    fn gather(&self, t: &Tensor, root: usize) -> CommResult<Option<Vec<Tensor>>> {
        self.count();
        self.inner.gather(t, root)
    }
    fn scatter(&self, t: Option<&[Tensor]>, root: usize) -> CommResult<Tensor> {
        self.count();
        self.inner.scatter(t, root)
    }
    fn reduce(&self, t: &Tensor, root: usize, op: ReduceOp) -> CommResult<Option<Tensor>> {
        self.count();
        self.inner.reduce(t, root, op)
    }
    fn barrier(&self) -> CommResult<()> {
        self.count();
        self.inner.barrier()
    }
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> CommResult<Vec<Vec<u8>>> {
        self.count();
        self.inner.all_gather_bytes(bytes)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn failure(&self) -> Option<candle_dp::comm::Failure> {
        self.inner.failure()
    }
}

#[test]
fn no_sync_and_join_are_restored_when_their_closure_panics() {
    spawn(1, |ctx| {
        let pg = Arc::new(Counting {
            inner: ctx.process_group(),
            calls: AtomicUsize::new(0),
        });
        let varmap = VarMap::new();
        let mut ddp = linear_ddp(pg.clone(), &varmap)?;
        let x = Tensor::ones((4, 3), DType::F32, &Device::Cpu)?;
        let grads_of_a_step = |ddp: &mut DistributedDataParallel<Linear>| -> anyhow::Result<usize> {
            let loss = ddp.forward(&x)?.sqr()?.sum_all()?;
            Ok(ddp.backward(&loss)?.get_ids().count())
        };
        assert_eq!(grads_of_a_step(&mut ddp)?, 2);
        let caught = catch_unwind(AssertUnwindSafe(|| ddp.no_sync(|_| panic!("in no_sync"))));
        assert!(caught.is_err());
        assert_eq!(grads_of_a_step(&mut ddp)?, 2, "no_sync left behind");
        let caught = catch_unwind(AssertUnwindSafe(|| {
            ddp.join(|_| -> candle_dp::Result<()> { panic!("in join") })
        }));
        assert!(caught.is_err());
        // Outside `join` a forward runs no collective (this model has no
        // buffers); one left joining counts the active ranks first.
        let before = pg.calls.load(Ordering::SeqCst);
        ddp.forward(&x)?;
        assert_eq!(pg.calls.load(Ordering::SeqCst), before, "join left behind");
        Ok(())
    })
    .unwrap();
}

/// A factory that runs normally for its first `normal` calls, then `then`.
fn counting_factory(
    normal: usize,
    then: fn(),
) -> impl Fn(VarBuilder) -> candle_core::Result<Linear> + Send + Sync + 'static {
    let calls = AtomicUsize::new(0);
    move |vb| {
        if calls.fetch_add(1, Ordering::SeqCst) >= normal {
            then();
        }
        linear(4, 2, vb)
    }
}

#[test]
fn a_factory_that_never_returns_on_a_replica_is_bounded_by_the_timeout() {
    let err = within(60, || {
        let varmap = VarMap::new();
        // Master and replica 0 build; replica 1's factory never returns.
        DataParallel::builder(&varmap, DType::F32, &cpu_devices(2))
            .timeout(Duration::from_secs(2))
            .build(counting_factory(2, || {
                std::thread::sleep(Duration::from_secs(3600))
            }))
            .map(|_| ())
            .unwrap_err()
    });
    assert!(
        matches!(err, Error::ReplicaTimeout { replica: 1, .. }),
        "{err}"
    );
}

#[test]
fn a_factory_that_never_returns_on_the_master_is_bounded_by_the_timeout() {
    let err = within(60, || {
        let varmap = VarMap::new();
        DataParallel::builder(&varmap, DType::F32, &cpu_devices(2))
            .timeout(Duration::from_secs(2))
            .build(counting_factory(0, || {
                std::thread::sleep(Duration::from_secs(3600))
            }))
            .map(|_| ())
            .unwrap_err()
    });
    assert!(
        matches!(err, Error::ReplicaTimeout { replica: 0, .. }),
        "{err}"
    );
}

#[test]
fn a_factory_that_panics_on_the_master_is_an_error() {
    let varmap = VarMap::new();
    let built = catch_unwind(AssertUnwindSafe(|| {
        DataParallel::new(
            &varmap,
            DType::F32,
            &cpu_devices(2),
            counting_factory(0, || panic!("bad config")),
        )
    }));
    let err = built
        .expect("no panic escapes build")
        .map(|_| ())
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("panicked while building the master: bad config"),
        "{err}"
    );
}

#[test]
fn backward_with_a_wrong_grad_output_shape_can_be_retried() {
    let dp = linear_dp(2);
    let x = Tensor::ones((6, 4), DType::F32, &Device::Cpu).unwrap();
    let out = dp.forward(&x).unwrap();
    let wrong = Tensor::ones((6, 3), DType::F32, &Device::Cpu).unwrap();
    assert!(dp.backward(&out, &wrong).is_err());
    let right = Tensor::ones((6, 2), DType::F32, &Device::Cpu).unwrap();
    let grads = dp
        .backward(&out, &right)
        .expect("the corrected retry works");
    assert_eq!(grads.get_ids().count(), 2);
}

#[test]
fn checkpoints_keep_names_that_begin_with_module_and_name_missing_files() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    linear(3, 2, vb.pp("module").pp("head")).unwrap();
    linear(3, 2, vb.pp("body")).unwrap();
    let path = temp_file("module-names.safetensors");
    checkpoint::save(&varmap, &path, Prefix::None).unwrap();
    let fresh = VarMap::new();
    let vb = VarBuilder::from_varmap(&fresh, DType::F32, &Device::Cpu);
    linear(3, 2, vb.pp("module").pp("head")).unwrap();
    linear(3, 2, vb.pp("body")).unwrap();
    let report = checkpoint::load(&fresh, &path, true).unwrap();
    assert!(report.is_exact(), "{report:?}");
    assert_eq!(running_weights(&fresh), running_weights(&varmap));
    let _ = std::fs::remove_file(&path);

    let missing = temp_file("no-such-checkpoint.safetensors");
    let err = checkpoint::load(&fresh, &missing, false).unwrap_err();
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
}

fn running_weights(varmap: &VarMap) -> HashMap<String, Vec<f32>> {
    let data = varmap.data().lock().unwrap();
    data.iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_save_replaces_the_file_whole_and_a_failed_one_names_the_path() {
    let varmap = VarMap::new();
    linear(
        3,
        2,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let dir = temp_file("atomic");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    checkpoint::save(&varmap, &path, Prefix::None).unwrap();
    checkpoint::save(&varmap, &path, Prefix::Module).unwrap();
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        vec!["model.safetensors".to_string()],
        "no temporary file is left"
    );
    assert!(candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap()
        .contains_key("module.weight"));
    // A directory in the way: the rename fails, the error names the path,
    // and the temporary file is removed.
    let blocked = dir.join("blocked");
    std::fs::create_dir_all(blocked.join("inside")).unwrap();
    let err = checkpoint::save(&varmap, &blocked, Prefix::None).unwrap_err();
    assert!(
        err.to_string().contains(&blocked.display().to_string()),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn digit_labels_that_are_not_classes_are_rejected_naming_the_row() {
    let pixels = vec!["0"; 64].join(",");
    for label in ["-1", "3.5", "nan", "10"] {
        let path = temp_file(&format!("digits-{label}.csv"));
        std::fs::write(&path, format!("{pixels},1\n{pixels},{label}\n")).unwrap();
        let err = load_digits(&path).unwrap_err();
        assert!(err.to_string().contains("line 2"), "{label}: {err}");
        assert!(
            err.to_string().contains("is not a digit class"),
            "{label}: {err}"
        );
        let _ = std::fs::remove_file(path);
    }
}

/// `l2(layer_norm(l1(x)))`, with candle-nn's fused LayerNorm (no backward)
/// or the differentiable `layer_norm_slow`.
struct Normed {
    l1: Linear,
    ln: candle_nn::LayerNorm,
    l2: Linear,
    slow: bool,
}

impl Normed {
    fn new(vb: VarBuilder, slow: bool) -> candle_core::Result<Self> {
        Ok(Self {
            l1: linear(4, 8, vb.pp("l1"))?,
            ln: candle_nn::layer_norm(8, 1e-5, vb.pp("ln"))?,
            l2: linear(8, 3, vb.pp("l2"))?,
            slow,
        })
    }
}

impl Module for Normed {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.l1.forward(x)?;
        let h = if self.slow {
            let bias = self.ln.bias().expect("layer_norm has a bias");
            candle_nn::ops::layer_norm_slow(&h, self.ln.weight(), bias, 1e-5)?
        } else {
            self.ln.forward(&h)?
        };
        self.l2.forward(&h)
    }
}

#[test]
fn variables_without_gradient_are_reported_by_both_engines() {
    let x = Tensor::randn(0f32, 1., (6, 4), &Device::Cpu).unwrap();
    let y = Tensor::new(&[0u32, 1, 2, 0, 1, 2], &Device::Cpu).unwrap();
    let untrained: Vec<String> = ["l1.bias", "l1.weight", "ln.bias", "ln.weight"]
        .map(String::from)
        .to_vec();
    for slow in [false, true] {
        let varmap = VarMap::new();
        let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), move |vb| {
            Normed::new(vb, slow)
        })
        .unwrap();
        let step = dp
            .forward_backward(
                (x.clone(), y.clone()),
                candle_dp::LossReduction::Mean,
                |m, (x, y)| candle_nn::loss::cross_entropy(&m.forward(&x)?, &y),
            )
            .unwrap();
        let expected = if slow { Vec::new() } else { untrained.clone() };
        assert_eq!(
            step.vars_without_grad(),
            expected.as_slice(),
            "DataParallel, slow = {slow}"
        );
        assert_eq!(dp.vars_without_grad(), expected);

        let (x, y, expected) = (x.clone(), y.clone(), expected.clone());
        spawn(1, move |ctx| {
            let varmap = VarMap::new();
            let mut ddp = DistributedDataParallel::new(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                |vb| Normed::new(vb, slow),
                DdpConfig::default(),
            )?;
            let loss = candle_nn::loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            ddp.backward(&loss)?;
            assert_eq!(
                ddp.vars_without_grad(),
                expected.as_slice(),
                "DDP, slow = {slow}"
            );
            Ok(())
        })
        .unwrap();
    }
}

// ---- Round two (issue 18) ----

#[test]
fn a_timeout_too_large_to_represent_means_no_limit() {
    within(60, || {
        let varmap = VarMap::new();
        let dp = DataParallel::builder(&varmap, DType::F32, &cpu_devices(2))
            .timeout(Duration::MAX)
            .build(|vb| linear(4, 3, vb))
            .unwrap();
        let x = Tensor::ones((4, 4), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(dp.forward(&x).unwrap().dims(), &[4, 3]);
    });
}

/// `scale * l(x)`: a model with a 0-dim parameter.
struct Scaled {
    l: Linear,
    scale: Tensor,
}

impl Scaled {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            l: linear(4, 3, vb.pp("l"))?,
            scale: vb.get_with_hints((), "scale", candle_nn::Init::Const(1.5))?,
        })
    }
}

impl Module for Scaled {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l.forward(x)?.broadcast_mul(&self.scale)
    }
}

/// Every gradient of `grads` for `varmap`'s variables, as f64 values by name.
fn grad_values(
    varmap: &VarMap,
    grads: &candle_core::backprop::GradStore,
) -> HashMap<String, Vec<f64>> {
    let data = varmap.data().lock().unwrap();
    data.iter()
        .filter_map(|(name, var)| {
            let g = grads.get(var.as_tensor())?;
            let values = g.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
            Some((name.clone(), values.to_vec1::<f64>().unwrap()))
        })
        .collect()
}

fn assert_close(got: &HashMap<String, Vec<f64>>, want: &HashMap<String, Vec<f64>>, what: &str) {
    assert_eq!(
        got.keys().collect::<std::collections::BTreeSet<_>>(),
        want.keys().collect::<std::collections::BTreeSet<_>>(),
        "{what}"
    );
    for (name, w) in want {
        for (a, b) in got[name].iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-5 * (1. + b.abs()),
                "{what}: {name}: {a} vs {b}"
            );
        }
    }
}

/// Replicas in f64 over an f32 master on `devices` (the master on the
/// first): every replica holds converted copies, refreshed every step, the
/// 0-dim `scale` included; gradients as on one device in f32.
fn scalar_parameter_in_another_dtype(devices: Vec<Device>) {
    let master = devices[0].clone();
    let x = Tensor::randn(0f32, 1., (6, 4), &master).unwrap();
    let y = Tensor::new(&[0u32, 1, 2, 0, 1, 2], &master).unwrap();
    let varmap = seeded_varmap(3, DType::F32, &master, Scaled::new).unwrap();
    // The reference: one device, the master's dtype.
    let model = Scaled::new(VarBuilder::from_varmap(&varmap, DType::F32, &master)).unwrap();
    let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
    let want = grad_values(&varmap, &loss.backward().unwrap());
    assert!(want.contains_key("scale"));

    let dp = within(60, {
        let varmap = varmap.clone();
        move || DataParallel::new(&varmap, DType::F64, &devices, Scaled::new).unwrap()
    });
    for step in 0..2 {
        let logits = dp.forward(&x.to_dtype(DType::F64).unwrap()).unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
        assert_close(
            &grad_values(&varmap, &loss.backward().unwrap()),
            &want,
            &format!("drop-in, step {step}"),
        );
        let fast = dp
            .forward_backward(
                (x.to_dtype(DType::F64).unwrap(), y.clone()),
                candle_dp::LossReduction::Mean,
                |m, (x, y)| candle_nn::loss::cross_entropy(&m.forward(&x)?, &y),
            )
            .unwrap();
        assert_close(
            &grad_values(&varmap, &fast.grads),
            &want,
            &format!("fast path, step {step}"),
        );
    }
}

#[test]
fn replicas_in_another_dtype_train_a_model_with_a_scalar_parameter() {
    scalar_parameter_in_another_dtype(cpu_devices(2));
}

/// BatchNorm statistics after three training forwards of `x` with replicas
/// in `dtype` on `devices`, over an f32 master on the first: the master
/// keeps its dtype, replica 0's statistics are committed.
fn batch_norm_stats_with_replicas_in(
    x: &Tensor,
    dtype: DType,
    devices: &[Device],
) -> Vec<Vec<f32>> {
    let x = x.to_device(&devices[0]).unwrap();
    let varmap = seeded_varmap(5, DType::F32, &devices[0], BnNet::new).unwrap();
    let dp = DataParallel::new(&varmap, dtype, devices, BnNet::new).unwrap();
    for _ in 0..3 {
        dp.forward_t(&x.to_dtype(dtype).unwrap(), true).unwrap();
    }
    let data = varmap.data().lock().unwrap();
    assert_eq!(
        data["bn.running_mean"].dtype(),
        DType::F32,
        "the master keeps its dtype"
    );
    drop(data);
    running_stats(&varmap)
}

#[test]
fn replicas_in_another_dtype_refresh_and_commit_batch_norm_buffers() {
    let x = Tensor::randn(1f32, 2., (6, 12), &Device::Cpu).unwrap();
    let devices = cpu_devices(2);
    let same = batch_norm_stats_with_replicas_in(&x, DType::F32, &devices);
    let other = batch_norm_stats_with_replicas_in(&x, DType::F64, &devices);
    for (a, b) in same.iter().flatten().zip(other.iter().flatten()) {
        assert!((a - b).abs() <= 1e-5 * (1. + b.abs()), "{a} vs {b}");
    }
    // Three steps moved the statistics: the commit did happen.
    assert!(same[0].iter().any(|&m| m.abs() > 1e-3), "{same:?}");
}

/// The same two cases with replicas on CUDA devices (GPUs 0 and 1, or both
/// on GPU 0): each parameter's refresh is one device copy into the
/// replica's own storage (`scripts/gpu_check.sh`).
#[cfg(feature = "cuda")]
mod on_gpus {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::CudaContext;

    /// Two replicas: on GPUs 0 and 1, or both on GPU 0's one device.
    fn two_gpu_devices() -> Vec<Device> {
        let gpus = CudaContext::device_count().unwrap() as usize;
        let first = Device::new_cuda_with_stream(0).unwrap();
        let second = match gpus {
            1 => first.clone(),
            _ => Device::new_cuda_with_stream(1).unwrap(),
        };
        vec![first, second]
    }

    #[test]
    fn gpu_replicas_in_another_dtype_train_a_model_with_a_scalar_parameter() {
        within(120, || scalar_parameter_in_another_dtype(two_gpu_devices()));
    }

    #[test]
    fn gpu_replicas_in_another_dtype_refresh_and_commit_batch_norm_buffers() {
        let x = Tensor::randn(1f32, 2., (6, 12), &Device::Cpu).unwrap();
        let on_cpu = batch_norm_stats_with_replicas_in(&x, DType::F32, &cpu_devices(2));
        let (same, other) = within(120, move || {
            let devices = two_gpu_devices();
            (
                batch_norm_stats_with_replicas_in(&x, DType::F32, &devices),
                batch_norm_stats_with_replicas_in(&x, DType::F64, &devices),
            )
        });
        for (a, b) in same.iter().flatten().zip(other.iter().flatten()) {
            assert!((a - b).abs() <= 1e-5 * (1. + b.abs()), "{a} vs {b}");
        }
        for (a, b) in same.iter().flatten().zip(on_cpu.iter().flatten()) {
            assert!((a - b).abs() <= 1e-4 * (1. + b.abs()), "GPU {a} vs CPU {b}");
        }
    }
}

#[test]
fn gather_names_the_replica_that_differs_from_the_majority() {
    let scalar = |v: f32| Tensor::new(v, &Device::Cpu).unwrap();
    let vector = || Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
    let replica_of = |parts: Vec<Tensor>| match candle_dp::gather(parts, 0, &Device::Cpu) {
        Err(Error::Gather { replica, reason }) => (replica, reason),
        other => panic!("expected a gather error, got {other:?}"),
    };
    // Two scalars and a vector: the vector is the odd one out.
    let (replica, reason) = replica_of(vec![scalar(1.), scalar(2.), vector()]);
    assert_eq!(replica, 2, "{reason}");
    assert!(reason.contains("0-dim"), "{reason}");
    // A scalar first, then vectors: the scalar is.
    assert_eq!(replica_of(vec![scalar(1.), vector(), vector()]).0, 0);
    // Scalars of different dtypes: a gather error, not candle's raw one.
    let f64_scalar = Tensor::new(3f64, &Device::Cpu).unwrap();
    let (replica, reason) = replica_of(vec![scalar(1.), scalar(2.), f64_scalar]);
    assert_eq!(replica, 2, "{reason}");
    assert!(reason.contains("F64"), "{reason}");
    // Scalars of one dtype still gather into a vector.
    let all = candle_dp::gather(vec![scalar(1.), scalar(2.)], 0, &Device::Cpu).unwrap();
    assert_eq!(all.to_vec1::<f32>().unwrap(), vec![1., 2.]);
}

#[test]
fn all_gather_object_keeps_nan_and_infinities_bit_for_bit() {
    // A NaN with a payload, as a loss can hold, and the other edge values.
    let odd_nan = f32::from_bits(0x7fc0_1234);
    let values = within(60, move || {
        spawn(2, move |ctx| {
            let mine = (
                ctx.rank,
                vec![odd_nan, f32::INFINITY, -0.0],
                [f64::NAN, f64::NEG_INFINITY, f64::MIN_POSITIVE / 2.],
            );
            Ok(candle_dp::comm::all_gather_object(ctx.pg.as_ref(), &mine)?)
        })
        .unwrap()
    });
    for gathered in values {
        for (rank, (r, f32s, f64s)) in gathered.into_iter().enumerate() {
            assert_eq!(r, rank);
            let bits: Vec<u32> = f32s.iter().map(|v| v.to_bits()).collect();
            assert_eq!(
                bits,
                vec![
                    odd_nan.to_bits(),
                    f32::INFINITY.to_bits(),
                    (-0f32).to_bits()
                ]
            );
            let bits: Vec<u64> = f64s.iter().map(|v| v.to_bits()).collect();
            let want = [f64::NAN, f64::NEG_INFINITY, f64::MIN_POSITIVE / 2.].map(f64::to_bits);
            assert_eq!(bits, want.to_vec());
        }
    }
}

/// A varmap with `w` and `module.w` (and `module.module.b`), distinct values.
fn prefixed_names_varmap() -> VarMap {
    let varmap = VarMap::new();
    let mut data = varmap.data().lock().unwrap();
    for (i, name) in ["w", "module.w", "module.module.b"].iter().enumerate() {
        let t = Tensor::full(i as f32 + 1., 2, &Device::Cpu).unwrap();
        data.insert(name.to_string(), candle_core::Var::from_tensor(&t).unwrap());
    }
    drop(data);
    varmap
}

fn zeroed_like(varmap: &VarMap) -> VarMap {
    let fresh = VarMap::new();
    let mut data = fresh.data().lock().unwrap();
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let zeros = var.zeros_like().unwrap();
        data.insert(name.clone(), candle_core::Var::from_tensor(&zeros).unwrap());
    }
    drop(data);
    fresh
}

#[test]
fn checkpoints_of_w_and_module_w_load_back_with_either_prefix() {
    let varmap = prefixed_names_varmap();
    for prefix in [Prefix::None, Prefix::Module] {
        let path = temp_file(&format!("prefixed-names-{prefix:?}.safetensors"));
        checkpoint::save(&varmap, &path, prefix).unwrap();
        let fresh = zeroed_like(&varmap);
        let report =
            checkpoint::load(&fresh, &path, true).unwrap_or_else(|e| panic!("{prefix:?}: {e}"));
        assert!(report.is_exact(), "{prefix:?}: {report:?}");
        assert_eq!(
            running_weights(&fresh),
            running_weights(&varmap),
            "{prefix:?}"
        );
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn a_checkpoint_saves_under_a_250_byte_file_name() {
    let dir = temp_file("long-names");
    std::fs::create_dir_all(&dir).unwrap();
    let name = format!("{}.safetensors", "n".repeat(250 - ".safetensors".len()));
    assert_eq!(name.len(), 250);
    let path = dir.join(&name);
    let varmap = prefixed_names_varmap();
    checkpoint::save(&varmap, &path, Prefix::Module).unwrap();
    let fresh = zeroed_like(&varmap);
    assert!(checkpoint::load(&fresh, &path, true).unwrap().is_exact());
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        vec![std::ffi::OsString::from(name)],
        "no temporary file is left"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_variable_the_format_cannot_name_is_refused_and_the_old_checkpoint_survives() {
    let path = temp_file("reserved-name.safetensors");
    let good = prefixed_names_varmap();
    checkpoint::save(&good, &path, Prefix::None).unwrap();
    let before = std::fs::read(&path).unwrap();

    let bad = VarMap::new();
    let t = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
    bad.data().lock().unwrap().insert(
        "__metadata__".into(),
        candle_core::Var::from_tensor(&t).unwrap(),
    );
    let err = checkpoint::save(&bad, &path, Prefix::None).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("__metadata__") && msg.contains(&path.display().to_string()),
        "{msg}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the good checkpoint is untouched"
    );
    // Under the `module.` prefix the same variable has a name the format holds.
    checkpoint::save(&bad, &path, Prefix::Module).unwrap();
    let fresh = zeroed_like(&bad);
    assert!(checkpoint::load(&fresh, &path, true).unwrap().is_exact());
    let _ = std::fs::remove_file(&path);
}

/// A dataset of `usize::MAX` samples whose sample `i` is `i` (as u32, wrapped).
struct Unbounded;

impl candle_dp::loader::Dataset for Unbounded {
    fn len(&self) -> usize {
        usize::MAX
    }

    fn get(&self, index: usize) -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![Tensor::new(index as u32, &Device::Cpu)?])
    }
}

#[test]
fn a_loader_over_an_unbounded_dataset_yields_its_first_batches() {
    let firsts = within(30, || {
        let loader = Loader::new(Arc::new(Unbounded), 4).unwrap();
        assert_eq!(loader.len(), usize::MAX.div_ceil(4));
        let inline: Vec<Vec<u32>> = loader
            .iter()
            .take(3)
            .map(|b| b.unwrap()[0].to_vec1::<u32>().unwrap())
            .collect();
        let prefetched = loader.clone().prefetch(2).iter().next().unwrap().unwrap();
        (inline, prefetched[0].to_vec1::<u32>().unwrap())
    });
    assert_eq!(
        firsts.0,
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9, 10, 11]]
    );
    assert_eq!(firsts.1, vec![0, 1, 2, 3]);
}
