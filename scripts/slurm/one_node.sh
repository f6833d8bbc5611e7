#!/bin/bash
# A one-node SLURM cluster on this machine, for trying scripts/slurm/train.sbatch without a
# cluster (CI runs tests/test_slurm.py on it). Needs Debian's slurmctld, slurmd, slurm-client and
# munge (apt-get install slurmctld slurmd slurm-client munge), and root: the daemons run as root,
# in the background, from a slurm.conf in DIR (default /tmp/jaxmeg-slurm), without systemd.
#   scripts/slurm/one_node.sh start [DIR]   # then: export SLURM_CONF=DIR/slurm.conf
#   scripts/slurm/one_node.sh stop [DIR]
# The node is `localhost` at 127.0.0.1 with this machine's CPUs, in one partition `debug`; no
# accounting, no cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none).
set -euo pipefail
action=${1:?usage: one_node.sh start|stop [DIR]}
dir=${2:-/tmp/jaxmeg-slurm}

stop() {
    for daemon in slurmd slurmctld munged; do
        if [[ -f "$dir/$daemon.pid" ]]; then
            kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
            rm -f "$dir/$daemon.pid"
        fi
    done
}

if [[ $action == stop ]]; then
    stop
    exit 0
fi
[[ $action == start ]] || { echo "usage: one_node.sh start|stop [DIR]" >&2; exit 2; }
for tool in slurmctld slurmd sbatch munged; do
    command -v "$tool" > /dev/null || {
        echo "one_node.sh: $tool not found (apt-get install slurmctld slurmd slurm-client munge)" >&2
        exit 2
    }
done
stop
mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
if [[ ! -f "$dir/munge/munge.key" ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
fi
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/socket" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"
cat > "$dir/slurm.conf" <<EOF
ClusterName=jaxmeg
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -c -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF" -N localhost
for _ in $(seq 60); do
    if sinfo -h -o %t 2>/dev/null | grep -q idle; then
        echo "one_node.sh: SLURM up (export SLURM_CONF=$SLURM_CONF)"
        exit 0
    fi
    sleep 1
done
echo "one_node.sh: the node did not come up in 60 s; logs in $dir" >&2
exit 1
