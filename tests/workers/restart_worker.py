"""A rank of the reference workload under ``unbroken.restart.run``, for tests and the benchmark.

Launched like a launcher would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, and
UNBROKEN_STORE_ADDR when the test hosts the store). Trains the reference model (FSDP2, fixed
seed) for ``--steps`` steps and prints ``final_state_sha256=<hex>``; rank 0 writes
``final.json``. Every rank prints one ``WORKER_RESULT {json}`` line: iterations, world size,
leftover unbroken threads and child processes after ``run`` returned.

Fault kinds beyond the plan's (each fires once per run, claimed in ``<run_dir>/faults/``):
``--hang-collective STEP:RANK[,...]`` the rank blocks in a receive its peer never sends (native
code);
``--victim SCENARIO`` what rank 0 does after step ``--victim-step`` of iteration 0 while it waits
to be interrupted: ``swallow`` (catches the first interrupts), ``finally`` (a finally block
that runs a collective and raises), ``del`` (interrupts land in ``__del__``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: procs

import torch
import torch.distributed as dist

from procs import children  # noqa: E402
from unbroken import restart
from unbroken.env import WorkerEnv
from unbroken.faults import FaultInjector, FaultPlan, load_plan
from unbroken.ledger import Ledger
from unbroken.workload import data as wdata
from unbroken.workload import model as wmodel
from unbroken.workload.parallel import wrap_model
from unbroken.workload.train import final_state_hash

GLOBAL_BATCH = 8


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--parallel", default="fsdp")
    p.add_argument("--faults", default=None)
    p.add_argument("--hang-collective", default=None, metavar="STEP:RANK[,STEP:RANK]")
    p.add_argument("--victim", choices=["swallow", "finally", "del"], default=None)
    p.add_argument("--victim-step", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--ckpt-dir", default=None, help="default: <run-dir>/ckpt")
    p.add_argument("--ckpt-allow-foreign", action="store_true", help="restore another run's")
    p.add_argument("--fault-count-check", type=int, default=0, help="FaultCountCheck(N)")
    p.add_argument("--soft", type=float, default=2.0)
    p.add_argument("--hard", type=float, default=20.0)
    p.add_argument("--initial-soft", type=float, default=30.0)
    p.add_argument("--initial-hard", type=float, default=40.0)
    p.add_argument("--exit-timeout", type=float, default=10.0)
    p.add_argument("--barrier-timeout", type=float, default=45.0)
    p.add_argument("--interval", type=float, default=0.01)
    p.add_argument("--max-iterations", type=int, default=8)
    p.add_argument("--min-world", type=int, default=1)
    p.add_argument("--max-rank-faults", type=int, default=3)
    p.add_argument("--max-restore-faults", type=int, default=4)
    p.add_argument("--steps-per-s", type=float, default=0.0, help="pace steps (benchmark)")
    return p.parse_args(argv)


def _claim(run_dir: Path, name: str) -> bool:
    d = run_dir / "faults" / "extra"
    d.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(d / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class Victim:
    """What rank 0 does while it waits to be interrupted (iteration 0 only)."""

    def __init__(self, scenario: str) -> None:
        self.scenario = scenario
        self.caught = 0

    def __call__(self) -> None:
        getattr(self, self.scenario)()

    def swallow(self) -> None:
        while self.caught < 3:  # user code that swallows the first interrupts
            try:
                time.sleep(0.01)
            except BaseException:  # noqa: BLE001
                self.caught += 1
        print(f"VICTIM swallow caught={self.caught}", flush=True)
        while True:
            time.sleep(0.01)

    def finally_(self) -> None:
        t = torch.ones(4)
        try:
            while True:
                time.sleep(0.01)
        finally:
            try:
                dist.all_reduce(t)  # the group is aborted: must fail at once, not hang
            except RuntimeError:
                self.caught += 1
            print(f"VICTIM finally caught={self.caught}", flush=True)
            raise ValueError("cleanup failed")

    def del_(self) -> None:
        victim = self

        class Slow:
            def __del__(self) -> None:
                try:
                    time.sleep(0.05)
                except BaseException:
                    victim.caught += 1
                    raise  # an exception in __del__ is ignored by Python: swallowed

        while self.caught < 2:
            obj = Slow()
            del obj
        print(f"VICTIM del caught={self.caught}", flush=True)
        while True:
            time.sleep(0.01)


def train(ctx: restart.RestartContext, args: argparse.Namespace, ledger: Ledger) -> str:
    run_dir = Path(args.run_dir)
    plan = load_plan(args.faults) if args.faults else FaultPlan()
    injector = FaultInjector(plan, run_dir=run_dir, rank=ctx.member, sink=ledger)
    ctx.add_step_hook(injector.on_step)
    if args.hang_collective:
        hangs = [tuple(int(x) for x in s.split(":")) for s in args.hang_collective.split(",")]

        def hang_collective(step: int) -> None:
            spec = (step, ctx.member)
            if spec in hangs and _claim(run_dir, f"hang-collective-{step}-{ctx.member}"):
                ledger.emit("fault_injected", fault="hang-collective", step=step, index=-1)
                ledger.flush()
                peer = (ctx.rank + 1) % ctx.world_size
                dist.recv(torch.zeros(1), src=peer, tag=4242)  # never sent

        ctx.add_step_hook(hang_collective)
    if args.victim and ctx.iteration == 0 and ctx.member == 0:
        victim = Victim(args.victim + ("_" if args.victim in ("finally", "del") else ""))

        def victim_hook(step: int) -> None:
            if step == args.victim_step:
                victim()

        ctx.add_step_hook(victim_hook)

    cfg = wmodel.get_config("tiny")
    model = wrap_model(wmodel.build_model(cfg, seed=0), parallel=args.parallel, device="cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    num_samples = 1 << 12
    dataset = wdata.SyntheticDataset(
        wdata.MarkovLanguage(cfg.vocab_size, seed=0), seq_len=args.seq_len, num_samples=num_samples
    )
    sampler = wdata.ResumableSampler(
        num_samples, global_batch=GLOBAL_BATCH, rank=ctx.rank, world_size=ctx.world_size, seed=0
    )
    start = 0
    ckpt = None
    if args.ckpt_every:
        from unbroken.checkpoint import Checkpointer

        ckpt = Checkpointer(
            args.ckpt_dir or run_dir / "ckpt",
            ledger=ledger,
            every_steps=args.ckpt_every,
            mode="sync",
            keep=100,
            allow_foreign=args.ckpt_allow_foreign,
        )
        restored = ckpt.restore({"model": model, "optim": optim, "data": sampler})
        start = 0 if restored is None else restored + 1
        ledger.mark()  # the first step begins after the restore
    try:
        period = 1.0 / args.steps_per_s if args.steps_per_s else 0.0
        for step in range(start, args.steps):
            t0 = time.monotonic()
            inputs, targets = dataset.get_batch(sampler.next_indices())
            loss = wmodel.loss_fn(model(inputs), targets)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            ctx.step_done(step, loss=float(global_loss) / ctx.world_size)
            if ckpt is not None:
                with ctx.no_hang_protection():  # a sync save may take seconds
                    ckpt.maybe_save(step, {"model": model, "optim": optim, "data": sampler})
            if period:
                time.sleep(max(0.0, period - (time.monotonic() - t0)))
        digest = final_state_hash(model, optim)
    except BaseException:
        if ckpt is not None:
            ckpt.abort()
        raise
    if ckpt is not None:
        ckpt.close()
    return digest


def main() -> int:
    args = parse()
    env = WorkerEnv.from_environ()
    run_dir = Path(args.run_dir)
    ledger = Ledger(run_dir, run=run_dir.name, rank=env.rank)
    checks: list[restart.HealthCheck] = []
    if args.fault_count_check:
        checks.append(restart.FaultCountCheck(args.fault_count_check))
    config = restart.RestartConfig(
        soft_timeout_s=args.soft,
        hard_timeout_s=args.hard,
        initial_soft_timeout_s=args.initial_soft,
        initial_hard_timeout_s=args.initial_hard,
        exit_timeout_s=args.exit_timeout,
        barrier_timeout_s=args.barrier_timeout,
        monitor_interval_s=args.interval,
        max_iterations=args.max_iterations,
        min_world_size=args.min_world,
        max_rank_faults=args.max_rank_faults,
        max_restore_point_faults=args.max_restore_faults,
        health_checks=checks,
        pg_timeout_s=60.0,
    )
    iterations = []
    world = []

    def fn(ctx: restart.RestartContext) -> str:
        iterations.append(ctx.iteration)
        world.append(ctx.world_size)
        return train(ctx, args, ledger)

    code = 0
    digest = None
    status = "ok"
    try:
        digest = restart.run(fn, config=config, ledger=ledger, env=env)
    except restart.Escalated as e:
        status, code = f"escalated: {e}", e.exit_code
    except restart.RankExcluded as e:
        status, code = f"excluded: {e}", e.exit_code
    result = {
        "member": env.rank,
        "status": status,
        "iterations": iterations,
        "world": world,
        "threads": [t.name for t in threading.enumerate() if t.name.startswith("unbroken-r")],
        "children": children(os.getpid()),
        "pg_initialized": dist.is_initialized(),
    }
    if digest is not None:
        if env.rank == 0:
            (run_dir / "final.json").write_text(
                json.dumps({"final_state_sha256": digest, "world_size": world[-1]})
            )
        sys.stdout.write(f"final_state_sha256={digest}\n")
    sys.stdout.write(f"WORKER_RESULT {json.dumps(result)}\n")
    sys.stdout.flush()
    ledger.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
