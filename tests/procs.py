"""Run the project's CLIs as subprocesses, in their own process group, never leaking them."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launchpad import CLIENT, served_argv
from unbroken.env import WorkerEnv

SRC = Path(__file__).resolve().parents[1] / "src"
VENV_BIN = Path(sys.executable).parent
LAUNCHER = [sys.executable, "-m", "unbroken.launcher.cli"]
TORCHRUN = str(VENV_BIN / "torchrun")


def _served(cmd: list[str], *, code: bool = False) -> tuple[str, list[str]] | None:
    """The module (or script) and arguments of ``cmd`` when the launch server can run it
    (``code``: ``python -c`` too, see ``launchpad.served_argv``)."""
    if cmd[:1] == [TORCHRUN]:
        return "torch.distributed.run", cmd[1:]
    served = served_argv(cmd, code=code)
    return None if served is None else (served[0], served[1:])


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
    ``python -m MODULE ...`` (MODULE one of ``launchpad.SERVED``), ``python SCRIPT.py ...`` and
    ``torchrun ...`` go through the launch server (``launchpad``)."""
    env = env or worker_env()
    served = _served(cmd)
    if served is not None and (pad := launchpad(env)) is not None:
        module, args = served
        return pad.run(args, env=env, cwd=cwd or Path.cwd(), timeout_s=timeout_s, module=module)
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
        out, _ = _communicate(proc, cmd, timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
    return Result(proc.returncode, out)


def popen(
    cmd: list[str], *, env: dict[str, str] | None = None, code: bool = False, **kw: object
) -> subprocess.Popen:
    """``subprocess.Popen(cmd, env=env, **kw)``; a command ``run`` would send to the launch
    server starts as ``padclient.py`` (a process of a few milliseconds that runs it from the
    server: its signals passed on, its exit status the client's, its session killed with the
    client). ``code``: ``python -c`` too (``launchpad.served_argv``)."""
    env = env or worker_env()
    served = _served(cmd, code=code)
    if served is not None and (pad := launchpad(env)) is not None:
        cmd = [sys.executable, "-S", "-E", CLIENT, pad.path, served[0], *served[1]]
    return subprocess.Popen(cmd, env=env, **kw)  # type: ignore[call-overload]


def capture(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` through ``popen`` (``python -c``
    included): its stdout and stderr apart; on timeout its process group is killed and the
    test fails."""
    proc = popen(
        cmd,
        env=env,
        code=True,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err = _communicate(proc, cmd, timeout_s)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _communicate(proc: subprocess.Popen, cmd: list[str], timeout_s: float) -> tuple[str, str]:
    """``proc.communicate()``; after ``timeout_s`` its process group is killed and the test
    fails, with what it wrote."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout_s}s; output:\n{out[-4000:]}") from e


def python_shim(directory: Path) -> Path:
    """An executable ``python`` in ``directory``, for a script that runs ``$PY ARGS``: with
    ``ARGS`` that ``run`` would send to the launch server it runs as ``padclient.py``, else it
    is this Python. The environment is the script's (give it ``worker_env()``'s)."""
    pad = launchpad(worker_env())
    tail = "" if pad is None else f" -S -E {shlex.quote(CLIENT)} --python {shlex.quote(pad.path)}"
    path = directory / "python"
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)}{tail} "$@"\n')
    path.chmod(0o755)
    return path


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

    def start(self, args: list[str], *, env: dict[str, str], cwd: Path, module: str) -> Launched:
        """Start ``python -m module args`` (``module`` a script's path: ``python module args``)
        from the server, its output to a pipe of ours."""
        from launchpad import recv, send

        r, w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            try:
                send(conn, {"module": module, "args": args, "env": env, "cwd": str(cwd)}, [w])
            finally:
                os.close(w)
            started = recv(conn)[0]
            assert started, f"the launch server did not start {args}: see {self.dir}/log"
        except BaseException:
            conn.close()
            os.close(r)
            raise
        return Launched(started["pid"], conn, r, f"{module} {args}", self.dir / "log")

    def run(
        self,
        args: list[str],
        *,
        env: dict[str, str],
        cwd: Path,
        timeout_s: float,
        module: str = "unbroken.launcher.cli",
    ) -> Result:
        return self.start(args, env=env, cwd=cwd, module=module).result(timeout_s)


class Launched:
    """A launch from the server: ``pid`` (its session), then ``result``, or ``close``."""

    def __init__(self, pid: int, conn: socket.socket, out: int, what: str, log: Path) -> None:
        self.pid = pid
        self._conn, self._out, self._what, self._log = conn, out, what, log

    def close(self) -> None:
        """Kill its session (stragglers, or all of it when it has not ended) and let go of
        its output and connection; a second call does nothing."""
        if self._out >= 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            os.close(self._out)
            self._conn.close()
            self._out = -1

    def result(self, timeout_s: float) -> Result:
        """Its exit status and output, once it ends; after ``timeout_s`` it is killed and the
        test fails. Its session's stragglers are killed either way."""
        from launchpad import recv

        out = bytearray()
        deadline = time.monotonic() + timeout_s
        try:
            while select.select([self._out], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(self._out, 1 << 16)
                if not chunk:
                    break
                out += chunk
            else:
                self.close()
                text = out.decode(errors="replace")
                raise AssertionError(
                    f"{self._what} timed out after {timeout_s}s; output:\n{text[-4000:]}"
                )
            ended = recv(self._conn)[0]
            assert ended, f"the launch server lost {self._what}: see {self._log}"
        finally:
            self.close()
        text = out.decode(errors="replace").replace("\r\n", "\n")
        return Result(ended["returncode"], text)


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


def _pad_path() -> str | None:
    pad = launchpad(worker_env())
    return None if pad is None else pad.path


def route_pods() -> None:
    """Start the emulated pods' ``python -m`` containers from the launch server too
    (``launchpad.route_pods``)."""
    from launchpad import route_pods as route

    route(_pad_path, worker_env()["OMP_NUM_THREADS"])


def launchpad_pid() -> int | None:
    return _PAD[0].proc.pid if _PAD else None
