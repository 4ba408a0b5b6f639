//! Tensor parallelism (`tp` of the Fabric's mesh) on the language model of
//! `examples/train_lm.rs`: every mesh with a `tp` degree trains to one
//! device's losses and weights, each rank holds its share of the
//! matrices, and what cannot be split is refused before a step runs.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::Tensor;
use candle_dp::fabric::{Degrees, Fabric, FabricConfig, ModelRecipe};
use candle_dp::optim::{Sgd, SgdConfig};
use candle_dp::tensor_parallel::{Placement, TpPlan};

use crate::common::gpt_loop::{adamw, adamw_run, module, rank_loop, windows, Run, BATCH, GPT};
use crate::common::{max_rel_diff, within};
use crate::example_gpt::{adamw_groups, lm_loss_tp, tp_plan, tp_units, GptConfig};
use crate::example_text::windows_at;

fn config(mesh: &str, sequence_parallel: bool, clip: Option<f64>) -> Result<FabricConfig> {
    let config = FabricConfig {
        gradient_clip: clip,
        sequence_parallel,
        ..FabricConfig::default()
    };
    Ok(match mesh {
        "single" => config,
        mesh => config.with_mesh(mesh.parse::<Degrees>()?)?,
    })
}

/// `steps` steps on a global batch of 8 windows of the book, through
/// the Fabric's one loop: AdamW over the GPT-2 groups, or SGD with
/// momentum (`sgd`), whose steps do not magnify rounding as Adam's do.
fn train(config: FabricConfig, gpt: GptConfig, steps: u64, sgd: bool) -> Result<Run> {
    let train = windows(gpt)?;
    let runs = Fabric::spawn(config, |fabric| {
        if !sgd && gpt == GPT {
            return Ok(Some(adamw_run(&fabric, steps)?).filter(|_| fabric.rank() == 0));
        }
        let sgd = SgdConfig {
            lr: 0.3,
            momentum: 0.9,
            ..Default::default()
        };
        let mut model = fabric.setup(module(&fabric, gpt), |p| Sgd::new_named(p, sgd))?;
        let losses = rank_loop(&fabric, &mut model, &train, (0, steps))?;
        let run = Run {
            losses,
            weights: model.full_state()?,
            memory: model.memory()?,
        };
        Ok((fabric.rank() == 0).then_some(run))
    })?;
    Ok(runs.into_iter().flatten().next().expect("rank 0's run"))
}

fn worst_loss_gap(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs())
        .fold(0.0, f32::max)
}

/// Every loss within 1e-6 (relative) of one device's on the same
/// batches; with SGD the weights too (1.5e-6). AdamW divides each step by
/// the gradient's running size, so a gradient that is zero but for
/// rounding (the attention's key bias: softmax ignores it) takes whole
/// steps of rounding noise on every strategy; there the weights are held
/// to data parallelism's own gap from one device (DDP's, measured beside
/// them), five times over. Meshes of 3 and 4 dimensions among them
/// (`pp=2,dp_shard=2,tp=2`: 8 ranks; `dp_replicate=2,dp_shard=2,pp=2,tp=2`:
/// 16).
#[test]
fn every_mesh_with_tp_trains_to_one_devices_losses_and_weights() -> Result<()> {
    let steps = 12;
    for sgd in [true, false] {
        let one = train(config("single", false, Some(1.0))?, GPT, steps, sgd)?;
        let unclipped = train(config("single", false, None)?, GPT, steps, sgd)?;
        let ddp = train(config("dp_replicate=2", false, Some(1.0))?, GPT, steps, sgd)?;
        let ddp_gap = max_rel_diff(&ddp.weights, &one.weights);
        let weights_within = match sgd {
            true => 1.5e-6,
            false => 5.0 * ddp_gap,
        };
        for (mesh, sp, clip) in [
            ("tp=2", false, Some(1.0)),
            ("tp=2", true, Some(1.0)),
            ("tp=4", false, Some(1.0)),
            ("tp=4", true, None),
            ("dp_replicate=2,tp=2", false, Some(1.0)),
            ("dp_replicate=2,tp=2", true, Some(1.0)),
            ("dp_shard=2,tp=2", false, Some(1.0)),
            ("dp_shard=2,tp=2", true, Some(1.0)),
            ("pp=2,tp=2", false, Some(1.0)),
            ("pp=2,dp_shard=2,tp=2", false, Some(1.0)),
            ("pp=2,dp_shard=2,tp=2", true, Some(1.0)),
            ("dp_replicate=2,dp_shard=2,pp=2,tp=2", false, Some(1.0)),
        ] {
            let reference = if clip.is_some() { &one } else { &unclipped };
            let run = within(300, move || train(config(mesh, sp, clip)?, GPT, steps, sgd))?;
            let (losses, weights) = (
                worst_loss_gap(&run.losses, &reference.losses),
                max_rel_diff(&run.weights, &reference.weights),
            );
            let optimizer = if sgd { "SGD" } else { "AdamW" };
            println!(
                "{optimizer} {mesh} sequence parallel {sp}: losses {losses:.1e}, weights \
                 {weights:.1e} (DDP's {ddp_gap:.1e})"
            );
            assert!(
                losses < 1e-6,
                "{optimizer} {mesh} sp {sp}: losses {losses:e}"
            );
            assert!(
                weights < weights_within,
                "{optimizer} {mesh} sp {sp}: weights {weights:e} (DDP's gap {ddp_gap:e})"
            );
        }
    }
    Ok(())
}

