"""A configuration error is not a fault: ``unbroken.restart.run`` does not restart ``fn`` for a
``ConfigError``, nor for a ``ValueError`` raised before the first step (one rank, real gloo)."""

from __future__ import annotations

import pytest

from procs import one_rank
from unbroken.errors import ConfigError
from unbroken.restart import RestartConfig, RestartContext
from unbroken.restart import run as restart_run

ENV = one_rank("cfg")


def _config(store_addr: str) -> RestartConfig:
    return RestartConfig(
        store_addr=store_addr,
        monitor_interval_s=0.01,
        backstop_margin_s=None,
        health_checks=(),
        pg_backend="gloo",
    )


@pytest.mark.parametrize("where", ["before-first-step", "config-error-later"])
def test_inprocess_restart_does_not_retry_a_config_error(store_addr: str, where: str) -> None:
    calls = []

    def fn(ctx: RestartContext) -> None:
        calls.append(ctx.iteration)
        if where == "before-first-step":
            raise ValueError("bad --lr")
        ctx.step_done(0)
        raise ConfigError("bad data path")

    with pytest.raises(ConfigError, match="bad"):
        restart_run(fn, config=_config(store_addr), env=ENV)
    assert calls == [0]


def test_a_value_error_after_the_first_step_is_still_a_fault(store_addr: str) -> None:
    calls = []

    def fn(ctx: RestartContext) -> None:
        calls.append(ctx.iteration)
        ctx.step_done(0)
        if ctx.iteration == 0:
            raise ValueError("a transient bad batch")

    restart_run(fn, config=_config(store_addr), env=ENV)
    assert calls == [0, 1]
