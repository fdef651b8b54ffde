"""What unbroken's per-step calls cost a training step: ``ctx.phase("data")`` around the batch
and ``ctx.step_done`` after it, against the same step without them.

The FSDP2 example's model and step (examples/fsdp.py) on the ranks of ``unbroken-run``; blocks
of 50 steps alternate with and without the calls (the first two blocks are warm-up). Rank 0
prints each arm's median and mean wall time per step and its median process CPU time (every
thread of the process: the ledger's writer, the watchdog), then the difference of the medians.

    unbroken-run --standalone --nproc-per-node 2 scripts/harness_cost.py [STEPS]
"""

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import unbroken

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
BLOCK = 50
_spec = importlib.util.spec_from_file_location(
    "fsdp_example", Path(__file__).resolve().parents[1] / "examples" / "fsdp.py"
)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)  # its batch() and DIM; its model is built as train() does


def train(ctx: unbroken.RestartContext) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(example.DIM, 64), nn.Tanh(), nn.Linear(64, example.DIM))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for step in range(STEPS):
        on = (step // BLOCK) % 2 == 1
        t, c = time.perf_counter(), time.process_time()
        if on:
            with ctx.phase("data"):
                inputs, targets = example.batch(step, rank)
        else:
            inputs, targets = example.batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if on:
            ctx.step_done(step, loss=loss.item())
        else:
            loss.item()
        if step >= 2 * BLOCK:
            wall[on].append(time.perf_counter() - t)
            cpu[on].append(time.process_time() - c)
    if rank == 0:
        for on in (False, True):
            print(
                f"calls {'on ' if on else 'off'}: {len(wall[on])} steps, median "
                f"{1e3 * statistics.median(wall[on]):.3f} ms, mean "
                f"{1e3 * statistics.fmean(wall[on]):.3f} ms, median process CPU "
                f"{1e3 * statistics.median(cpu[on]):.3f} ms",
                flush=True,
            )
        off_s, on_s = statistics.median(wall[False]), statistics.median(wall[True])
        print(
            f"difference of the medians: {1e6 * (on_s - off_s):.0f} us "
            f"({100 * (on_s - off_s) / off_s:.2f}% of a step)",
            flush=True,
        )


if __name__ == "__main__":
    unbroken.main(train)
