"""Run the project's CLIs as subprocesses, in their own process group, never leaking them."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.env import WorkerEnv

SRC = Path(__file__).resolve().parents[1] / "src"
VENV_BIN = Path(sys.executable).parent
LAUNCHER = [sys.executable, "-m", "unbroken.launcher.cli"]


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
    """Run ``cmd`` (in ``cwd``) to completion; on timeout kill its whole process group and fail.
    ``python -m unbroken.launcher.cli ...`` goes through the launch server (``launchpad``)."""
    env = env or worker_env()
    if cmd[:3] == LAUNCHER and (pad := launchpad(env)) is not None:
        return pad.run(cmd[3:], env=env, cwd=cwd or Path.cwd(), timeout_s=timeout_s)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
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


class Launchpad:
    """This pytest process's launch server (``tests/launchpad.py``), started on first use."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="unbroken-launchpad-"))
        self.path = str(self.dir / "sock")
        self.env = worker_env()
        self.log = open(self.dir / "log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "launchpad.py"), self.path],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the launch server did not start: see {self.dir}/log")
            time.sleep(0.02)
        atexit.register(self.close)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, args: list[str], *, env: dict[str, str], cwd: Path, timeout_s: float) -> Result:
        from launchpad import recv, send

        r, w = os.pipe()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            try:
                send(conn, {"args": args, "env": env, "cwd": str(cwd)}, [w])
            finally:
                os.close(w)
            started = recv(conn)[0]
            assert started, f"the launch server did not start {args}: see {self.dir}/log"
            pid = started["pid"]
            out = bytearray()
            deadline = time.monotonic() + timeout_s
            try:
                while select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    chunk = os.read(r, 1 << 16)
                    if not chunk:
                        break
                    out += chunk
                else:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    text = out.decode(errors="replace")
                    raise AssertionError(
                        f"{args} timed out after {timeout_s}s; output:\n{text[-4000:]}"
                    )
                ended = recv(conn)[0]
                assert ended, f"the launch server lost {args}: see {self.dir}/log"
                returncode = ended["returncode"]
            finally:
                os.close(r)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # stragglers of the group, if any
        text = out.decode(errors="replace").replace("\r\n", "\n")
        return Result(returncode, text)


_PAD: list[Launchpad] = []


def _at_start(env: dict[str, str]) -> dict[str, str]:
    """What an interpreter reads from its environment as it starts (``sys.path`` from
    ``PYTHONPATH``, the hash seed, ...) and the thread count torch's import takes."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") or k == "OMP_NUM_THREADS"}


def launchpad(env: dict[str, str]) -> Launchpad | None:
    """The launch server, unless ``UNBROKEN_TEST_LAUNCHPAD=0`` or an interpreter started with
    ``env`` would differ from the server's (see ``_at_start``)."""
    if os.environ.get("UNBROKEN_TEST_LAUNCHPAD", "1") == "0":
        return None
    if not _PAD:
        _PAD.append(Launchpad())
    pad = _PAD[0]
    return pad if _at_start(env) == _at_start(pad.env) else None


def launchpad_pid() -> int | None:
    return _PAD[0].proc.pid if _PAD else None
