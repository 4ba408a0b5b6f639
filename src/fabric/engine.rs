//! Each strategy's engine behind one interface: build it from the model's
//! recipe, run a step's forward and backward (synchronised or only
//! accumulating), name the variables its gradients are keyed by, and give
//! back the whole model. The strategies differ here and only here.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, ModuleT, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

use super::config::{DpBackward, FabricConfig, Strategy};
use super::module::FabricModule;
use crate::buffers::{is_batch_norm_buffer, BufferSnapshot};
use crate::comm::{DeviceMesh, ProcessGroup};
use crate::data_parallel::DataParallel;
use crate::ddp::{DdpConfig, DistributedDataParallel, ZeroStage};
use crate::error::{Error, Result};
use crate::fsdp::{FsdpConfig, FullyShardedDataParallel};
use crate::pipeline::{Pipeline, RankPipeline, RankPipelineConfig};
use crate::precision::{cast_input, output_for_loss, MixedPrecisionModel};
use crate::process_env::Backend;
use crate::step::{LossReduction, Step};
use crate::units::Units;
use crate::vars::sorted_vars;

/// A loss from the model's output (in f32) and the targets.
pub(crate) type LossFn = Arc<dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// `single`'s model: the units themselves, or (mixed precision) computing
/// on low-precision copies of them.
pub(crate) enum Plain {
    Units(Units),
    Mixed(MixedPrecisionModel<Units>),
}

impl Plain {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        Ok(match self {
            Plain::Units(units) => units.forward_t(x, train)?,
            Plain::Mixed(model) => model.forward_t(x, train)?,
        })
    }
}

/// One rank's engine.
pub(crate) enum Engine {
    /// `single`: plain candle on one device, the step's buffers (BatchNorm
    /// statistics) put back if it fails.
    Single {
        model: Box<Plain>,
        buffers: Vec<(String, Var)>,
    },
    /// `single` and `dp`: a master model and a replica per device, the
    /// loss per replica or of the gathered output.
    Replicas {
        dp: DataParallel<Units>,
        gathered: bool,
    },
    /// `ddp`, `zero1`, `zero2` (a module reduced after its backward), and
    /// `ddp-overlap` (units reduced during it).
    Ddp {
        ddp: Box<DistributedDataParallel<Units>>,
        overlapped: bool,
    },
    /// `fsdp`.
    Fsdp(Box<FullyShardedDataParallel>),
    /// `pipeline`.
    Pipeline(Pipeline),
    /// `pipeline-ddp`.
    PipelineDdp(Box<DistributedDataParallel<Pipeline>>),
    /// `pipeline-ranks`: this rank's stages.
    RankPipeline(Box<RankPipeline>),
}

/// What one forward and backward gave: this rank's loss (unscaled), and
/// the gradients when the step synchronised (`None` while a no-sync
/// engine only accumulated).
pub(crate) struct Ran {
    pub(crate) loss: Tensor,
    pub(crate) grads: Option<GradStore>,
}

