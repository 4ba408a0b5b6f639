# What scripts/slurm.sh (one node) and scripts/netcluster.sh --slurm (a node
# per simulated machine) share: the cluster's settings and munge. Sourced,
# not run.

# The settings every test cluster has, for a slurm.conf in DIR: munge's
# socket there, no cgroups, no accounting, nodes that may claim more CPUs
# than the machine has, short timeouts.
slurm_common_settings() {
    local dir=$1
    cat <<SETTINGS
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
KillWait=5
InactiveLimit=0
MinJobAge=5
SETTINGS
}

# Starts munged with its socket, key seed and log in DIR/munge.
slurm_start_munged() {
    local dir=$1
    chown munge:munge "$dir/munge"
    runuser -u munge -- munged --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
        --seed-file="$dir/munge/munged.seed"
}
