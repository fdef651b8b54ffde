"""What a note costs a training step: ``maybe_save`` on the steps it only notes, against the step.

The DDP example's model and step (examples/ddp.py, its every_steps=10) on the ranks of
``unbroken-run``, so the journal is on as it is for an adopter. ``moving`` also draws
from torch's global generator every step (as dropout does), so every note captures new
generator states and rewrites its journal entry; without it the generators stay put and a note
keeps the last one's values. The first 50 steps are warm-up. Each rank prints the median step,
the median ``maybe_save`` of the steps it noted (no save or snapshot staged), and that as a
share of the step.

    unbroken-run --standalone --nproc-per-node 2 scripts/note_cost.py [STEPS] [still|moving]
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
MOVING = sys.argv[2:3] == ["moving"]
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
    ckpt = unbroken.Checkpointer(ctx.run_dir / "ckpt", every_steps=10)
    steps: list[float] = []
    notes: list[float] = []
    last = time.perf_counter()
    for step in range(ckpt.resume(state), STEPS):
        inputs, targets = example.batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        if MOVING:
            loss = loss + 0 * torch.rand(1).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        t0 = time.perf_counter()
        staged = ckpt.maybe_save(step, state)
        took = time.perf_counter() - t0
        ctx.step_done(step, loss=loss.item())
        now = time.perf_counter()
        if step >= WARMUP:
            steps.append(now - last)
            if not staged and step % 10 != 9:
                notes.append(took)
        last = now
    ckpt.close()
    step_s, note_s = statistics.median(steps), statistics.median(notes)
    print(
        f"rank {rank}: generators {'moving' if MOVING else 'still'}; step {step_s * 1e3:.2f} ms, "
        f"note {note_s * 1e6:.0f} us ({len(notes)} notes), {note_s / step_s:.1%} of the step",
        flush=True,
    )


if __name__ == "__main__":
    unbroken.main(train)
