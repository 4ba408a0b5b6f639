//! The mesh part of the benchmark (`--mesh`): the language model's step
//! (`lm`'s child, through a `Fabric`) on two simulated machines of two
//! ranks each (`scripts/netcluster.sh --block`: ranks 0, 1 on machine 1,
//! ranks 2, 3 on machine 2, over TCP only), as DDP, as FSDP over all four
//! ranks, as ZeRO-2 over all four and on a mesh (a machine's two ranks
//! a shard group), as HSDP with a machine's two ranks as its shard group, and as
//! pipelines on ranks (four stages across both machines; two pipelines of
//! two stages, one per machine, replicated across them, their stages
//! whole, split by ZeRO-2 or by FSDP across the replicas): the step time and
//! the bytes each machine's link carries per step, read from the link's
//! own counters around the timed steps.
//!
//! Runs interleaved over the rounds, each in its own `mpirun`; every
//! process gets one thread (four processes share this machine's cores).

use std::process::Command;

use anyhow::Result;

use crate::lm::{LmMeasured, LmSpec};
use crate::stats::median;

const MACHINES: usize = 2;
const PER_MACHINE: usize = 2;

/// One row: a Fabric strategy by name, the ranks per pipeline of
/// `pipeline-ranks`, the ranks per shard group of ZeRO on a mesh, and the
/// ZeRO stage across the pipelines' replicas (3: FSDP).
type Row = (&'static str, Option<usize>, Option<usize>, Option<u8>);

/// The rows with tensor parallelism, as degrees (`tp` innermost: a
/// machine's two ranks split each matrix) and with sequence parallelism
/// or not.
const TENSOR_PARALLEL: [(&str, bool); 3] = [
    ("dp_replicate=2,tp=2", false),
    ("dp_shard=2,tp=2", false),
    ("dp_shard=2,tp=2", true),
];

/// The strategies compared.
const STRATEGIES: [Row; 9] = [
    ("ddp", None, None, None),
    ("zero2", None, None, None),
    ("zero2", None, Some(PER_MACHINE), None),
    ("fsdp", None, None, None),
    ("hsdp", None, None, None),
    ("pipeline-ranks", Some(4), None, None),
    ("pipeline-ranks", Some(2), None, None),
    ("pipeline-ranks", Some(2), None, Some(2)),
    ("pipeline-ranks", Some(2), None, Some(3)),
];

/// `mpirun` of this binary's language-model child on the simulated
/// machines.
fn on_cluster(spec: &LmSpec) -> Result<Command> {
    let mut cmd = crate::on_simulated_machines(MACHINES, PER_MACHINE)?;
    cmd.arg("--lm-child")
        .arg(serde_json::to_string(spec)?)
        .env("RAYON_NUM_THREADS", "1")
        .env("CANDLE_NUM_THREADS", "1");
    Ok(cmd)
}

/// Every strategy, interleaved over `rounds`; the report.
pub fn run(steps: usize, rounds: usize) -> Result<String> {
    let specs: Vec<LmSpec> = STRATEGIES
        .iter()
        .map(|&(strategy, stages, shard_size, zero)| LmSpec {
            strategy: strategy.to_string(),
            world: MACHINES * PER_MACHINE,
            fused_ops: true,
            steps,
            count_link_bytes: true,
            stages,
            shard_size,
            zero,
            ..LmSpec::default()
        })
        .chain(
            TENSOR_PARALLEL
                .iter()
                .map(|&(mesh, sequence_parallel)| LmSpec {
                    strategy: "single".into(),
                    world: MACHINES * PER_MACHINE,
                    fused_ops: true,
                    steps,
                    count_link_bytes: true,
                    mesh: Some(mesh.into()),
                    sequence_parallel,
                    ..LmSpec::default()
                }),
        )
        .collect();
    let mut measured: Vec<Vec<LmMeasured>> = vec![Vec::new(); specs.len()];
    for round in 0..rounds {
        for (spec, runs) in specs.iter().zip(&mut measured) {
            let name = spec.mesh.as_deref().unwrap_or(&spec.strategy);
            eprintln!("mesh: {name} (round {})", round + 1);
            runs.push(crate::child_answer(on_cluster(spec)?, &spec.strategy)?);
        }
    }
    Ok(report(&specs, &measured, steps, rounds))
}

fn report(specs: &[LmSpec], measured: &[Vec<LmMeasured>], steps: usize, rounds: usize) -> String {
    let mut s = format!(
        "## The language model on {MACHINES} simulated machines x {PER_MACHINE} ranks\n\n\
         `scripts/netcluster.sh --block` (TCP between network namespaces; ranks 0, 1 on \
         machine 1, ranks 2, 3 on machine 2), one thread per rank, {rounds} round(s) of \
         {steps} timed steps; `train_lm`'s model and step. HSDP's shard group is a \
         machine's two ranks, replicated across the machines, and so is ZeRO-2's on a \
         mesh. The pipelines on ranks run \
         1F1B over 4 micro-batches: 4 stages, one per rank (stages 1 and 2 meet across the \
         machines), or 2 x 2 (a pipeline of 2 stages on each machine, the two replicas \
         averaging their gradients across, or with ZeRO-2 or FSDP reduce-scattering them \
         and all-gathering the updated pieces). Bytes: what each machine's \
         link sent per timed step, the median over the rounds (with two machines, what one \
         sends the other receives). The tp rows split each matrix over a machine's \
         two ranks (tensor parallelism, Megatron's layout) and run DDP or FSDP across the \
         machines; with sequence parallelism the activations between the blocks are split \
         along the sequence too. {}.\n\n\
         | run | ms/step | machine 1 sent, MB/step | machine 2 sent, MB/step | vs FSDP's bytes |\n\
         |---|---:|---:|---:|---:|\n",
        crate::machine(crate::plan::DeviceKind::Cpu),
    );
    let per_step = |runs: &[LmMeasured], machine: usize| -> f64 {
        let sent: Vec<f64> = runs
            .iter()
            .filter_map(|m| m.link_bytes.get(machine))
            .map(|&(tx, _)| tx as f64 / steps as f64 / 1e6)
            .collect();
        if sent.is_empty() {
            f64::NAN
        } else {
            median(&sent)
        }
    };
    let fsdp = specs
        .iter()
        .position(|s| s.strategy == "fsdp")
        .map(|i| per_step(&measured[i], 0));
    for (spec, runs) in specs.iter().zip(measured) {
        let times: Vec<f64> = runs
            .iter()
            .flat_map(|m| m.step_ms.iter().copied())
            .collect();
        let (m1, m2) = (per_step(runs, 0), per_step(runs, 1));
        let ratio = fsdp.map_or_else(String::new, |f| format!("{:.2}x", m1 / f));
        let label = match (&spec.mesh, spec.stages) {
            (Some(mesh), _) => format!(
                "{mesh}: tp within a machine x {} across{}",
                if mesh.contains("dp_shard") {
                    "FSDP"
                } else {
                    "DDP"
                },
                if spec.sequence_parallel {
                    ", sequence parallel"
                } else {
                    ""
                }
            ),
            (None, stages) => match stages {
                Some(pp) if pp == spec.world => format!("pipeline, {pp} stages on ranks"),
                Some(pp) => format!(
                    "pipeline, {} x {pp} (dp x pp){}",
                    spec.world / pp,
                    match spec.zero {
                        Some(3) => ", FSDP across the replicas".to_string(),
                        Some(stage) => format!(", ZeRO-{stage} across the replicas"),
                        None => String::new(),
                    }
                ),
                None => match spec.shard_size {
                    Some(shard) => format!(
                        "{} x{}, shard groups of {shard} (one per machine)",
                        spec.strategy.to_uppercase(),
                        spec.world
                    ),
                    None => format!("{} x{}", spec.strategy.to_uppercase(), spec.world),
                },
            },
        };
        s += &format!(
            "| {label} | {:.0} | {m1:.2} | {m2:.2} | {ratio} |\n",
            median(&times),
        );
    }
    s
}