impl Engine {
    /// Builds `module` for `config`'s strategy on this rank's `devices`,
    /// its variables in `varmap` (every rank's initial values are rank 0's).
    pub(crate) fn build(
        config: &FabricConfig,
        pg: Arc<dyn ProcessGroup>,
        devices: &[Device],
        varmap: &VarMap,
        module: &FabricModule,
    ) -> Result<Self> {
        let strategy = config.effective_strategy();
        let policy = config.precision.policy();
        let first = devices
            .first()
            .ok_or(crate::error::Error::NoDevices)?
            .clone();
        let ddp_builder = || {
            let mut builder =
                DistributedDataParallel::builder(pg.clone(), varmap, DType::F32, &first);
            if let Some(policy) = policy.clone() {
                builder = builder.mixed_precision(policy);
            }
            builder
        };
        let pipeline = |devices: &[Device]| {
            let mut builder = Pipeline::builder(varmap, DType::F32, devices)
                .schedule(config.pipeline_schedule)
                .checkpoint(config.activation_checkpoint);
            if let Some(chunks) = config.chunks {
                builder = builder.chunks(chunks);
            }
            if let Some(policy) = policy.clone() {
                builder = builder.mixed_precision(policy);
            }
            if let Some(Some(timeout)) = config.timeout() {
                builder = builder.timeout(timeout);
            }
            builder.build(module.parts().to_vec())
        };
        Ok(match strategy {
            Strategy::Single => {
                let model = match policy {
                    None => Plain::Units(module.whole()(VarBuilder::from_varmap(
                        varmap,
                        DType::F32,
                        &first,
                    ))?),
                    Some(policy) => Plain::Mixed(MixedPrecisionModel::new(
                        varmap,
                        DType::F32,
                        &first,
                        policy,
                        module.whole(),
                    )?),
                };
                let buffers = sorted_vars(varmap)
                    .into_iter()
                    .filter(|(name, _)| is_batch_norm_buffer(name))
                    .collect();
                Engine::Single {
                    model: Box::new(model),
                    buffers,
                }
            }
            Strategy::Dp => {
                let mut builder = DataParallel::builder(varmap, DType::F32, devices);
                if let Some(policy) = policy.clone() {
                    builder = builder.mixed_precision(policy);
                }
                if let Some(Some(timeout)) = config.timeout() {
                    builder = builder.timeout(timeout);
                }
                Engine::Replicas {
                    dp: builder.build(module.whole())?,
                    gathered: config.dp_backward == DpBackward::Gathered,
                }
            }
            Strategy::Ddp => Engine::Ddp {
                ddp: Box::new(ddp_builder().build(module.whole())?),
                overlapped: false,
            },
            Strategy::Zero1 | Strategy::Zero2 => {
                let stage = match strategy {
                    Strategy::Zero1 => ZeroStage::One,
                    _ => ZeroStage::Two,
                };
                // With a shard size, ZeRO on a mesh: the pieces split
                // within each shard group, replicated across them.
                let builder = match config.shard_size {
                    Some(size) => {
                        let mesh = hybrid_mesh(strategy, pg.clone(), Some(size))?;
                        ddp_builder().zero_on_mesh(stage, &mesh)?
                    }
                    None => ddp_builder().zero(stage),
                };
                let overlapped = config.overlaps();
                let ddp = match overlapped {
                    true => builder.build_units(module.parts().to_vec())?,
                    false => builder.build(module.whole())?,
                };
                Engine::Ddp {
                    ddp: Box::new(ddp),
                    overlapped,
                }
            }
            Strategy::DdpOverlap => Engine::Ddp {
                ddp: Box::new(ddp_builder().build_units(module.parts().to_vec())?),
                overlapped: true,
            },
            Strategy::Fsdp | Strategy::Hsdp => {
                let fsdp_config = FsdpConfig {
                    reshard_after_forward: config.reshard_after_forward,
                    prefetch: config.prefetch,
                    mixed_precision: policy,
                    ..FsdpConfig::default()
                };
                let parts = module.parts().to_vec();
                let fsdp = match strategy {
                    Strategy::Hsdp => {
                        let mesh = hybrid_mesh(strategy, pg, config.shard_size)?;
                        FullyShardedDataParallel::from_units_on_mesh(
                            &mesh,
                            varmap,
                            DType::F32,
                            &first,
                            parts,
                            fsdp_config,
                        )?
                    }
                    _ => FullyShardedDataParallel::from_units(
                        pg,
                        varmap,
                        DType::F32,
                        &first,
                        parts,
                        fsdp_config,
                    )?,
                };
                Engine::Fsdp(Box::new(fsdp))
            }
            Strategy::Pipeline => Engine::Pipeline(pipeline(devices)?),
            Strategy::PipelineDdp => {
                let pipe = pipeline(devices)?;
                Engine::PipelineDdp(Box::new(DistributedDataParallel::from_module(
                    pg,
                    varmap,
                    pipe,
                    DdpConfig::default(),
                )?))
            }
            Strategy::PipelineRanks => {
                // Pipelines of consecutive ranks (a machine's, when the
                // launcher numbers them so), replicated across them.
                let stages = config.stages.max(1);
                let world = pg.world_size();
                let mesh = DeviceMesh::new(pg, &[("dp", world / stages), ("pp", stages)])?;
                let pipe_config = RankPipelineConfig {
                    chunks: config.chunks,
                    schedule: config.pipeline_schedule,
                    checkpoint: config.activation_checkpoint,
                    mixed_precision: policy,
                    zero: match config.zero {
                        Some(1) => Some(ZeroStage::One),
                        Some(2 | 3) => Some(ZeroStage::Two),
                        _ => None,
                    },
                    fsdp: config.zero == Some(3),
                    ..RankPipelineConfig::default()
                };
                Engine::RankPipeline(Box::new(RankPipeline::on_mesh(
                    &mesh,
                    ("pp", "dp"),
                    varmap,
                    DType::F32,
                    &first,
                    module.parts().to_vec(),
                    pipe_config,
                )?))
            }
        })
    }

