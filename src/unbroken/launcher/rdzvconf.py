"""What ``--rdzv-conf`` says in seconds, torch's rendezvous polled faster, and its event names
found without ``inspect.stack()``.

Imports of ours: ``unbroken.launcher.errors``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from unbroken.launcher.errors import LauncherError

TIMEOUTS = ("join", "last_call", "close", "heartbeat")


def seconds(conf: dict[str, Any], key: str) -> float | None:
    raw = conf.pop(key, None)
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise LauncherError(f"--rdzv-conf {key}={raw!r} must be a number of seconds") from None
    if not value > 0:
        raise LauncherError(f"--rdzv-conf {key}={raw!r} must be > 0")
    return value


def fast_polls(poll_s: float) -> Callable[[], None]:
    """Shorten torch's hard-coded 1 s wait between two looks at the rendezvous state; returns
    the function that undoes it.

    ``dynamic_rendezvous._delay(seconds=1)`` is the only call with that argument (the start
    skew passes a range); the agent runs one handler, so the change is scoped to it.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = getattr(dr._delay, "__wrapped__", dr._delay)

    def delay(seconds: float | tuple[float, float]) -> None:
        original(seconds=poll_s if seconds == 1 else seconds)

    delay.__wrapped__ = original  # type: ignore[attr-defined]
    dr._delay = delay

    def undo() -> None:
        dr._delay = original

    return undo


def _method_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up (0: this one), as torch's
    ``get_method_name`` returns it from ``inspect.stack()[depth].function``."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def cheap_event_names() -> None:
    """Name torch's rendezvous events by walking frames instead of ``inspect.stack()``.

    Every step of torch's rendezvous (each compare-and-set, each keep-alive) records an event
    named after the calling method, and computes that name with ``inspect.stack()`` twice
    *before* it checks whether any handler takes events (none does by default):
    ``inspect.stack()`` reads the source context of every frame and looks up each frame's
    module among the thousands torch imports, tens of milliseconds of CPU a call. Nodes
    contending for the shared state retry their compare-and-set, so a round of n nodes pays it
    O(n^2) times. The names are the same; idempotent, process-wide (only the cost changes).
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    if dr.get_method_name is not _method_name:
        dr.get_method_name = _method_name
