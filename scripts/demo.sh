#!/usr/bin/env bash
# make demo: the published recovery comparison, scaled down to this machine (a few minutes).
# It is the shadow benchmark (`unbroken bench recovery ... -- COMMAND`) of the reference script,
# which adopts unbroken through the public API as any script does (STEPS=2000 for the long run).
# One seeded 5-fault schedule (exception, sigkill, hang) on 2 CPU ranks, the same job under:
#   clean      no faults (the reference final state)
#   inprocess  in-process restart with unbroken-run behind it (every layer)
#   launcher   unbroken-run restarts only (--no-inprocess)
#   inprocess-nofault, launcher-nofault
#              those two without faults: what each gives up to its faults is the gap to its twin
#   baseline   Kubernetes alone, on the emulated cluster: a failed pod fails the job and the
#              JobSet recreates every pod (after --pod-restart-s); a hang ends by the peers'
#              collective timeout
# Every unbroken configuration snapshots every other step to memory (the agent keeps it across
# a SIGKILL), notes the steps between (a fault the worker unwinds from snapshots the noted step
# from the live state: the rescue) and persists every 5 steps; then the table (training/infrastructure goodput,
# recovery, steps lost, = clean?), an HTML report, the runs ingested into the knowledge base,
# and how to open the dashboard on them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/demo-$(date +%Y%m%d-%H%M%S)}
export OMP_NUM_THREADS=1
rc=0
STEPS=${STEPS:-500}
.venv/bin/unbroken bench recovery \
  --configs inprocess-nofault inprocess launcher-nofault launcher baseline \
  --faults 5 --kinds exception sigkill hang --seed 42 \
  --hang-timeout-s 0.5 --pg-timeout-s 3 --pod-restart-s 1 \
  --out "$OUT" --json "$OUT/results.json" "$@" \
  -- -m unbroken.workload.train --model tiny --steps "$STEPS" --batch-size 8 --seq-len 64 \
     --ckpt-every 5 --snapshot-every 2 || rc=$?
cat <<MSG

Open the dashboard on these runs (faults, rollbacks, alerts, /metrics):
  .venv/bin/unbroken dashboard $OUT        # then browse http://127.0.0.1:8765/
Search every run the demo and the benchmarks recorded:
  .venv/bin/unbroken kb search sigkill     # or: kb show $OUT/inprocess, kb compare ...
MSG
exit $rc
