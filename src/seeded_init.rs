//! Reproducible initial values: candle's CPU random generator cannot be
//! seeded (`Device::Cpu.set_seed` is an error), so two runs of the same
//! program start from different weights. [`seeded_varmap`] draws a model's
//! initial values from a seeded generator instead, with the distributions
//! candle's layers ask for.
//!
//! It matters for data parallelism across processes: every process can
//! build the same model on its own, and a run with threads and a run with
//! MPI processes start, and so end, at the same weights.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal, Uniform};

use crate::tensor_parallel::TpPlan;
use crate::util::lock::lock;

/// A [`VarMap`] holding the variables that `build` creates, with initial
/// values drawn from a generator seeded with `seed`: the same seed gives the
/// same values, in any process, on any machine. Build the model from the
/// returned map (its variables are found there, not created again).
///
/// Each variable is drawn as its [`Init`] asks (constants, uniform, normal,
/// Kaiming), in the order in which `build` asks for them.
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{linear, VarBuilder};
/// use candle_dp::seeded_varmap;
///
/// let a = seeded_varmap(7, DType::F32, &Device::Cpu, |vb| linear(4, 3, vb.pp("fc")))?;
/// let b = seeded_varmap(7, DType::F32, &Device::Cpu, |vb| linear(4, 3, vb.pp("fc")))?;
/// let weight = |m: &candle_nn::VarMap| m.data().lock().unwrap()["fc.weight"].to_vec2::<f32>();
/// assert_eq!(weight(&a)?, weight(&b)?);
/// let model = linear(4, 3, VarBuilder::from_varmap(&a, DType::F32, &Device::Cpu))?;
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// What `build` returns, or an invalid distribution (for example a
/// negative standard deviation) naming the variable.
pub fn seeded_varmap<M>(
    seed: u64,
    dtype: DType,
    device: &Device,
    build: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
) -> candle_core::Result<VarMap> {
    seeded_pieces(seed, dtype, device, None, build)
}

/// A rank's pieces of the parameters a tensor-parallel `plan` splits
/// over `tp` ranks: [`seeded_varmap`] where `build` asks for each piece's
/// shape, and each is cut from the whole value one device draws, so that
/// the ranks' pieces join into one device's initial weights.
pub(crate) struct Pieces<'a> {
    /// The placements.
    pub plan: &'a TpPlan,
    /// This rank's place among the tensor-parallel ranks.
    pub rank: usize,
    /// The tensor-parallel ranks.
    pub tp: usize,
}

/// [`seeded_varmap`], each parameter `pieces` splits cut to this rank's
/// piece.
pub(crate) fn seeded_pieces<M>(
    seed: u64,
    dtype: DType,
    device: &Device,
    pieces: Option<Pieces<'_>>,
    build: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
) -> candle_core::Result<VarMap> {
    let drawn = Arc::new(Drawn {
        rng: Mutex::new(StdRng::seed_from_u64(seed)),
        values: Mutex::new(Vec::new()),
        pieces: pieces.map(|p| (p.plan.clone(), p.rank, p.tp)),
    });
    let backend: Box<dyn SimpleBackend> = Box::new(Seeded(Arc::clone(&drawn)));
    build(VarBuilder::from_backend(backend, dtype, device.clone()))?;
    let varmap = VarMap::new();
    {
        let values = lock(&drawn.values);
        let mut vars = lock(varmap.data());
        for (name, value) in values.iter() {
            vars.insert(name.clone(), Var::from_tensor(value)?);
        }
    }
    Ok(varmap)
}

/// The generator and what it drew, by variable name.
struct Drawn {
    rng: Mutex<StdRng>,
    values: Mutex<Vec<(String, Tensor)>>,
    /// A tensor-parallel plan, this rank's place and the ranks.
    pieces: Option<(TpPlan, usize, usize)>,
}

struct Seeded(Arc<Drawn>);

