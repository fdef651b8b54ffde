"""Property-based fuzzing of unbroken-run's command line and ``--ft-config`` YAML: every value
of every flag either parses into a valid ``JobSpec``/``LauncherConfig`` or is refused with a
ValueError (argparse's own usage exit 2 for a malformed command line), never another
exception; non-finite numbers (nan, inf) and fractional integers are refused."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.launcher import args as largs
from unbroken.launcher import cli as lcli
from unbroken.launcher import config as lconfig

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# torchrun's value flags and ours (the nproc "gpu"/"auto" values would import torch: left out)
VALUE_FLAGS = [
    "--nnodes",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--max-restarts",
    "--monitor-interval",
    "--role",
    "--redirects",
    "--tee",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--signals-to-handle",
    "--shutdown-timeout",
    *(
        "--ft-" + name.replace("_", "-")
        for name in lconfig.FIELDS
        if lconfig.kind_of(name) != "bool"
    ),
]
SWITCHES = ["--standalone", "-m", "--no-python", "--ft-warm-pool", "--ft-no-hang-detection"]
tokens = st.one_of(
    st.sampled_from(["0", "1", "-1", "2:1", "1:2", "nan", "inf", "-inf", "1e309", "1.5", ""]),
    st.sampled_from(["c10d", "static", "h:1", "h:x", ":1", "join_timeout=x", "a=b,c", "0:3,1:9"]),
    st.sampled_from(["SIGTERM", "SIGFOO", "torch,", "a..b", "x" * 300]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
    st.text(max_size=6),
)
argvs = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(VALUE_FLAGS), tokens).map(list),
        st.sampled_from(SWITCHES).map(lambda s: [s]),
    ),
    max_size=4,
).map(lambda pairs: [t for p in pairs for t in p] + ["train.py"])


def _no_job(*args: object) -> int:
    raise AssertionError("the flags parsed: a job would start")


def _nproc(argv: list[str]) -> list[str]:
    return ["--nproc-per-node", "1", *argv]


@FUZZ
@given(argvs)
@pytest.mark.slow
def test_parse_raises_only_value_error_or_usage_exit(argv: list[str]) -> None:
    try:
        spec, cfg, _ = largs.parse(_nproc(argv))
    except (ValueError, FileNotFoundError):
        return
    except SystemExit as e:  # argparse: a malformed command line
        assert e.code == 2
        return
    for value in (spec.monitor_interval_s, cfg.stop_grace_s, cfg.rdzv_timeout_s):
        assert math.isfinite(value)


yaml_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=6),
    ),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=2)
    ),
    max_leaves=6,
)
configs = st.dictionaries(
    st.sampled_from(sorted(lconfig.FIELDS)) | st.integers() | st.text(max_size=4),
    yaml_values,
    max_size=4,
)


@FUZZ
@given(configs | yaml_values)
@pytest.mark.slow
def test_ft_config_raises_only_value_error(
    tmp_path_factory: pytest.TempPathFactory, obj: object
) -> None:
    path = tmp_path_factory.mktemp("cfg") / "ft.yaml"
    path.write_text(yaml.safe_dump(obj))
    with contextlib.suppress(ValueError):
        cfg = lconfig.build(yaml_path=path)
        assert all(math.isfinite(v) for v in vars(cfg).values() if isinstance(v, float)), cfg


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--ft-stop-grace-s", "nan"], "finite"),
        (["--ft-auto-timeout-factor", "inf"], "finite"),
        (["--shutdown-timeout", "nan"], "finite"),
        (["--monitor-interval", "inf"], "finite"),
        (["--ft-max-no-progress-restarts", "1.5"], "integer"),
        (["--rdzv-conf", "join_timeout=x"], "join_timeout"),
        (["--rdzv-conf", "keep_alive_max_attempt=0"], "keep_alive_max_attempt"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:port"], "rdzv-endpoint"),
        (["--node-rank", "-1", "--nnodes", "2", "--master-port", "1"], "node-rank"),
    ],
)
def test_bad_flags_get_exit_2_and_a_message(
    argv: list[str], needle: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lcli, "run", _no_job)
    assert lcli.main(_nproc(argv) + ["train.py"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("stop_grace_s: .nan\n", "finite"),
        ("metrics_port: 80.5\n", "integer"),
        ("run_dir: [a]\n", "path"),
        ("preload: [1, 2]\n", "module names"),
        ("1: 2\nfoo: 3\n", "unknown keys"),
    ],
)
def test_bad_ft_config_gets_exit_2(
    tmp_path: Path, text: str, needle: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lcli, "run", _no_job)
    path = tmp_path / "ft.yaml"
    path.write_text(text)
    assert lcli.main(["--nproc-per-node", "1", "--ft-config", str(path), "train.py"]) == 2
    assert needle in capsys.readouterr().err
