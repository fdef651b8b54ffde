"""RestartConfig validation and the store address parser."""

from __future__ import annotations

import pytest

from unbroken.restart import EXIT_ESCALATE, EXIT_EXCLUDED, Escalated, RankExcluded, RestartConfig
from unbroken.restart.config import parse_addr


def test_defaults_are_valid_and_ordered() -> None:
    c = RestartConfig()
    soft, hard, isoft, ihard = c.ceilings()  # the defaults leave every timeout to calibration
    assert c.soft_timeout_s is None and (soft, hard, isoft, ihard) == (60.0, 90.0, 600.0, 900.0)
    assert c.monitor_interval_s < soft < hard < c.barrier_timeout_s
    assert c.timeouts(initial=True) == (isoft, ihard)
    assert c.timeouts(initial=False) == (soft, hard)


def test_ceilings_keep_order_with_explicit_values() -> None:
    assert RestartConfig(hard_timeout_s=10.0).ceilings()[:2] == (pytest.approx(10 / 1.5), 10.0)
    assert RestartConfig(soft_timeout_s=70.0).ceilings()[:2] == (70.0, pytest.approx(105.0))
    explicit = {"soft_timeout_s": 0.4, "hard_timeout_s": 10.0}
    both = {"initial_soft_timeout_s": 10.0, "initial_hard_timeout_s": 20.0}
    assert RestartConfig(**explicit, **both).ceilings() == (0.4, 10.0, 10.0, 20.0)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"soft_timeout_s": 5, "hard_timeout_s": 5}, "soft_timeout_s"),
        ({"monitor_interval_s": 1, "soft_timeout_s": 0.5}, "monitor_interval_s"),
        ({"hard_timeout_s": 200, "barrier_timeout_s": 100}, "hard_timeout_s"),
        ({"initial_soft_timeout_s": 10}, "initial_soft_timeout_s"),
        ({"initial_hard_timeout_s": 80}, "initial_hard_timeout_s"),
        ({"exit_timeout_s": 130}, "exit_timeout_s"),
        ({"max_iterations": 0}, "max_iterations"),
        ({"min_world_size": 0}, "min_world_size"),
        ({"pg_backend": "mpi"}, "pg_backend"),
        ({"store_addr": "nohost"}, "host:port"),
        ({"backstop_margin_s": 0}, "backstop_margin_s"),
        ({"soft_timeout_s": 0}, "soft_timeout_s"),
        ({"timeout_factor": 1.0}, "timeout_factor"),
        ({"timeout_floor_s": 0}, "timeout_floor_s"),
        ({"timeout_warmup": 0}, "timeout_warmup"),
    ],
)
def test_bad_values_are_rejected_with_the_field_named(fields: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        RestartConfig(**fields)


def test_parse_addr() -> None:
    assert parse_addr("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert parse_addr("[::1]:80") == ("::1", 80)
    for bad in ("host", ":80", "host:0", "host:x", "host:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_addr(bad)


def test_exit_codes_ride_on_the_errors() -> None:
    assert Escalated("x").exit_code == EXIT_ESCALATE != 0
    assert RankExcluded("x").exit_code == EXIT_EXCLUDED
