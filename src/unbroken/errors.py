"""The root of unbroken's error hierarchy.

Every error unbroken raises on purpose is an ``UnbrokenError`` (or a ``ValueError`` for bad user
input), so a caller can tell a platform failure from a bug in their own code. Imports of ours:
none.
"""

from __future__ import annotations


class UnbrokenError(Exception):
    """A failure unbroken detected and reports: a dead helper process, a timeout, a bad checkpoint.

    Messages say what was wrong, the value seen, and what to do.
    """
