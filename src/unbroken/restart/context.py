"""What ``fn`` gets: its place in the job this iteration, why it was restarted, and the
progress heartbeat that the watchdog lives on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.ledger import phases

if TYPE_CHECKING:
    from unbroken.ledger import Recorder
    from unbroken.restart.monitor import Monitor

logger = logging.getLogger(__name__)

StepHook = Callable[[int], None]
ExitHook = Callable[[BaseException | None], None]
PhaseHook = Callable[[str, "float | None"], None]
"""Called with (name, None) when fn enters a named phase, (name, seconds) when it leaves."""


@dataclass(frozen=True, kw_only=True)
class RestartCause:
    """Why ``fn`` was called again."""

    iteration: int
    """The iteration that failed."""
    kind: str
    """"exception", "hang" (no progress, running Python), "stuck" (no progress, in native
    code), "pg_init" (the process group could not be formed)."""
    rank: int
    """The failing rank, in the failed iteration's numbering."""
    member: int
    """The failing rank's launch rank."""
    message: str
    """What it reported (exception type and message, or the watchdog's figures)."""
    excluded: tuple[int, ...] = ()
    """Launch ranks that left the job at this restart."""


class RestartContext:
    """Handed to ``fn`` by ``unbroken.restart.run``; one per iteration.

    The default process group is initialized before ``fn`` is called (``dist.get_rank()`` equals
    ``rank``) and torn down by ``run`` afterwards: ``fn`` must not destroy it, and anything that
    holds it (a DDP/FSDP model, a DeviceMesh, a Checkpointer) belongs inside ``fn``.

    Built by ``run``, not by a training script.

    Args:
        iteration: 0 on the first call of ``fn``, +1 per in-process restart.
        cause: What restarted the previous iteration (None on the first).
        rank: This rank in the iteration's process group.
        world_size: Ranks in the iteration's process group.
        local_rank: Rank on this node (the GPU index).
        member: The launch rank (RANK at start): this process's identity across iterations.
        run_dir: The run directory (ledger, checkpoints), if known.
        ledger: Where ``step_done`` and ``phase`` record.
        monitor: The watchdog's progress clock (None: no hang detection).
    """

    def __init__(
        self,
        *,
        iteration: int,
        cause: RestartCause | None,
        rank: int,
        world_size: int,
        local_rank: int,
        member: int,
        run_dir: Path | None,
        ledger: Recorder,
        monitor: Monitor | None,
    ) -> None:
        self._iteration = iteration
        self._cause = cause
        self._rank = rank
        self._world_size = world_size
        self._local_rank = local_rank
        self._member = member
        self._run_dir = run_dir
        self._ledger = ledger
        self._monitor = monitor
        self._hooks: list[StepHook] = []
        self._exit_hooks: list[ExitHook] = []
        self._phase_hooks: list[PhaseHook] = []
        self.first_step: int | None = None
        """The first step completed in this iteration (its restore point), or None."""
        self.last_step: int | None = None
        """The last step completed in this iteration, or None."""

    @property
    def iteration(self) -> int:
        """0 on the first call, +1 per in-process restart."""
        return self._iteration

    @property
    def cause(self) -> RestartCause | None:
        """Why this iteration exists; None on the first call."""
        return self._cause

    @property
    def rank(self) -> int:
        """Global rank in this iteration (ranks are renumbered when a rank leaves)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in this iteration."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank on this node (the GPU index); never changes."""
        return self._local_rank

    @property
    def member(self) -> int:
        """The launch rank (RANK at start): this process's identity across iterations."""
        return self._member

    @property
    def run_dir(self) -> Path | None:
        """The run directory (ledger, checkpoints), if known."""
        return self._run_dir

    def step_done(self, step: int, **data: Any) -> None:
        """Call after each completed training step (after ``optimizer.step``): the progress
        heartbeat, the ledger's ``step`` record, then the step hooks in registration order (a
        hook may raise, hang or kill: that is the fault injector).

        Call it after the step's ``Checkpointer.maybe_save``: a fault the plan fires here then
        finds the step saved or noted, as a fault in the next step's work would, and an
        in-process restart resumes after it; called before, such a fault lands between
        ``optimizer.step`` and the note, and the restart rolls back to the last snapshot.

        Args:
            step: The step just completed (0-based).
            **data: Fields of the ledger's ``step`` record (``loss=...``).
        """
        if self._monitor is not None:
            self._monitor.progress(step=True)
        if self.first_step is None:
            self.first_step = step
        self.last_step = step
        self._ledger.step(step, **data)
        for hook in self._hooks:
            hook(step)

    def heartbeat(self) -> None:
        """Progress without a completed step (e.g. in a long evaluation loop)."""
        if self._monitor is not None:
            self._monitor.progress(step=False)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """The enclosed block is the named phase ``name`` of the job ("data", "validation",
        any name: a letter, then letters, digits, ``_.-``).

        - The ledger records it (a ``phase`` interval; the next step's interval starts when it
          ends): the report's badput names it ("data": data loading; another name: custom).
        - The hang watchdog applies the phase's own timeout while fn is inside it, learned
          from the phase's past durations unless ``RestartConfig.phase_timeouts_s`` (or
          ``UNBROKEN_PHASE_TIMEOUTS``) names one; its time is not a step gap.
        - A fault plan may target it (``phase: validation``), firing on entry.

        Call from fn's thread; phases nest.

        Args:
            name: The phase's name.

        Returns:
            The context manager (a class: a step's calls run cold after its compute, where
            every generator frame costs tens of microseconds).

        Raises:
            ValueError: For an invalid name.
        """
        return _Phase(self, phases.check_name(name))

    def add_step_hook(self, hook: StepHook) -> None:
        """Call ``hook(step)`` at the end of every ``step_done`` of this iteration.

        Args:
            hook: Called with the step just completed.
        """
        self._hooks.append(hook)

    def add_phase_hook(self, hook: PhaseHook) -> None:
        """Watch the named phases of this iteration.

        Args:
            hook: Called as ``hook(name, None)`` on entry to every named phase (before a fault
                plan's phase target fires) and ``hook(name, seconds)`` when it ends normally.
        """
        self._phase_hooks.append(hook)

    def add_exit_hook(self, hook: ExitHook) -> None:
        """Call ``hook(error)`` once ``fn`` has ended in this iteration, before the next
        iteration starts. Hooks run outside ``fn``, where no restart interrupt reaches them
        (e.g. to abort what a failed ``fn`` left open); an exception from one is logged and
        ignored.

        Args:
            hook: Called with what ``fn`` raised (None when it returned).
        """
        self._exit_hooks.append(hook)

    def _exited(self, error: BaseException | None) -> None:
        """``run`` calls this once ``fn`` has ended: runs the exit hooks in registration order."""
        for hook in self._exit_hooks:
            try:
                hook(error)
            except Exception:
                logger.exception("exit hook %r failed", hook)

    @contextmanager
    def no_hang_protection(self) -> Iterator[None]:
        """Suspend the hang watchdog (soft and hard timeouts) for a known long region, such as
        a blocking checkpoint save or an evaluation. Faults of other ranks still interrupt it;
        the progress clock restarts when the region ends."""
        if self._monitor is None:
            yield
            return
        self._monitor.protect(enter=True)
        try:
            yield
        finally:
            self._monitor.protect(enter=False)


