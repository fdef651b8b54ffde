"""What checkpointing costs a training step by default: saves, snapshots and notes, each as a
share of the loop's time.

The DDP example's model and step (examples/ddp.py) on the ranks of ``unbroken-run``, with
``Checkpointer(every_steps=100)`` and nothing else set, so the snapshot interval is the
default budget's and the journal is on, as for an adopter. ``STEP_MS`` (0: the model's own
step) stretches each step to that length with a sleep, as a larger model's step on a GPU
would (its host thread waits for the device).
``moving`` also draws from torch's generator every step, as dropout does, so every note
captures new generator states. The first 50 steps are warm-up. Each rank prints the median
step, the snapshot interval chosen, and for each kind of ``maybe_save`` call (a durable save,
a snapshot, a note) how many there were, their median, and their total as a share of the
loop's time.

    unbroken-run --standalone --nproc-per-node 2 scripts/checkpoint_cost.py \
        [STEPS] [STEP_MS] [still|moving]
"""

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import unbroken

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 600
STEP_S = float(sys.argv[2]) / 1e3 if len(sys.argv) > 2 else 0.0
MOVING = sys.argv[3:4] == ["moving"]
EVERY = 100
WARMUP = 50
_spec = importlib.util.spec_from_file_location(
    "ddp_example", Path(__file__).resolve().parents[1] / "examples" / "ddp.py"
)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)  # its batch() and DIM; its model is built as train() does


def train(ctx: unbroken.RestartContext) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    dim = example.DIM
    model = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, dim))
    model = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim}
    ckpt = unbroken.Checkpointer(ctx.run_dir / "ckpt", every_steps=EVERY)
    steps: list[float] = []
    calls: dict[str, list[float]] = {"save": [], "snapshot": [], "note": []}
    last = time.perf_counter()
    for step in range(ckpt.resume(state), STEPS):
        inputs, targets = example.batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        if MOVING:
            loss = loss + 0 * torch.rand(1).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        rest = STEP_S - (time.perf_counter() - last)
        if rest > 0:
            time.sleep(rest)  # the rest of a longer step, as a GPU step's host thread waits
        held = ckpt._saves.pending  # True: a durable save held back a step (one copy)
        t0 = time.perf_counter()
        staged = ckpt.maybe_save(step, state)
        took = time.perf_counter() - t0
        ctx.step_done(step, loss=loss.item())
        now = time.perf_counter()
        if step >= WARMUP:
            steps.append(now - last)
            durable = step % EVERY == EVERY - 1 or held is True
            kind = "note" if not staged else "save" if durable else "snapshot"
            calls[kind].append(took)
        last = now
    interval = getattr(ckpt._auto, "interval", None)  # what the budget chose (None: none)
    ckpt.close()
    loop_s = sum(steps)
    parts = ", ".join(
        f"{kind} {len(t)} × {statistics.median(t) * 1e6:.0f} us = {sum(t) / loop_s:.2%}"
        for kind, t in calls.items()
        if t
    )
    print(
        f"rank {rank}: step {statistics.median(steps) * 1e3:.2f} ms "
        f"(generators {'moving' if MOVING else 'still'}), snapshot every {interval} steps; "
        f"{parts}",
        flush=True,
    )


if __name__ == "__main__":
    unbroken.main(train)
