"""The in-process restart's configuration, its errors and its exit codes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from unbroken.errors import UnbrokenError

if TYPE_CHECKING:
    from unbroken.restart.health import HealthCheck

Backend = Literal["gloo", "nccl"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# Exit codes a training script should return for the two ways ``run`` gives up on this process.
EXIT_ESCALATE = 75
"""The job cannot continue in-process (limits hit, too few healthy ranks): the launcher (or
Kubernetes) must take over. 75 is sysexits' EX_TEMPFAIL: "try again later"."""
EXIT_EXCLUDED = 0
"""This rank left the job (it failed its health check) while the others continue. 0, because
torchrun tears the whole group down when any worker exits non-zero."""


class RestartError(UnbrokenError):
    """Root of the in-process restart's errors."""


class RestartInterrupt(BaseException):  # noqa: N818 - an interrupt, not an error
    """Raised asynchronously in the main thread to stop ``fn`` for a restart.

    A ``BaseException`` so that ``except Exception`` in user code does not swallow it; it is
    raised again every monitor interval until ``fn`` has returned anyway.
    """


class Escalated(RestartError):  # noqa: N818
    """``run`` gave up: a higher layer must restart the job. Exit with ``exit_code``.

    Args:
        reason: Why (also the message), kept as ``reason``.
    """

    exit_code = EXIT_ESCALATE

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RankExcluded(RestartError):  # noqa: N818
    """This rank was dropped from the job (failed health check, or arrived too late).

    Args:
        reason: Why (also the message), kept as ``reason``.
    """

    exit_code = EXIT_EXCLUDED

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# The timeouts' ceilings when left to calibration, and how a hard timeout follows a soft one.
DEFAULT_SOFT_S = 60.0
DEFAULT_HARD_S = 90.0
DEFAULT_INITIAL_SOFT_S = 600.0
DEFAULT_INITIAL_HARD_S = 900.0
HARD_RATIO = 1.5
HARD_MARGIN_S = 10.0
"""A derived hard timeout is max(HARD_RATIO x soft, soft + HARD_MARGIN_S): time for fn to
return after the restart was requested, before the rank is killed."""
_TIMEOUTS = ("soft_timeout_s", "hard_timeout_s", "initial_soft_timeout_s", "initial_hard_timeout_s")


