//! What the environment says of this process before anything starts:
//! whether an MPI launcher (`mpirun`, `srun`) started it, and its rank
//! and neighbours there. The launcher ([`launch`](crate::launch)) decides
//! from it, and the reports name the rank from it.

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
    /// Slurm's `SLURM_NTASKS_PER_NODE`); 1 when the launcher does not say.
    /// [`launch::run`](crate::launch::run) gives each its share of the cores.
    pub fn local_processes() -> usize {
        env_number(&[
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "MPI_LOCALNRANKS",
            "PMI_LOCAL_SIZE",
            "SLURM_NTASKS_PER_NODE",
        ])
        .unwrap_or(1)
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

/// The first of `variables` that is set, as a number.
fn env_number(variables: &[&str]) -> Option<usize> {
    variables
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .and_then(|value| value.trim().parse().ok())
}
