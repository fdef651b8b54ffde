"""What ``--rdzv-conf`` says in seconds, and torch's rendezvous polled faster.

Imports of ours: ``unbroken.launcher.errors``.
"""

from __future__ import annotations

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
