#!/usr/bin/env bash
# make demo: the reference job on 2 CPU ranks under torchrun, with two injected faults, then
# the goodput report of the run. (The recovery comparison of the published experiment replaces
# this once in-process restart and unbroken-run land.)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
RUN_DIR=${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$RUN_DIR"
cat > "$RUN_DIR/plan.yaml" <<'YAML'
faults:
  - {step: 15, rank: 1, kind: sigkill}
  - {step: 30, rank: 0, kind: exception}
YAML
echo "== fault plan"
$BIN/unbroken faults show "$RUN_DIR/plan.yaml" --world-size 2
echo "== training: 2 ranks, FSDP2 on gloo, 40 steps, restarts by torchrun (no checkpoints yet)"
export OMP_NUM_THREADS=1
$BIN/torchrun --standalone --nproc-per-node 2 --max-restarts 2 --monitor-interval 0.1 \
  -m unbroken.workload.train --steps 40 --batch-size 4 --seq-len 64 --log-every 5 \
  --run-dir "$RUN_DIR" --faults "$RUN_DIR/plan.yaml" 2>&1 \
  | grep -E "step [0-9]+ loss|final_state|injecting|Worker.*failed|Restarting" || true
test -f "$RUN_DIR/final.json" || { echo "demo: the run did not finish" >&2; exit 1; }
echo "== goodput report"
$BIN/unbroken report "$RUN_DIR" --json "$RUN_DIR/report.json"
echo
echo "run directory: $RUN_DIR (ledger in events/, figures in report.json)"
