"""LauncherConfig: values, timeout ordering, YAML."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.launcher import config as lconfig
from unbroken.launcher.config import LauncherConfig


def test_defaults_are_valid_and_documented() -> None:
    cfg = LauncherConfig()
    assert cfg.heartbeat_interval_s < cfg.steady_timeout_s < cfg.rdzv_timeout_s
    assert cfg.initial_timeout_s < cfg.rdzv_timeout_s
    assert set(lconfig.field_docs()) == set(lconfig.FIELDS)
    assert cfg.error_path(Path("/r")) == Path("/r/error.json")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"heartbeat_interval_s": 5, "steady_timeout_s": 5}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": 2, "initial_timeout_s": 1}, "heartbeat_interval_s"),
        ({"steady_timeout_s": 700}, "rdzv_timeout_s"),
        ({"initial_timeout_s": 20, "rdzv_timeout_s": 10, "steady_timeout_s": 5}, "rdzv"),
        ({"heartbeat_interval_s": 0}, "> 0"),
        ({"auto_timeout_factor": 1.0}, "auto_timeout_factor"),
        ({"stop_grace_s": -1}, "stop_grace_s"),
        ({"max_no_progress_restarts": -1}, "max_no_progress_restarts"),
        ({"preload": ("torch", "not a module")}, "preload"),
        ({"node_checks": ("shm", "gloo")}, "'gloo' is not a node check; choose from checkpoint"),
        ({"node_checks": ("checkpoint",)}, "node_check_dir is not set"),
    ],
)
def test_bad_values_raise_value_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LauncherConfig(**kwargs)


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = LauncherConfig()
    with pytest.raises(AttributeError):
        cfg.stop_grace_s = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        LauncherConfig(None)  # type: ignore[misc]


def test_yaml_values_are_coerced_and_unknown_keys_rejected(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        "run_dir: runs/a\nheartbeat_interval_s: 1\nauto_timeouts: true\npreload: torch,numpy\n"
    )
    cfg = lconfig.build(yaml_path=good)
    assert (cfg.run_dir, cfg.heartbeat_interval_s) == (Path("runs/a"), 1.0)
    assert (cfg.auto_timeouts, cfg.preload) == (True, ("torch", "numpy"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("steady_timeout: 3\n")
    with pytest.raises(ValueError, match="unknown keys"):
        lconfig.build(yaml_path=bad)
    bad.write_text("warm_pool: 1\n")
    with pytest.raises(ValueError, match="true or false"):
        lconfig.build(yaml_path=bad)
    with pytest.raises(FileNotFoundError):
        lconfig.build(yaml_path=tmp_path / "missing.yaml")


def test_node_checks_come_from_the_cli_as_a_list() -> None:
    from unbroken.launcher import args as largs

    _, cfg, _ = largs.parse(
        [
            "--standalone",
            "--ft-node-checks",
            "checkpoint, clock",
            "--ft-node-check-dir",
            "/c",
            "x.py",
        ]
    )
    assert cfg.node_checks == ("checkpoint", "clock") and cfg.node_check_dir == Path("/c")
