//! Device meshes and hybrid sharding (HSDP): which ranks each dimension's
//! group holds, the refusals, and HSDP training to FSDP's and DDP's
//! weights on every mesh shape of four thread ranks.

use crate::common::*;
use crate::fsdp::{Ranks, Save};
use crate::overlap::{batches, bounded, deep_units, init_deep};

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_dp::comm::{DeviceMesh, ProcessGroup};
use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_dp::launch::spawn_with;

type Weights = HashMap<String, Tensor>;

#[test]
fn each_dimensions_group_holds_the_ranks_that_differ_only_there() {
    let seen = within(60, || {
        spawn_with(6, bounded(), |ctx| {
            let mesh = DeviceMesh::new(ctx.process_group(), &[("dp", 2), ("tp", 3)])?;
            let mut out = Vec::new();
            for dim in ["dp", "tp"] {
                let group = mesh.group(dim)?;
                let me = Tensor::new(&[ctx.rank as u32], &Device::Cpu)?;
                let members: Vec<usize> = group
                    .all_gather(&me)?
                    .iter()
                    .map(|t| t.to_vec1::<u32>().map(|v| v[0] as usize))
                    .collect::<candle_core::Result<_>>()?;
                anyhow::ensure!(members == mesh.ranks_along(dim)?, "{dim}: {members:?}");
                anyhow::ensure!(group.rank() == mesh.local_rank(dim)?);
                anyhow::ensure!(group.world_size() == mesh.size(dim)?);
                out.push(members);
            }
            Ok((mesh.coordinate().to_vec(), out))
        })
        .unwrap()
    });
    assert_eq!(seen[4], (vec![1, 1], vec![vec![1, 4], vec![3, 4, 5]]));
    assert_eq!(seen[2], (vec![0, 2], vec![vec![2, 5], vec![0, 1, 2]]));
}

#[test]
fn a_mesh_that_does_not_fit_or_differs_between_ranks_is_refused_on_every_rank() {
    let seen = within(60, || {
        spawn_with(4, bounded(), |ctx| {
            let pg = ctx.process_group();
            let shape = DeviceMesh::new(pg.clone(), &[("dp", 3)]).unwrap_err();
            let names = DeviceMesh::new(pg.clone(), &[("a", 2), ("a", 2)]).unwrap_err();
            let size = if ctx.rank == 3 { 1 } else { 2 };
            let differs = DeviceMesh::new(pg.clone(), &[("a", size), ("b", 2)]).unwrap_err();
            let mesh = DeviceMesh::new(pg, &[("a", 4)])?;
            let unknown = mesh.group("b").unwrap_err();
            Ok([shape, names, differs, unknown].map(|e| e.to_string()))
        })
        .unwrap()
    });
    for [shape, names, differs, unknown] in &seen {
        assert!(
            shape.contains("shape [3] (dp=3) does not fit a group of 4"),
            "{shape}"
        );
        assert!(names.contains("distinct"), "{names}");
        assert!(
            differs.contains("rank 3 asked for the mesh a=1, b=2"),
            "{differs}"
        );
        assert!(unknown.contains("no dimension `b`"), "{unknown}");
    }
}

/// The ranks of `group`, as every member sees them.
fn members(group: &dyn ProcessGroup, rank: usize) -> anyhow::Result<Vec<usize>> {
    let me = Tensor::new(&[rank as u32], &Device::Cpu)?;
    Ok(group
        .all_gather(&me)?
        .iter()
        .map(|t| t.to_vec1::<u32>().map(|v| v[0] as usize))
        .collect::<candle_core::Result<_>>()?)
}

