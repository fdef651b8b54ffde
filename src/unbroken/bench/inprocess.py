"""``unbroken bench inprocess``: how fast ``unbroken.restart.run`` brings two ranks back.

Two ranks of the reference workload (Llama-style model, FSDP2, gloo) under ``run``, launched as
a launcher would (LOCAL_RANK set, the store hosted by this process). Three faults, each
injected ``--trials`` times (one per in-process iteration, alternating ranks 1 and 0):

- ``exception``: the rank raises after a step;
- ``stuck_collective``: the rank blocks in a receive its peer never sends (native code; its
  peer then blocks in the next collective): found by the soft timeout, freed by the abort;
- ``python_hang``: the rank loops in Python without making progress: found by the soft
  timeout, stopped by an asynchronous exception.

Per trial, from the ledger: ``detect_s`` (fault -> first detection on any rank), ``reentry_s``
(fault -> every rank formed the new process group, i.e. ``fn`` is called again) and
``recovery_s`` (fault -> every rank completed a step again: the new iteration rebuilt the model
and ran its first step). Targets: exception < 0.3 s median; the hangs soft timeout + 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

FAULTS = ("exception", "stuck_collective", "python_hang")
FAULT_STEP = 2
PUBLISHED = (
    "published on this machine: NVIDIA in-process restart re-enters fn 0.3-1.3 s after an "
    "exception; torchft pauses survivors for its heartbeat timeout (0.3 s at 300 ms)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=5, help="faults of each kind (>= 1)")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset")
    p.add_argument("--model", default="tiny", help="reference model size")
    p.add_argument("--soft-timeout", type=float, default=1.0, help="soft timeout, seconds")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--dir", default=None, help="where the runs go (default: a temp dir)")


# --- the rank ---------------------------------------------------------------------------------
def _worker(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from unbroken import restart
    from unbroken.env import WorkerEnv
    from unbroken.ledger import Ledger
    from unbroken.workload import data as wdata
    from unbroken.workload import model as wmodel
    from unbroken.workload.parallel import wrap_model

    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--fault", choices=FAULTS, required=True)
    p.add_argument("--trials", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--soft-timeout", type=float, required=True)
    args = p.parse_args(argv)
    env = WorkerEnv.from_environ()
    ledger = Ledger(args.run_dir, run="bench-inprocess", rank=env.rank)
    cfg = wmodel.get_config(args.model)
    config = restart.RestartConfig(
        monitor_interval_s=0.01,
        soft_timeout_s=args.soft_timeout,
        hard_timeout_s=args.soft_timeout + 30,
        initial_soft_timeout_s=60.0,
        initial_hard_timeout_s=90.0,
        exit_timeout_s=20.0,
        barrier_timeout_s=60.0,
        max_iterations=args.trials + 1,
        max_rank_faults=args.trials + 1,
        max_restore_point_faults=args.trials + 1,
    )

    def fire(ctx: restart.RestartContext, step: int) -> None:
        it = ctx.iteration
        if it >= args.trials or step != FAULT_STEP or ctx.member != (1 - it % 2):
            return
        ledger.emit("fault_injected", fault=args.fault, step=step, index=it)
        if args.fault == "exception":
            raise RuntimeError(f"bench fault {it}")
        while args.fault == "python_hang":  # runs Python, never progresses
            time.sleep(0.01)
        dist.recv(torch.zeros(1), src=1 - ctx.rank, tag=4242)  # never sent

    def fn(ctx: restart.RestartContext) -> None:
        ctx.add_step_hook(lambda step: fire(ctx, step))
        model = wrap_model(wmodel.build_model(cfg, seed=0), parallel="fsdp", device="cpu")
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
        n = 1 << 12
        dataset = wdata.SyntheticDataset(
            wdata.MarkovLanguage(cfg.vocab_size, seed=0), seq_len=64, num_samples=n
        )
        sampler = wdata.ResumableSampler(
            n, global_batch=8, rank=ctx.rank, world_size=ctx.world_size, seed=0
        )
        for step in range(FAULT_STEP + 2):
            inputs, targets = dataset.get_batch(sampler.next_indices())
            loss = wmodel.loss_fn(model(inputs), targets)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            dist.all_reduce(loss.detach())
            ctx.step_done(step)

    try:
        restart.run(fn, config=config, ledger=ledger, env=env)
    finally:
        ledger.close()
    return 0


# --- the driver -------------------------------------------------------------------------------
def _launch(run_dir: Path, fault: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCH_CPP_LOG_LEVEL="ERROR")
    env.update(UNBROKEN_STORE_ADDR=f"127.0.0.1:{store.port}", UNBROKEN_RUN_ID=f"bench-{fault}")
    cmd = [sys.executable, "-m", "unbroken.bench.inprocess", "--worker", "--run-dir", str(run_dir)]
    cmd += ["--fault", fault, "--trials", str(args.trials), "--model", args.model]
    cmd += ["--soft-timeout", str(args.soft_timeout)]
    procs = [
        subprocess.Popen(
            cmd,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    timeout_s = 300 + args.trials * (args.soft_timeout + 30)
    try:
        errs = [p.communicate(timeout=timeout_s)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    for p, err in zip(procs, errs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"bench rank exited {p.returncode} ({fault}):\n{err[-3000:]}")


def _measure(run_dir: Path, trials: int) -> dict[str, list[float]]:
    from unbroken.ledger import read_events

    events = sorted(read_events(run_dir), key=lambda e: e.ts)
    out: dict[str, list[float]] = {"recovery_s": [], "detect_s": [], "reentry_s": []}
    for k in range(trials):
        fault_ts = min(e.ts for e in events if e.kind == "fault_injected" and e.iteration == k)
        detect_ts = min(e.ts for e in events if e.kind == "fault_detected" and e.ts >= fault_ts)
        nxt = [e for e in events if e.iteration == k + 1]
        reentry = [e.ts for e in nxt if e.kind == "phase" and e.get("name") == "pg_init"]
        firsts: dict[int, float] = {}
        for e in nxt:
            if e.kind == "step":
                firsts.setdefault(e.rank, e.ts)
        if len(reentry) != 2 or len(firsts) != 2:
            raise RuntimeError(f"trial {k}: the next iteration did not run on both ranks")
        out["detect_s"].append(detect_ts - fault_ts)
        out["reentry_s"].append(max(reentry) - fault_ts)
        out["recovery_s"].append(max(firsts.values()) - fault_ts)
    return out


def main(args: argparse.Namespace) -> int:
    if args.trials < 1:
        raise ValueError(f"--trials must be >= 1, got {args.trials}")
    faults = [f for f in args.faults.split(",") if f]
    bad = sorted(set(faults) - set(FAULTS))
    if bad:
        raise ValueError(f"unknown faults {bad}; choose from {', '.join(FAULTS)}")
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for fault in faults:
            run_dir = Path(tmp) / fault
            t0 = time.time()
            _launch(run_dir, fault, args)
            figures = _measure(run_dir, args.trials)
            target = 0.3 if fault == "exception" else args.soft_timeout + 0.5
            rec = figures["recovery_s"]
            rows[fault] = {
                **figures,
                "median_s": statistics.median(rec),
                "max_s": max(rec),
                "detect_median_s": statistics.median(figures["detect_s"]),
                "reentry_median_s": statistics.median(figures["reentry_s"]),
                "target_median_s": target,
                "meets_target": statistics.median(rec) < target,
                "soft_timeout_s": args.soft_timeout,
                "trials": args.trials,
                "model": args.model,
                "wall_s": time.time() - t0,
            }
    print(f"{'fault':<18} {'trials':>6} {'median s':>9} {'max s':>7} {'detect s':>9} "
          f"{'re-entry s':>10} {'target s':>9}")  # fmt: skip
    for fault, r in rows.items():
        print(
            f"{fault:<18} {r['trials']:>6} {r['median_s']:>9.3f} {r['max_s']:>7.3f} "
            f"{r['detect_median_s']:>9.3f} {r['reentry_median_s']:>10.3f} "
            f"{'<' + format(r['target_median_s'], '.2f'):>9} {'ok' if r['meets_target'] else 'MISSED'}"
        )
    print(f"recovery = fault -> every rank completed a step again (model rebuilt); {PUBLISHED}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker(sys.argv[2:]))
    parser = argparse.ArgumentParser(prog="python -m unbroken.bench.inprocess")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
