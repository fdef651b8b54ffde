"""One owner per directory: a run directory or a checkpoint directory belongs to one job.

A job is named by its identity (its run id: ``TORCHELASTIC_RUN_ID``, ``UNBROKEN_RUN_ID``, or
one derived for a job without one; see ``unbroken.workload.train``). Every process of that
job (its ranks, their checkpoint writers, on every node) may share the directory; a process of
another job is refused with ``DirectoryOwned``, whose message names the owner, and nothing in
the directory is touched.

Files in the directory:
- ``.owner.json``: the owner record (job, host, pid, since, the jobs it took over from),
  written atomically (``durable``). It outlives the job: a later job sees whose it was.
- ``.owner.live``: held with a shared ``flock`` by every process of the owning job while it
  uses the directory (``Claim.release`` or the process's death drops it, so a crashed job
  holds nothing). Nobody holding it means the owner is gone.
- ``.owner.lock``: held exclusively for the few microseconds of checking and writing the record.

A crashed job does not hold a directory forever: its locks die with its processes. Whether a
later job of another identity may then take the directory over is the caller's choice
(``takeover``): a checkpoint directory may be (its foreign checkpoints are refused at restore
unless allowed), a run directory only to continue that run on purpose (``--resume``).

Across nodes the locks are only as good as the shared filesystem's ``flock`` (NFSv4 and Lustre
honour it across clients; an NFS client that dies releases its locks when its lease expires,
90 s by default). Imports of ours: none.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from unbroken.ledger.durable import write_atomic

logger = logging.getLogger(__name__)

RECORD = ".owner.json"
LIVE = ".owner.live"
LOCK = ".owner.lock"
_LOCK_TIMEOUT_S = 30.0
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""flock's errors on a filesystem without locks (some FUSE and old NFS mounts)."""
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_FAILING = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)
"""A write's errors on storage that is failing (full, over quota, I/O errors, turned
read-only): the owner record cannot be written, and no checkpoint either until it recovers."""


