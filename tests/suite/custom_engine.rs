//! A strategy of the user's own ([`Engine`] given to
//! `Fabric::setup_engine`): the Fabric's loop drives it as any of its own
//! (accumulation, clipping, saving), and the trait's defaults give it a
//! whole state that saves and loads.

use candle_core::{DType, ModuleT, Tensor};
use candle_dp::fabric::{
    Engine, EngineSetup, EngineStep, Fabric, FabricConfig, FabricModel, LossFn, Strategy,
    Trainables,
};
use candle_dp::optim::{Sgd, SgdConfig};
use candle_dp::training_state::Progress;
use candle_dp::units::Units;
use candle_nn::VarBuilder;

use crate::common::fabric_loop::{classifier, dataset, train, train_model};
use crate::common::identical;

/// Plain candle on one device: a strategy the crate does not have.
struct OwnEngine {
    model: Units,
    trainables: Trainables<Sgd>,
}

impl Engine<Sgd> for OwnEngine {
    fn name(&self) -> &str {
        "own"
    }

    fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        _sync: bool,
        loss_fn: &LossFn,
    ) -> candle_dp::Result<EngineStep> {
        let loss = loss_fn(&self.model.forward_t(x, true)?, y)?;
        let grads = loss.affine(factor, 0.0)?.backward()?;
        Ok(EngineStep {
            loss: loss.detach(),
            grads: Some(grads),
        })
    }

    fn forward(&mut self, x: &Tensor) -> candle_dp::Result<Tensor> {
        Ok(self.model.forward_t(x, false)?)
    }

    fn trainables(&self) -> &Trainables<Sgd> {
        &self.trainables
    }

    fn trainables_mut(&mut self) -> &mut Trainables<Sgd> {
        &mut self.trainables
    }
}

/// The classifier on one device as an [`OwnEngine`], with
/// `fabric_loop::setup`'s optimizer.
#[allow(clippy::result_large_err)] // setup_engine's closure returns candle_dp::Result
fn own_engine(fabric: &Fabric) -> anyhow::Result<FabricModel<Sgd>> {
    Ok(fabric.setup_engine(classifier(), |setup: EngineSetup<'_>| {
        let varmap = setup.varmap().clone();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, setup.device());
        let model = setup.module().build(vb)?;
        let sgd = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        };
        let trainables = Trainables::over_all(varmap, |named| Sgd::new_named(named, sgd))?;
        Ok(Box::new(OwnEngine { model, trainables }) as Box<dyn Engine<Sgd>>)
    })?)
}

#[test]
fn a_users_own_engine_trains_through_the_fabrics_loop_to_singles_bytes() {
    let config = FabricConfig {
        accumulation_steps: 2,
        gradient_clip: Some(0.5),
        ..FabricConfig::new(Strategy::Single, 1)
    };
    let data = dataset();
    let single = Fabric::launch(config.clone(), |f| train(f, data.clone())).unwrap();
    let own = Fabric::launch(config, |f| {
        let model = own_engine(&f)?;
        let engine = format!("{model:?}");
        anyhow::ensure!(engine.contains("own"), "{engine}");
        train_model(f, data.clone(), model)
    })
    .unwrap();
    let (ours, theirs) = (&own[0], &single[0]);
    assert_eq!(ours.1, theirs.1, "the losses differ");
    assert!(identical(&ours.0, &theirs.0), "the weights differ");
}

#[test]
fn a_users_own_engine_saves_and_loads_its_whole_state_with_the_defaults() {
    let dir = std::env::temp_dir().join(format!("candle-dp-own-engine-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = FabricConfig {
        checkpoint_dir: Some(dir.clone()),
        ..FabricConfig::new(Strategy::Single, 1)
    };
    let data = dataset();
    Fabric::launch(config, |f| {
        let mut model = own_engine(&f)?;
        let batch = candle_dp::loader::Dataset::get_batch(data.as_ref(), &[0, 1, 2, 3])?;
        for _ in 0..3 {
            model.backward(&batch[0], &batch[1], candle_nn::loss::cross_entropy)?;
            model.step()?;
        }
        let progress = Progress {
            epoch: 0,
            batch: 3,
            step: 3,
        };
        model.save(progress)?;
        let saved = model.full_state()?;
        let mut fresh = own_engine(&f)?;
        let resumed = fresh.load()?.expect("a state was saved");
        anyhow::ensure!(resumed.progress == progress, "{resumed}");
        anyhow::ensure!(fresh.steps() == 3, "steps {}", fresh.steps());
        anyhow::ensure!(
            identical(&saved, &fresh.full_state()?),
            "the loaded weights differ"
        );
        // The optimizer's momentum came back too: one more step is the
        // same on both.
        for m in [&mut model, &mut fresh] {
            m.backward(&batch[0], &batch[1], candle_nn::loss::cross_entropy)?;
            m.step()?;
        }
        anyhow::ensure!(
            identical(&model.full_state()?, &fresh.full_state()?),
            "the weights differ after a step"
        );
        Ok(())
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