    /// A pipeline on ranks keeps only its stages' variables and buffers:
    /// the `VarMap` of those (the others, built only to draw the seeded
    /// initial values, are dropped). `None` for the other engines.
    pub(crate) fn rank_varmap(&self) -> Option<VarMap> {
        let Engine::RankPipeline(pipe) = self else {
            return None;
        };
        let varmap = VarMap::new();
        {
            let mut data = crate::lock::lock(varmap.data());
            for (name, var) in pipe.variables().iter().chain(pipe.buffers()) {
                data.insert(name.clone(), var.clone());
            }
        }
        Some(varmap)
    }

    /// Whether this engine keeps gradients across `no_sync` steps itself
    /// (the others' gradients are summed by the caller).
    pub(crate) fn accumulates_itself(&self) -> bool {
        matches!(
            self,
            Engine::Ddp { .. } | Engine::Fsdp(_) | Engine::PipelineDdp(_)
        )
    }

    /// The bytes of this rank's parameters: its pieces (FSDP), or its
    /// whole model.
    pub(crate) fn param_bytes(&self, varmap: &VarMap) -> usize {
        let bytes = |vars: &[(String, Var)]| -> usize {
            vars.iter()
                .map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes())
                .sum()
        };
        match self {
            Engine::Fsdp(fsdp) => fsdp.last_memory().shard_bytes,
            Engine::Ddp { ddp, .. } => bytes(ddp.params()),
            Engine::PipelineDdp(ddp) => bytes(ddp.params()),
            _ => bytes(&sorted_vars(varmap)),
        }
    }

    /// The variables the optimizer steps, named: the masters, this rank's
    /// model, or (FSDP) this rank's pieces.
    pub(crate) fn named_params(&self, varmap: &VarMap) -> Vec<(String, Var)> {
        match self {
            Engine::Fsdp(fsdp) => fsdp.shards().to_vec(),
            Engine::Replicas { dp, .. } => dp.vars().to_vec(),
            Engine::RankPipeline(pipe) => pipe.variables().to_vec(),
            _ => sorted_vars(varmap),
        }
    }

    /// One forward and backward of `loss_fn(output, y)` times `factor` (the
    /// loss scale over the accumulation steps); `sync` false: the engines
    /// that can skip their reduction do (no_sync).
    pub(crate) fn forward_backward(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        factor: f64,
        sync: bool,
        loss_fn: &LossFn,
    ) -> Result<Ran> {
        let scaled = {
            let loss_fn = loss_fn.clone();
            move |out: &Tensor, y: &Tensor| loss_fn(&output_for_loss(out)?, y)?.affine(factor, 0.0)
        };
        match self {
            Engine::Single { model, buffers } => {
                let before = BufferSnapshot::take(buffers)?;
                let run = || -> Result<Ran> {
                    let loss = loss_fn(&output_for_loss(&model.forward_t(x, true)?)?, y)?;
                    let grads = loss.affine(factor, 0.0)?.backward()?;
                    Ok(Ran {
                        loss: loss.detach(),
                        grads: Some(grads),
                    })
                };
                run().inspect_err(|e| before.restore_after(e))
            }
            Engine::Replicas { dp, gathered: true } => {
                let loss = loss_fn(&output_for_loss(&dp.forward_t(x, true)?)?, y)?;
                let grads = loss.affine(factor, 0.0)?.backward()?;
                Ok(Ran {
                    loss: loss.detach(),
                    grads: Some(grads),
                })
            }
            Engine::Replicas { dp, .. } => {
                let dtype = dp.compute_dtype();
                let step = dp.forward_backward(
                    (x.clone(), y.clone()),
                    LossReduction::Mean,
                    move |m: &Units, (x, y): (Tensor, Tensor)| {
                        let x = match dtype {
                            Some(dtype) => cast_input(&x, dtype)?,
                            None => x,
                        };
                        scaled(&m.forward_t(&x, true)?, &y)
                    },
                )?;
                ran(step, factor, true)
            }
            Engine::Ddp { ddp, overlapped } => {
                let overlapped = *overlapped;
                let run = |ddp: &mut DistributedDataParallel<Units>| -> Result<Ran> {
                    if overlapped {
                        return ran(ddp.forward_backward(x, y, scaled)?, factor, true);
                    }
                    let loss = loss_fn(&output_for_loss(&ddp.forward_t(x, true)?)?, y)?;
                    let grads = ddp.backward(&loss.affine(factor, 0.0)?)?;
                    Ok(Ran {
                        loss: loss.detach(),
                        grads: Some(grads),
                    })
                };
                let ran = match sync {
                    true => run(ddp),
                    false => ddp.no_sync(run),
                }?;
                Ok(only_when(sync, ran))
            }
            Engine::Fsdp(fsdp) => {
                let run = |fsdp: &mut FullyShardedDataParallel| fsdp.forward_backward(x, y, scaled);
                let step = match sync {
                    true => run(fsdp),
                    false => fsdp.no_sync(run),
                }?;
                ran(step, factor, sync)
            }
            Engine::Pipeline(pipe) => {
                let step = pipe.forward_backward(x, y, LossReduction::Mean, scaled)?;
                ran(step, factor, true)
            }
            Engine::PipelineDdp(ddp) => {
                let run = |ddp: &mut DistributedDataParallel<Pipeline>| {
                    ddp.forward_backward(x, y, LossReduction::Mean, scaled)
                };
                let step = match sync {
                    true => run(ddp),
                    false => ddp.no_sync(run),
                }?;
                ran(step, factor, sync)
            }
            Engine::RankPipeline(pipe) => {
                // Every rank of a pipeline has the batch; the first stage
                // reads the input, the last the targets. The loss (the
                // replicas' mean on a mesh) then goes to every rank.
                let step = pipe.forward_backward(Some(x), Some(y), LossReduction::Mean, scaled)?;
                let loss = pipe.from_last_stage(step.loss.as_ref())?;
                Ok(Ran {
                    loss: loss.affine(1.0 / factor, 0.0)?,
                    grads: Some(step.grads),
                })
            }
        }
    }

    /// The model's output for `x` in evaluation mode, in f32 (every rank
    /// must call it: DDP broadcasts its buffers, FSDP gathers its units).
    pub(crate) fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let out = match self {
            Engine::Single { model, .. } => model.forward_t(x, false)?,
            Engine::Replicas { dp, .. } => dp.forward_t(x, false)?,
            Engine::Ddp { ddp, .. } => ddp.forward_t(x, false)?,
            Engine::Fsdp(fsdp) => fsdp.forward_t(x, false)?,
            Engine::Pipeline(pipe) => pipe.forward_t(x, false)?,
            Engine::PipelineDdp(ddp) => ddp.forward_t(x, false)?,
            Engine::RankPipeline(pipe) => {
                let out = pipe.forward_t(Some(x), false)?;
                pipe.from_last_stage(out.as_ref())?
            }
        };
        Ok(output_for_loss(&out)?)
    }

    /// The whole model's variables by name, on the CPU (FSDP gathers them:
    /// every rank must call it).
    pub(crate) fn full_state(&self, varmap: &VarMap) -> Result<HashMap<String, Tensor>> {
        let whole = match self {
            Engine::Fsdp(fsdp) => fsdp.full_state()?,
            Engine::RankPipeline(pipe) => pipe.full_state()?,
            _ => sorted_vars(varmap)
                .into_iter()
                .map(|(name, var)| (name, var.as_tensor().clone()))
                .collect(),
        };
        whole
            .into_iter()
            .map(|(name, t)| Ok((name, t.to_device(&Device::Cpu)?)))
            .collect()
    }
}

