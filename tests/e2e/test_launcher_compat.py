"""unbroken-run as a drop-in for torchrun: an unmodified env:// script, PET_* defaults,
--no-python, redirects and tee."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from procs import run, unbroken_run_cmd, worker_env

WORKERS = Path(__file__).resolve().parents[1] / "workers_launcher"
SCRIPT = WORKERS / "env_dump.py"


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_unmodified_script_gets_torchruns_environment(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cmd = unbroken_run_cmd(tmp_path, nproc=2, steps=None, target=[str(SCRIPT), str(out)])
    cmd.remove("--nproc-per-node")
    cmd.remove("2")
    env = worker_env(PET_NPROC_PER_NODE="2", PET_MAX_RESTARTS="3")  # the operators' defaults
    res = run(cmd, timeout_s=180, env=env)
    assert res.returncode == 0, res.output[-3000:]
    records = _records(out, 2)
    for rank, rec in enumerate(records):
        e = rec["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["ROLE_RANK"]) == (str(rank),) * 3
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["ROLE_WORLD_SIZE"]) == ("2",) * 3
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"], e["ROLE_NAME"]) == ("0", "1", "default")
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert (e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "3")
        assert e["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
        assert e["OMP_NUM_THREADS"] == "1" and e["UNBROKEN_ROUND"] == "0"
        assert Path(e["UNBROKEN_RUN_DIR"]) == tmp_path.resolve()
        assert e["UNBROKEN_HEARTBEAT_ADDR"].startswith("127.0.0.1:")
        assert e["UNBROKEN_STORE_ADDR"].startswith("127.0.0.1:")
        assert rec["argv"] == [str(SCRIPT), str(out)]
        assert rec["path0"] == str(WORKERS)  # as `python script.py` sets it
        assert rec["all_reduce"] == 3.0
    assert records[0]["env"]["MASTER_PORT"] == records[1]["env"]["MASTER_PORT"]
    assert "hello from rank 0" in res.output and "error line from rank 1" in res.output


def test_no_python_with_redirects_and_tee(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=2,
        steps=None,
        target=[sys.executable, str(SCRIPT), str(out)],
        launcher_args=["--no_python", "--log-dir", str(logs), "-r", "3", "--tee", "0:1"],
    )
    res = run(cmd, timeout_s=180)
    assert res.returncode == 0, res.output[-3000:]
    assert [r["all_reduce"] for r in _records(out, 2)] == [3.0, 3.0]
    # <log_dir>/<run id>/attempt_<round>/<rank>/{stdout,stderr}.log, as torchrun lays them out
    files = {p.relative_to(logs).as_posix(): p.read_text() for p in logs.rglob("*.log")}
    [run_logs] = logs.iterdir()  # the run id: the run dir's name and this launch's own id
    assert run_logs.name.startswith(f"{tmp_path.name}-")
    prefix = f"{run_logs.name}/attempt_0"
    assert "hello from rank 1" in files[f"{prefix}/1/stdout.log"]
    assert "error line from rank 0" in files[f"{prefix}/0/stderr.log"]
    assert "[default0]:hello from rank 0" in res.output  # local rank 0's stdout is teed
    assert "hello from rank 1" not in res.output and "error line" not in res.output


def test_bad_flags_exit_2(tmp_path: Path) -> None:
    cmd = unbroken_run_cmd(
        tmp_path,
        nproc=1,
        steps=None,
        target=[str(SCRIPT)],
        launcher_args=["--ft-steady-timeout-s", "0.1", "--ft-heartbeat-interval-s", "1"],
    )
    res = run(cmd, timeout_s=60)
    assert res.returncode == 2
    assert "heartbeat_interval_s" in res.output


def test_a_second_launch_into_a_used_run_dir_is_refused_unless_it_resumes(tmp_path: Path) -> None:
    """One job per run directory: a later standalone launch is another job (its own run id),
    refused with the owner named (exit 2, the first run's ledger untouched); --ft-resume
    continues the first run under its run id."""
    out = tmp_path / "out"
    out.mkdir()

    def launch(*extra: str):
        cmd = unbroken_run_cmd(
            tmp_path / "run",
            nproc=1,
            steps=None,
            target=[str(SCRIPT), str(out)],
            launcher_args=list(extra),
        )
        return run(cmd, timeout_s=120)

    def runs() -> set[str]:
        events = tmp_path / "run" / "events"
        return {
            json.loads(line)["run"]
            for p in events.glob("*.jsonl")
            for line in p.read_text().splitlines()
        }

    assert launch().returncode == 0
    [first] = runs()
    ledger = sorted((tmp_path / "run" / "events").glob("*.jsonl"))
    before = [p.read_bytes() for p in ledger]
    refused = launch()
    assert refused.returncode == 2, refused.output[-2000:]
    assert f"belongs to job {first!r}" in refused.output and "--ft-resume" in refused.output
    assert [p.read_bytes() for p in ledger] == before
    resumed = launch("--ft-resume")
    assert resumed.returncode == 0, resumed.output[-2000:]
    assert runs() == {first}
