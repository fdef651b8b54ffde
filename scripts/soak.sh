#!/usr/bin/env bash
# The soak: one run of the reference job under unbroken-run with a seeded random plan of
# FAULTS faults of every kind that fits one node (in-process, launcher and storage faults
# mixed; node-loss needs the emulated cluster of `unbroken bench recovery` and is left out),
# then the same job without faults: the final_state_sha256 must be equal, and nothing may
# be left behind (processes, /dev/shm, cgroups; the agent's descriptors stay flat).
# Usage: scripts/soak.sh [FAULTS] [SEED]   (make soak; about 5 min on 2 idle CPUs)
set -euo pipefail
cd "$(dirname "$0")/.."
FAULTS=${FAULTS:-${1:-100}}
SEED=${SEED:-${2:-12}}
STEPS=${STEPS:-$((FAULTS * 3 + 20))}
PY=.venv/bin
OUT=${SOAK_DIR:-runs/soak-$(date +%Y%m%d-%H%M%S)}
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
KINDS="exception, sigkill, sigterm, hang, hang-collective, hang-native, segfault, oom-kill, slow-storage, checkpoint-corruption"
cat > "$OUT/plan.yaml" <<YAML
random: {count: $FAULTS, seed: $SEED, steps: [5, $((STEPS - 5))], kinds: [$KINDS]}
YAML

count_shm() { ls /dev/shm | wc -l; }
count_cgroups() { find /sys/fs/cgroup -type d -name 'unbroken-oom-*' 2>/dev/null | wc -l; }
count_procs() { pgrep -fc -- "$OUT/" || true; }  # every process of ours names $OUT in argv
SHM0=$(count_shm); CG0=$(count_cgroups); PROCS0=$(count_procs)

job() {  # job NAME [extra train flags...]
  local name=$1; shift
  "$PY/unbroken-run" --standalone --nproc-per-node 2 --max-restarts 1000 \
      --ft-max-no-progress-restarts 1000 --ft-run-dir "$OUT/$name" \
      -m unbroken.workload.train --steps "$STEPS" --run-dir "$OUT/$name" --ckpt-every 4 \
      --soft-timeout-s 2 --hard-timeout-s 6 --max-rank-faults 1000 --log-every 1000 "$@" \
      > "$OUT/$name.log" 2>&1 &
  local agent=$! t=0
  : > "$OUT/$name.fds-series"
  while kill -0 "$agent" 2>/dev/null; do  # the agent's descriptors, once a second
    echo "$t $(ls "/proc/$agent/fd" 2>/dev/null | wc -l)" >> "$OUT/$name.fds-series"
    sleep 1; t=$((t + 1))
  done
  wait "$agent"
  # After its start-up (the 20th second) and its last sample before exit.
  awk 'NR == 21 {a = $2} $2 > 0 {z = $2; m = ($2 > m ? $2 : m)}
       END {printf "at_20s=%s last=%s max=%s\n", a, z, m}' "$OUT/$name.fds-series" > "$OUT/$name.fds"
}

T0=$(date +%s)
job faulty --faults "$OUT/plan.yaml"
T1=$(date +%s)
job clean
T2=$(date +%s)
sleep 5  # the last workers' exit
FAULTY=$(grep -o 'final_state_sha256=[0-9a-f]*' "$OUT/faulty.log" | tail -1 | cut -d= -f2)
CLEAN=$(grep -o 'final_state_sha256=[0-9a-f]*' "$OUT/clean.log" | tail -1 | cut -d= -f2)
"$PY/unbroken" report "$OUT/faulty" --json "$OUT/report.json" > "$OUT/report.txt"
"$PY/python" -m unbroken.bench.soak "$OUT" \
    --clean-sha "$CLEAN" --faulty-sha "$FAULTY" --wall-s $((T1 - T0)) --clean-wall-s $((T2 - T1)) \
    --leaks "shm=$(( $(count_shm) - SHM0 )) cgroups=$(( $(count_cgroups) - CG0 )) processes=$(( $(count_procs) - PROCS0 ))" \
    --agent-fds "$(cat "$OUT/faulty.fds")"