/// Each rank holds its share of the matrices and the replicated
/// parameters whole: at tp = 2 and 4 its parameters and AdamW's state
/// are `sharded / tp + replicated` of one device's.
#[test]
fn each_tp_rank_holds_its_share_of_the_matrices() -> Result<()> {
    let (v, c, w, l) = (GPT.vocab, GPT.context, GPT.width, GPT.layers);
    let sharded = v * w + l * (3 * w * w + 3 * w + w * w + 4 * w * w + 4 * w + 4 * w * w);
    let replicated = c * w + l * (2 * w + w + 2 * w + w) + 2 * w;
    assert_eq!(sharded + replicated, GPT.parameters());
    let one = train(config("single", false, None)?, GPT, 1, false)?.memory;
    // AdamW's state beside its two moments (its steps).
    let counters = one.optimizer_state - 2 * 4 * GPT.parameters();
    for (mesh, sp, tp) in [("tp=2", false, 2), ("tp=4", false, 4), ("tp=4", true, 4)] {
        let run = train(config(mesh, sp, None)?, GPT, 1, false)?;
        let expected = 4 * (sharded / tp + replicated);
        println!(
            "{mesh} sequence parallel {sp}: parameters {} bytes of one device's {}",
            run.memory.parameters,
            4 * GPT.parameters()
        );
        assert_eq!(run.memory.parameters, expected, "{mesh}");
        assert_eq!(
            run.memory.optimizer_state,
            2 * expected + counters,
            "{mesh}"
        );
        assert_eq!(run.memory.gradients, expected, "{mesh}");
    }
    Ok(())
}

fn refusal(config: FabricConfig, gpt: GptConfig, plan: TpPlan) -> String {
    let e = within(60, move || {
        Fabric::spawn(config, |fabric| {
            let tp = fabric.tensor_parallel();
            let module = ModelRecipe::units(tp_units(gpt, tp)).with_tp_plan(plan.clone());
            fabric.setup(module, |p| Sgd::new_named(p, SgdConfig::default()))?;
            Ok(())
        })
        .map_err(anyhow::Error::from)
    })
    .expect_err("refused");
    format!("{e:#}")
}

