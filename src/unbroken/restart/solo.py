"""``fn`` once, without in-process restart (``RestartConfig(enabled=False)``).

What the launcher-only configuration runs: the default process group is formed on the
launcher's store (a private one for a process started by hand) under a prefix of this launcher
attempt, so that a restarted worker never reads a dead peer's address from an earlier round
(pytorch/pytorch#135712); ``fn(ctx)`` runs once; whatever it raises ends the process, and the
launcher restarts every worker. No thread watches for hangs here: the launcher's heartbeat
timeout does. The context has no monitor (``ctx.no_hang_protection`` and phases time nothing
but the ledger's records).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from unbroken.env import WorkerEnv
from unbroken.ledger import Recorder
from unbroken.restart import pg
from unbroken.restart.config import RestartConfig
from unbroken.restart.context import RestartContext

logger = logging.getLogger(__name__)

T = TypeVar("T")


def attempt_prefix(env: WorkerEnv, *, run: str) -> str:
    """The store prefix of this launcher attempt."""
    return f"unbroken/{run}/a{env.restart_count}/solo/"


def launcher_store(env: WorkerEnv, *, timeout_s: float) -> dist.Store:
    """The launcher's store as a client (its master when the agent does not host it), or a
    private one for a process started by hand."""
    timeout = timedelta(seconds=timeout_s)
    if not env.launched:
        if env.world_size != 1:
            raise ValueError(
                f"WORLD_SIZE={env.world_size} but no MASTER_ADDR: start the job with a launcher "
                "(unbroken-run or torchrun)"
            )
        return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    assert env.master_addr is not None and env.master_port is not None
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=(not env.use_agent_store) and env.rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )


def run_once(
    fn: Callable[[RestartContext], T],
    *,
    config: RestartConfig,
    ledger: Recorder,
    env: WorkerEnv,
) -> T:
    """Form the group, call ``fn`` once, tear the group down; returns ``fn``'s value and lets
    anything it raises propagate (after the context's exit hooks ran)."""
    store = launcher_store(env, timeout_s=config.pg_timeout_s)
    run = env.run_id if env.run_id and env.run_id != "none" else ledger.run or "local"
    with ledger.phase("pg_init"):
        pg.form(
            store,
            prefix=attempt_prefix(env, run=run),
            rank=env.rank,
            world_size=env.world_size,
            backend=config.pg_backend or pg.default_backend(),
            timeout_s=config.pg_timeout_s,
            local_rank=env.local_rank,
        )
    ledger.mark()
    ctx = RestartContext(
        iteration=0,
        cause=None,
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        member=env.rank,
        run_dir=env.run_dir,
        ledger=ledger,
        monitor=None,
    )
    error: BaseException | None = None
    try:
        return fn(ctx)
    except BaseException as e:
        error = e
        raise
    finally:
        ctx._exited(error)
        del error
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is the launcher's to clean up
                logger.exception("destroying the process group failed")
