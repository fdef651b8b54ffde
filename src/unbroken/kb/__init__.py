"""The searchable record of experiments: SQLite (FTS5) over run directories.

Indexes each run's configuration, fault trace and results (``unbroken kb ingest``), and answers
``search``, ``show`` and ``compare``. Derived data only: it reads run directories through
``unbroken.ledger`` and never becomes a second source of truth. Imports ``unbroken.ledger`` and
nothing else of ours (never torch, the launcher, checkpoints or restart).
"""

from unbroken.kb.extract import RunRecord, extract
from unbroken.kb.store import Hit, KnowledgeBase, default_path

__all__ = ["Hit", "KnowledgeBase", "RunRecord", "default_path", "extract"]
