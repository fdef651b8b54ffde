"""The searchable record of experiments: SQLite (FTS5) over run directories.

Indexes each run's configuration, fault trace and results (``unbroken kb ingest``), and answers
``search``, ``show`` and ``compare``. Derived data only: it reads run directories through
``unbroken.ledger`` and never becomes a second source of truth. Never imports torch, the
launcher, checkpoints or restart. Imports of ours: ``unbroken.env`` (where the database is),
``unbroken.ledger``.
"""

from unbroken.kb.extract import RunRecord, extract
from unbroken.kb.store import Hit, KnowledgeBase, default_path

__all__ = ["Hit", "KnowledgeBase", "RunRecord", "default_path", "extract"]
