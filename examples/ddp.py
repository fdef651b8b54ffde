"""Tiny DDP training on CPU, before (plain_ddp.py) and after (ddp.py) adopting unbroken.

plain_ddp.py is a plain torchrun script; it runs unchanged under unbroken-run, which restarts
it from scratch when a rank dies. ddp.py is the same script in unbroken.main: it restarts
in-process after an exception, resumes from its newest checkpoint after a lost process, and
its ledger yields `unbroken report`. `diff -u examples/plain_ddp.py examples/ddp.py` is
what a user applies. Run either with

    unbroken-run --standalone --nproc-per-node 2 examples/ddp.py    # or torchrun

Each batch is a function of the step and the rank, so a resumed run trains on the same data as
one that never stopped. Rank 0 prints a hash of the trained weights at the end: the same for
both scripts and every run of them on 2 ranks, with faults or without.
"""

import hashlib

import torch
import torch.distributed as dist
from torch import nn

import unbroken

STEPS = 40
DIM = 32


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: random inputs and a fixed function of them to learn."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, DIM, generator=g)
    return x, torch.sin(3 * x)


def weights_sha256(model: nn.Module) -> str:
    """A hash of the weights (every rank holds all of them)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().numpy().tobytes())
    return h.hexdigest()


def train(ctx: unbroken.RestartContext) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, DIM))
    model = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim}
    ckpt = unbroken.Checkpointer(ctx.run_dir / "ckpt", every_steps=10)
    for step in range(ckpt.resume(state), STEPS):
        inputs, targets = batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        ckpt.maybe_save(step, state)
        ctx.step_done(step, loss=loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    ckpt.close()
    digest = weights_sha256(model)
    if rank == 0:
        print(f"final_state_sha256={digest}", flush=True)


if __name__ == "__main__":
    unbroken.main(train)
