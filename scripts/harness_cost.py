"""What unbroken's per-step calls cost a training step: ``ctx.phase("data")`` around the batch
and ``ctx.step_done`` after it, against the same step without them.

The FSDP2 example's model and step (examples/fsdp.py) on the ranks of ``unbroken-run``; blocks
of 50 steps cycle through three arms: without the calls ("off"), with them ("on"), and without
them again ("off2", the control: what two arms that differ in nothing differ by on this machine).
The first three blocks are warm-up. Rank 0 prints each arm's median and mean wall time per step
and its median process CPU time (every thread of the process: the ledger's writer, the
watchdog), then the difference of the medians, on - off beside off2 - off: a cost is
measurable when it stands out of the control's difference.

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
ARMS = ("off", "on", "off2")
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
    wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for step in range(STEPS):
        arm = ARMS[(step // BLOCK) % len(ARMS)]
        on = arm == "on"
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
        if step >= len(ARMS) * BLOCK:
            wall[arm].append(time.perf_counter() - t)
            cpu[arm].append(time.process_time() - c)
    if rank == 0:
        for arm in ARMS:
            print(
                f"calls {arm:4}: {len(wall[arm])} steps, median "
                f"{1e3 * statistics.median(wall[arm]):.3f} ms, mean "
                f"{1e3 * statistics.fmean(wall[arm]):.3f} ms, median process CPU "
                f"{1e3 * statistics.median(cpu[arm]):.3f} ms",
                flush=True,
            )
        # Paired by cycle (off, on, off2 back to back), so that a drift of the machine's speed
        # over the run cancels: each cycle's block medians, on against the mean of its two off
        # blocks, and the control off2 against off.
        medians = {arm: _block_medians(wall[arm]) for arm in ARMS}
        off_s = statistics.median(wall["off"])
        cycles = list(zip(medians["off"], medians["on"], medians["off2"], strict=False))
        on_d = [n - (a + b) / 2 for a, n, b in cycles]
        aa_d = [b - a for a, _, b in cycles]
        for label, diffs in (("on - off", on_d), ("off2 - off (control)", aa_d)):
            q1, q2, q3 = statistics.quantiles(diffs, n=4)
            print(
                f"{label}: median {1e6 * q2:.0f} us ({100 * q2 / off_s:.2f}% of a step), "
                f"quartiles {1e6 * q1:.0f} .. {1e6 * q3:.0f} us over {len(diffs)} cycles",
                flush=True,
            )


def _block_medians(times: list[float]) -> list[float]:
    return [statistics.median(times[i : i + BLOCK]) for i in range(0, len(times), BLOCK)]


if __name__ == "__main__":
    unbroken.main(train)