/// What an engine's [`Step`] of a loss scaled by `factor` gave: the loss
/// unscaled, and the gradients unless it ran inside no_sync.
fn ran(step: Step, factor: f64, sync: bool) -> Result<Ran> {
    Ok(Ran {
        loss: step.loss.affine(1.0 / factor, 0.0)?,
        grads: Some(step.grads).filter(|_| sync),
    })
}

/// A step that ran inside no_sync returns no gradients.
fn only_when(sync: bool, ran: Ran) -> Ran {
    Ran {
        loss: ran.loss,
        grads: ran.grads.filter(|_| sync),
    }
}

/// A hybrid mesh over `pg` for `strategy` (HSDP, or ZeRO given a shard
/// size): `(replicate, shard)`, shard groups of `shard_size` ranks
/// (default: the ranks per machine the MPI launcher reports, all ranks on
/// threads).
fn hybrid_mesh(
    strategy: Strategy,
    pg: Arc<dyn ProcessGroup>,
    shard_size: Option<usize>,
) -> Result<DeviceMesh> {
    let world = pg.world_size();
    let shard = shard_size.unwrap_or(match Backend::from_env() {
        Backend::Threads => world,
        Backend::Mpi { .. } => Backend::local_processes(),
    });
    if shard == 0 || !world.is_multiple_of(shard) {
        return Err(Error::Strategy {
            strategy: strategy.name().into(),
            reason: format!(
                "{world} ranks do not split into shard groups of {shard}: give a shard_size \
                 that divides the number of ranks"
            ),
        });
    }
    Ok(DeviceMesh::new(
        pg,
        &[("replicate", world / shard), ("shard", shard)],
    )?)
}
