"""A configuration error is not a fault: the launcher's restart budget is not spent on it (a
worker exit code ``EXIT_CONFIG`` ends the job with exit 2)."""

from __future__ import annotations

from unbroken.errors import EXIT_CONFIG, ConfigError, UnbrokenError
from unbroken.launcher import errors
from unbroken.launcher import failures as failures_
from unbroken.launcher.machine import Machine, State, Tick
from unbroken.launcher.workers import WorkerExit


def test_config_error_is_a_value_error_and_ours() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, UnbrokenError)


def _exit(code: int) -> WorkerExit:
    return WorkerExit(local_rank=0, rank=0, pid=1, exit_code=code, signum=None, ts=1.0)


def test_a_worker_exiting_with_the_config_code_ends_the_job_with_exit_2() -> None:
    failure = failures_.from_exit(_exit(EXIT_CONFIG), round_=0)
    assert (failure.cause, failure.category) == ("config", "user")
    m = Machine(max_restarts=10, max_no_progress_restarts=0)
    m.begin()
    m.rendezvous_done()
    m.started()
    m.observe(Tick(failures=(failure,)))
    assert m.stopped(progress=None) is State.FAILED
    assert m.exit_code == errors.EXIT_USAGE and m.restarts == 0
    # any other exit code still restarts
    other = failures_.from_exit(_exit(1), round_=0)
    assert other.cause == "exit_code"