#[test]
fn what_cannot_be_split_is_refused_naming_the_dimension_and_the_layer() -> Result<()> {
    let tp2 = || config("tp=2", false, None);
    let heads = GptConfig {
        heads: 3,
        width: 24,
        ..GPT
    };
    let e = refusal(tp2()?, heads, tp_plan());
    assert!(
        e.contains("the heads of block 0 (3) does not divide among tp = 2"),
        "{e}"
    );
    let vocab = GptConfig { vocab: 255, ..GPT };
    let e = refusal(tp2()?, vocab, tp_plan());
    assert!(e.contains("the vocabulary of `wte.weight` (255)"), "{e}");
    let width = GptConfig {
        width: 30,
        heads: 4,
        ..GPT
    };
    let e = refusal(config("tp=4", false, None)?, width, tp_plan());
    assert!(e.contains("(90) does not divide among tp = 4"), "{e}");
    let plan = tp_plan().with("h.*.mlp.gate.weight", Placement::Shard(0));
    let e = refusal(tp2()?, GPT, plan);
    assert!(
        e.contains("`h.*.mlp.gate.weight`") && e.contains("no parameter"),
        "{e}"
    );

    // A model without a plan on a mesh with tp.
    let e = within(60, move || {
        Fabric::spawn(tp2()?, |fabric| {
            let module = ModelRecipe::units(tp_units(GPT, fabric.tensor_parallel()));
            fabric.setup(module, |p| Sgd::new_named(p, SgdConfig::default()))?;
            Ok(())
        })
        .map_err(anyhow::Error::from)
    })
    .expect_err("refused");
    assert!(
        format!("{e:#}").contains("ModelRecipe::with_tp_plan"),
        "{e:#}"
    );

    // Sequence parallelism without tensor parallelism, and degrees that
    // are not the ranks given.
    let e = config("dp_replicate=2", true, None)?
        .check()
        .expect_err("refused");
    assert!(e.to_string().contains("sequence_parallel"), "{e}");
    let three = FabricConfig {
        devices: candle_dp::fabric::Devices::Count(3),
        ..FabricConfig::default()
    };
    let e = three.with_mesh("tp=2".parse()?).expect_err("refused");
    assert!(e.to_string().contains("spans 2 ranks"), "{e}");
    // DDP's overlap reduces on a thread of its own beside the backward's
    // tensor-parallel collectives.
    let overlap = FabricConfig {
        overlap: true,
        ..FabricConfig::default()
    };
    let e = overlap
        .with_mesh("dp_replicate=2,tp=2".parse()?)?
        .check()
        .expect_err("refused");
    assert!(e.to_string().contains("use ddp beside tp"), "{e}");
    Ok(())
}

/// The gradients' total norm over every mesh with tp counts each
/// parameter once (a split one's pieces on every rank, a replicated one
/// once, FSDP's and ZeRO's pieces across their ranks): one device's norm
/// within 1e-6, steps 1 to 3.
#[test]
fn the_clipping_norm_over_tp_and_sharding_is_one_devices() -> Result<()> {
    let norms = |config: FabricConfig| -> Result<Vec<f64>> {
        let train = windows(GPT)?;
        let runs = within(300, move || {
            Fabric::spawn(config, |fabric| {
                let sgd = SgdConfig {
                    lr: 0.3,
                    ..Default::default()
                };
                let mut model = fabric.setup(module(&fabric, GPT), |p| Sgd::new_named(p, sgd))?;
                let mut norms = Vec::new();
                for step in 0..3 {
                    let (share, shares) =
                        (fabric.data_parallel_rank(), fabric.data_parallel_size());
                    let rows = windows_at(&train, shares, share, 7, BATCH / shares, step)?;
                    let (x, y) = train.batch(&rows)?;
                    match fabric.tensor_parallel().cloned() {
                        Some(tp) => model.backward(&x, &y, move |o, y| lm_loss_tp(o, y, &tp))?,
                        None => model.backward(&x, &y, crate::example_gpt::lm_loss)?,
                    };
                    let clipped = model.clip_gradients(0.5)?.expect("a whole step");
                    norms.push(clipped.total_norm);
                    model.step()?;
                }
                Ok(norms)
            })
            .map_err(anyhow::Error::from)
        })?;
        // Every rank clipped by the same norm.
        assert!(runs.iter().all(|n| n == &runs[0]), "{runs:?}");
        Ok(runs[0].clone())
    };
    let one = norms(config("single", false, None)?)?;
    let zero2 = |mesh: &str| -> Result<FabricConfig> {
        Ok(FabricConfig {
            zero: Some(2),
            ..FabricConfig::default()
        }
        .with_mesh(mesh.parse()?)?)
    };
    for (label, config) in [
        ("tp=2", config("tp=2", false, None)?),
        ("tp=4 sequence parallel", config("tp=4", true, None)?),
        (
            "dp_shard=2,tp=2 (FSDP)",
            config("dp_shard=2,tp=2", false, None)?,
        ),
        (
            "dp_shard=2,tp=2 sequence parallel",
            config("dp_shard=2,tp=2", true, None)?,
        ),
        (
            "dp_replicate=2,dp_shard=2,tp=2 (HSDP)",
            config("dp_replicate=2,dp_shard=2,tp=2", false, None)?,
        ),
        ("dp_replicate=2,tp=2 ZeRO-2", zero2("dp_replicate=2,tp=2")?),
        (
            "pp=2,dp_shard=2,tp=2",
            config("pp=2,dp_shard=2,tp=2", false, None)?,
        ),
        (
            "pp=2,dp_replicate=2,tp=2 ZeRO-2",
            zero2("pp=2,dp_replicate=2,tp=2")?,
        ),
    ] {
        let got = norms(config)?;
        let gap = got
            .iter()
            .zip(&one)
            .map(|(a, b)| ((a - b) / b).abs())
            .fold(0.0, f64::max);
        println!("{label}: norms {got:?} (one device {one:?}), largest gap {gap:.1e}");
        assert!(gap < 1e-6, "{label}: {got:?} against one device's {one:?}");
    }
    Ok(())
}

