"""Starting a node's workers: n worker processes forked from the warm pool (the real
``launcher.zygote.Zygote`` and ``bootstrap``), against n cold starts of the same preload.

Stood in: the worker's training script, a one-liner that records when it runs (the agent's
``WorkerGroup`` around the pool is not needed to fork). The caller is made a child subreaper,
as the agent is, so each worker is re-parented to it. Measured, the median of a few trials:

- warm: the spawn request -> the last of the n workers running its script, forked then;
- standby: the same from the pool's standbys (what a restart gets: the pool forks them while
  it is idle, ``launcher.zygote``), each trial once they are there;
- cold: ``Popen`` of n interpreters that import the warm pool's preload, then run the same
  script -> the last of them running it (what a restart pays without the pool).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TRIALS_WARM = 5
TRIALS_STANDBY = 5
TRIALS_COLD = 2
_SCRIPT = "import sys, time\nopen(sys.argv[1], 'w').write(repr(time.time()))\n"


def _await(paths: list[Path], timeout_s: float) -> float:
    """When the last of ``paths`` was written (their content), waiting up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() and p.stat().st_size for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not run within {timeout_s} s")
        time.sleep(0.001)
    return max(float(p.read_text()) for p in paths)


def _reap(pids: list[int], *, kill: bool = False) -> None:
    """Reap ``pids`` (this process's children); with ``kill`` (the wait for them failed),
    SIGKILL them first: no worker outlives the benchmark."""
    for pid in pids:
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _children() -> set[int]:
    """This process's children (Linux's /proc children list)."""
    me = os.getpid()
    return {int(x) for x in Path(f"/proc/{me}/task/{me}/children").read_text().split()}


def measure(
    n: int,
    *,
    trials_warm: int = TRIALS_WARM,
    trials_standby: int = TRIALS_STANDBY,
    trials_cold: int = TRIALS_COLD,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    from unbroken.launcher import bootstrap
    from unbroken.launcher.config import DEFAULT_PRELOAD
    from unbroken.launcher.zygote import Zygote

    if not bootstrap.set_child_subreaper():
        raise RuntimeError("cannot become a child subreaper: the warm pool needs it (Linux)")
    env = {"OMP_NUM_THREADS": "1"} | dict(os.environ)  # as the agent sets it for a node's workers
    with tempfile.TemporaryDirectory(prefix="unbroken-spawn-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(_SCRIPT)
        outs = [Path(tmp) / f"ran-{i}" for i in range(n)]

        def clear() -> None:
            for p in outs:
                p.unlink(missing_ok=True)

        zygote = Zygote(DEFAULT_PRELOAD, env=env)
        try:
            if not zygote.wait_ready(timeout_s):
                raise RuntimeError("the warm pool did not come up")
            warm: list[float] = []
            standby: list[float] = []
            for trial in range(trials_warm + trials_standby):
                clear()
                if trial >= trials_warm:  # wait for the pool's standbys (forked when idle)
                    deadline = time.monotonic() + timeout_s
                    while len(_children() - {zygote.pid}) < n:
                        if time.monotonic() > deadline:
                            raise RuntimeError("the warm pool made no standbys")
                        time.sleep(0.005)
                reqs = [
                    {
                        "kind": "script",
                        "target": str(script),
                        "args": [str(p)],
                        "cwd": tmp,
                        "env": env,
                        "stdout": None,
                        "stderr": None,
                    }
                    for p in outs
                ]
                t0 = time.time()
                pids = zygote.spawn(reqs, timeout_s=timeout_s)
                try:
                    took = _await(outs, timeout_s) - t0
                except BaseException:
                    _reap(pids, kill=True)
                    raise
                _reap(pids)
                if trial < trials_warm:
                    warm.append(took)
                elif zygote.standby == n:
                    standby.append(took)
                else:
                    raise RuntimeError(f"{n - zygote.standby} standby(s) missing at the start")
        finally:
            zygote.close()
            _reap(list(_children()))  # the standbys left, which end with the pool
        preload = "; ".join(f"import {m}" for m in DEFAULT_PRELOAD)
        code = (
            f"{preload}\nimport sys, runpy\nsys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        cold = []
        for _ in range(trials_cold):
            clear()
            t0 = time.time()
            procs = [
                subprocess.Popen([sys.executable, "-c", code, str(script), str(p)], env=env)
                for p in outs
            ]
            try:
                cold.append(_await(outs, timeout_s) - t0)
            except BaseException:
                for proc in procs:
                    proc.kill()
                raise
            finally:
                for proc in procs:
                    proc.wait()
    return {
        "workers": n,
        "warm_spawn_s": statistics.median(warm),
        "standby_spawn_s": statistics.median(standby),
        "cold_spawn_s": statistics.median(cold),
        "warm_trials": warm,
        "standby_trials": standby,
        "cold_trials": cold,
    }
