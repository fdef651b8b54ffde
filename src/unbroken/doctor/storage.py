"""The checkpoint file system: a commit (write, fsync, rename), flock, free space."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from pathlib import Path

from unbroken.doctor.config import Check, DoctorConfig, gb


def _fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (longest mount point prefix)."""
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1].replace("\\040", " ")
            inside = str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, parts[2]
    return kind


def _probe_dir(d: Path) -> str | None:
    """Write, fsync, flock and rename as a commit does, in ``d``; None when locks hold, else
    why not. Raises OSError when writing or renaming fails."""
    partial = d / f".unbroken-doctor-{os.getpid()}.partial"
    final = d / f".unbroken-doctor-{os.getpid()}"
    partial.mkdir()
    try:
        path = partial / "probe"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"unbroken doctor\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        no_lock = _probe_flock(path)
        os.rename(partial, final)
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return no_lock
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)


def _probe_flock(path: Path) -> str | None:
    """None when an exclusive flock on ``path`` keeps a second one out, else why not."""
    first, second = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return f"flock is not supported ({e.strerror})"
        try:
            fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        return "a second exclusive flock was granted: locks are not enforced"
    finally:
        os.close(first)
        os.close(second)


def check_checkpoint_dir(cfg: DoctorConfig) -> Check:
    """The checkpoint directory exists, takes a commit (write, fsync, rename), enforces
    flock (which keeps two jobs out of one run directory) and has room for the checkpoints."""
    d = cfg.checkpoint_dir
    if d is None:
        return Check("checkpoint", "skip", "no --checkpoint-dir given", "")
    if not d.exists():
        return Check(
            "checkpoint",
            "fail",
            f"{d} does not exist",
            "create it (mkdir -p) on the file system every node mounts, or mount that there",
        )
    if not d.is_dir():
        return Check("checkpoint", "fail", f"{d} is not a directory", "pass a directory")
    kind = _fs_type(d.resolve())
    try:
        no_lock = _probe_dir(d)
    except OSError as e:
        read_only = e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        return Check(
            "checkpoint",
            "fail",
            f"{d} ({kind}) cannot take a checkpoint: {e.strerror or e}",
            "mount it read-write and give this user write access"
            if read_only
            else "check the file system",
        )
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    found = f"{d} ({kind}): write, fsync and rename work, {gb(free)} free"
    need = cfg.checkpoint_bytes()
    if cfg.state_gb and need > free:
        return Check(
            "checkpoint",
            "fail",
            f"{found}; {cfg.keep} kept + 1 in flight x {cfg.nnodes * cfg.nproc_per_node} "
            f"rank(s) x {cfg.state_gb:g} GB need {gb(need)}",
            f"free {gb(need - free)} there, or lower --keep",
        )
    if no_lock:
        return Check(
            "checkpoint",
            "warn",
            f"{found}; {no_lock}",
            "use a file system with working flock (NFSv4, Lustre, local): without it two jobs "
            "given one run directory are told apart only on one host",
        )
    return Check("checkpoint", "ok", found + "; flock enforced")
