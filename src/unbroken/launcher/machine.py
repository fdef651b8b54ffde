"""The agent's state machine, as pure code: what to do next, given what was observed.

::

    INIT -> RENDEZVOUS -> STARTING -> RUNNING -> SUCCEEDED
                ^   |         |          |
                |   v         v          v
                | FAILED   STOPPING <----+
                |              |
                +--------------+--> FAILED

- RUNNING -> STOPPING on a worker failure (exit != 0, hang), on a node waiting to join
  (membership change; does not use the restart budget), on a signal to the agent, or on
  another node's preemption (its agent was signalled: every rank saves the step they agree on
  with it; does not use the restart budget).
- STOPPING -> RENDEZVOUS when a restart is allowed: membership changes and another node's
  preemption always; failures while the budget lasts and while the no-progress guard allows it.
- STOPPING -> FAILED otherwise, with a distinct exit code (see ``errors``); at once, whatever
  the budget, when a worker reported a configuration error (exit code 2).
- RENDEZVOUS -> SUCCEEDED when the rendezvous is closed before this node ever joined a round
  (a hot spare, or a replacement pod that came after the job finished).

``Machine`` performs no I/O; ``agent.Agent`` drives it and does the side effects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from unbroken.launcher import errors
from unbroken.launcher.errors import Failure

CONFIG_CAUSE = "config"
"""A failure's cause for a worker that exited with ``unbroken.errors.EXIT_CONFIG``."""
STORAGE_CAUSE = "storage"
"""A failure's cause for a worker that exited with ``unbroken.errors.EXIT_STORAGE``."""


class State(enum.Enum):
    INIT = "init"
    RENDEZVOUS = "rendezvous"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class StopReason(enum.Enum):
    FAILURE = "failure"
    MEMBERSHIP = "membership"
    SIGNAL = "signal"
    PREEMPTION = "preemption"
    """Another node of the job was preempted: save with it, then go on without it."""


TERMINAL = frozenset({State.SUCCEEDED, State.FAILED})

_ALLOWED = {
    State.INIT: {State.RENDEZVOUS},
    State.RENDEZVOUS: {State.STARTING, State.FAILED, State.STOPPING, State.SUCCEEDED},
    State.STARTING: {State.RUNNING, State.STOPPING},
    State.RUNNING: {State.STOPPING, State.SUCCEEDED},
    State.STOPPING: {State.RENDEZVOUS, State.FAILED},
    State.SUCCEEDED: set(),
    State.FAILED: set(),
}


@dataclass(frozen=True, kw_only=True)
class Tick:
    """One look at the running workers."""

    failures: tuple[Failure, ...] = ()
    """New failures: workers that exited non-zero or are past their heartbeat deadline."""
    succeeded: bool = False
    """Every local worker has exited 0."""
    nodes_waiting: int = 0
    """Nodes waiting to join the rendezvous."""
    signal: int | None = None
    """A signal the agent received (SIGTERM, SIGINT, ...)."""
    peer_preempted: bool = False
    """Another node of the round was preempted (its agent got a SIGTERM)."""


class Machine:
    """Transitions, restart budget and the no-progress guard of one agent."""

    def __init__(self, *, max_restarts: int, max_no_progress_restarts: int) -> None:
        if max_restarts < 0 or max_no_progress_restarts < 0:
            raise ValueError("max_restarts and max_no_progress_restarts must be >= 0")
        self.max_restarts = max_restarts
        self.max_no_progress_restarts = max_no_progress_restarts
        self.state = State.INIT
        self.history: list[State] = [State.INIT]
        self.restarts = 0
        """Restarts after failures so far (membership changes are not counted)."""
        self.failures: list[Failure] = []
        """Failures of the current round (cleared when a new round starts)."""
        self.stop_reason: StopReason | None = None
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.no_progress_streak = 0
        self._last_progress: int | None = None

    # --- helpers -----------------------------------------------------------------------------
    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def _go(self, new: State) -> State:
        assert new in _ALLOWED[self.state], f"illegal transition {self.state} -> {new}"
        self.state = new
        self.history.append(new)
        return new

    def _fail(self, exit_code: int) -> State:
        self.exit_code = exit_code
        return self._go(State.FAILED)

    # --- transitions -------------------------------------------------------------------------
    def begin(self) -> State:
        return self._go(State.RENDEZVOUS)

    def rendezvous_done(self) -> State:
        self.failures = []
        self.stop_reason = None
        return self._go(State.STARTING)

    def rendezvous_failed(self, failure: Failure) -> State:
        self.failures = [failure]
        return self._fail(errors.EXIT_RENDEZVOUS_FAILED)

    def job_over(self) -> State:
        """The rendezvous closed before this node ever joined a round (a spare): nothing to do."""
        self.exit_code = errors.EXIT_OK
        return self._go(State.SUCCEEDED)

    def started(self) -> State:
        return self._go(State.RUNNING)

    def start_failed(self, failure: Failure) -> State:
        self.failures.append(failure)
        self.stop_reason = StopReason.FAILURE
        return self._go(State.STOPPING)

    def interrupt(self, signum: int) -> State:
        """The agent got a signal outside RUNNING (during rendezvous or start)."""
        self.signal = signum
        self.stop_reason = StopReason.SIGNAL
        return self._go(State.STOPPING)

    def observe(self, tick: Tick) -> State:
        """RUNNING: stay, stop (failure, membership, signal) or succeed."""
        assert self.state is State.RUNNING, self.state
        if tick.signal is not None:
            self.signal = tick.signal
            self.stop_reason = StopReason.SIGNAL
            return self._go(State.STOPPING)
        if tick.failures:
            self.failures.extend(tick.failures)
            self.stop_reason = StopReason.FAILURE
            return self._go(State.STOPPING)
        if tick.succeeded:
            self.exit_code = errors.EXIT_OK
            return self._go(State.SUCCEEDED)
        if tick.peer_preempted:
            self.stop_reason = StopReason.PREEMPTION
            return self._go(State.STOPPING)
        if tick.nodes_waiting > 0:
            self.stop_reason = StopReason.MEMBERSHIP
            return self._go(State.STOPPING)
        return self.state

    def note(self, failures: list[Failure]) -> None:
        """Failures seen while stopping (consequences, usually); kept for the error file."""
        self.failures.extend(failures)

    def stopped(self, *, progress: int | None) -> State:
        """STOPPING is over: restart or give up. ``progress``: best step reported so far."""
        assert self.state is State.STOPPING, self.state
        if self.stop_reason is StopReason.SIGNAL:
            assert self.signal is not None
            return self._fail(128 + self.signal)
        if self.stop_reason in (StopReason.MEMBERSHIP, StopReason.PREEMPTION):
            return self._go(State.RENDEZVOUS)
        if any(f.cause == CONFIG_CAUSE for f in self.failures):  # no restart can fix it
            return self._fail(errors.EXIT_USAGE)
        if any(f.cause == STORAGE_CAUSE for f in self.failures):  # nor storage that failed
            return self._fail(errors.EXIT_STORAGE_FAILED)
        if progress is not None:  # a job that reports no step is never stopped for it
            if self._last_progress is not None and progress <= self._last_progress:
                self.no_progress_streak += 1
            else:
                self.no_progress_streak = 0
            self._last_progress = progress
            if 0 < self.max_no_progress_restarts <= self.no_progress_streak:
                return self._fail(errors.EXIT_NO_PROGRESS)
        if self.restarts >= self.max_restarts:
            return self._fail(errors.EXIT_BUDGET_EXHAUSTED)
        self.restarts += 1
        return self._go(State.RENDEZVOUS)
