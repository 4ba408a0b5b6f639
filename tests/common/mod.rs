//! Models and helpers shared by the integration tests.
#![allow(dead_code)]

pub mod fabric_loop;
pub mod gpt_loop;
pub mod killing;

use std::collections::HashMap;

use candle_core::{DType, Device, Module, ModuleT, Result, Tensor};
use candle_nn::{
    batch_norm, conv2d, linear, BatchNorm, Conv2d, Conv2dConfig, Linear, VarBuilder, VarMap,
};

/// `l2(relu(bn(l1(x))))`, the model of `dp_reference.safetensors`.
pub struct BnNet {
    l1: Linear,
    bn: BatchNorm,
    l2: Linear,
}

impl BnNet {
    pub fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            l1: linear(12, 16, vb.pp("l1"))?,
            bn: batch_norm(16, 1e-5, vb.pp("bn"))?,
            l2: linear(16, 4, vb.pp("l2"))?,
        })
    }
}

impl ModuleT for BnNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = self.bn.forward_t(&self.l1.forward(x)?, train)?.relu()?;
        self.l2.forward(&h)
    }
}

/// A small MLP `in -> hidden -> out`.
pub struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    pub fn new(vb: VarBuilder, sizes: (usize, usize, usize)) -> Result<Self> {
        Ok(Self {
            l1: linear(sizes.0, sizes.1, vb.pp("l1"))?,
            l2: linear(sizes.1, sizes.2, vb.pp("l2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.relu()?)
    }
}

/// A small conv net on 1x8x8 images: conv(1->4, 3x3) -> relu -> maxpool 2 -> linear(36 -> 5).
pub struct ConvNet {
    conv: Conv2d,
    fc: Linear,
}

impl ConvNet {
    pub fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            conv: conv2d(1, 4, 3, Conv2dConfig::default(), vb.pp("conv"))?,
            fc: linear(36, 5, vb.pp("fc"))?,
        })
    }
}

impl Module for ConvNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv.forward(x)?.relu()?.max_pool2d(2)?;
        self.fc.forward(&h.flatten_from(1)?)
    }
}

/// Reads `prefix.*` entries of a safetensors file as a name -> tensor map.
pub fn fixture_tensors(file: &HashMap<String, Tensor>, prefix: &str) -> HashMap<String, Tensor> {
    file.iter()
        .filter_map(|(k, v)| k.strip_prefix(prefix).map(|n| (n.to_string(), v.clone())))
        .collect()
}

pub fn load_fixture(name: &str) -> HashMap<String, Tensor> {
    let path = format!("{}/data/{name}", env!("CARGO_MANIFEST_DIR"));
    candle_core::safetensors::load(path, &Device::Cpu).expect("fixture loads")
}

/// A VarMap holding copies of `values` (so runs do not share storage).
pub fn varmap_from(values: &HashMap<String, Tensor>) -> VarMap {
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for (name, t) in values {
            let t = t.to_dtype(DType::F32).unwrap().copy().unwrap();
            data.insert(name.clone(), candle_core::Var::from_tensor(&t).unwrap());
        }
    }
    varmap
}

/// The variables of `varmap`, sorted by name (for an optimizer, a scaler
/// or clipping over all of them).
pub fn sorted_var_list(varmap: &VarMap) -> Vec<candle_core::Var> {
    let mut named: Vec<_> = varmap.data().lock().unwrap().clone().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, v)| v).collect()
}

/// A snapshot of every var (name -> values) for comparisons.
pub fn snapshot(varmap: &VarMap) -> HashMap<String, Tensor> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

