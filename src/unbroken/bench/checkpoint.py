"""``unbroken bench checkpoint``: what a checkpoint costs the training loop, side by side.

On the reference model (``small``: 22M parameters, 263 MB of fp32 model + AdamW state; FSDP2
when two ranks), one process and two, in one run each:

- ``none``: no checkpoints (the step time every other row is compared with);
- ``dcp-sync``: ``torch.distributed.checkpoint.save`` (blocks for the whole write);
- ``dcp-async``: ``dcp.async_save`` in its best mode that works on torch 2.13 CPU: thread
  executor, one reused ``DefaultStager`` with asynchronous staging; the loop waits for staging
  before ``optimizer.step`` and for the previous upload before the next save (both blocking);
- ``unbroken``: ``Checkpointer`` (async, ``overlap``, the default ``on_busy="skip"``);
- ``unbroken-wait``: the same with ``on_busy="wait"``.

Save intervals are chosen from the measured persist time P of one unbroken save and the step
time T: about P/T steps (persist = interval) and about 2P/T (persist = 50% of the interval),
plus 4P/T without ``--quick``; ``P/intv`` is then measured per row. Efficiency = 1 - blocking
save time / loop wall time, blocking summed over ranks' maxima; the stall per save (rank 0's
median) is set beside one plain memory copy of the same bytes in the same process (the
physical floor of a snapshot). ``--throttle-mbps`` caps every writer's rate (ours and DCP's,
per rank) to emulate slow shared storage, e.g. to reproduce the published regime.

The cores are shared by training and the background writers (and, on a shared machine, by
whatever else runs); ``slowdown`` (loop time per step over a no-checkpoint run measured just
before each mode) shows what background persistence costs the steps themselves.

This file drives the benchmark (the parent, the worker's loop and its rows); the modes under
test are in ``savers``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from unbroken.bench.savers import DcpAsync, DcpSync, Saver, UnbrokenSaver

logger = logging.getLogger(__name__)

MODES = ("none", "dcp-sync", "dcp-async", "unbroken", "unbroken-wait")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer saves per configuration (<5 min)")
    p.add_argument("--throttle-mbps", type=float, default=0.0, help="cap writes at N MB/s")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    p.add_argument("--model", default="small", help="reference model size (default: small)")
    p.add_argument("--ranks", default="1,2", help="world sizes to run, comma-separated")
    p.add_argument("--batch-size", type=int, default=4, help="samples per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    p.add_argument("--saves", type=int, default=None, help="saves per configuration")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")


# --- the parent: one group of worker processes per world size --------------------------------
def main(args: argparse.Namespace) -> int:
    worlds = [int(x) for x in str(args.ranks).split(",") if x.strip()]
    saves = args.saves or (3 if args.quick else 5)
    rows: list[dict[str, Any]] = []
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(dir=base, prefix="bench-ckpt-") as tmp:
        for world in worlds:
            cfg = {
                "model": args.model,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "saves": saves,
                "quick": bool(args.quick),
                "throttle_mbps": args.throttle_mbps,
                "root": str(Path(tmp) / f"w{world}"),
                "out": str(Path(tmp) / f"w{world}.json"),
            }
            _launch(world, cfg)
            rows.extend(json.loads(Path(cfg["out"]).read_text()))
    _print(rows, throttle=args.throttle_mbps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _launch(world: int, cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for rank in range(world):
        wenv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        if world > 1:
            wenv.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                TORCHELASTIC_USE_AGENT_STORE="True",
            )
        cmd = [sys.executable, "-m", "unbroken.bench.checkpoint", "--worker", json.dumps(cfg)]
        procs.append(subprocess.Popen(cmd, env=wenv))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"benchmark workers of world size {world} failed: exit codes {codes}")


def _print(rows: list[dict[str, Any]], *, throttle: float) -> None:
    head = (
        f"{'ranks':>5} {'mode':<14} {'interval':>8} {'P/intv':>6} {'efficiency':>10} "
        f"{'stall ms':>9} {'memcpy ms':>9} {'stall/cp':>8} {'persist s':>9} {'skipped':>7} "
        f"{'slowdown':>8}"
    )
    if throttle:
        print(f"writes throttled to {throttle:g} MB/s")
    print(head)
    for r in rows:
        stall = r["stall_s_median"]
        ratio = "" if stall is None else f"{stall / r['memcpy_s']:.2f}"
        print(
            f"{r['world_size']:>5} {r['mode']:<14} {r['interval_steps']:>8} "
            f"{_fmt(r['persist_over_interval'], '.2f'):>6} {100 * r['efficiency']:>9.2f}% "
            f"{_fmt(stall, '.1f', 1e3):>9} {1e3 * r['memcpy_s']:>9.1f} {ratio:>8} "
            f"{_fmt(r['persist_s_median'], '.2f'):>9} {r['skipped_saves']:>7} "
            f"{r['slowdown']:>8.3f}"
        )
    state = {r["world_size"]: r["state_bytes"] for r in rows}
    print(
        "state bytes per rank: "
        + ", ".join(f"{w} rank(s): {b / 1e6:.0f} MB" for w, b in state.items())
    )


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


# --- the worker ---------------------------------------------------------------------------------
class _Ctx:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        from unbroken.env import WorkerEnv
        from unbroken.workload import data as wdata
        from unbroken.workload import model as wmodel
        from unbroken.workload.dist import init_process_group
        from unbroken.workload.parallel import wrap_model

        self.env = WorkerEnv.from_environ()
        self.world = self.env.world_size
        self.rank = self.env.rank
        if self.world > 1:
            init_process_group(
                self.env, run="bench-ckpt", backend="gloo", timeout=timedelta(seconds=600)
            )
        self.dist = dist
        self.throttle = float(cfg["throttle_mbps"])
        self.root = Path(cfg["root"])
        mcfg = wmodel.get_config(cfg["model"])
        parallel: Literal["fsdp", "none"] = "fsdp" if self.world > 1 else "none"
        self.model = wrap_model(wmodel.build_model(mcfg, seed=0), parallel=parallel, device="cpu")
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        lang = wdata.MarkovLanguage(mcfg.vocab_size, seed=0)
        self.dataset = wdata.SyntheticDataset(lang, seq_len=cfg["seq_len"], num_samples=1 << 14)
        self.sampler = wdata.ResumableSampler(
            1 << 14,
            global_batch=cfg["batch_size"] * self.world,
            rank=self.rank,
            world_size=self.world,
            seed=0,
        )
        self.wmodel = wmodel
        self.state = {"model": self.model, "optim": self.optim}
        self.global_step = 0

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optim),
        }

    def step(self) -> Any:
        inputs, targets = self.dataset.get_batch(self.sampler.next_indices())
        loss = self.wmodel.loss_fn(self.model(inputs), targets)
        loss.backward()
        return loss

    def update(self, loss: Any) -> None:
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if self.world > 1:
            self.dist.all_reduce(loss.detach())

    def reduce_max(self, value: float) -> float:
        if self.world == 1:
            return value
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t)

    def barrier(self) -> None:
        if self.world > 1:
            self.dist.barrier()


def _state_bytes(ctx: _Ctx) -> int:
    from unbroken.checkpoint.state.resolve import resolve_for_save

    resolved = resolve_for_save(ctx.state, rank=ctx.rank, world_size=ctx.world, overlap=False)
    return resolved.tensor_bytes


def _memcpy_s(nbytes: int) -> float:
    """One plain copy of ``nbytes`` between two already-faulted buffers: the snapshot floor."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _loop(ctx: _Ctx, saver: Saver, *, interval: int, steps: int) -> dict[str, Any]:
    ctx.barrier()
    blocking = 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        loss = ctx.step()
        blocking += saver.before_update()
        ctx.update(loss)
        ctx.global_step += 1  # checkpoint step numbers only grow, across configurations
        if interval and (step + 1) % interval == 0:
            blocking += saver.save(ctx.global_step)
    loop_s = time.perf_counter() - t0
    saver.drain()
    ctx.barrier()
    got = saver.take()
    blocking = got.get("blocking_s", blocking)
    return {"loop_s": loop_s, "blocking_s": blocking, **got}