/// A tensor-parallel rank whose step fails fails every rank (none waits
/// for it), and the step that failed changed no weight.
#[test]
fn a_tp_rank_failing_mid_step_fails_every_rank_and_changes_no_weight() -> Result<()> {
    let train = windows(GPT)?;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let rank0 = std::sync::Arc::clone(&seen);
    let result = within(120, move || {
        Fabric::spawn(config("tp=2", false, Some(1.0))?, |fabric| {
            let tp = fabric.tensor_parallel().cloned().expect("tp");
            let module = ModelRecipe::units(tp_units(GPT, Some(&tp))).with_tp_plan(tp_plan());
            let mut model = fabric.setup(module, |p| Sgd::new_named(p, SgdConfig::default()))?;
            let (x, y) = train.batch(&windows_at(&train, 1, 0, 7, BATCH, 0)?)?;
            let before = copies(model.varmap())?;
            let rank = fabric.rank();
            let failing = move |out: &Tensor, y: &Tensor| {
                if rank == 1 {
                    candle_core::bail!("rank 1's loss fails");
                }
                lm_loss_tp(out, y, &tp)
            };
            let step = match model.backward(&x, &y, failing) {
                Ok(_) => model.step(),
                Err(e) => Err(e),
            };
            if rank == 0 {
                // Rank 0's collectives lose rank 1: its step fails too.
                let unchanged = copies(model.varmap())? == before;
                *rank0.lock().unwrap() = Some((step.is_err(), unchanged));
            }
            step?;
            Ok(())
        })
        .map_err(anyhow::Error::from)
    });
    let e = result.err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(e.contains("rank 1 failed: rank 1's loss fails"), "{e}");
    assert_eq!(*seen.lock().unwrap(), Some((true, true)));
    Ok(())
}

/// This rank's variables, copied out as values.
fn copies(varmap: &candle_nn::VarMap) -> Result<Vec<(String, Vec<f32>)>> {
    let mut all = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(name, var)| Ok((name.clone(), var.flatten_all()?.to_vec1::<f32>()?)))
        .collect::<Result<Vec<_>>>()?;
    all.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(all)
}

/// `tp` is the innermost degree: it multiplies the ranks, the strategy is
/// the other degrees', and the configuration reads back as its degrees.
#[test]
fn tp_multiplies_the_ranks_of_the_strategy_the_other_degrees_name() -> Result<()> {
    use candle_dp::fabric::Strategy;
    for (mesh, strategy, ranks) in [
        ("tp=2", Strategy::Single, 2),
        ("dp_replicate=2,tp=2", Strategy::Ddp, 4),
        ("dp_shard=2,tp=4", Strategy::Fsdp, 8),
        ("dp_replicate=2,dp_shard=2,tp=2", Strategy::Hsdp, 8),
        ("pp=2,dp_shard=2,tp=2", Strategy::PipelineRanks, 8),
    ] {
        let degrees: Degrees = mesh.parse()?;
        let config = FabricConfig::default().with_mesh(degrees)?;
        assert_eq!(config.effective_strategy(), strategy, "{mesh}");
        assert_eq!(config.ranks(), ranks, "{mesh}");
        assert_eq!(config.tensor_parallel_size(), degrees.tp, "{mesh}");
        assert_eq!(config.degrees(), degrees, "{mesh}");
        config.check()?;
    }
    Ok(())
}

