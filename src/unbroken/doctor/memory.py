"""The memory the staging takes: the node's memory against what the job stages, the memfd the
staging arena is, and /dev/shm (for data loaders and NCCL: the arena is not in it)."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
from pathlib import Path

from unbroken.doctor.config import PEER_REGIONS, Check, DoctorConfig, gb

SHM = Path("/dev/shm")


def _staging_text(cfg: DoctorConfig) -> str:
    regions = cfg.checkpoint_config().resident_regions
    per_rank = f"{regions} memory slot(s)" if cfg.memory_tier else "1 region (no memory tier)"
    if cfg.memory_tier and cfg.nnodes > 1:
        per_rank = f"({per_rank} + {PEER_REGIONS} peer replicas)"
    return (
        f"staging needs {gb(cfg.staging_bytes())} ({cfg.state_gb:g} GB x "
        f"{cfg.nproc_per_node} rank(s) x {per_rank})"
    )


SHM_MIN = 1 << 30
"""Least /dev/shm before the check warns: data loader workers that share tensors and NCCL's
intra-node transport put their buffers there (Docker's default is 64 MB)."""


def check_shm(cfg: DoctorConfig) -> Check:
    """/dev/shm is there and not tiny (data loaders, NCCL). The checkpoint staging is not in
    it: the arena is a memfd, on the kernel's own tmpfs, which /dev/shm's size does not limit
    (its pages count toward the node's and the pod's memory: ``check_memory``)."""
    try:
        st = os.statvfs(SHM)
    except OSError as e:
        return Check(
            "shm",
            "warn",
            f"no {SHM} ({e.strerror}): data loader workers that share tensors need it",
            f"mount a tmpfs on {SHM}",
        )
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    have = f"{SHM}: {gb(total)}, {gb(free)} free"
    if total < SHM_MIN:
        return Check(
            "shm",
            "warn",
            f"{have}: data loader workers that share tensors and NCCL need more",
            f"give {SHM} at least {gb(SHM_MIN)} (docker run --shm-size; Kubernetes: "
            "unbroken k8s render --shm-size)",
        )
    staged = "; the checkpoint staging is a memfd, not in it (see memory)" if cfg.state_gb else ""
    return Check("shm", "ok", have + staged)


def _cgroup_memory_limit() -> float | None:
    """This process's memory cgroup limit in bytes (v2 memory.max, v1 limit_in_bytes)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    root = Path("/sys/fs/cgroup")
    candidates = []
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if hier == "0" and controllers == "":
            candidates += [root / rel / "memory.max", root / "memory.max"]
        elif "memory" in controllers.split(","):
            candidates += [root / "memory" / rel / "memory.limit_in_bytes"]
            candidates += [root / "memory" / "memory.limit_in_bytes"]
    for c in candidates:
        with contextlib.suppress(OSError, ValueError):
            text = c.read_text().strip()
            if text != "max" and int(text) < 2**60:
                return float(text)
    return None


def _mem_available() -> float | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return None


def check_memory(cfg: DoctorConfig) -> Check:
    """The staging fits in the memory the node has left (its pages count as this job's)."""
    avail, limit = _mem_available(), _cgroup_memory_limit()
    have = ", ".join(
        part
        for part in (
            f"{gb(avail)} available" if avail is not None else "",
            f"a cgroup limit of {gb(limit)}" if limit is not None else "",
        )
        if part
    )
    if not have:
        return Check("memory", "warn", "cannot read /proc/meminfo", "check host memory by hand")
    if not cfg.state_gb:
        return Check("memory", "ok", have)
    need = cfg.staging_bytes()
    fewer = "" if cfg.checkpoint_config().resident_regions <= 1 else "fewer --memory-slots, or "
    fix = (
        "give the job more memory (the pod's memory limit), or stage less per node: "
        f"{fewer}more ranks to shard the state over"
    )
    if limit is not None and need > limit:
        return Check(
            "memory",
            "fail",
            f"{_staging_text(cfg)}, over {have}: the first save is OOM-killed",
            fix,
        )
    if avail is not None and need > avail:
        return Check("memory", "warn", f"{_staging_text(cfg)}; only {have}", fix)
    return Check("memory", "ok", f"{_staging_text(cfg)}; {have}")


def check_memfd(cfg: DoctorConfig) -> Check:
    """A memfd (the staging arena) maps, and its fd crosses a Unix socket (to the writer and
    the node agent's keeper) still showing the same bytes."""
    fix = "staging needs Linux >= 3.17 with memfd_create and SCM_RIGHTS (not allowed here?)"
    try:
        fd = os.memfd_create("unbroken-doctor", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as e:
        return Check("memfd", "fail", f"os.memfd_create failed: {e}", fix)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        with mmap.mmap(fd, mmap.PAGESIZE) as mm:
            mm[:7] = b"doctor!"
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with a, b:
            socket.send_fds(a, [b"x"], [fd])
            _, fds, _, _ = socket.recv_fds(b, 1, 1)
        try:
            with mmap.mmap(fds[0], mmap.PAGESIZE) as mm:
                seen = mm[:7]
        finally:
            for f in fds:
                os.close(f)
    except OSError as e:
        return Check("memfd", "fail", f"a memfd could not be mapped or handed over: {e}", fix)
    finally:
        os.close(fd)
    if seen != b"doctor!":
        return Check("memfd", "fail", f"a handed-over memfd showed {seen!r}", fix)
    return Check("memfd", "ok", "a memfd mapped and handed over a Unix socket")
