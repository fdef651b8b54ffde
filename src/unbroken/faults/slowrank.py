"""A slow rank: its process gets only ``cpu`` of one CPU for ``seconds``, then all of it again.

What thermal throttling (or a noisy neighbour) looks like to training: the rank computes, only
slower, and never stops. Mechanisms, best first (``mechanism()`` says which one ``slow`` uses):

- ``cgroup-v1`` / ``cgroup-v2``: where the process may create a child of its own cpu cgroup
  (v1 ``cpu.cfs_quota_us``; v2 ``cpu.max``, with the cpu controller enabled for children; as
  root in a container, usually), the process, every thread of it, moves into a child with a
  CFS quota of ``cpu`` x the period. The kernel makes its threads wait for quota in the run
  queue, which is what ``ledger.busy`` counts as busy: the straggler signal sees it.
- ``emulated``: elsewhere, a SIGSTOP/SIGCONT duty cycle (``cpu`` of every ``PERIOD_S`` running,
  the rest stopped). A stopped process is not runnable, so ``ledger.busy`` does not count
  that time: the rank is slowed as much, but the straggler signal cannot name it.

Either way a watcher process (started before the throttle, in its own session, so that it
outlives the rank) ends it: after ``seconds`` it moves every process of the child cgroup back
and removes the child (or sends SIGCONT a last time); it ends early, cleaning up the same way,
when the rank's process is gone. Nothing is left behind: no cgroup, no process, no stopped
rank. This module imports nothing but the standard library: the watcher runs it as a script
(``python -I slowrank.py``), which starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
"""CFS period of the child cgroup (the kernel's default)."""
PERIOD_S = 0.1
"""Duty cycle of the emulation."""
PREFIX = "unbroken-slow-"
"""Names of the child cgroups (``<PREFIX><pid>``)."""


def _cpu_cgroup(pid: int | str = "self") -> tuple[Path, str] | None:
    """(directory, "v1" | "v2") of a process's cpu cgroup, if a child with a quota can be made."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                d = ROOT / mount / path.lstrip("/")
                if (d / "cpu.cfs_quota_us").exists() and os.access(d, os.W_OK):
                    return d, "v1"
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if hier != "0" or controllers != "":
            continue
        for base in (ROOT / "unified", ROOT):
            d = base / path.lstrip("/")
            try:
                if "cpu" not in (d / "cgroup.controllers").read_text().split():
                    continue
                if not os.access(d, os.W_OK):
                    continue
                if "cpu" not in (d / "cgroup.subtree_control").read_text().split():
                    # Fails where d holds processes itself (cgroup v2's no-internal-process
                    # rule, the root excepted): then no child of d can have a cpu quota.
                    (d / "cgroup.subtree_control").write_text("+cpu")
            except OSError:
                continue
            return d, "v2"
    return None


def mechanism(pid: int | str = "self") -> str:
    """ "cgroup-v1" / "cgroup-v2" where a cpu quota can be put on the process, else "emulated"."""
    own = _cpu_cgroup(pid)
    return f"cgroup-{own[1]}" if own else "emulated"


def probe() -> tuple[str, str]:
    """Do what ``slow`` does to a process, short of moving one: make a child of this process's
    cpu cgroup, put a quota on it, remove it.

    Returns:
        ("cgroup-v1" | "cgroup-v2", the child's parent directory) when that worked, else
        ("emulated", why not): a slow-rank fault then stops and continues the process instead.
    """
    own = _cpu_cgroup()
    if own is None:
        return "emulated", "no writable cpu cgroup (v2 cpu.max or v1 cpu.cfs_quota_us) here"
    parent, version = own
    child = parent / f"{PREFIX}probe-{os.getpid()}"
    try:
        child.mkdir(exist_ok=True)
        try:
            _limit(child, version, 0.5)
        finally:
            child.rmdir()
    except OSError as e:
        return "emulated", f"cannot put a cpu quota on a child of {parent}: {e}"
    return f"cgroup-{version}", str(parent)


def _watcher(spec: dict[str, object]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).resolve()), json.dumps(spec)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )


def _limit(child: Path, version: str, cpu: float) -> None:
    quota = max(1000, round(cpu * PERIOD_US))
    if version == "v1":
        (child / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (child / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (child / "cpu.max").write_text(f"{quota} {PERIOD_US}")


def slow(pid: int, *, cpu: float, seconds: float, cgroup: bool = True) -> dict[str, object]:
    """Give process ``pid`` ``cpu`` (0 < cpu <= 1) of one CPU for ``seconds``; returns at once.

    ``cgroup=False`` forces the emulation. Returns what was done, for the ledger:
    ``mechanism``, ``watcher_pid`` and, in a cgroup, ``cgroup`` (the child's path). Raises
    ValueError for bad arguments, OSError when not even the watcher could be started."""
    if not 0 < cpu <= 1:
        raise ValueError(f"cpu must be in (0, 1], got {cpu!r}")
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    until = time.time() + seconds
    own = _cpu_cgroup(pid) if cgroup else None
    if own is not None:
        parent, version = own
        child = parent / f"{PREFIX}{pid}"
        try:
            child.mkdir(exist_ok=True)
            _limit(child, version, cpu)
            spec = {"pid": pid, "until": until, "child": str(child), "parent": str(parent)}
            watcher = _watcher(spec)
        except OSError:
            with contextlib.suppress(OSError):
                child.rmdir()
        else:
            try:
                (child / "cgroup.procs").write_text(str(pid))
            except OSError:
                watcher.kill()  # nothing moved: nothing to undo but the child
                watcher.wait()
                with contextlib.suppress(OSError):
                    child.rmdir()
            else:
                return {
                    "mechanism": f"cgroup-{version}",
                    "cgroup": str(child),
                    "watcher_pid": watcher.pid,
                }
    watcher = _watcher({"pid": pid, "until": until, "cpu": cpu})
    return {"mechanism": "emulated", "watcher_pid": watcher.pid}


# --- the watcher (a process of its own) ------------------------------------------------------
def _wait(pidfd: int | None, timeout_s: float) -> bool:
    """Sleep up to ``timeout_s``; True when the watched process ended meanwhile."""
    if pidfd is None:
        time.sleep(max(0.0, timeout_s))
        return False
    ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout_s))
    return bool(ready)


def _unlimit(child: Path) -> None:
    """Lift ``child``'s quota, so that nothing in it is left waiting for quota when it moves."""
    with contextlib.suppress(OSError):
        if (child / "cpu.cfs_quota_us").exists():
            (child / "cpu.cfs_quota_us").write_text("-1")
        else:
            (child / "cpu.max").write_text(f"max {PERIOD_US}")


def _restore(child: Path, parent: Path) -> None:
    """Lift ``child``'s quota, move every process of it back to ``parent`` and remove it
    (retrying while a process is still leaving it).

    The quota goes first: a thread moved out of a cgroup while the kernel holds it throttled
    there may otherwise wait for that cgroup's next refill, which never comes once the
    cgroup is gone."""
    _unlimit(child)
    deadline = time.monotonic() + 5.0
    while True:
        with contextlib.suppress(OSError):
            for p in (child / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # a process that just ended
                    (parent / "cgroup.procs").write_text(p)
        try:
            child.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return
        time.sleep(0.01)


def _watch(spec: dict[str, object]) -> None:
    pid, until = int(str(spec["pid"])), float(str(spec["until"]))
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (OSError, AttributeError):
        pidfd = None
    # A SIGTERM (a test's or a machine's shutdown) ends the window early, cleaning up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if "child" in spec:
        child, parent = Path(str(spec["child"])), Path(str(spec["parent"]))
        try:
            _wait(pidfd, until - time.time())
        finally:
            _restore(child, parent)
        return
    cpu = float(str(spec["cpu"]))
    try:
        while time.time() < until:
            if _wait(pidfd, min(cpu * PERIOD_S, until - time.time())):
                return
            if time.time() >= until:
                break
            os.kill(pid, signal.SIGSTOP)
            if _wait(pidfd, min((1 - cpu) * PERIOD_S, until - time.time())):
                return
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


if __name__ == "__main__":
    _watch(json.loads(sys.argv[1]))
