"""The goodput ledger: event records, the per-process writer, the reader, the goodput math.

Owns the event schema and every figure derived from it. Imports nothing else of ours and
never imports torch, so any process (a launcher, the dashboard) can use it cheaply.
"""

from unbroken.ledger import events, goodput, report
from unbroken.ledger.events import Event
from unbroken.ledger.goodput import FaultRecord, RunReport, compute
from unbroken.ledger.reader import read_events, read_run
from unbroken.ledger.writer import Ledger, install_sigterm_flush, process_start_time

__all__ = [
    "Event",
    "FaultRecord",
    "RunReport",
    "compute",
    "goodput",
    "report",
    "Ledger",
    "events",
    "install_sigterm_flush",
    "process_start_time",
    "read_events",
    "read_run",
]
