"""A toy model and training step for single-process checkpoint tests."""

from __future__ import annotations

import torch


def mlp(
    seed: int, *, inputs: int = 16, hidden: int = 32
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A seeded 2-layer MLP and its AdamW (no state until the first step)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """One step on a random batch (the global RNG: seed it for a reproducible run)."""
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    model(torch.randn(8, first.in_features)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
