"""The goodput planner: what goodput a job of a given size, failure rate, step time and storage
can expect under each layering of unbroken, with which checkpoint interval, memory tier and
hot spares.

``config`` holds the job (``PlanConfig``), ``model`` the analytical expectation, ``simulate``
a seeded Monte Carlo run of the same job for the spread, ``measured`` turns a real run's
ledger (or its ``unbroken report --json``) into per-fault costs, ``scenarios`` the stored
run summaries the planner is validated against, ``cli`` is ``unbroken plan``. ``observed``
measures a run's compute and storage times from its ledger, ``tune`` sizes the durable and
snapshot intervals and hang timeouts on them, ``tune_cli`` is ``unbroken plan --recommend``.
Standard library only; never imports torch. Imports of ours: ``unbroken.ledger``.
"""

from unbroken.plan.config import KINDS, LAYERINGS, PlanConfig
from unbroken.plan.model import Prediction, predict
from unbroken.plan.simulate import Spread, simulate

__all__ = ["KINDS", "LAYERINGS", "PlanConfig", "Prediction", "Spread", "predict", "simulate"]