#[test]
fn a_sub_mesh_and_a_flattened_dimension_hold_the_ranks_they_span() {
    let seen = within(60, || {
        spawn_with(8, bounded(), |ctx| {
            let mesh = DeviceMesh::new(ctx.process_group(), &[("a", 2), ("b", 2), ("c", 2)])?;
            let sub = mesh.sub_mesh(&["a", "c"])?;
            let flat = mesh.flatten(&["a", "b"], "ab")?;
            anyhow::ensure!(
                members(mesh.group("c")?.as_ref(), ctx.rank)? == {
                    members(sub.group("c")?.as_ref(), ctx.rank)?
                }
            );
            Ok((
                members(sub.world().as_ref(), ctx.rank)?,
                sub.coordinate().to_vec(),
                members(flat.group("ab")?.as_ref(), ctx.rank)?,
                (flat.shape().to_vec(), flat.coordinate().to_vec()),
                flat.dim_names().to_vec(),
            ))
        })
        .unwrap()
    });
    // Rank 6 is at (1, 1, 0): with b = 1 are ranks 2, 3, 6, 7; along a
    // and b (c = 0) ranks 0, 2, 4, 6, of which it is the fourth.
    let (sub, sub_at, flat, (shape, at), names) = &seen[6];
    assert_eq!((sub, sub_at), (&vec![2, 3, 6, 7], &vec![1, 0]));
    assert_eq!(
        (flat, shape, at),
        (&vec![0, 2, 4, 6], &vec![4, 2], &vec![3, 0])
    );
    assert_eq!(names, &["ab", "c"]);
}

#[test]
fn a_sub_mesh_of_unknown_unordered_or_differing_names_is_refused_on_every_rank() {
    let seen = within(60, || {
        spawn_with(4, bounded(), |ctx| {
            let mesh = DeviceMesh::new(ctx.process_group(), &[("a", 2), ("b", 1), ("c", 2)])?;
            let unknown = mesh.sub_mesh(&["a", "z"]).unwrap_err();
            let unordered = mesh.sub_mesh(&["c", "a"]).unwrap_err();
            let apart = mesh.flatten(&["a", "c"], "ac").unwrap_err();
            let clash = mesh.flatten(&["a", "b"], "c").unwrap_err();
            let names: &[&str] = if ctx.rank == 2 { &["a"] } else { &["c"] };
            let differs = mesh.sub_mesh(names).unwrap_err();
            // The mesh still serves after the refusals.
            let fine = mesh.flatten(&["b", "c"], "bc")?;
            anyhow::ensure!(fine.size("bc")? == 2);
            Ok([unknown, unordered, apart, clash, differs].map(|e| e.to_string()))
        })
        .unwrap()
    });
    for [unknown, unordered, apart, clash, differs] in &seen {
        assert!(unknown.contains("no dimension `z`"), "{unknown}");
        assert!(unordered.contains("in the mesh's order"), "{unordered}");
        assert!(apart.contains("neighbouring dimensions"), "{apart}");
        assert!(clash.contains("distinct"), "{clash}");
        assert!(differs.contains("rank 2 asked for"), "{differs}");
    }
}

#[test]
fn hsdp_trains_to_fsdps_weights_on_every_mesh_of_four_ranks() {
    within(240, || {
        let init = init_deep();
        let data = batches(3, 16, 5);
        let run = |mesh| -> Vec<Weights> {
            sharded_adamw(4, mesh, &init, &data, None, None)
                .into_iter()
                .map(|(_, weights)| weights)
                .collect()
        };
        let fsdp = run(None);
        // One replica of four shards is FSDP itself: the same bytes.
        let one_replica = run(Some((1, 4)));
        assert!(
            identical(&one_replica[0], &fsdp[0]),
            "{}",
            diff_report(&one_replica[0], &fsdp[0])
        );
        for shape in [(2, 2), (4, 1)] {
            let hsdp = run(Some(shape));
            for rank in 1..4 {
                assert!(
                    identical(&hsdp[rank], &hsdp[0]),
                    "{shape:?}: rank {rank} differs"
                );
            }
            let diff = max_rel_diff(&hsdp[0], &fsdp[0]);
            eprintln!("HSDP {shape:?} against FSDP x4: max relative difference {diff:e}");
            assert!(
                diff < 1e-5,
                "{shape:?}: {diff}: {}",
                diff_report(&hsdp[0], &fsdp[0])
            );
            // Three steps move the weights far more than the tolerance.
            assert!(max_rel_diff(&hsdp[0], &init) > 1e-3);
        }
    });
}