@dataclass(frozen=True, kw_only=True)
class OwnerRecord:
    """Who owns a directory."""

    job: str
    """The owning job's identity (its run id)."""
    host: str
    """Host of the process that first claimed it for this job."""
    pid: int
    """That process's pid."""
    since: float
    """Epoch seconds of that first claim."""
    previous: list[str] = field(default_factory=list)
    """Jobs that owned it before, oldest first (a takeover or a resume)."""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"job {self.job!r} (pid {self.pid} on {self.host}, since {when})"

    @classmethod
    def read(cls, directory: Path) -> OwnerRecord | None:
        """The record of ``directory``, or None when it has none (or an unreadable one)."""
        try:
            raw = json.loads((directory / RECORD).read_text())
            return cls(
                job=str(raw["job"]),
                host=str(raw["host"]),
                pid=int(raw["pid"]),
                since=float(raw["since"]),
                previous=[str(p) for p in raw.get("previous", [])],
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the unreadable owner record of %s: %s", directory, e)
            return None


class DirectoryOwned(ValueError):
    """A directory belongs to another job (running, or one not continued on purpose)."""

    def __init__(self, message: str, *, owner: OwnerRecord, running: bool) -> None:
        super().__init__(message)
        self.owner = owner
        self.running = running


class Claim:
    """This process's share of a directory's ownership; ``release()`` (idempotent) drops it."""

    def __init__(self, directory: Path, record: OwnerRecord, fd: int | None) -> None:
        self.directory = directory
        self.record = record
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _open(path: Path) -> int:
    """A read-only descriptor of ``path`` (created if missing): enough for ``flock``, and it
    does not keep the filesystem from being remounted read-only."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return os.open(path, os.O_RDONLY | os.O_CREAT, 0o600)


def _lock(path: Path) -> int:
    """An exclusive flock on ``path`` (created), waited for up to _LOCK_TIMEOUT_S."""
    fd = _open(path)
    deadline = time.monotonic() + _LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno in _NO_LOCKS:
                logger.warning(
                    "%s: this filesystem has no flock (%s); ownership is recorded, "
                    "and enforced only against live processes of this host",
                    path,
                    e,
                )
                return fd
            if not isinstance(e, BlockingIOError):
                os.close(fd)
                raise
            if time.monotonic() > deadline:
                os.close(fd)
                raise TimeoutError(
                    f"{path} stayed locked for {_LOCK_TIMEOUT_S:.0f} s; a process claiming the "
                    "directory is stuck (stopped?): end it, or remove the file if none runs"
                ) from None
            time.sleep(0.005)


def _nobody_holds(live_fd: int, owner: OwnerRecord) -> bool:
    try:
        fcntl.flock(live_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        return owner.host != socket.gethostname() or not pid_alive(owner.pid)
    return True


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(directory: str | os.PathLike[str], *, job: str, takeover: bool, hint: str = "") -> Claim:
    """Claim ``directory`` (created, private to the user) for ``job``.

    Shared with the other processes of ``job``. Raises ``DirectoryOwned`` when a process of
    another job holds it, or when another job that no longer runs owned it and ``takeover``
    is False; ``hint`` (what to do then, e.g. "pass --resume to continue it") ends the
    latter message. Nothing in the directory is changed by a refusal."""
    if not job:
        raise ValueError("claim() needs a non-empty job identity")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock_fd = None
    try:
        lock_fd = _lock(root / LOCK)
        live_fd = _open(root / LIVE)
    except OSError as e:
        if lock_fd is not None:
            os.close(lock_fd)
        if e.errno not in _READ_ONLY:
            raise
        # Nobody can write or delete here (a read-only mount, a published checkpoint): there
        # is nothing to protect, and reading must go on.
        logger.warning("%s is not writable (%s); using it without claiming it", root, e)
        return Claim(root, OwnerRecord(job=job, host="", pid=0, since=time.time()), None)
    try:
        owner = OwnerRecord.read(root)
        if owner is not None and owner.job != job:
            if not _nobody_holds(live_fd, owner):
                raise DirectoryOwned(
                    f"{root} is in use by {owner.describe()}; refusing to use it for job "
                    f"{job!r}, and nothing of it was touched. Wait for that job to end (or "
                    "stop it), or use another directory",
                    owner=owner,
                    running=True,
                )
            if not takeover:
                raise DirectoryOwned(
                    f"{root} belongs to {owner.describe()}, which is no longer running; "
                    f"refusing to use it for job {job!r} by accident"
                    + (f": {hint}" if hint else ""),
                    owner=owner,
                    running=False,
                )
            logger.warning("%s: job %r takes over from %s", root, job, owner.describe())
            owner = _write(root, job=job, previous=[*owner.previous, owner.job])
        elif owner is None:
            try:
                owner = _write(root, job=job, previous=[])
            except OSError as e:
                if e.errno not in _FAILING:
                    raise
                # Failing storage is a storage fault, not a reason to stop a job: nothing can
                # be written here now, by this job or another; its saves fail and are retried.
                logger.warning(
                    "%s: cannot write its owner record (%s); using it without claiming it",
                    root,
                    e,
                )
                owner = OwnerRecord(job=job, host="", pid=0, since=time.time())
        try:  # converts a held LOCK_EX; we hold the lock file
            fcntl.flock(live_fd, fcntl.LOCK_SH)
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
        return Claim(root, owner, live_fd)
    except BaseException:
        os.close(live_fd)
        raise
    finally:
        os.close(lock_fd)


def _write(root: Path, *, job: str, previous: list[str]) -> OwnerRecord:
    record = OwnerRecord(
        job=job, host=socket.gethostname(), pid=os.getpid(), since=time.time(), previous=previous
    )
    data: dict[str, Any] = asdict(record)
    write_atomic(root / RECORD, json.dumps(data, indent=1), mode=0o600)
    return record
