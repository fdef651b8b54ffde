"""In-process restart: survive exceptions and hangs without losing the process.

``run(fn)`` calls ``fn(ctx)``; when any rank raises, hangs, or gets stuck in a collective,
every rank is interrupted, the process group is aborted, health checks run, ranks are
renumbered, a fresh group is formed, and ``fn`` is called again. Files, one per step:
``wrapper`` (the loop), ``store`` + ``store_server`` (the coordination store), ``pg`` (form,
abort, tear down), ``monitor`` + ``interrupt`` (the threads that watch and stop ``fn``),
``watchdog`` (hang decisions), ``health`` (checks), ``assign`` (culprit, limits, new ranks),
``context`` (what ``fn`` gets: its place, ``step_done``, named ``phase``s), ``config``
(configuration, errors, exit codes), ``calibrate`` (learned timeouts, per phase too), ``solo``
(``fn`` once, when in-process restart is off: the launcher-only configuration), ``handover``
(the node agent's handover of a worker to its next round, after another node is lost).

Imports torch; never the workload, the checkpoint module or the launcher. Imports of ours:
``unbroken.errors``, ``unbroken.env``, ``unbroken.ledger``, ``unbroken.mask``.
"""

from unbroken.restart.config import (
    EXIT_ESCALATE,
    EXIT_EXCLUDED,
    Escalated,
    RankExcluded,
    RestartConfig,
    RestartError,
    RestartInterrupt,
)
from unbroken.restart.context import RestartCause, RestartContext
from unbroken.restart.health import (
    CudaDeviceCheck,
    FaultCountCheck,
    HealthCheck,
    HealthInfo,
    HealthResult,
    HostMemoryCheck,
    NvmlCheck,
    default_checks,
)
from unbroken.restart.wrapper import run

__all__ = [
    "EXIT_ESCALATE",
    "EXIT_EXCLUDED",
    "CudaDeviceCheck",
    "Escalated",
    "FaultCountCheck",
    "HealthCheck",
    "HealthInfo",
    "HealthResult",
    "HostMemoryCheck",
    "NvmlCheck",
    "RankExcluded",
    "RestartCause",
    "RestartConfig",
    "RestartContext",
    "RestartError",
    "RestartInterrupt",
    "default_checks",
    "run",
]
