#!/usr/bin/env bash
# Start N training processes on this machine, splitting JAXMEG_CPU_DEVICES (default 8) simulated
# CPU devices among them, joined by jax.distributed over a free localhost port: the way to debug
# multi-host behaviour without a cluster. Extra arguments go to every scripts/train.py.
#
#   scripts/launch_local.sh 2 --config configs/gpt_tiny.yaml --set parallel.pipe=2 --out runs/a
#
# Exits with the first non-zero exit code of any process (the others are then stopped).
set -uo pipefail
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ]; then
  echo "usage: $0 NUM_PROCESSES [scripts/train.py arguments...]" >&2
  exit 2
fi
n=$1; shift
total=${JAXMEG_CPU_DEVICES:-8}
if (( total % n )); then
  echo "$total CPU devices cannot be split evenly over $n processes" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
python=${PYTHON:-python}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for ((i = 0; i < n; i++)); do
  "$python" "$here/train.py" --cpu-devices $((total / n)) --coordinator "127.0.0.1:$port" \
    --num-processes "$n" --process-id "$i" "$@" &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' TERM INT
status=0
for pid in "${pids[@]}"; do
  wait "$pid"
  code=$?
  if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$code
    kill "${pids[@]}" 2>/dev/null
  fi
done
exit "$status"
