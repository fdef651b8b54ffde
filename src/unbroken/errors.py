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


EXIT_PREEMPTED = 143
"""A worker's exit code after a graceful preemption (128 + SIGTERM, as a process the signal
ended): its newest step is committed (``Preempted``)."""


class Preempted(StopJob):
    """The job was asked to stop (SIGTERM) and every rank saved the same step durably: not a
    failure. ``unbroken.main`` exits with ``EXIT_PREEMPTED`` (143); the relaunched job resumes
    from that step (``unbroken.checkpoint.preempt``)."""

    exit_code = EXIT_PREEMPTED
    unwound = False
    """Raised while recovering from a fault (the launcher stopping the workers to restart
    them): nothing was saved and nothing is left to wait for, ``unbroken.main`` exits at once."""


class ConfigError(UnbrokenError, ValueError):
    """The job is misconfigured (a bad flag, a bad config file): no restart can fix it.

    ``unbroken.run`` does not restart ``fn`` in-process for it (it re-raises it at once),
    ``unbroken.main`` exits with ``EXIT_CONFIG`` and ``unbroken-run`` then ends the job with
    exit code 2. A ``ValueError``, so code that checks input with ``except ValueError`` still
    catches it.
    """


def stop_job_of(error: BaseException | None) -> StopJob | None:
    """The ``StopJob`` that ended a call, also when another exception (a restart interrupt
    that a peer's own stop sent) replaced it on its way out: it is then that one's context.

    Args:
        error: What the call raised (None: it returned).

    Returns:
        The ``StopJob``, or None.
    """
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, StopJob):
            return error
        error, seen = error.__context__, seen + 1
    return None
