"""Fault injection from a deterministic plan.

Owns the plan format (YAML) and the injectors that fire it, the slow-storage and storage-fail
faults' control files with the checkpoint writer hooks that obey them (``throttle``,
``storagefail``), the slow rank's CPU throttle (``slowrank``) and the network fault's request
to the emulated cluster (``link``).
The storage faults act on the checkpoint directory through its torch-free on-disk layout; the
ledger is passed in as a ``Recorder``. Never imports torch at import time. Imports of ours:
``unbroken.errors``, ``unbroken.env``, ``unbroken.ledger``, ``unbroken.checkpoint.layout``.
"""

from unbroken.faults.inject import FaultInjector, InjectedFault, fired_faults
from unbroken.faults.plan import KINDS, FaultPlan, FaultSpec, load_plan, parse_plan

__all__ = [
    "KINDS",
    "FaultInjector",
    "FaultPlan",
    "FaultSpec",
    "InjectedFault",
    "fired_faults",
    "load_plan",
    "parse_plan",
]