/// `steps` AdamW steps from the newest state in `dir` (if any, when
/// `resume`), saving after step `save_at`; every rank's losses and rank
/// 0's whole model.
fn train_saving(
    config: FabricConfig,
    dir: &std::path::Path,
    steps: u64,
    save_at: Option<u64>,
    resume: bool,
) -> Result<(Vec<f32>, HashMap<String, Tensor>)> {
    use candle_dp::training_state::Progress;
    let config = FabricConfig {
        checkpoint_dir: Some(dir.to_path_buf()),
        gradient_clip: Some(1.0),
        ..config
    };
    let train = windows(GPT)?;
    let runs = within(300, move || {
        Fabric::spawn(config, |fabric| {
            let mut model =
                fabric.setup(module(&fabric, GPT), |p| adamw_groups(p, adamw(), false))?;
            let from = model.resume(resume)?.step;
            let mut losses = Vec::new();
            for step in from..steps {
                losses.extend(rank_loop(&fabric, &mut model, &train, (step, step + 1))?);
                if save_at == Some(step + 1) {
                    let done = step + 1;
                    model.save(Progress {
                        epoch: 0,
                        batch: done,
                        step: done,
                    })?;
                }
            }
            Ok((losses, model.full_state()?))
        })
        .map_err(anyhow::Error::from)
    })?;
    Ok(runs.into_iter().next().expect("rank 0"))
}

fn bits(weights: &HashMap<String, Tensor>) -> Result<Vec<(String, Vec<u32>)>> {
    let mut all = weights
        .iter()
        .map(|(name, t)| {
            let values = t.flatten_all()?.to_vec1::<f32>()?;
            Ok((name.clone(), values.iter().map(|v| v.to_bits()).collect()))
        })
        .collect::<Result<Vec<_>>>()?;
    all.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(all)
}

/// A tensor-parallel run's state is saved whole (the strategy's pieces
/// and the tensor-parallel ones joined): beside single, DDP, FSDP, HSDP
/// and ZeRO-2 it resumes on its mesh to the bytes of the run that did not
/// stop, and loads on other meshes (tp = 4, FSDP beside tp, tp = 1 on 4
/// DDP ranks, one device) to the same values.
#[test]
fn a_tp_state_resumes_to_the_same_bytes_and_loads_on_any_mesh() -> Result<()> {
    for mesh in [
        "tp=2",
        "dp_replicate=2,tp=2",
        "dp_shard=2,tp=2",
        "dp_replicate=2,dp_shard=2,tp=2",
    ] {
        let (dir, again) = (scratch(&format!("{mesh}-all")), scratch(mesh));
        let (all_losses, all_weights) =
            train_saving(config(mesh, false, None)?, &dir, 4, Some(2), false)?;
        train_saving(config(mesh, false, None)?, &again, 2, Some(2), false)?;
        let (losses, weights) = train_saving(config(mesh, false, None)?, &again, 4, None, true)?;
        assert_eq!(losses, all_losses[2..], "{mesh}: the resumed losses");
        assert_eq!(
            bits(&weights)?,
            bits(&all_weights)?,
            "{mesh}: the resumed weights"
        );

        // The state after step 2 onto other meshes: the same values.
        let (_, saved) = train_saving(config(mesh, false, None)?, &again, 2, None, true)?;
        for other in [
            "single",
            "tp=4",
            "dp_replicate=4",
            "dp_shard=2,tp=2",
            "dp_replicate=2,tp=2",
        ] {
            let (_, loaded) = train_saving(config(other, false, None)?, &again, 2, None, true)?;
            assert_eq!(bits(&loaded)?, bits(&saved)?, "{mesh} loaded on {other}");
        }
        for folder in [dir, again] {
            std::fs::remove_dir_all(folder)?;
        }
    }
    // ZeRO-2 beside tp too; a pipeline beside tp cannot put its whole
    // state together yet, and says so.
    let zero2 = FabricConfig {
        zero: Some(2),
        ..FabricConfig::default()
    }
    .with_mesh("dp_replicate=2,tp=2".parse()?)?;
    let dir = scratch("zero2");
    let (all_losses, all_weights) = train_saving(zero2.clone(), &dir, 4, Some(2), false)?;
    let again = scratch("zero2-again");
    train_saving(zero2.clone(), &again, 2, Some(2), false)?;
    let (losses, weights) = train_saving(zero2, &again, 4, None, true)?;
    assert_eq!(
        losses,
        all_losses[2..],
        "ZeRO-2 beside tp: the resumed losses"
    );
    assert_eq!(
        bits(&weights)?,
        bits(&all_weights)?,
        "ZeRO-2 beside tp: the resumed weights"
    );
    let dir_pp = scratch("pipeline");
    let e = train_saving(
        config("pp=2,tp=2", false, None)?,
        &dir_pp,
        1,
        Some(1),
        false,
    )
    .err()
    .map(|e| format!("{e:#}"))
    .unwrap_or_default();
    assert!(
        e.contains("strategy pipeline-ranks cannot put its whole state together"),
        "{e}"
    );
    for folder in [dir, again, dir_pp] {
        let _ = std::fs::remove_dir_all(folder);
    }
    Ok(())
}

