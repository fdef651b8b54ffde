"""Tiny Lightning training on CPU, before (plain_lightning_ddp.py) and after (lightning_ddp.py) adopting
unbroken.

plain_lightning_ddp.py is a plain Lightning script with Lightning's own fault tolerance: a
checkpoint every 10 steps (``ModelCheckpoint``) and ``fit(ckpt_path="last")``, so a restarted
job resumes from its last checkpoint. lightning_ddp.py is the same script in unbroken.main with the
``Unbroken`` callback: it restarts in-process after an exception or a hang, resumes from memory
after a lost process, and its ledger yields `unbroken report`. `diff -u
examples/plain_lightning_ddp.py examples/lightning_ddp.py` is what a user applies. Run either with

    unbroken-run --standalone --nproc-per-node 2 examples/lightning_ddp.py    # or torchrun

Each batch is a function of its index and the rank, and the loader is resumable (its position
is in Lightning's checkpoints), so a resumed run trains on the same data as one that never
stopped. Rank 0 prints a hash of the trained weights at the end: the same for both scripts and
every run of them on 2 ranks, with faults or without.
"""

import hashlib
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import unbroken
from unbroken.integrations.lightning import Unbroken

EPOCHS, BATCHES, DIM = 2, 20, 32


def batch(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch ``index``: random inputs and a fixed function of them to learn."""
    g = torch.Generator().manual_seed(1000 * index + rank)
    x = torch.randn(16, DIM, generator=g)
    return x, torch.sin(3 * x)


class Batches:
    """This rank's batches, epoch after epoch; resumable: Lightning keeps its ``state_dict`` in
    its checkpoints and resumes an epoch where it stopped."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.epoch = self.next = 0

    def __len__(self) -> int:
        return BATCHES

    def __iter__(self):
        if self.next == BATCHES:  # the last epoch ended
            self.epoch, self.next = self.epoch + 1, 0
        while self.next < BATCHES:
            self.next += 1
            yield batch(self.epoch * BATCHES + self.next - 1, self.rank)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.next = state["epoch"], state["next"]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, DIM))

    def training_step(self, b, batch_idx):
        loss = nn.functional.mse_loss(self.net(b[0]), b[1])
        if self.global_step % 10 == 0 and self.global_rank == 0:
            print(f"step {self.global_step} loss {loss.item():.4f}", flush=True)
        return loss

    def validation_step(self, b, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.net(b[0]), b[1]), sync_dist=True)

    def configure_optimizers(self):
        optim = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optim], [torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)]


def weights_sha256(model: nn.Module) -> str:
    """A hash of the weights (every rank holds all of them)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().numpy().tobytes())
    return h.hexdigest()


def train(ctx: unbroken.RestartContext) -> None:
    pl.seed_everything(0, verbose=False)
    model = Model()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy="ddp",
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Unbroken(ctx, every_steps=10)],
    )
    x = torch.randn(64, DIM, generator=torch.Generator().manual_seed(-1))
    validation = DataLoader(TensorDataset(x, torch.sin(3 * x)), batch_size=16)
    trainer.fit(model, Batches(rank), validation)
    digest = weights_sha256(model)
    if trainer.is_global_zero:
        print(f"final_state_sha256={digest}", flush=True)


if __name__ == "__main__":
    unbroken.main(train)