def _row(
    ctx: _Ctx, mode: str, interval: int, steps: int, res: dict[str, Any], **extra: Any
) -> dict:
    stall = res["stall_s"]
    persist = res["persist_s"]
    return {
        "world_size": ctx.world,
        "mode": mode,
        "interval_steps": interval,
        "steps": steps,
        "efficiency": 1.0 - res["blocking_s"] / res["loop_s"],
        "stall_s_median": statistics.median(stall) if stall else None,
        "stall_s_max": max(stall) if stall else None,
        "persist_s_median": statistics.median(persist) if persist else None,
        "skipped_saves": res["skipped"],
        "saves": len(stall),
        "loop_s": res["loop_s"],
        "step_s": res["loop_s"] / steps,
        "staging_bytes": res["staging_bytes"],
        **extra,
    }


def worker(cfg: dict[str, Any]) -> None:
    ctx = _Ctx(cfg)
    for _ in range(2):  # warm up: optimizer state exists, allocator warm
        ctx.update(ctx.step())
    state_bytes = _state_bytes(ctx)
    memcpy_s = ctx.reduce_max(_memcpy_s(state_bytes))
    rows: list[dict[str, Any]] = []

    calib_steps = 6
    base = _loop(ctx, Saver(), interval=0, steps=calib_steps)
    step_s = ctx.reduce_max(base["loop_s"] / calib_steps)
    savers: dict[str, Saver] = {
        "dcp-sync": DcpSync(ctx),
        "dcp-async": DcpAsync(ctx),
        "unbroken": UnbrokenSaver(ctx, on_busy="skip"),
        "unbroken-wait": UnbrokenSaver(ctx, on_busy="wait"),
    }
    # Warm every saver (writer processes started, staging memory allocated) and take the
    # persist time P of one unbroken save to pick the intervals.
    for saver in savers.values():
        for _ in range(2):  # the first save also pays for fresh files in the page cache
            ctx.global_step += 1
            saver.save(ctx.global_step)
            saver.drain()
            got = saver.take()
        if saver.mode == "unbroken":
            persist_probe = ctx.reduce_max(max(got["persist_s"]))
    k_eq = max(1, round(persist_probe / step_s))
    # persist ~ interval, ~50% of it, and (full run) ~25% of it.
    intervals = [k_eq, max(k_eq + 1, math.ceil(2 * persist_probe / step_s))]
    if not cfg["quick"]:
        intervals.append(max(intervals[-1] + 1, math.ceil(4 * persist_probe / step_s)))
    saves = int(cfg["saves"])
    extra = {"memcpy_s": memcpy_s, "state_bytes": state_bytes, "persist_probe_s": persist_probe}
    for mode in MODES:
        saver = savers.get(mode, Saver())
        # A no-checkpoint baseline right before each mode: the step time its slowdown is
        # measured against (other load on a shared machine drifts over minutes).
        base_steps = intervals[0] * saves + 1
        base = _loop(ctx, Saver(), interval=0, steps=base_steps)
        none_step_s = ctx.reduce_max(base["loop_s"] / base_steps)
        if mode == "none":
            rows.append(
                _row(ctx, "none", 0, base_steps, base, persist_over_interval=None,
                     slowdown=1.0, **extra)
            )  # fmt: skip
            continue
        for interval in intervals:
            steps = interval * saves + 1
            res = _loop(ctx, saver, interval=interval, steps=steps)
            res["blocking_s"] = ctx.reduce_max(res["blocking_s"])
            res["loop_s"] = ctx.reduce_max(res["loop_s"])
            persist = statistics.median(res["persist_s"]) if res["persist_s"] else None
            row = _row(
                ctx,
                mode,
                interval,
                steps,
                res,
                persist_over_interval=None
                if persist is None
                else persist / (interval * none_step_s),
                slowdown=(res["loop_s"] / steps) / none_step_s,
                **extra,
            )
            rows.append(row)
            if ctx.rank == 0:
                logger.info("%s", json.dumps(row))
            if mode.startswith("dcp"):
                shutil.rmtree(ctx.root / mode, ignore_errors=True)
        saver.close()
    if ctx.rank == 0:
        Path(cfg["out"]).write_text(json.dumps(rows))
    if ctx.world > 1:
        ctx.dist.destroy_process_group()


if __name__ == "__main__":
    from unbroken.log import init_logging

    init_logging()
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit("usage: python -m unbroken.bench.checkpoint --worker CONFIG_JSON")
