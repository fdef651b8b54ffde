"""The process's active ledger: the one ``unbroken.run`` records into while it runs.

Components created inside a run (a ``Checkpointer``) record into it without being handed it,
so that a user's script gets every figure of the report without wiring ledgers through its own
code. Outside ``unbroken.run`` there is none. One per process; set from the main thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from unbroken.ledger.recorder import Recorder

_active: Recorder | None = None


def current() -> Recorder | None:
    """The active ledger, or None outside ``unbroken.run``."""
    return _active


@contextmanager
def activate(ledger: Recorder) -> Iterator[None]:
    """Make ``ledger`` the active one for the enclosed block (nests: the previous one returns)."""
    global _active
    previous, _active = _active, ledger
    try:
        yield
    finally:
        _active = previous
