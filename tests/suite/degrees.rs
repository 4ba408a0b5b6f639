//! Parallelism as degrees of one mesh (`Degrees`, `--mesh`, the JSON
//! config's `mesh`): parsed and printed, the strategy names as aliases of
//! degrees, contradictions refused naming both, and a mesh trains as the
//! strategy it names, to one device's weights.

// The Fabric's own calls return candle_dp::Result, as the crate's do.
#![allow(clippy::result_large_err)]

use candle_dp::fabric::{Degrees, Fabric, FabricArgs, FabricConfig, Strategy};
use clap::Parser;

use crate::common::fabric_loop::{dataset, setup, train, train_resumable, AfterStep, Trained};
use crate::common::{identical, max_rel_diff};

fn degrees(text: &str) -> Degrees {
    text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn refused(result: candle_dp::Result<impl std::fmt::Debug>) -> String {
    result.unwrap_err().to_string()
}

#[test]
fn degrees_are_parsed_printed_and_refused_naming_the_degree() {
    let d = degrees("dp_replicate=2, dp_shard=2");
    assert_eq!(
        (d.dp_replicate, d.dp_shard, d.pp, d.world_size()),
        (2, 2, 1, 4)
    );
    assert_eq!(d.mesh_dims(), vec![("dp_replicate", 2), ("dp_shard", 2)]);
    // The short names, and the order outermost first whatever the order given.
    let d = degrees("shard=2,pp=3,dp=2");
    assert_eq!(d.to_string(), "dp_replicate=2,dp_shard=2,pp=3");
    assert_eq!(degrees(&d.to_string()), d);
    assert_eq!(Degrees::one().to_string(), "dp_replicate=1");
    assert_eq!(degrees("dp_replicate=1"), Degrees::one());

    for (text, says) in [
        ("dp_replicate=0", "a degree is a whole number, at least 1"),
        ("dp=two", "dp_replicate=two"),
        ("ep=2", "no degree `ep`"),
        ("dp=2,dp_replicate=2", "dp_replicate given twice"),
        ("dp_shard", "`dp_shard` is not name=degree"),
    ] {
        let e = refused(text.parse::<Degrees>());
        assert!(e.contains(says), "{text}: {e}");
    }
    let e = refused(FabricConfig::default().with_mesh(degrees("dp_shard=2,cp=2")));
    assert!(
        e.contains("context parallelism (cp = 2) is reserved"),
        "{e}"
    );
}

/// What a configuration trains with, as the engines see it.
fn trains_as(c: &FabricConfig) -> (Strategy, usize, Option<usize>, Option<u8>, usize) {
    (
        c.effective_strategy(),
        c.ranks(),
        c.shard_size,
        c.zero,
        c.stages,
    )
}

/// Every strategy name of ranks is an alias of degrees: the degrees it
/// expands to build back the same training.
#[test]
fn every_strategy_of_ranks_is_an_alias_of_its_degrees() {
    let named = |strategy, devices, tweak: fn(&mut FabricConfig)| {
        let mut c = FabricConfig::new(strategy, devices);
        tweak(&mut c);
        c
    };
    let cases = [
        (named(Strategy::Ddp, 4, |_| {}), "dp_replicate=4"),
        (
            named(Strategy::Ddp, 2, |c| c.zero = Some(2)),
            "dp_replicate=2",
        ),
        (named(Strategy::Fsdp, 4, |_| {}), "dp_shard=4"),
        (
            named(Strategy::Hsdp, 4, |c| c.shard_size = Some(2)),
            "dp_replicate=2,dp_shard=2",
        ),
        (named(Strategy::PipelineRanks, 2, |_| {}), "pp=2"),
        (
            named(Strategy::PipelineRanks, 4, |_| {}),
            "dp_replicate=2,pp=2",
        ),
        (
            named(Strategy::PipelineRanks, 6, |c| c.stages = 3),
            "dp_replicate=2,pp=3",
        ),
        (
            named(Strategy::PipelineRanks, 4, |c| c.zero = Some(3)),
            "dp_shard=2,pp=2",
        ),
        (
            named(Strategy::PipelineRanks, 8, |c| {
                c.zero = Some(3);
                c.shard_size = Some(2);
            }),
            "dp_replicate=2,dp_shard=2,pp=2",
        ),
        (named(Strategy::Single, 1, |_| {}), "dp_replicate=1"),
    ];
    for (config, want) in cases {
        let what = format!("{} on {}", config.effective_strategy(), config.ranks());
        assert_eq!(config.degrees().to_string(), want, "{what}");
        let back = FabricConfig {
            zero: config.zero.filter(|&z| z != 3),
            ..FabricConfig::default()
        }
        .with_mesh(config.degrees())
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(trains_as(&back), trains_as(&config), "{what}");
        back.check().unwrap();
    }
    // The strategies in one process name their devices' degree too.
    assert_eq!(
        FabricConfig::new(Strategy::Dp, 2).degrees().to_string(),
        "dp_replicate=2"
    );
    assert_eq!(
        FabricConfig::new(Strategy::Pipeline, 3)
            .degrees()
            .to_string(),
        "pp=3"
    );
}

#[test]
fn a_mesh_that_contradicts_the_configuration_is_refused_naming_both() {
    let cases = [
        (
            FabricConfig::new(Strategy::Ddp, 2),
            "dp_shard=2",
            "trains as strategy fsdp, and the configuration names strategy ddp",
        ),
        (
            FabricConfig::new(Strategy::Fsdp, 3),
            "dp_shard=4",
            "spans 4 ranks, and the configuration names 3 devices",
        ),
        (
            FabricConfig {
                zero: Some(1),
                ..FabricConfig::default()
            },
            "dp_shard=2",
            "ZeRO stage 1 does not go with it",
        ),
        (
            FabricConfig {
                shard_size: Some(1),
                ..FabricConfig::default()
            },
            "dp_replicate=2,dp_shard=2",
            "shard groups of 2 ranks, and the configuration names shard_size 1",
        ),
    ];
    for (config, mesh, says) in cases {
        let e = refused(config.with_mesh(degrees(mesh)));
        assert!(e.contains(says) && e.contains(mesh), "{mesh}: {e}");
    }
    // A mesh written beside fields that say another training.
    let config = FabricConfig {
        mesh: Some(degrees("dp_shard=2")),
        ..FabricConfig::new(Strategy::Ddp, 2)
    };
    let e = refused(config.check());
    assert!(
        e.contains("trains as strategy fsdp, and the configuration names strategy ddp"),
        "{e}"
    );
    // The same strategy on other ranks than the mesh's.
    let config = FabricConfig {
        mesh: Some(degrees("dp_shard=2")),
        ..FabricConfig::new(Strategy::Fsdp, 3)
    };
    let e = refused(config.check());
    assert!(
        e.contains("trains as fsdp on 2 ranks") && e.contains("say fsdp on 3"),
        "{e}"
    );
}

#[test]
fn the_flags_and_the_json_config_take_a_mesh() {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        fabric: FabricArgs,
    }
    let config = Cli::parse_from(["train", "--mesh", "dp_replicate=2,dp_shard=2"])
        .fabric
        .config()
        .unwrap();
    assert_eq!(trains_as(&config), (Strategy::Hsdp, 4, Some(2), None, 2));
    assert_eq!(config.mesh, Some(degrees("dp_replicate=2,dp_shard=2")));

    let config =
        FabricConfig::from_json(r#"{"mesh": {"dp_shard": 2, "pp": 2}, "chunks": 2}"#).unwrap();
    assert_eq!(
        trains_as(&config),
        (Strategy::PipelineRanks, 4, None, Some(3), 2)
    );
    // Written out and read back: the same.
    assert_eq!(FabricConfig::from_json(&config.to_json()).unwrap(), config);
    let e = refused(FabricConfig::from_json(r#"{"mesh": {"dp": 2}}"#));
    assert!(e.contains("unknown field `dp`"), "{e}");

    // The flag's mesh replaces the file's.
    let dir = std::env::temp_dir().join(format!("candle_dp_degrees_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.json");
    std::fs::write(&file, r#"{"mesh": {"dp_shard": 4}}"#).unwrap();
    let from_file = |extra: &[&str]| {
        let mut args = vec!["train", "--config", file.to_str().unwrap()];
        args.extend(extra);
        Cli::parse_from(args).fabric.config()
    };
    assert_eq!(trains_as(&from_file(&[]).unwrap()).0, Strategy::Fsdp);
    let replaced = from_file(&["--mesh", "dp_replicate=2"]).unwrap();
    assert_eq!(trains_as(&replaced), (Strategy::Ddp, 2, None, None, 2));
    let e = refused(from_file(&["--strategy", "ddp"]));
    assert!(e.contains("names strategy ddp"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn trained(config: FabricConfig) -> Trained {
    let data = dataset();
    let what = format!("{:?}", config.mesh);
    let mut ranks = Fabric::launch(
        FabricConfig {
            timeout_secs: Some(120.0),
            chunks: Some(2),
            ..config
        },
        |fabric| train(fabric, data.clone()),
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    ranks.remove(0)
}

/// Each mesh of today's forms trains as the strategy its degrees name, to
/// its bytes, and to one device's weights within the f32 tolerance of the
/// strategies (1e-6).
#[test]
fn a_mesh_of_degrees_trains_as_the_strategy_it_names_to_one_devices_weights() {
    let single = trained(FabricConfig::default());
    let hsdp = |c: FabricConfig| FabricConfig {
        shard_size: Some(2),
        ..c
    };
    let zero3 = |c: FabricConfig| FabricConfig { zero: Some(3), ..c };
    let cases = [
        ("dp_replicate=2", FabricConfig::new(Strategy::Ddp, 2)),
        ("dp_shard=2", FabricConfig::new(Strategy::Fsdp, 2)),
        (
            "dp_replicate=2,dp_shard=2",
            hsdp(FabricConfig::new(Strategy::Hsdp, 4)),
        ),
        ("pp=2", FabricConfig::new(Strategy::PipelineRanks, 2)),
        (
            "pp=2,dp_replicate=2",
            FabricConfig::new(Strategy::PipelineRanks, 4),
        ),
        (
            "pp=2,dp_shard=2",
            zero3(FabricConfig::new(Strategy::PipelineRanks, 4)),
        ),
        // Three dimensions: a pipeline whose replicas are HSDP.
        (
            "pp=2,dp_replicate=2,dp_shard=2",
            hsdp(zero3(FabricConfig::new(Strategy::PipelineRanks, 8))),
        ),
    ];
    for (mesh, named) in cases {
        let by_mesh = trained(FabricConfig::default().with_mesh(degrees(mesh)).unwrap());
        let by_name = trained(named);
        assert!(
            identical(&by_mesh.0, &by_name.0) && by_mesh.1 == by_name.1,
            "{mesh}: not the bytes of the strategy it names"
        );
        let weights = max_rel_diff(&by_mesh.0, &single.0);
        println!("{mesh}: {weights:.2e} from one device");
        assert!(weights <= 1e-6, "{mesh}: {weights:e} from one device");
    }
}

/// A pipeline of two stages whose replicas are HSDP over 2 x 2 (8 thread
/// ranks, a mesh of three dimensions) clips by one device's norm: each
/// shard group holds the same pieces, and only one copy of them counts,
/// so the clip (small enough to bite at every step) scales the gradients
/// as one device's does.
#[test]
fn a_pipeline_whose_replicas_are_hsdp_clips_by_one_devices_norm() {
    let clipped = |c: FabricConfig| FabricConfig {
        gradient_clip: Some(0.05),
        ..c
    };
    let single = trained(clipped(FabricConfig::default()));
    let mesh = degrees("pp=2,dp_replicate=2,dp_shard=2");
    let config = clipped(FabricConfig::default()).with_mesh(mesh).unwrap();
    assert_eq!(
        (config.ranks(), config.shard_size, config.zero),
        (8, Some(2), Some(3))
    );
    let hsdp = trained(config);
    let weights = max_rel_diff(&hsdp.0, &single.0);
    println!("{mesh}, clipped: {weights:.2e} from one device");
    assert!(weights <= 1e-6, "{mesh}: {weights:e} from one device");
}

/// Shard groups that do not divide a pipeline's replicas, or a shard size
/// without FSDP across them, are refused before anything runs, naming
/// what is wrong.
#[test]
fn shard_groups_of_a_pipelines_replicas_that_cannot_be_built_are_refused() {
    let pipeline = |zero, shard_size| FabricConfig {
        zero,
        shard_size: Some(shard_size),
        ..FabricConfig::new(Strategy::PipelineRanks, 8)
    };
    for (config, says) in [
        (
            pipeline(Some(3), 3),
            "4 replicas of the pipeline do not split into shard groups of 3",
        ),
        (pipeline(None, 2), "set ZeRO stage 3"),
        (pipeline(Some(3), 0), "do not split into shard groups of 0"),
        (pipeline(Some(3), 1), "a shard group of one replica"),
    ] {
        let e = refused(config.check());
        assert!(e.contains(says), "{config:?}: {e}");
    }
    // A shard size beside a mesh without shard groups is not dropped.
    let e = refused(
        FabricConfig {
            shard_size: Some(2),
            ..FabricConfig::default()
        }
        .with_mesh(degrees("dp_shard=4,pp=2")),
    );
    assert!(e.contains("the mesh has none"), "{e}");
}

/// The parameters each rank holds after a step on `mesh`, the most of any rank.
fn parameters_held(mesh: &str) -> usize {
    // Bounded: a rank that waits past 120 s fails the run.
    let config = FabricConfig {
        chunks: Some(2),
        timeout_secs: Some(120.0),
        ..FabricConfig::default().with_mesh(degrees(mesh)).unwrap()
    };
    let held = Fabric::launch(config, |fabric| {
        let mut model = setup(&fabric)?;
        let x = candle_core::Tensor::ones((4, 6), candle_core::DType::F32, fabric.device())?;
        let y = candle_core::Tensor::new(&[0u32, 1, 2, 0], fabric.device())?;
        model.backward(&x, &y, candle_nn::loss::cross_entropy)?;
        model.step()?;
        Ok(model.memory()?.parameters)
    })
    .unwrap_or_else(|e| panic!("{mesh}: {e}"));
    held.into_iter().max().unwrap_or(0)
}

/// HSDP's memory: a pipeline's replicas that are HSDP over 2 x 2 hold the
/// pieces of a shard group of 2 (FSDP over 2 replicas' share), twice what
/// FSDP over all 4 replicas holds.
#[test]
fn a_pipelines_hsdp_replicas_hold_the_pieces_of_their_shard_group() {
    let hsdp = parameters_held("pp=2,dp_replicate=2,dp_shard=2");
    let over_two = parameters_held("pp=2,dp_shard=2");
    let over_four = parameters_held("pp=2,dp_shard=4");
    println!("per rank: HSDP 2 x 2 {hsdp} B, FSDP over 2 {over_two} B, over 4 {over_four} B");
    assert_eq!(hsdp, over_two);
    assert!(over_four < hsdp, "{over_four} !< {hsdp}");
}

/// `mesh`'s run with its states in `dir`, stopped right after its save at
/// step `stop_at` (to the end when `None`), resuming from `dir`'s newest.
fn resumable(mesh: &str, dir: &std::path::Path, stop_at: Option<u64>) -> Trained {
    let config = FabricConfig {
        checkpoint_dir: Some(dir.to_path_buf()),
        timeout_secs: Some(120.0),
        ..FabricConfig::default().with_mesh(degrees(mesh)).unwrap()
    };
    let data = dataset();
    Fabric::launch(config, |fabric| {
        train_resumable(fabric, data.clone(), |_, step| {
            Ok(match stop_at == Some(step) {
                true => AfterStep::SaveAndStop,
                false => AfterStep::Go,
            })
        })
    })
    .unwrap_or_else(|e| panic!("{mesh}: {e}"))
    .swap_remove(0)
}

/// A pipeline whose replicas are HSDP saves a plain pipeline's state: it
/// resumes on its own mesh to the bytes of the run without a stop, and on
/// FSDP over all four replicas to one device's weights.
#[test]
fn a_pipeline_with_hsdp_replicas_resumes_to_its_bytes_and_onto_fsdp_across_the_replicas() {
    let dir = std::env::temp_dir().join(format!("candle-dp-degrees-hsdp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mesh = "pp=2,dp_replicate=2,dp_shard=2";
    let straight = resumable(mesh, &dir.join("straight"), None);
    resumable(mesh, &dir.join("stopped"), Some(3));
    let resumed = resumable(mesh, &dir.join("stopped"), None);
    assert!(
        identical(&resumed.0, &straight.0),
        "{mesh}: resumed weights differ"
    );
    assert_eq!(
        resumed.1,
        straight.1[3..],
        "{mesh}: losses after the resume"
    );
    resumable(mesh, &dir.join("moved"), Some(3));
    let moved = resumable("pp=2,dp_shard=4", &dir.join("moved"), None);
    // It went on from step 3, not from the start.
    assert_eq!(moved.1.len(), straight.1.len() - 3);
    let single = trained(FabricConfig::default());
    let weights = max_rel_diff(&moved.0, &single.0);
    println!("{mesh} resumed on pp=2,dp_shard=4: {weights:.2e} from one device");
    assert!(weights <= 1e-6, "{weights:e} from one device");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Which ranks a dimension of the Fabric's mesh holds, as every member
/// sees them.
fn along(fabric: &Fabric, dim: &str) -> anyhow::Result<Vec<usize>> {
    let me = candle_core::Tensor::new(&[fabric.rank() as u32], &candle_core::Device::Cpu)?;
    let mut ranks = Vec::new();
    for t in fabric.mesh().group(dim)?.all_gather(&me)? {
        ranks.push(t.to_vec1::<u32>()?[0] as usize);
    }
    Ok(ranks)
}

#[test]
fn the_fabrics_mesh_has_every_degree_and_its_groups_are_the_strategys() {
    use candle_dp::fabric::RANK_MESH;
    let cases = [
        // The 4-D mesh: 16 thread ranks.
        ("dp_replicate=2,dp_shard=2,pp=2,tp=2", vec![2, 2, 2, 2]),
        ("dp_shard=4", vec![1, 4, 1, 1]),
        // ZeRO's shard groups are dp_shard, though its degrees are DDP's.
        ("zero1 shard 2", vec![2, 2, 1, 1]),
    ];
    for (mesh, shape) in cases {
        let config = match mesh {
            "zero1 shard 2" => FabricConfig {
                shard_size: Some(2),
                ..FabricConfig::new(Strategy::Zero1, 4)
            },
            mesh => FabricConfig::default().with_mesh(degrees(mesh)).unwrap(),
        };
        let config = FabricConfig {
            timeout_secs: Some(120.0),
            ..config
        };
        let seen = Fabric::launch(config, |fabric| {
            let mesh = fabric.mesh();
            anyhow::ensure!(mesh.dim_names() == RANK_MESH);
            let tp = fabric.tensor_parallel().map(|tp| tp.group().world_size());
            anyhow::ensure!(tp.unwrap_or(1) == mesh.size("tp")?);
            Ok((
                mesh.shape().to_vec(),
                along(&fabric, "dp_shard")?,
                along(&fabric, "tp")?,
            ))
        })
        .unwrap_or_else(|e| panic!("{mesh}: {e}"));
        assert_eq!(seen[0].0, shape, "{mesh}");
        if mesh.starts_with("dp_replicate=2,dp_shard=2,pp=2") {
            // Rank 13 is at (1, 1, 0, 1): its shard group differs from it
            // along dp_shard only, its tp group along tp only.
            assert_eq!((&seen[13].1, &seen[13].2), (&vec![9, 13], &vec![12, 13]));
        }
    }
}
