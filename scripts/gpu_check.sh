#!/usr/bin/env bash
# The GPU path in one prepared run, for a machine with a GPU (a few minutes on one):
#   1. unbroken doctor: torch, the backend, /dev/shm, the checkpoint file system;
#   2. unbroken bench size on the device: the snapshot stall of a multi-GB state staged from
#      GPU memory (a device-to-host copy into the pinned arena) beside DCP async_save with and
#      without pinned staging, persist and restore, against the same run's copy floor;
#   3. the reference script on one rank (NCCL on a GPU), fault-free and with an exception and
#      a hang, both recovered in-process: the final hashes must be equal;
#   4. the GPU's memory after the runs: nothing of ours left on it.
#
# Usage: scripts/gpu_check.sh [--device cuda|cpu] [--out DIR]
# --device cpu is the dry run (small sizes, gloo) that `make test` runs, so the script is
# always ready. Figures go to DIR (default: runs/gpu-check) and to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

device=cuda
out=runs/gpu-check
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="${2:?--device takes cuda or cpu}"; shift 2 ;;
    --out) out="${2:?--out takes a directory}"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
case "$device" in
  cuda) sizes="1,4"; steps=60; hang_s=2 ;;
  cpu) sizes="0.004"; steps=16; hang_s=1 ;;
  *) echo "gpu_check.sh: --device takes cuda or cpu, got $device" >&2; exit 2 ;;
esac
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS=1
rm -rf "$out" && mkdir -p "$out"
t0=$SECONDS

echo "== 1. doctor"
"$PY" -m unbroken.cli doctor --json "$out/doctor.json" || echo "(doctor found something to fix: $out/doctor.json)"

echo "== 2. checkpoint and restore at sizes $sizes GB, state on $device"
"$PY" -m unbroken.cli bench size --device "$device" --sizes "$sizes" --saves 3 \
  --dir "$out" --json "$out/size.json"

echo "== 3. in-process restart on $device: an exception and a hang, one rank"
cat > "$out/plan.yaml" <<EOF
faults:
  - {step: $((steps / 4)), rank: 0, kind: exception}
  - {step: $((steps / 2)), rank: 0, kind: hang}
EOF
train() {  # run_dir, extra args...
  local dir="$1"; shift
  "$PY" -m unbroken.launcher.cli --standalone --nproc-per-node 1 --monitor-interval 0.05 \
    --ft-run-dir "$dir" -m unbroken.workload.train --device "$device" --run-dir "$dir" \
    --steps "$steps" --seq-len 32 --ckpt-every 5 --snapshot-every 1 \
    --soft-timeout-s "$hang_s" "$@" > "$dir.log" 2>&1 \
    || { echo "the run in $dir failed:"; tail -30 "$dir.log"; exit 1; }
}
mkdir -p "$out/clean" "$out/faults"
train "$out/clean"
train "$out/faults" --faults "$out/plan.yaml"
"$PY" -m unbroken.cli report "$out/faults" | tee "$out/report.txt"
"$PY" - "$out" <<'EOF'
import json, sys
from pathlib import Path

from unbroken.ledger import goodput, read_run

out = Path(sys.argv[1])
clean, faults = (json.loads((out / d / "final.json").read_text()) for d in ("clean", "faults"))
rep = goodput.compute(read_run(out / "faults").events)
injected = [f for f in rep.faults if f.injected]
print("faults recovered:", [(f.kind, f.step, f.layer, f.recovery_s, f.steps_lost) for f in injected])
if clean["final_state_sha256"] != faults["final_state_sha256"]:
    sys.exit(f"final weights differ: {clean['final_state_sha256']} != {faults['final_state_sha256']}")
if sorted(f.kind for f in injected) != ["exception", "hang"]:
    sys.exit(f"expected an exception and a hang, the report has {[f.kind for f in injected]}")
if any(f.layer != "inprocess" for f in injected):
    sys.exit("a fault was not recovered in-process: see report.txt")
print("bit-exact after both faults:", faults["final_state_sha256"])
EOF

echo "== 4. the device's memory after the runs"
if [ "$device" = cuda ] && command -v nvidia-smi > /dev/null; then
  left=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader || true)
  echo "${left:-no process holds GPU memory}"
  [ -z "$left" ] || { echo "GPU memory still held"; exit 1; }
else
  echo "not checked: no GPU"
fi
echo "gpu_check: passed on $device in $((SECONDS - t0)) s; figures in $out"
