"""``@masked``: functions that the in-process restart interrupt waits for instead of entering.

The restart interrupt (``unbroken.restart.interrupt``) can land at any bytecode of ``fn``,
including the ``finally`` block that aborts a Checkpointer. A function decorated ``@masked``
runs to its end: an interrupt that arrives while it (or anything it calls) runs on the main
thread is deferred, and raised when the outermost masked function returns. Use it for cleanup
that must complete (stop a writer process, free shared memory, put a ledger record on its
queue) and keep such functions short: a restart waits for them.

The decision is made where the interrupt is raised, in the main thread, by looking for
``MASKED_CODE`` on the stack; so a masked function is masked from its first bytecode (no
window between entering it and "masking"), whichever thread asked for the interrupt.

A leaf module that every layer may import (the ledger, checkpoints, restart). Imports of ours:
none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class _Deferral:
    """The main thread's deferred interrupt (written by the interrupt's handler only)."""

    pending = False
    """An interrupt arrived inside a masked function and waits for it to return."""
    on_return: Callable[[], None] | None = None
    """Called (in the masked function's frame) when a masked function returns while an
    interrupt is pending; delivers it unless an outer masked function is still running."""


deferral = _Deferral()


def masked(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` without the restart interrupt landing in it (see the module docstring)."""

    @functools.wraps(fn)
    def masked_call(*args: P.args, **kwargs: P.kwargs) -> R:
        result = fn(*args, **kwargs)
        if deferral.pending and deferral.on_return is not None:
            deferral.on_return()
        return result

    return masked_call


MASKED_CODE = masked(lambda: None).__code__
"""The code object of every masked function's frame (one per call of a masked function)."""
