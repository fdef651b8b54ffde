"""Form the training process group on a store prefix unique to the restart attempt.

torchrun on torch 2.13 shares one TCPStore across restart rounds; a restarted worker that
joins the default prefix can read a dead peer's address left by the previous round and hang
(pytorch/pytorch#135712). Every key we use lives under ``unbroken/<run>/a<attempt>/``, so a
round only ever sees its own peers.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from unbroken.env import WorkerEnv

logger = logging.getLogger(__name__)


def attempt_prefix(env: WorkerEnv, *, run: str, iteration: int = 0) -> str:
    """The store prefix of this launcher attempt and in-process iteration."""
    return f"unbroken/{run}/a{env.restart_count}/i{iteration}/"


def connect_store(env: WorkerEnv, *, timeout: timedelta) -> dist.Store:
    """The launcher's store (as a client) or, when launched bare, a private one."""
    if not env.launched:
        return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    assert env.master_addr is not None and env.master_port is not None
    is_master = (not env.use_agent_store) and env.rank == 0
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=is_master,
        timeout=timeout,
        wait_for_workers=False,
    )


def init_process_group(
    env: WorkerEnv, *, run: str, backend: str, timeout: timedelta, iteration: int = 0
) -> dist.Store:
    """Initialize the default process group under the attempt's prefix; returns the raw store."""
    store = connect_store(env, timeout=timeout)
    prefixed = dist.PrefixStore(attempt_prefix(env, run=run, iteration=iteration), store)
    dist.init_process_group(
        backend, store=prefixed, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    return store


def default_backend(device: torch.device) -> Literal["gloo", "nccl"]:
    return "nccl" if device.type == "cuda" else "gloo"
