"""The agent's signals: SIGCHLD and the stop signals wake its event loop through a self-pipe.

While the agent blocks outside its event loop (in a rendezvous, starting workers), a stop signal
raises ``AgentSignal`` instead, so it can stop its workers and exit.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any

from unbroken.launcher import errors


class AgentSignal(Exception):  # noqa: N818 - a control-flow signal, not an error
    """The agent received a stop signal while blocked (rendezvous, start)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {errors.signal_name(signum)}")
        self.signum = signum


class SignalPipe:
    """SIGCHLD and the agent's stop signals wake ``select`` through a self-pipe."""

    def __init__(self, stop_signals: tuple[int, ...]) -> None:
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.stop_signals = stop_signals
        self.raise_on_stop = False
        self._old_wakeup = signal.set_wakeup_fd(self.wfd, warn_on_full_buffer=False)
        self._old: dict[int, Any] = {}
        for sig in (signal.SIGCHLD, *stop_signals):
            self._old[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGCHLD and self.raise_on_stop:
            self.raise_on_stop = False
            raise AgentSignal(signum)

    def drain(self) -> list[int]:
        out: list[int] = []
        while True:
            try:
                data = os.read(self.rfd, 512)
            except (BlockingIOError, InterruptedError):
                return out
            if not data:
                return out
            out.extend(data)

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        os.close(self.rfd)
        os.close(self.wfd)
