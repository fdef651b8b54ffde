"""examples/ddp.py with its weights nudged at start by noise no seed fixes: fault-free runs end
with different weights (by ~1e-7) but the same loss curve within a hair, as many real scripts
do. What ``unbroken bench recovery`` must call not deterministic and judge by loss curve."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch
from torch import nn

_linear_init = nn.Linear.reset_parameters


def _nudged(self: nn.Linear) -> None:
    _linear_init(self)
    with torch.no_grad():
        noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.weight.add_(1e-7 * torch.randn(self.weight.shape, generator=noise))


nn.Linear.reset_parameters = _nudged  # type: ignore[method-assign]

if __name__ == "__main__":
    example = Path(__file__).resolve().parents[2] / "examples" / "ddp.py"
    sys.argv = [str(example), *sys.argv[1:]]
    runpy.run_path(str(example), run_name="__main__")