impl Seeded {
    fn sample(
        &self,
        name: &str,
        count: usize,
        init: Init,
        shape: &Shape,
    ) -> candle_core::Result<Vec<f64>> {
        let invalid = |e: &dyn std::fmt::Display| {
            candle_core::Error::Msg(format!("cannot initialise `{name}`: {e}"))
        };
        let mut rng = lock(&self.0.rng);
        let uniform = |rng: &mut StdRng, lo: f64, up: f64| -> candle_core::Result<Vec<f64>> {
            if lo == up {
                return Ok(vec![lo; count]);
            }
            let dist = Uniform::new(lo, up).map_err(|e| invalid(&e))?;
            Ok((0..count).map(|_| dist.sample(rng)).collect())
        };
        let normal = |rng: &mut StdRng, mean: f64, std: f64| -> candle_core::Result<Vec<f64>> {
            let dist = Normal::new(mean, std).map_err(|e| invalid(&e))?;
            Ok((0..count).map(|_| dist.sample(rng)).collect())
        };
        match init {
            Init::Const(value) => Ok(vec![value; count]),
            Init::Uniform { lo, up } => uniform(&mut rng, lo, up),
            Init::Randn { mean, stdev } => normal(&mut rng, mean, stdev),
            Init::Kaiming {
                dist,
                fan,
                non_linearity,
            } => {
                // As candle's `Init::var`.
                let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
                match dist {
                    candle_nn::init::NormalOrUniform::Uniform => {
                        let bound = 3f64.sqrt() * std;
                        uniform(&mut rng, -bound, bound)
                    }
                    candle_nn::init::NormalOrUniform::Normal => normal(&mut rng, 0., std),
                }
            }
        }
    }
}

impl SimpleBackend for Seeded {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut values = lock(&self.0.values);
        if let Some((_, value)) = values.iter().find(|(n, _)| n == name) {
            if value.shape() != &shape {
                candle_core::bail!(
                    "`{name}` asked for with shape {shape:?} after {:?}",
                    value.shape()
                );
            }
            return Ok(value.clone());
        }
        let placement = self
            .0
            .pieces
            .as_ref()
            .map(|(plan, rank, tp)| (plan.placement(name), *rank, *tp));
        let whole = match placement {
            Some((placement, _, tp)) => placement.whole_shape(&shape, tp),
            None => shape.clone(),
        };
        let data = self.sample(name, whole.elem_count(), init, &whole)?;
        let mut value = Tensor::from_vec(data, whole, device)?.to_dtype(dtype)?;
        if let Some((placement, rank, tp)) = placement {
            value = placement
                .piece(&value, rank, tp, name)
                .map_err(candle_core::Error::wrap)?;
        }
        values.push((name.to_string(), value.clone()));
        Ok(value)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        let values = lock(&self.0.values);
        values
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            })
    }

    fn contains_tensor(&self, name: &str) -> bool {
        let values = lock(&self.0.values);
        values.iter().any(|(n, _)| n == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::{batch_norm, linear, BatchNormConfig};

    fn values(seed: u64) -> Vec<(String, Vec<f32>)> {
        let map = seeded_varmap(seed, DType::F32, &Device::Cpu, |vb| {
            linear(5, 4, vb.pp("fc"))?;
            batch_norm(4, BatchNormConfig::default(), vb.pp("bn"))
        })
        .unwrap();
        let data = map.data().lock().unwrap();
        let mut out: Vec<_> = data
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                )
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    #[test]
    fn the_same_seed_gives_the_same_values_and_another_seed_others() {
        assert_eq!(values(3), values(3));
        assert_ne!(values(3), values(4));
    }

    #[test]
    fn values_follow_the_layers_init() {
        let all: std::collections::HashMap<_, _> = values(1).into_iter().collect();
        // candle's linear: bias uniform in ±1/sqrt(fan_in), weight Kaiming normal.
        let bound = 1. / 5f32.sqrt();
        assert!(all["fc.bias"].iter().all(|b| b.abs() <= bound));
        assert!(all["fc.weight"].iter().any(|w| w.abs() > bound));
        assert_eq!(all["bn.running_var"], vec![1.0; 4]);
        assert_eq!(all["bn.running_mean"], vec![0.0; 4]);
    }
}
