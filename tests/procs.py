"""Run the project's CLIs as subprocesses, in their own process group, never leaking them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from unbroken.env import WorkerEnv

SRC = Path(__file__).resolve().parents[1] / "src"
VENV_BIN = Path(sys.executable).parent


@dataclass
class Result:
    returncode: int
    output: str

    def hashes(self) -> list[str]:
        return re.findall(r"final_state_sha256=([0-9a-f]{64})", self.output)


def one_rank(run_id: str) -> WorkerEnv:
    """A world of one rank, no launcher, no agent store; ``run_id`` names its run."""
    return WorkerEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        group_rank=0,
        master_addr=None,
        master_port=None,
        restart_count=0,
        run_id=run_id,
        use_agent_store=False,
        run_dir=None,
    )


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run(
    cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Result:
    """Run ``cmd`` (in ``cwd``) to completion; on timeout kill its whole process group and fail."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env or worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout_s}s; output:\n{out[-4000:]}") from e
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
    return Result(proc.returncode, out)


def train_cmd(
    run_dir: Path,
    *,
    nproc: int | None,
    steps: int,
    extra: list[str] = (),
    torchrun_args: list[str] = (),
) -> list[str]:
    args = [
        "-m",
        "unbroken.workload.train",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--seq-len",
        "32",
        *extra,
    ]
    if nproc is None:
        return [sys.executable, *args]
    return [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--monitor-interval",
        "0.1",
        *torchrun_args,
        *args,
    ]


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


def unbroken_run_cmd(
    run_dir: Path,
    *,
    nproc: int,
    steps: int | None,
    extra: list[str] = (),
    launcher_args: list[str] = (),
    target: list[str] = ("-m", "unbroken.workload.train"),
    standalone: bool = True,
) -> list[str]:
    """``unbroken-run`` (as ``python -m unbroken.launcher.cli``) running ``target``.

    With the reference script (the default target) and ``steps`` set, the script gets
    ``--run-dir run_dir --steps N --seq-len 32``; the launcher always gets ``--ft-run-dir``.
    """
    script = list(target)
    if steps is not None:
        script += ["--run-dir", str(run_dir), "--steps", str(steps), "--seq-len", "32"]
    return [
        sys.executable,
        "-m",
        "unbroken.launcher.cli",
        *(["--standalone"] if standalone else []),
        "--nproc-per-node",
        str(nproc),
        "--monitor-interval",
        "0.05",
        "--ft-run-dir",
        str(run_dir),
        *launcher_args,
        *script,
        *extra,
    ]


def children(pid: int) -> list[int]:
    """Live (non-zombie) child processes of ``pid``, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out