/// Largest relative difference over all tensors, each measured against its
/// own scale: `max|a - b| / max|b|` (elementwise ratios blow up on entries
/// near zero, where f32 rounding alone exceeds any relative bound).
pub fn max_rel_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f32 {
    let mut worst = 0f32;
    for (name, tb) in b {
        let ta = a.get(name).unwrap_or_else(|| panic!("missing {name}"));
        let va = ta
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let vb = tb
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(va.len(), vb.len(), "{name} sizes");
        let scale = vb.iter().fold(1e-6f32, |m, y| m.max(y.abs()));
        let diff = va
            .iter()
            .zip(&vb)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

/// The whole model's relative difference, `|a - b| / |b|` over every
/// value of every tensor (2-norms): unlike [`max_rel_diff`], a tensor
/// whose values are mostly rounding noise (a gradient that is 0 in exact
/// arithmetic, which AdamW turns into steps of its learning rate) weighs
/// by its size.
pub fn relative_l2(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (name, tb) in b {
        let ta = a.get(name).unwrap_or_else(|| panic!("missing {name}"));
        let va = ta.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let vb = tb.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in va.iter().zip(&vb) {
            diff += (f64::from(*x) - f64::from(*y)).powi(2);
            norm += f64::from(*y).powi(2);
        }
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Whether two snapshots are bit-identical.
pub fn identical(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> bool {
    a.len() == b.len()
        && b.iter().all(|(n, tb)| {
            let va = a[n].flatten_all().unwrap().to_vec1::<f32>().unwrap();
            va == tb.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        })
}

/// The bits of every value of `t` (any dtype, widened to f64 exactly;
/// every NaN as one pattern), for bitwise comparisons.
pub fn bits(t: &Tensor) -> Vec<u64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
        .iter()
        .map(|x| if x.is_nan() { u64::MAX } else { x.to_bits() })
        .collect()
}

/// Largest absolute elementwise difference of two tensors.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Per tensor: (name, max abs diff, max abs value), for failure messages.
pub fn diff_report(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> String {
    let mut names: Vec<_> = b.keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let d = max_abs_diff(&a[n], &b[n]);
            let m = b[n].abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            format!(
                "{n}: diff {:.3e} of max {:.3e}",
                d,
                m.to_scalar::<f32>().unwrap()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The sizes of the MLP the DDP tests train.
pub const DDP_SIZES: (usize, usize, usize) = (6, 16, 5);

/// Plain candle on one device: the MLP of [`DDP_SIZES`] from `init`, one
/// step per `(x, y)` of `data`, SGD 0.1 or AdamW 0.01.
pub fn single_device_mlp(
    init: &HashMap<String, Tensor>,
    data: &[(Tensor, Tensor)],
    adamw: bool,
) -> HashMap<String, Tensor> {
    use candle_nn::Optimizer;
    let varmap = varmap_from(init);
    let net = Mlp::new(
        VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &Device::Cpu),
        DDP_SIZES,
    )
    .unwrap();
    let mut sgd = candle_nn::SGD::new(varmap.all_vars(), 0.1).unwrap();
    let mut adam = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        },
    )
    .unwrap();
    for (x, y) in data {
        let loss = candle_nn::loss::cross_entropy(&net.forward(x).unwrap(), y).unwrap();
        if adamw {
            adam.backward_step(&loss).unwrap();
        } else {
            sgd.backward_step(&loss).unwrap();
        }
    }
    snapshot(&varmap)
}

/// This rank's DDP around an MLP of [`DDP_SIZES`].
pub fn mlp_ddp(
    ctx: &candle_dp::launch::RankContext,
    varmap: &VarMap,
    config: candle_dp::DdpConfig,
) -> anyhow::Result<candle_dp::DistributedDataParallel<Mlp>> {
    Ok(candle_dp::DistributedDataParallel::new(
        ctx.process_group(),
        varmap,
        candle_core::DType::F32,
        &Device::Cpu,
        |vb| Mlp::new(vb, DDP_SIZES),
        config,
    )?)
}

/// One rank of a PyTorch DDP run of `tests/data/ddp_reference.safetensors`
/// (see `FIXTURES.md`): the fixture's MLP 20-32-10 from its initial
/// values, SGD 0.1, a shuffled `DistributedSampler` (`seed`) over the first
/// `samples` rows, batches of `batch` per rank, 2 epochs. Returns the
/// trained variables.
pub fn ddp_reference_run(
    ctx: &candle_dp::launch::RankContext,
    samples: usize,
    seed: u64,
    batch: usize,
) -> anyhow::Result<HashMap<String, Tensor>> {
    use candle_dp::loader::{Loader, TensorDataset};
    use candle_dp::sampler::DistributedSampler;
    use candle_nn::Optimizer;

    let file = load_fixture("ddp_reference.safetensors");
    let init = fixture_tensors(&file, "init.");
    let x = file["x"].narrow(0, 0, samples)?;
    let y = file["y"].narrow(0, 0, samples)?;
    let dataset = std::sync::Arc::new(TensorDataset::new(vec![x, y])?);
    let varmap = varmap_from(&init);
    let mut ddp = candle_dp::DistributedDataParallel::new(
        ctx.process_group(),
        &varmap,
        candle_core::DType::F32,
        &Device::Cpu,
        |vb| Mlp::new(vb, (20, 32, 10)),
        candle_dp::DdpConfig::default(),
    )?;
    let mut sgd = candle_nn::SGD::new(varmap.all_vars(), 0.1)?;
    let mut sampler = DistributedSampler::new(samples, ctx.world_size, ctx.rank)?
        .shuffle(true)
        .seed(seed);
    for epoch in 0..2 {
        sampler.set_epoch(epoch);
        let loader = Loader::new(dataset.clone(), batch)?
            .indices(sampler.indices())
            .prefetch(2);
        for b in &loader {
            let b = b?;
            let loss = candle_nn::loss::cross_entropy(&ddp.forward(&b[0])?, &b[1])?;
            ddp.backward_step(&loss, &mut sgd)?;
        }
    }
    Ok(snapshot(&varmap))
}

/// Runs `f` on a thread and returns its result, or fails the test if it
/// has not finished within `seconds` (a hang).
pub fn within<T: Send + 'static>(seconds: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(std::time::Duration::from_secs(seconds)) {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("did not finish within {seconds} s: it hangs"),
    }
}

/// Gradient accumulation inside `join`: rank r trains on the first
/// `2 + 2r` batches of `data` (rows `2r..2r + 2` of each), SGD 0.1 from
/// `init`, each pair of batches accumulated into one update (the first of
/// the pair inside `no_sync`, each loss halved). The ranks that joined
/// must skip the all-reduce of a step inside `no_sync`.
#[allow(clippy::result_large_err)] // the closures return candle_dp::Result, as join requires
pub fn join_accumulating(
    ctx: &candle_dp::launch::RankContext,
    init: &HashMap<String, Tensor>,
    data: &[(Tensor, Tensor)],
) -> anyhow::Result<HashMap<String, Tensor>> {
    use candle_nn::Optimizer;
    let varmap = varmap_from(init);
    let mut ddp = mlp_ddp(ctx, &varmap, candle_dp::DdpConfig::default())?;
    let mut sgd = candle_nn::SGD::new(varmap.all_vars(), 0.1)?;
    let mine = &data[..(2 + 2 * ctx.rank).min(data.len())];
    let rows = ctx.rank * 2;
    ddp.join(|ddp| {
        for (step, (x, y)) in mine.iter().enumerate() {
            let (x, y) = (x.narrow(0, rows, 2)?, y.narrow(0, rows, 2)?);
            let mut train = |ddp: &mut candle_dp::DistributedDataParallel<Mlp>| {
                let loss = (candle_nn::loss::cross_entropy(&ddp.forward(&x)?, &y)? / 2.)?;
                ddp.backward_step(&loss, &mut sgd)
            };
            if step % 2 == 0 {
                ddp.no_sync(&mut train)?;
            } else {
                train(ddp)?;
            }
        }
        Ok(())
    })?;
    Ok(snapshot(&varmap))
}

/// Runs `f` on `world` thread ranks of a group of their own (with
/// `options`), each given its rank of the group, and returns what each
/// returned, in rank order. Unlike `launch::spawn`, a rank that fails the
/// group does not replace the others' results with the group's failure:
/// for tests that read what each rank's failed step returned.
pub fn on_own_threads<T: Send>(
    world: usize,
    options: candle_dp::comm::GroupOptions,
    f: impl Fn(candle_dp::comm::ThreadRank) -> T + Sync,
) -> Vec<T> {
    let ranks = candle_dp::comm::ThreadGroup::with_options(world, options);
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| s.spawn(move || f(rank)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}
