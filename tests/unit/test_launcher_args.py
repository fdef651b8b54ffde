"""unbroken-run's command line: torchrun's flags in both spellings, PET_* defaults, --ft-*, YAML."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from unbroken.launcher import args as largs
from unbroken.launcher.config import DEFAULT_PRELOAD


def parse(*argv: str) -> tuple[largs.JobSpec, object]:
    spec, cfg, _ = largs.parse([*argv, "train.py", "--lr", "1"])
    return spec, cfg


@pytest.mark.parametrize("dash", ["-", "_"])
def test_both_spellings(dash: str) -> None:
    spec, _ = parse(
        f"--nproc{dash}per{dash}node",
        "3",
        f"--max{dash}restarts",
        "4",
        f"--monitor{dash}interval",
        "0.5",
        f"--rdzv{dash}backend",
        "c10d",
        f"--rdzv{dash}endpoint",
        "h:1234",
        f"--rdzv{dash}id",
        "job",
        f"--rdzv{dash}conf",
        "join_timeout=5,is_host=0",
        f"--log{dash}dir",
        "/x",
        f"--node{dash}rank",
        "1",
        f"--local{dash}addr",
        "10.0.0.1",
    )
    assert (spec.nproc_per_node, spec.max_restarts, spec.monitor_interval_s) == (3, 4, 0.5)
    assert (spec.rdzv_endpoint, spec.rdzv_id, spec.is_host) == ("h:1234", "job", False)
    assert spec.rdzv_conf == {"join_timeout": "5", "is_host": "0"}
    assert (spec.log_dir, spec.node_rank, spec.local_addr) == (Path("/x"), 1, "10.0.0.1")
    assert spec.entry == largs.Entrypoint(kind="script", target="train.py", args=("--lr", "1"))


def test_pet_environment_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_NNODES", "1:3")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "store:29400")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    monkeypatch.setenv("PET_STANDALONE", "0")
    spec, _ = parse()
    assert (spec.nproc_per_node, spec.min_nodes, spec.max_nodes) == (4, 1, 3)
    assert (spec.rdzv_endpoint, spec.max_restarts, spec.standalone) == ("store:29400", 7, False)
    spec, _ = parse("--max-restarts", "1")
    assert spec.max_restarts == 1


def test_standalone_and_single_node_static_are_c10d_on_localhost() -> None:
    for argv in (["--standalone", "--rdzv-id", "ignored"], []):
        spec, _ = parse(*argv)
        assert (spec.rdzv_endpoint, spec.is_host, spec.standalone) == ("127.0.0.1:0", True, True)
        assert spec.rdzv_id != "ignored" and len(spec.rdzv_id) == 36  # a fresh uuid, as torchrun


def test_static_multi_node_uses_master_addr_and_node_rank() -> None:
    spec, _ = parse(
        "--nnodes", "2", "--master-addr", "n0", "--master-port", "1234", "--node-rank", "1"
    )
    assert (spec.rdzv_endpoint, spec.is_host, spec.min_nodes) == ("n0:1234", False, 2)
    spec, _ = parse("--nnodes", "2", "--master-addr", "n0", "--node-rank", "0")
    assert (spec.rdzv_endpoint, spec.is_host) == ("n0:29500", True)


@pytest.mark.parametrize(
    "argv",
    [
        ["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1"],
        ["--rdzv-backend", "c10d"],
        ["--nnodes", "3:2"],
        ["--nnodes", "x"],
        ["--max-restarts", "-1"],
        ["-m", "--no-python"],
        ["--redirects", "9"],
        ["--rdzv-conf", "novalue"],
        ["--nproc-per-node", "many"],
        ["--signals-to-handle", "SIGNOPE"],
    ],
)
def test_bad_torchrun_flags_are_value_errors(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        parse(*argv)


def test_entrypoints_and_their_cold_command_lines() -> None:
    spec, _ = parse("-m")
    assert spec.entry.kind == "module"
    assert spec.entry.cold_argv() == [sys.executable, "-u", "-m", "train.py", "--lr", "1"]
    spec, _ = parse("--no-python")
    assert spec.entry.cold_argv() == ["train.py", "--lr", "1"]
    spec, _ = parse()
    assert spec.entry.cold_argv() == [sys.executable, "-u", "train.py", "--lr", "1"]


def test_redirect_and_tee_maps() -> None:
    spec, _ = parse("-r", "3", "-t", "0:1,1:2")
    assert [spec.std_for("redirects", lr) for lr in range(3)] == [3, 3, 3]
    assert [spec.std_for("tee", lr) for lr in range(3)] == [1, 2, 0]


def test_ft_flags_override_yaml_which_overrides_defaults(tmp_path: Path) -> None:
    yaml_file = tmp_path / "ft.yaml"
    yaml_file.write_text(
        "steady_timeout_s: 30\nwarm_pool: false\npreload: [torch]\nmax_no_progress_restarts: 5\n"
    )
    _, cfg = parse(
        "--ft-config",
        str(yaml_file),
        "--ft-steady-timeout-s",
        "20",
        "--ft_max_no_progress_restarts",
        "6",
        "--ft-run-dir",
        "runs/x",
    )
    assert (cfg.steady_timeout_s, cfg.warm_pool, cfg.preload) == (20.0, False, ("torch",))
    assert (cfg.max_no_progress_restarts, cfg.run_dir) == (6, Path("runs/x"))
    _, cfg = parse("--ft-config", str(yaml_file), "--ft-warm-pool", "--ft-preload", "a,b.c")
    assert (cfg.warm_pool, cfg.preload) == (True, ("a", "b.c"))
    _, cfg = parse()
    assert cfg.preload == DEFAULT_PRELOAD and cfg.warm_pool and cfg.hang_detection


def test_shutdown_timeout_is_the_stop_grace_unless_ours_is_given() -> None:
    assert parse("--shutdown-timeout", "7")[1].stop_grace_s == 7.0
    assert parse("--shutdown-timeout", "7", "--ft-stop-grace-s", "1")[1].stop_grace_s == 1.0


def test_every_config_field_has_a_flag() -> None:
    from unbroken.launcher.config import FIELDS

    text = largs.build_parser().format_help()
    for name in FIELDS:
        assert "--ft-" + name.replace("_", "-") in text


def test_bad_ft_values_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--ft-steady-timeout-s"):
        parse("--ft-steady-timeout-s", "soon")
