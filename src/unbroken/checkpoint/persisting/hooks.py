"""``WriterHooks``: what fault injection and tests may change in the writer process, injected.

The writer reads no control file and no environment variable of its own accord. Whoever
builds a ``Checkpointer`` may hand it a ``WriterHooks`` object (``hooks=``); the Checkpointer
sends it, pickled, to its writer process over their socket before any save, and the writer
calls it:

- ``save_rate`` at the start of every save: a write-rate cap for that save in bytes/s (None:
  no cap beyond ``throttle_mbps``). The slow-storage fault's hooks
  (``unbroken.faults.throttle.SlowStorage``) answer from the fault's control files under the
  checkpoint root, so that a restarted writer goes on counting where the last one stopped.
- ``at`` at each point of the commit protocol (``POINTS``), with the step being saved: a
  test may stop the writer there (and a test only: production code passes no hooks).

The storage-fail fault's hooks (``unbroken.faults.storagefail.FailingStorage``) raise the
failing storage's ``OSError`` from either call, which fails that save as the file system
would; a plan with both kinds combines them (``storagefail.Combined``).

Inside ``unbroken.run`` a Checkpointer built without ``hooks`` takes those it is offered
(``offer``/``offered``): the fault plan's, when it holds a storage fault.

A hooks object must be picklable and importable by the writer process (a module on
``sys.path``, not ``__main__``) and cheap; an exception it raises fails that save.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

POINTS = ("data", "done", "manifest", "renamed")
"""Where ``at`` is called: data (half of this rank's data file written), done (rank 0: every
rank's done record in), manifest (before the rename to ``step-N``), renamed (before
``COMMITTED``)."""


class WriterHooks(Protocol):
    """Fault and test hooks a checkpoint writer process calls (see the module docstring)."""

    def save_rate(self, *, root: Path, rank: int, step: int) -> float | None:
        """The write-rate cap of one save, asked at its start.

        Args:
            root: The checkpoint directory.
            rank: The rank whose writer asks.
            step: The step being saved.

        Returns:
            The cap in bytes/s, or None: no cap beyond ``throttle_mbps``.
        """
        ...

    def at(self, point: str, *, root: Path, step: int) -> None:
        """Called at each point of the commit protocol; may stop the writer there (tests).

        Args:
            point: One of ``POINTS``.
            root: The checkpoint directory.
            step: The step being saved.
        """
        ...


class NoHooks:
    """The hooks of a writer nobody injected any into: no cap, no stop."""

    def save_rate(self, *, root: Path, rank: int, step: int) -> float | None:
        return None

    def at(self, point: str, *, root: Path, step: int) -> None:
        return None


NO_HOOKS: WriterHooks = NoHooks()


HooksFor = Callable[[Path], "WriterHooks | None"]
"""What ``unbroken.run`` offers a Checkpointer built without ``hooks``: the hooks its writer
needs for a checkpoint root (the fault plan's; None: none), told the root as it is made."""

_hooks_for: HooksFor | None = None


def offered(root: Path) -> WriterHooks | None:
    """The hooks ``unbroken.run`` offers a Checkpointer under ``root`` (None outside it)."""
    return None if _hooks_for is None else _hooks_for(root)


@contextmanager
def offer(hooks_for: HooksFor) -> Iterator[None]:
    """Offer ``hooks_for(root)`` to the Checkpointers built in the enclosed block (nests)."""
    global _hooks_for
    previous, _hooks_for = _hooks_for, hooks_for
    try:
        yield
    finally:
        _hooks_for = previous
