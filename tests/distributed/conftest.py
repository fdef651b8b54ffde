"""Shared by the single-process restart tests: a store hosted by the test, as a launcher agent
would host one (their rank's environment: ``procs.one_rank``)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture
def store_addr() -> Iterator[str]:
    """A store hosted by the test, as a launcher agent would."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield f"127.0.0.1:{server.port}"
    del server