/// An empty folder of its own for a test's states.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "candle-dp-tp-{}-{}",
        name.replace([',', '='], "-"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// In bf16 (f32 masters, the forward and backward in bf16) a tp run
/// stays as near one device's bf16 run as bf16's own rounding allows: its
/// losses' gap from one device's bf16 losses is within the gap between
/// one device's bf16 and f32 losses (bf16's own error), every step.
#[test]
fn tp_in_bf16_stays_within_bf16s_own_gap_of_one_devices_bf16() -> Result<()> {
    use candle_dp::fabric::Precision;
    let bf16 = |mesh: &str| -> Result<FabricConfig> {
        Ok(config(mesh, false, Some(1.0))?.precision(Precision::Bf16Mixed))
    };
    let steps = 12;
    let f32_one = train(config("single", false, Some(1.0))?, GPT, steps, false)?;
    let bf16_one = train(bf16("single")?, GPT, steps, false)?;
    let own = worst_loss_gap(&bf16_one.losses, &f32_one.losses);
    for mesh in ["tp=2", "dp_shard=2,tp=2"] {
        let run = within(300, move || train(bf16(mesh)?, GPT, steps, false))?;
        let gap = worst_loss_gap(&run.losses, &bf16_one.losses);
        println!("bf16 {mesh}: losses {gap:.1e} from one device's bf16 (bf16 from f32: {own:.1e})");
        assert!(gap <= own, "{mesh}: {gap:e} against bf16's own {own:e}");
    }
    Ok(())
}

/// A token id that no rank's rows hold fails every tensor-parallel rank
/// alike, naming it, as one device's lookup fails (not a silent zero row).
#[test]
fn a_token_outside_the_vocabulary_fails_every_tp_rank_naming_it() -> Result<()> {
    let e = within(60, || {
        Fabric::spawn(config("tp=2", false, None)?, |fabric| {
            let mut model = fabric.setup(module(&fabric, GPT), |p| {
                Sgd::new_named(p, SgdConfig::default())
            })?;
            let x = Tensor::new(&[[1u32, 2, 300, 4]], &candle_core::Device::Cpu)?;
            let tp = fabric.tensor_parallel().cloned().expect("tp");
            model.backward(&x, &x, move |o, y| lm_loss_tp(o, y, &tp))?;
            Ok(())
        })
        .map_err(anyhow::Error::from)
    })
    .expect_err("refused");
    let e = format!("{e:#}");
    assert!(
        e.contains("token id 300 at position 2 is not one of the 256 rows"),
        "{e}"
    );
    Ok(())
}
