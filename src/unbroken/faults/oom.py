"""A real OOM kill: move this process into a child memory cgroup with a limit, then grow.

Where the process may create a child of its own memory cgroup (cgroup v1 ``memory`` or v2
``memory.max``; as root in a container, usually), the kernel's OOM killer ends it with SIGKILL,
exactly as in production. Elsewhere the fault is emulated: grow to the limit, then SIGKILL
itself; the ledger record says which (``mechanism``).

The child cgroup cannot be removed by the process inside it; a small watcher process started
beforehand removes it once the process is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """(directory, version) of this process's memory cgroup, if writable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = ROOT / "memory" / path.lstrip("/")
            if (d / "memory.limit_in_bytes").exists() and os.access(d, os.W_OK):
                return d, "v1"
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            for base in (ROOT / "unified", ROOT):
                d = base / path.lstrip("/")
                ctl = d / "cgroup.controllers"
                if ctl.exists() and os.access(d, os.W_OK) and "memory" in ctl.read_text().split():
                    return d, "v2"
    return None


def mechanism() -> str:
    """ "cgroup-v1" / "cgroup-v2" when a real OOM kill is possible here, else "emulated"."""
    own = _own_memory_cgroup()
    return f"cgroup-{own[1]}" if own else "emulated"


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _enter_limited_cgroup(limit_mb: int) -> bool:
    own = _own_memory_cgroup()
    if own is None:
        return False
    parent, version = own
    child = parent / f"unbroken-oom-{os.getpid()}"
    try:
        child.mkdir(exist_ok=True)
        limit = _rss_bytes() + limit_mb * (1 << 20)
        if version == "v1":
            (child / "memory.limit_in_bytes").write_text(str(limit))
            memsw = child / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit))  # no escape into swap
        else:
            (child / "memory.max").write_text(str(limit))
            swap = child / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        # The watcher removes the cgroup once this process is gone (it cannot do it itself).
        subprocess.Popen(
            [
                "sh",
                "-c",
                f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 0.05; done; "
                f"rmdir '{child}' 2>/dev/null",
            ],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        (child / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return False
    return True


def oom_kill(limit_mb: int) -> None:
    """Grow memory until the kernel kills this process (or, emulated, kill it at the limit)."""
    real = _enter_limited_cgroup(limit_mb)
    hog = []
    # Real: the kernel kills us somewhere past limit_mb. Emulated (or a limit that did not
    # hold): stop at limit_mb (x4 as a safety margin when real) and SIGKILL ourselves.
    for _ in range(max(1, limit_mb) * (4 if real else 1)):
        hog.append(bytearray(1 << 20))  # zero-filled, so really resident
    os.kill(os.getpid(), signal.SIGKILL)
