"""Tiny Hugging Face Trainer training on CPU, before (plain_hf_trainer.py) and after
(hf_trainer.py) adopting unbroken.

plain_hf_trainer.py is a plain Trainer script with the Trainer's own fault tolerance: a
checkpoint every 10 steps (``save_steps``) and ``train(resume_from_checkpoint=...)`` from the
newest, so a restarted job resumes there. hf_trainer.py is the same script in unbroken.main with
unbroken's ``Trainer``: it restarts in-process after an exception or a hang, resumes from memory
after a lost process, and its ledger yields `unbroken report`. Run either with

    unbroken-run --standalone --nproc-per-node 2 examples/hf_trainer.py    # or torchrun

The data are a fixed random set the Trainer shuffles with its seed, and it skips the batches a
resumed epoch has seen, so a resumed run trains on the same data as one that never stopped.
Rank 0 prints a hash of the trained weights at the end: the same for both scripts and every
run of them on 2 ranks, with faults or without.
"""

import hashlib
import os

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

DIM = 32


class Data(torch.utils.data.Dataset):
    """640 random inputs and a fixed function of them to learn."""

    def __init__(self) -> None:
        self.x = torch.randn(640, DIM, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": torch.sin(3 * self.x[i])}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, DIM))

    def forward(self, x, y):
        return {"loss": nn.functional.mse_loss(self.net(x), y)}


def weights_sha256(model: nn.Module) -> str:
    """A hash of the weights (every rank holds all of them)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().numpy().tobytes())
    return h.hexdigest()


def train() -> None:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir="checkpoints",
        per_device_train_batch_size=16,
        num_train_epochs=2,  # 20 steps each on 2 ranks
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=10,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    model = Model()
    trainer = Trainer(model=model, args=args, train_dataset=Data())
    last = get_last_checkpoint("checkpoints") if os.path.isdir("checkpoints") else None
    trainer.train(resume_from_checkpoint=last)
    digest = weights_sha256(model)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"final_state_sha256={digest}", flush=True)


if __name__ == "__main__":
    train()
