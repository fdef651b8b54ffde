"""A malformed value in the coordination store (one no rank of ours wrote) is ignored and
logged: the peer watcher does not die of it, and ``fn`` goes on (one rank, real gloo)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from procs import one_rank
from unbroken.restart import RestartConfig, RestartContext
from unbroken.restart import run as restart_run
from unbroken.restart.store import Keys

ENV = one_rank("values")


def test_a_malformed_wake_up_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    calls = []

    def fn(ctx: RestartContext) -> None:
        calls.append(ctx.iteration)
        key = Keys.for_run(run="values", attempt=0).wake(0, 0)
        server.set(key, "{not json")
        time.sleep(0.3)  # the watcher reads it meanwhile
        ctx.step_done(0)

    cfg = RestartConfig(
        store_addr=f"127.0.0.1:{server.port}",
        monitor_interval_s=0.01,
        backstop_margin_s=None,
        health_checks=(),
        pg_backend="gloo",
    )
    restart_run(fn, config=cfg, env=ENV)
    assert calls == [0] and died == []
