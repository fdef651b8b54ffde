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


EXIT_CONFIG = 78
"""A worker's exit code for a configuration error (sysexits' EX_CONFIG): ``unbroken-run`` ends
the job at once with its usage exit code 2 instead of restarting it."""


EXIT_STORAGE = 74
"""A worker's exit code when checkpoint storage ended the job (sysexits' EX_IOERR; see
``StopJob``): ``unbroken-run`` ends the job with its exit code 6 instead of restarting it."""


class StopJob(UnbrokenError):
    """An error that ends the job on purpose: no restart can fix it.

    ``unbroken.run`` does not restart ``fn`` in-process for it (it re-raises it at once, and
    its peers are told), ``unbroken.main`` exits with its ``exit_code`` and ``unbroken-run``
    then ends the job. ``unbroken.checkpoint.StorageFailed`` is one.
    """

    exit_code = EXIT_STORAGE


class ConfigError(UnbrokenError, ValueError):
    """The job is misconfigured (a bad flag, a bad config file): no restart can fix it.

    ``unbroken.run`` does not restart ``fn`` in-process for it (it re-raises it at once),
    ``unbroken.main`` exits with ``EXIT_CONFIG`` and ``unbroken-run`` then ends the job with
    exit code 2. A ``ValueError``, so code that checks input with ``except ValueError`` still
    catches it.
    """
