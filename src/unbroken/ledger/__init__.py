"""The goodput ledger: event records, the per-process writer, the reader, the goodput math.

Owns the event schema, the one ``Recorder`` protocol every recording component takes (and
its null ``NULL``), and every figure derived from the records. Also the two file disciplines
every package shares, here because every package may import the ledger: atomic durable writes
(``durable``) and one owner per run or checkpoint directory (``owner``). Never imports torch,
so any process (a launcher, the dashboard) can use it cheaply. Imports of ours:
``unbroken.mask``.
"""

from unbroken.ledger import events, goodput, report
from unbroken.ledger.events import Event
from unbroken.ledger.goodput import FaultRecord, RunReport, compute
from unbroken.ledger.process import install_sigterm_flush
from unbroken.ledger.reader import read_events, read_run
from unbroken.ledger.recorder import NULL, NullRecorder, Recorder
from unbroken.ledger.writer import Ledger, process_start_time

__all__ = [
    "NULL",
    "Event",
    "FaultRecord",
    "RunReport",
    "compute",
    "goodput",
    "report",
    "Ledger",
    "NullRecorder",
    "Recorder",
    "events",
    "install_sigterm_flush",
    "process_start_time",
    "read_events",
    "read_run",
]
