"""A one-rank gloo process group for tests that need one in the test process itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def gloo_group() -> Iterator[None]:
    """The default process group of one rank (gloo, a store on port 0) while the block runs."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
