"""Graceful preemption: on SIGTERM, every rank saves the same step durably, then the job stops.

Kubernetes stops a pod with SIGTERM and a grace period (a node drained, spot capacity
reclaimed, ``kubectl delete pod``); ``unbroken-run`` passes its own SIGTERM on to its workers
and kills them after ``--ft-stop-grace-s``. Inside ``unbroken.run`` a worker's SIGTERM only
sets ``requested`` (``unbroken.job`` installs the handler; a process without a Checkpointer
that saves exits at once, as before). The next ``Checkpointer.maybe_save`` then agrees with the
other ranks on the step to stop at (``target``) and, at that step, saves durably, waits for the
commit and raises ``unbroken.errors.Preempted``: the relaunched job resumes from that step and
trains no step twice.

The ranks agree through the checkpoint directory, which every rank sees: under a ``flock``, the
first rank to ask writes ``<root>/.preempt-<run>`` holding its step + ``MARGIN``, or more steps
when they take less than ``REACH_S`` together; the others read it. In a data-parallel job the
ranks are at most one step apart (a rank cannot finish a step whose collectives another rank
has not joined), every rank of a node gets its SIGTERM from one agent at once, and the ranks of
the other nodes of a multi-node job get theirs from their agents a membership check later
(``unbroken.launcher.departure``), so each rank reads the target before it reaches it. An
agreement file older than this process's import of this module is a previous launch's, and is
replaced.

Imports of ours: ``unbroken.errors``, ``unbroken.ledger``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import NoReturn

from unbroken.errors import Preempted
from unbroken.ledger import Recorder
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)

_IMPORTED = time.time()
"""Before any rank of this launch can ask (they import it before training): an agreement
file older than this is a previous launch's."""

MARGIN = 2
"""Steps between the first rank's step when it asks and the step every rank stops at, at least."""

REACH_S = 1.0
"""...and at least this long of steps (at the asking rank's pace): the SIGTERM reaches the
other nodes' ranks through their agents, a membership check (0.1 s by default) and a store
read after this node's."""

_requested: float | None = None


def request(ts: float | None = None) -> None:
    """Preemption was asked for (the worker's SIGTERM handler; a test).

    Args:
        ts: When (default: now).
    """
    global _requested
    if _requested is None:
        _requested = time.time() if ts is None else ts


def requested() -> float | None:
    """When preemption was asked for in this process, or None."""
    return _requested


def clear() -> None:
    """Forget a request (a test, or a process that goes on after it)."""
    global _requested
    _requested = None


def _path(root: Path, run: str | None) -> Path:
    return root / f".preempt-{re.sub(r'[^A-Za-z0-9._-]', '_', run or 'run')}"


def target(root: Path, *, run: str | None, step: int, step_s: float | None = None) -> int:
    """The step every rank stops at, agreed through ``root``.

    Args:
        root: The checkpoint directory (every rank sees it).
        run: The run (names the file).
        step: The asking rank's step (just completed).
        step_s: Its recent time per step (None: unknown); the target is then at least
            ``REACH_S`` of steps ahead, ``MARGIN`` steps at least.

    Returns:
        The target step; ``step`` itself when the directory cannot be written (failing
        storage: the save will fail too, and the job stops where it is).
    """
    path = _path(root, run)
    try:
        with open(path.with_name(path.name + ".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
            try:
                if path.stat().st_mtime >= _IMPORTED:  # this launch's (a rank asked first)
                    return int(json.loads(path.read_text())["step"])
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                pass  # none yet (or a previous launch's, or unreadable): this rank sets it
            ahead = MARGIN if not step_s else max(MARGIN, math.ceil(REACH_S / step_s))
            agreed = step + ahead
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"step": agreed, "ts": time.time(), "pid": os.getpid()}))
            os.replace(tmp, path)
    except OSError as e:
        logger.error("preemption: cannot agree through %s (%s); saving step %d", path, e, step)
        return step
    logger.warning("preemption: every rank stops after step %d", agreed)
    return agreed


class Stop:
    """One Checkpointer's graceful stop: the agreed step, asked for once, at the first
    ``maybe_save`` after the request.

    Args:
        root: The checkpoint directory.
        run: The run (names the agreement file).
    """

    def __init__(self, root: Path, run: str | None) -> None:
        self.root, self.run = root, run
        self.target: int | None = None
        self._seen: tuple[int, float] | None = None  # (step, when maybe_save saw it)
        self._step_s: float | None = None

    def due(self, step: int) -> bool:
        """Whether ``step`` is the one to save and stop at (or past it).

        Args:
            step: The step just completed.

        Returns:
            False while no stop was requested.
        """
        now = time.monotonic()
        if self._seen is not None and step > self._seen[0]:
            self._step_s = (now - self._seen[1]) / (step - self._seen[0])
        self._seen = (step, now)
        if _requested is None:
            return False
        if self.target is None:
            self.target = target(self.root, run=self.run, step=step, step_s=self._step_s)
        return step >= self.target


def stopped(
    step: int, *, began: float, ledger: Recorder, failed: str | None, latest: int | None
) -> NoReturn:
    """Record the last save (a ``preemption`` phase) and raise ``Preempted``.

    Args:
        step: The step saved.
        began: When the last save began.
        ledger: Where it is recorded.
        failed: Why the save failed (None: it is committed).
        latest: The newest committed step (where a relaunch resumes when it failed).

    Raises:
        Preempted: Always.
    """
    since = None if _requested is None else began - _requested
    durable = failed is None
    ledger.interval(
        ev.PHASE, begin=began, name="preemption", step=step, durable=durable, signal_s=since
    )
    ledger.flush()
    if durable:
        raise Preempted(f"preempted: step {step} is committed; a relaunch resumes after it")
    raise Preempted(
        f"preempted: the save of step {step} failed ({failed}); a relaunch resumes from the "
        f"newest committed checkpoint ({latest})"
    )
