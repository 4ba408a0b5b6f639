//! What the environment says of this process before anything starts:
//! whether an MPI launcher (`mpirun`, `srun`) started it, and its rank
//! and neighbours there. The launcher ([`launch`](crate::launch)) decides
//! from it, and the reports name the rank from it.

/// The environment variable through which an elastic supervisor
/// ([`Elastic::supervise`](crate::launch::Elastic::supervise)) tells the
/// ranks of a job it started which start it is (0 the first time), as
/// torchrun sets `TORCHELASTIC_RESTART_COUNT`.
pub const RESTART_VARIABLE: &str = "CANDLE_DP_RESTART";

/// Where the ranks of [`launch::run`](crate::launch::run) come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// Threads of this process (no MPI launcher around it).
    Threads,
    /// The processes of an MPI job: this process is one rank.
    Mpi {
        /// The environment variable that says so.
        variable: String,
    },
}

impl Backend {
    /// The environment variables through which MPI launchers announce a
    /// rank: Open MPI's `mpirun`, the PMI of MPICH, Intel MPI and Slurm's
    /// `srun`, and PMIx (`srun --mpi=pmix`, PRRTE).
    pub const MPI_VARIABLES: [&'static str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"];

    /// This process's rank in the MPI job that started it, read from the
    /// launcher's environment (`OMPI_COMM_WORLD_RANK`, `PMI_RANK`) before
    /// MPI is initialized; 0 outside MPI. For the usual "only rank 0
    /// prints" in code that runs before [`launch::run`](crate::launch::run).
    pub fn process_rank() -> usize {
        env_number(&["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]).unwrap_or(0)
    }

    /// The number of processes of the MPI job that started this one
    /// (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, Slurm's `SLURM_NTASKS`); 1
    /// outside MPI or when the launcher does not say.
    pub fn world_size() -> usize {
        env_number(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"]).unwrap_or(1)
    }

    /// This process's index among the processes of its MPI job on this
    /// machine (`OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`,
    /// `PMI_LOCAL_RANK`, Slurm's `SLURM_LOCALID`); 0 when the launcher does
    /// not say. It picks the process's GPU in `run_on_gpus` (feature `nccl`).
    pub fn local_rank() -> usize {
        env_number(&[
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "PMI_LOCAL_RANK",
            "SLURM_LOCALID",
        ])
        .unwrap_or(0)
    }

    /// The number of processes of this MPI job on this machine
    /// (`OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS`, `PMI_LOCAL_SIZE`,
    /// Slurm's `SLURM_NTASKS_PER_NODE`, or this node's entry of Slurm's
    /// `SLURM_STEP_TASKS_PER_NODE`, which `srun` always sets); 1 when the
    /// launcher does not say. [`launch::run`](crate::launch::run) gives
    /// each its share of the cores; HSDP's shard groups default to it.
    pub fn local_processes() -> usize {
        env_number(&[
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "MPI_LOCALNRANKS",
            "PMI_LOCAL_SIZE",
            "SLURM_NTASKS_PER_NODE",
        ])
        .or_else(|| {
            // A process that `srun` started directly has none of the
            // above: Open MPI's local size comes from mpirun's daemons.
            let list = std::env::var("SLURM_STEP_TASKS_PER_NODE")
                .or_else(|_| std::env::var("SLURM_TASKS_PER_NODE"))
                .ok()?;
            let node = env_number(&["SLURM_NODEID"]).unwrap_or(0);
            slurm_tasks_on_node(&list, node)
        })
        .unwrap_or(1)
    }

    /// Which start of an elastic job this process belongs to: the
    /// supervisor's [`RESTART_VARIABLE`]
    /// (torchrun's `TORCHELASTIC_RESTART_COUNT`); 0 when no supervisor
    /// started it.
    pub fn restart() -> usize {
        env_number(&[RESTART_VARIABLE]).unwrap_or(0)
    }

    /// [`Backend::Mpi`] when the process was started by an MPI launcher,
    /// else [`Backend::Threads`].
    pub fn from_env() -> Backend {
        Self::MPI_VARIABLES
            .iter()
            .find(|variable| std::env::var_os(variable).is_some())
            .map_or(Backend::Threads, |variable| Backend::Mpi {
                variable: variable.to_string(),
            })
    }
}

/// Node `node`'s entry of Slurm's compressed list of tasks per node
/// (`SLURM_STEP_TASKS_PER_NODE`: `4`, `2(x3),1`: two tasks on each of the
/// first three nodes, one on the fourth); `None` for a list it cannot
/// read or a node past its end.
pub(crate) fn slurm_tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut first = 0;
    for entry in list.split(',') {
        let (tasks, nodes) = match entry.trim().split_once("(x") {
            Some((tasks, repeat)) => (tasks, repeat.strip_suffix(')')?.parse().ok()?),
            None => (entry.trim(), 1),
        };
        let tasks: usize = tasks.parse().ok()?;
        if node < first + nodes {
            return Some(tasks);
        }
        first += nodes;
    }
    None
}

/// The first of `variables` that is set, as a number.
fn env_number(variables: &[&str]) -> Option<usize> {
    variables
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .and_then(|value| value.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::slurm_tasks_on_node;

    #[test]
    fn slurms_tasks_per_node_list_gives_each_nodes_count() {
        assert_eq!(slurm_tasks_on_node("4", 0), Some(4));
        assert_eq!(slurm_tasks_on_node("4", 1), None);
        let list = "2(x3),1";
        let counts: Vec<_> = (0..5).map(|n| slurm_tasks_on_node(list, n)).collect();
        assert_eq!(counts, [Some(2), Some(2), Some(2), Some(1), None]);
        assert_eq!(slurm_tasks_on_node("3,1(x2)", 2), Some(1));
        for unreadable in ["", "two", "2(x", "2(xz)"] {
            assert_eq!(slurm_tasks_on_node(unreadable, 0), None, "{unreadable:?}");
        }
    }
}
