"""The one logging setup: ``init_logging()``.

Library modules only ever call ``logging.getLogger(__name__)``; a process's entry point (the
``unbroken`` and ``unbroken-run`` CLIs, the reference training script, the checkpoint writer
process, a benchmark worker) calls ``init_logging()`` once, first thing. Imports of ours:
none.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"


def init_logging(level: int = logging.INFO) -> None:
    """Send log records of ``level`` and above to stderr as ``FORMAT``; a no-op when the root
    logger already has a handler (the first call wins, as ``logging.basicConfig``)."""
    logging.basicConfig(level=level, format=FORMAT)
