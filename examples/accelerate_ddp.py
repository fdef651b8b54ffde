"""Tiny Hugging Face Accelerate training on CPU, before (plain_accelerate.py) and after
(accelerate_ddp.py) adopting unbroken.

plain_accelerate.py is a plain Accelerate script with Accelerate's own fault tolerance: it
saves its state every 10 steps (``accelerator.save_state``) and a restarted job loads the
newest (``load_state``). accelerate_ddp.py is the same script in unbroken.main: its
Checkpointer takes the accelerator's state (``state_of``) instead, it restarts in-process after
an exception or a hang, resumes from memory after a lost process, and its ledger yields
`unbroken report`. Run either with

    unbroken-run --standalone --nproc-per-node 2 examples/accelerate_ddp.py  # or accelerate launch

Each batch is a function of the step and the rank, so a resumed run trains on the same data as
one that never stopped. Rank 0 prints a hash of the trained weights at the end: the same for
both scripts and every run of them on 2 ranks, with faults or without.
"""

import hashlib

import torch
from accelerate import Accelerator
from torch import nn

import unbroken
from unbroken.integrations.accelerate import state_of

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
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, DIM))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=15, gamma=0.5)
    model, optim, sched = accelerator.prepare(model, optim, sched)
    state = state_of(accelerator)
    ckpt = unbroken.Checkpointer(ctx.run_dir / "ckpt", every_steps=10)
    for step in range(ckpt.resume(state), STEPS):
        inputs, targets = batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optim.step()
        sched.step()
        optim.zero_grad()
        ckpt.maybe_save(step, state)
        ctx.step_done(step, loss=loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    ckpt.close()
    digest = weights_sha256(accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        print(f"final_state_sha256={digest}", flush=True)


if __name__ == "__main__":
    unbroken.main(train)