#[test]
fn hsdp_holds_a_shard_groups_pieces_on_each_replica() {
    let dims = within(60, || {
        spawn_with(4, bounded(), |ctx| {
            let varmap = varmap_from(&init_deep());
            let mesh = DeviceMesh::new(ctx.process_group(), &[("replicate", 2), ("shard", 2)])?;
            let fsdp = FullyShardedDataParallel::from_units_on_mesh(
                &mesh,
                &varmap,
                DType::F32,
                &Device::Cpu,
                deep_units(),
                FsdpConfig::default(),
            )?;
            let three = DeviceMesh::new(ctx.process_group(), &[("a", 1), ("b", 2), ("c", 2)])?;
            let refused = FullyShardedDataParallel::from_units_on_mesh(
                &three,
                &varmap_from(&init_deep()),
                DType::F32,
                &Device::Cpu,
                deep_units(),
                FsdpConfig::default(),
            )
            .unwrap_err()
            .to_string();
            anyhow::ensure!(refused.contains("this one has 3"), "{refused}");
            let weight = fsdp.shards().iter().find(|(name, _)| name == "l0.weight");
            Ok(weight.map(|(_, piece)| piece.dims().to_vec()))
        })
        .unwrap()
    });
    // l0.weight is 12 x 6: 6 rows on each of the two shard ranks.
    assert_eq!(dims, vec![Some(vec![6, 6]); 4]);
}

/// HSDP on a `replicas x shards` mesh, or FSDP over `world` ranks for
/// `None`, of the deep MLP: [`sharded_adamw`] of the FSDP tests.
fn sharded_adamw(
    world: usize,
    mesh: Option<(usize, usize)>,
    init: &Weights,
    data: &[(Tensor, Tensor)],
    saves: Option<Vec<Save>>,
    save_after: Option<usize>,
) -> Vec<(Option<Save>, Weights)> {
    let ranks = match mesh {
        Some((r, s)) => Ranks::Hsdp(r, s),
        None => Ranks::Fsdp(world),
    };
    crate::fsdp::sharded_adamw(deep_units, ranks, init, data, saves, save_after)
}

#[test]
fn an_hsdp_checkpoint_is_one_replicas_pieces_and_reshards_to_other_meshes_and_fsdp() {
    within(240, || {
        let init = init_deep();
        let data = batches(4, 16, 21);
        let whole = sharded_adamw(4, Some((2, 2)), &init, &data, None, Some(2));
        let saves: Vec<Save> = whole.iter().map(|(s, _)| s.clone().unwrap()).collect();
        // Both replicas hold the same pieces: ranks 0, 2 and ranks 1, 3.
        for (a, b) in [(0, 2), (1, 3)] {
            assert!(
                identical(&saves[a].0, &saves[b].0),
                "ranks {a} and {b} differ"
            );
        }
        let replica: Vec<Save> = saves[..2].to_vec();
        // The same mesh: the last 2 steps from one replica's save, the same bytes.
        let resumed = sharded_adamw(
            4,
            Some((2, 2)),
            &init,
            &data[2..],
            Some(replica.clone()),
            None,
        );
        for (rank, (_, weights)) in resumed.iter().enumerate() {
            assert!(identical(weights, &whole[0].1), "rank {rank}");
        }
        // Other meshes and plain FSDP: the same whole weights at the save,
        // then the same training up to the reduction's order.
        let two_steps = sharded_adamw(4, Some((2, 2)), &init, &data[..2], None, None);
        for (world, mesh) in [(4, Some((4, 1))), (4, Some((1, 4))), (4, None), (1, None)] {
            let at_save =
                sharded_adamw(world, mesh, &init, &data[..0], Some(replica.clone()), None);
            assert!(
                identical(&at_save[0].1, &two_steps[0].1),
                "{world} {mesh:?}"
            );
            let resumed =
                sharded_adamw(world, mesh, &init, &data[2..], Some(replica.clone()), None);
            let diff = max_rel_diff(&resumed[0].1, &whole[0].1);
            assert!(diff < 1e-5, "{world} {mesh:?}: {diff}");
        }
    });
}
