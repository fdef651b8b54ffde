"""Fault injection from a deterministic plan.

Owns the plan format (YAML) and the injectors that fire it. Of ours it imports only the
checkpoint directory's torch-free layout and slow-storage control files
(``unbroken.checkpoint.layout``, ``.throttle``), which the storage faults act on; the ledger is
passed in as an event sink.
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
