"""The reference training script; once per run, rank R sends itself signal SIG after step K.

Environment: TEST_SIGNAL (e.g. SIGSEGV, SIGSTOP), TEST_SIGNAL_STEP, TEST_SIGNAL_RANK. The claim
is a file in the run directory, so a restarted worker does not fire again.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from pathlib import Path

from unbroken import job
from unbroken.workload import train

SIG = getattr(signal, os.environ["TEST_SIGNAL"])
STEP = int(os.environ["TEST_SIGNAL_STEP"])
RANK = int(os.environ["TEST_SIGNAL_RANK"])
_heartbeat = job.heartbeat


def heartbeat(step: int | None = None, **kwargs: int | None) -> None:
    _heartbeat(step, **kwargs)
    if step != STEP or os.environ.get("RANK") != str(RANK):
        return
    marker = Path(os.environ["UNBROKEN_RUN_DIR"]) / f"fired-{SIG.name}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), SIG)


job.heartbeat = heartbeat  # unbroken.run's step hook sends the reference script's heartbeats

if __name__ == "__main__":
    sys.exit(train.main())
