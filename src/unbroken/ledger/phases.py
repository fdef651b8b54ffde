"""Phases a process announces, and who listens: where a fault plan's phase targets fire.

A phase is a named part of a job's life. unbroken names its own where they happen: ``init``
(a process's first call of the training function), ``recovery`` (a restarted process's start,
or an in-process restart's next call), ``restore`` (``Checkpointer.restore``), ``save`` (a
durable save's staging), ``persist`` (a durable save handed to the writer) and ``shutdown``
(``Checkpointer.close``, unless the user already named it); the user names the others with
``RestartContext.phase`` (``data``, ``validation``, any name).

``region(name)`` is a phase on the main thread: it is on the stack (``active``) while the
block runs, and every listener hears ``name`` on entry. A listener may raise, hang or end the
process (the fault injector does), so a region is entered only where a fault may happen. This
module records nothing: whoever times a phase writes its ledger record.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[str], None]

LIBRARY = ("init", "recovery", "restore", "save", "persist", "shutdown")
"""The phases unbroken itself enters (see the module docstring)."""

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
_listeners: list[Listener] = []
_stack: list[str] = []
_valid: set[str] = set()  # names check_name passed (it runs on every step's phase)


def check_name(name: object) -> str:
    """``name`` if it is a valid phase name, else ValueError saying what one looks like."""
    if type(name) is str and name in _valid:
        return name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"phase name {name!r} is not valid: use a letter, then up to 63 letters, digits, "
            "'_', '.' or '-' (e.g. 'data', 'validation')"
        )
    if len(_valid) < 1024:
        _valid.add(name)
    return name


def active() -> tuple[str, ...]:
    """The phases enclosing the current point, outermost first."""
    return tuple(_stack)


@contextmanager
def region(name: str) -> Iterator[None]:
    """The enclosed block is phase ``name``; listeners hear it on entry (and may raise)."""
    push(name)
    try:
        yield
    finally:
        pop()


def push(name: str) -> None:
    """Enter phase ``name`` (``region``'s entry, for a caller that is a context manager
    itself): on the stack, then every listener hears it; a listener that raises leaves the
    stack as it was. Leave with ``pop``."""
    _stack.append(name)
    try:
        for listener in tuple(_listeners):
            listener(name)
    except BaseException:
        _stack.pop()
        raise


def pop() -> None:
    """Leave the innermost phase (``push``'s)."""
    _stack.pop()


def entered(name: str) -> None:
    """A phase that is a moment, not a block (``persist``: the save was handed over)."""
    with region(name):
        pass


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Call ``listener(name)`` on every phase entry in the enclosed block (nests)."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