class _Phase:
    """``RestartContext.phase``'s context manager: the watchdog's phase, the ledger's record,
    the phase hooks and the phase stack (whose listeners may raise: the fault injector)."""

    __slots__ = ("_ctx", "_name", "_t0", "_record")

    def __init__(self, ctx: RestartContext, name: str) -> None:
        self._ctx = ctx
        self._name = name
        self._t0 = 0.0
        self._record: AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        ctx, name = self._ctx, self._name
        if ctx._monitor is not None:
            ctx._monitor.enter_phase(name)
        try:
            self._t0 = time.monotonic()
            record = ctx._ledger.phase(name)
            record.__enter__()
            self._record = record  # recorded at a clean exit only: not when a hook raises
            for hook in ctx._phase_hooks:
                hook(name, None)
            phases.push(name)
        except BaseException:
            if ctx._monitor is not None:
                ctx._monitor.exit_phase(name)
            raise

    def __exit__(self, kind: type[BaseException] | None, value: Any, tb: Any) -> None:
        ctx, name = self._ctx, self._name
        phases.pop()
        try:
            assert self._record is not None
            self._record.__exit__(kind, value, tb)
        finally:
            if ctx._monitor is not None:
                ctx._monitor.exit_phase(name)
        if kind is None:
            dur_s = time.monotonic() - self._t0
            for hook in ctx._phase_hooks:
                hook(name, dur_s)