@dataclass(frozen=True, kw_only=True)
class RestartConfig:
    """How ``unbroken.restart.run`` detects faults and restarts ``fn``. Durations in seconds."""

    enabled: bool = True
    """False: no in-process restart. ``fn`` runs once, in a process group formed on the
    launcher's store; a fault ends the process with its error, and the launcher restarts it.
    Nothing watches for hangs inside the process then: the launcher's heartbeat timeout does."""
    max_iterations: int = 16
    """``fn`` is called at most this many times; a fault in the last one escalates."""
    min_world_size: int = 1
    """Fewer healthy ranks than this escalates instead of continuing smaller."""
    max_rank_faults: int = 3
    """The same rank (by its launch rank) causing this many faults escalates."""
    max_restore_point_faults: int = 3
    """This many consecutive faults from the same restore point (the first step an iteration
    completes, i.e. the checkpoint it resumed from) escalates."""
    soft_timeout_s: float | None = None
    """No progress heartbeat for this long: the rank is declared hung and all ranks restart.
    None: calibrated from the job's own progress gaps (``calibrate.py``), at most 60 s."""
    hard_timeout_s: float | None = None
    """No progress heartbeat for this long: the rank is killed (SIGKILL) for the launcher.
    None: max(1.5 x, 10 s +) the soft timeout in effect, at most 90 s (or 1.5 x an explicit
    soft timeout)."""
    initial_soft_timeout_s: float | None = None
    """The soft timeout before an iteration's first step (model build, checkpoint load). None:
    calibrated from the observed first-step durations, at most 600 s."""
    initial_hard_timeout_s: float | None = None
    """The hard timeout before an iteration's first step. None: derived like the hard one, at
    most 900 s."""
    phase_timeouts_s: Mapping[str, float] = field(default_factory=dict)
    """Soft hang timeouts of named phases (``RestartContext.phase``: "validation", "data"...),
    in effect while ``fn`` is inside one. A phase not named here is calibrated like the
    initial timeout: ``timeout_factor`` x its longest duration seen (at least
    ``timeout_floor_s``), the initial ceiling until it was seen once."""
    timeout_factor: float = 8.0
    """Calibrated timeouts are this many times the largest recent gap (or first-step time)."""
    timeout_floor_s: float = 1.0
    """A calibrated soft timeout is never below this."""
    initial_timeout_floor_s: float = 60.0
    """A calibrated initial soft timeout is never below this."""
    timeout_warmup: int = 20
    """Progress gaps observed before the soft timeout is calibrated (until then: the ceiling)."""
    exit_timeout_s: float = 30.0
    """After a restart was requested, ``fn`` must have returned within this, else the rank is
    killed (it is stuck in native code that no abort reaches)."""
    barrier_timeout_s: float = 120.0
    """How long ranks wait for each other between iterations before leaving a rank out."""
    monitor_interval_s: float = 0.05
    """Period of the watchdog's checks and of repeated interrupts."""
    backstop_margin_s: float | None = 10.0
    """A GIL-free timer (faulthandler) exits the process this long after a missed hard
    timeout, for a main thread stuck in native code while holding the GIL; None: off."""
    pg_backend: Backend | None = None
    """Backend of the process group ``run`` forms: "gloo", "nccl", or None for nccl when CUDA is
    available, else gloo."""
    pg_timeout_s: float = 600.0
    """Collective timeout of the process group."""
    health_checks: Sequence[HealthCheck] | None = None
    """Checks each rank runs before rejoining; None: ``health.default_checks()``."""
    store_addr: str | None = None
    """``host:port`` of the coordination store; None: from the environment (see store.py)."""
    store_timeout_s: float = 60.0
    """Timeout of single store operations and of reaching the store at start."""
    gc_freeze: bool = True
    """Exempt the objects that exist when ``run`` starts from cyclic garbage collection until
    it returns (``gc.freeze``), so that freeing a failed iteration's model takes milliseconds
    instead of a walk over the whole heap. Cyclic garbage among those objects waits."""

    def __post_init__(self) -> None:
        if self.max_iterations < 1:
            raise ValueError(f"max_iterations must be >= 1, got {self.max_iterations}")
        for name in ("min_world_size", "max_rank_faults", "max_restore_point_faults"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("monitor_interval_s", "exit_timeout_s", "pg_timeout_s", "store_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.timeout_factor > 1:
            raise ValueError(f"timeout_factor must be > 1, got {self.timeout_factor}")
        if self.timeout_warmup < 1:
            raise ValueError(f"timeout_warmup must be >= 1, got {self.timeout_warmup}")
        for name in ("timeout_floor_s", "initial_timeout_floor_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in _TIMEOUTS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None (calibrated), got {value}")
        soft, hard, isoft, ihard = self.ceilings()
        names = {n: f"{n} (in effect)" if getattr(self, n) is None else n for n in _TIMEOUTS}
        order = [
            ("monitor_interval_s", self.monitor_interval_s),
            (names["soft_timeout_s"], soft),
            (names["hard_timeout_s"], hard),
            ("barrier_timeout_s", self.barrier_timeout_s),
        ]
        self._check_order(order)
        self._check_order(
            [
                (names["soft_timeout_s"], soft),
                (names["initial_soft_timeout_s"], isoft),
                (names["initial_hard_timeout_s"], ihard),
            ],
            strict=False,
        )
        self._check_order(
            [(names["hard_timeout_s"], hard), (names["initial_hard_timeout_s"], ihard)],
            strict=False,
        )
        if ihard <= isoft:
            raise ValueError(
                f"initial_hard_timeout_s ({ihard}) must be > initial_soft_timeout_s ({isoft})"
            )
        if self.exit_timeout_s >= self.barrier_timeout_s:
            raise ValueError(
                f"exit_timeout_s ({self.exit_timeout_s}) must be < barrier_timeout_s "
                f"({self.barrier_timeout_s}): peers must wait longer than a rank may take to stop"
            )
        if self.backstop_margin_s is not None and self.backstop_margin_s <= 0:
            raise ValueError(f"backstop_margin_s must be > 0 or None, got {self.backstop_margin_s}")
        if self.pg_backend is not None and self.pg_backend not in BACKENDS:
            raise ValueError(
                f"pg_backend must be one of {BACKENDS} or None, got {self.pg_backend!r}"
            )
        if self.store_addr is not None:
            parse_addr(self.store_addr)
        for name, seconds in self.phase_timeouts_s.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"phase_timeouts_s: a phase name must be a string, got {name!r}")
            if not (isinstance(seconds, int | float) and 0 < seconds < float("inf")):
                raise ValueError(
                    f"phase_timeouts_s[{name!r}] must be a number of seconds > 0, got {seconds!r}"
                )

    @staticmethod
    def _check_order(pairs: list[tuple[str, float]], *, strict: bool = True) -> None:
        for (a, va), (b, vb) in zip(pairs, pairs[1:], strict=False):
            if va >= vb if strict else va > vb:
                rel = "<" if strict else "<="
                raise ValueError(
                    f"{a} ({va}) must be {rel} {b} ({vb}); timeouts must be ordered "
                    f"{' < '.join(n for n, _ in pairs)}"
                )

    def ceilings(self) -> tuple[float, float, float, float]:
        """The ceilings of the hang timeouts.

        Returns:
            The explicit values of (soft, hard, initial soft, initial hard), and for each one
                left None the most calibration may give it (the defaults, kept in order with
                the explicit ones).
        """
        soft = self.soft_timeout_s
        if soft is None:
            soft = (
                DEFAULT_SOFT_S
                if self.hard_timeout_s is None
                else min(DEFAULT_SOFT_S, self.hard_timeout_s / HARD_RATIO)
            )
        hard = self.hard_timeout_s
        if hard is None:
            hard = max(DEFAULT_HARD_S, HARD_RATIO * soft)
        isoft = self.initial_soft_timeout_s
        if isoft is None:
            isoft = max(DEFAULT_INITIAL_SOFT_S, soft)
            if self.initial_hard_timeout_s is not None:
                isoft = max(soft, min(isoft, self.initial_hard_timeout_s / HARD_RATIO))
        ihard = self.initial_hard_timeout_s
        if ihard is None:
            ihard = max(DEFAULT_INITIAL_HARD_S, HARD_RATIO * isoft, hard)
        return soft, hard, isoft, ihard

    def timeouts(self, *, initial: bool) -> tuple[float, float]:
        """The ceilings of the hang timeouts of one part of an iteration; the watchdog asks
        ``calibrate.Calibrator`` for the values in effect.

        Args:
            initial: Before the iteration's first step (True) or after it.

        Returns:
            (soft, hard) ceilings, in seconds.
        """
        soft, hard, isoft, ihard = self.ceilings()
        return (isoft, ihard) if initial else (soft, hard)


def parse_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError naming the bad value."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store address {addr!r} is not host:port (e.g. 10.0.0.1:29500)")
    return host, int(port)
