#!/usr/bin/env bash
# Start N training processes on this machine, splitting JAXMEG_CPU_DEVICES (default 8) simulated
# CPU devices among them, joined by jax.distributed over a free localhost port: the way to debug
# multi-host behaviour without a cluster. Extra arguments go to every scripts/train.py. Process i
# is node `local<i>` (JAXMEG_NODE_NAME); with `--cluster FILE` it takes the i-th node of the file.
# The launch path is scripts/slurm/train.sbatch's: scripts/train.py in every process, the process
# group read by jaxmeg/parallel/distributed.py (here from the flags, there from the SLURM step),
# and this script in srun's place (--kill-on-bad-exit, TERM forwarded).
#
#   scripts/launch_local.sh 2 --config configs/gpt_tiny.yaml --set parallel.pipe=2 --out runs/a
#
# SIGTERM / SIGINT to this script are forwarded to every process as one TERM (they finish the
# step, checkpoint and exit 0), and the script waits until all of them have exited; sending it
# again forwards another TERM, which stops them at once. If a process fails, the others get TERM
# and, JAXMEG_KILL_GRACE seconds later (default 30), KILL: they may be stuck in a collective
# waiting for the failed one. Exit code: the first non-zero exit code of a process, else 0.
set -uo pipefail
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ]; then
  echo "usage: $0 NUM_PROCESSES [scripts/train.py arguments...]" >&2
  exit 2
fi
n=$1; shift
total=${JAXMEG_CPU_DEVICES:-8}
grace=${JAXMEG_KILL_GRACE:-30}
if (( total % n )); then
  echo "$total CPU devices cannot be split evenly over $n processes" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
python=${PYTHON:-python}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

# Each process in its own session, so a Ctrl-C in the terminal reaches only this script, which
# forwards exactly one TERM (two signals would tell the processes to stop without a checkpoint).
detach=()
if command -v setsid >/dev/null; then detach=(setsid); fi

declare -A running  # pid -> process id
terminate_running() {
  local pid
  for pid in "${!running[@]}"; do kill -TERM "$pid" 2>/dev/null; done
}
on_signal() {
  echo "launch_local: $1: forwarding TERM to the training processes, waiting for them to exit" >&2
  terminate_running
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
# The processes run in their own sessions, so a closed terminal (HUP) reaches only this script;
# and whatever ends it, no process is left behind as an orphan.
trap 'on_signal HUP' HUP
trap terminate_running EXIT

for ((i = 0; i < n; i++)); do
  # Each process plays a node of its own (a cluster file's node groups tell them apart).
  JAXMEG_NODE_NAME=local$i ${detach[@]+"${detach[@]}"} "$python" "$here/train.py" --cpu-devices $((total / n)) \
    --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id "$i" "$@" &
  running[$!]=$i
done

status=0
kill_at=0
while (( ${#running[@]} )); do
  for pid in "${!running[@]}"; do
    kill -0 "$pid" 2>/dev/null && continue  # bash reaps exited children, then kill -0 fails
    wait "$pid"
    code=$?
    process=${running[$pid]}
    unset "running[$pid]"
    if (( code != 0 && status == 0 )); then
      status=$code
      echo "launch_local: process $process exited with $code; stopping the others" >&2
      terminate_running
      kill_at=$((SECONDS + grace))
    fi
  done
  if (( kill_at && SECONDS >= kill_at && ${#running[@]} )); then
    echo "launch_local: processes still running ${grace} s after TERM; sending KILL" >&2
    for pid in "${!running[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    kill_at=0
  fi
  sleep 0.2
done
exit "$status"
