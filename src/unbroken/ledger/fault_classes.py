"""Fault classes and phases: which class a fault belongs to and where it fired.

A fault's *class* groups the ways a job breaks by what recovering from it takes:

- ``exception``: Python raised (the in-process restart's case);
- ``hang``: a rank stopped making progress, in Python, a collective or native code;
- ``crash``: a process died (SIGKILL, SIGSEGV, an OOM kill, SIGTERM, a non-zero exit);
- ``node``: a whole node went away (its launcher agent with it), lost or drained;
- ``storage``: checkpoint storage was slow or its data corrupt;
- ``degradation``: the job got slower without breaking (a slow rank, a degraded network);
- ``other``: anything else (a rendezvous or process-group failure, an unknown cause).

An injected fault's class comes from its kind (``INJECTED_CLASSES``: every kind of
``unbroken.faults.plan.KINDS`` must be there, a test says so); a natural one's from the cause
its detection named (``natural_class``).

A fault's *phase* is where it fired: the ``phase`` of its ``fault_injected`` record (a fault
targeted at a phase fires on entering it: init, data, save, persist, restore, validation,
recovery, shutdown or a phase the user named), else ``step`` (the plan's default: after a step
completed). A natural fault's phase is the ``phase`` its detection record names, else unknown
(None).
"""

from __future__ import annotations

CLASSES = ("exception", "hang", "crash", "node", "storage", "degradation", "other")
"""Every fault class, in the order reports list them."""

OTHER = "other"

STEP_PHASE = "step"
"""The phase of an injected fault whose record names none (it fired after a step completed)."""

PHASES = (
    "init",
    "data",
    STEP_PHASE,
    "validation",
    "save",
    "persist",
    "restore",
    "recovery",
    "shutdown",
)
"""The phases reports list first, in this order; other (user) phase names follow, sorted."""

UNKNOWN_PHASE = "unknown"
"""The group of faults whose phase is not known (natural faults, mostly)."""

INJECTED_CLASSES: dict[str, str] = {
    "exception": "exception",
    "hang": "hang",
    "hang-collective": "hang",
    "hang-native": "hang",
    "sigkill": "crash",
    "sigterm": "crash",
    "segfault": "crash",
    "oom-kill": "crash",
    "node-loss": "node",
    "node-drain": "node",  # the emulated cluster's (``unbroken bench k8s --drain``)
    "slow-storage": "storage",
    "storage-fail": "storage",
    "checkpoint-corruption": "storage",
    "slow-rank": "degradation",
    "network": "degradation",
}
"""Injected fault kind -> class."""

# Causes a detection names (launcher.errors, restart.assign, the launcher agent) -> class.
_NATURAL_CLASSES: dict[str, str] = {
    "stuck": "hang",
    "exit_code": "crash",
    "node_lost": "node",
}


def natural_class(cause: str | None) -> str:
    """The class of a fault from the cause its detection named.

    An injected kind's name maps as it does for an injected fault; ``stuck`` is a hang;
    a signal (``sigabrt``, ``signal:SIGUSR1``, ``SIGKILL``) or an exit (``exit_code``,
    ``exit 1``) a crash; ``node_lost`` and the agent's own signals (``agent_sigterm``) a node;
    an exception's type name (``RuntimeError``, ``InjectedFault``) an exception; else other.
    """
    if not cause:
        return OTHER
    low = cause.lower()
    if low in INJECTED_CLASSES:
        return INJECTED_CLASSES[low]
    if low in _NATURAL_CLASSES:
        return _NATURAL_CLASSES[low]
    if low.startswith("agent_"):
        return "node"
    if low.startswith(("sig", "exit ")):
        return "crash"
    if cause[0].isupper() and cause.isidentifier():
        return "exception"
    return OTHER


def fault_class(kind: str | None, *, injected: bool) -> str:
    """The class of a fault: from its kind when injected, else from its cause (``kind``)."""
    if injected:
        return INJECTED_CLASSES.get(str(kind), OTHER)
    return natural_class(kind)


def phase_order(name: str) -> tuple[int, str]:
    """Sort key of a phase group: ``PHASES`` in order, user phases by name, unknown last."""
    if name in PHASES:
        return (0, f"{PHASES.index(name):03d}")
    if name == UNKNOWN_PHASE:
        return (2, name)
    return (1, name)
