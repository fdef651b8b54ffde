"""Turn what the agent observed (an exit status, silent workers, an error) into ``Failure``s."""

from __future__ import annotations

from unbroken.errors import EXIT_CONFIG, EXIT_STORAGE
from unbroken.launcher import errors
from unbroken.launcher.errors import Failure
from unbroken.launcher.machine import CONFIG_CAUSE, STORAGE_CAUSE
from unbroken.launcher.monitor import Hang
from unbroken.launcher.workers import WorkerExit

STOPPED_STATES = ("T", "t")


def from_exit(x: WorkerExit, *, round_: int) -> Failure:
    """A worker that exited non-zero or was killed by a signal."""
    cause, category, message = errors.classify_exit(
        exit_code=x.exit_code,
        signum=x.signum,
        error_message=x.error_message,
        oom_killed=x.oom_killed,
    )
    if x.signum is None and x.exit_code == EXIT_CONFIG:
        cause, category = CONFIG_CAUSE, "user"
        message = f"configuration error (exit code {EXIT_CONFIG}): {message}"
    elif x.signum is None and x.exit_code == EXIT_STORAGE:
        cause, category = STORAGE_CAUSE, "infra"
        message = f"checkpoint storage failed for good (exit code {EXIT_STORAGE}): {message}"
    return Failure(
        rank=x.rank,
        local_rank=x.local_rank,
        cause=cause,
        category=category,
        detector="exit",
        ts=x.ts,
        round=round_,
        exit_code=x.exit_code,
        signal=None if x.signum is None else errors.signal_name(x.signum),
        pid=x.pid,
        message=message,
    )


def from_hangs(
    hangs: list[Hang], states: dict[int, str | None], *, ts: float, round_: int
) -> list[Failure]:
    """Silent workers, the likeliest culprit first: a stopped process (state T), then the
    longest silent. Their times keep that order (one microsecond apart), so the root cause by
    time is the likeliest culprit and the others are co-suspects. ``states``: local rank ->
    the kernel's state letter."""
    order = sorted(
        hangs, key=lambda h: (states.get(h.local_rank) not in STOPPED_STATES, -h.silent_s, h.rank)
    )
    out = []
    for i, h in enumerate(order):
        stopped = states.get(h.local_rank) in STOPPED_STATES
        out.append(
            Failure(
                rank=h.rank,
                local_rank=h.local_rank,
                cause="hang",
                category="infra",
                detector="heartbeat",
                ts=ts + i * 1e-6,
                round=round_,
                pid=h.pid,
                message=f"no heartbeat for {h.silent_s:.2f} s (the {h.phase} timeout is "
                f"{h.timeout_s:.2f} s); last step reported: {h.last_step}"
                + ("; the process is stopped (SIGSTOP/SIGTSTP)" if stopped else "")
                + (
                    f"; it ran or waited to run {h.runnable:.2f} of the time lately"
                    if h.runnable is not None
                    else ""
                )
                + (f"; it wrote {h.sending:.0f} B/s lately" if h.sending is not None else ""),
            )
        )
    return out


def of_agent(cause: str, *, detector: str, message: str, ts: float, round_: int) -> Failure:
    """A failure of the node rather than of a worker: rendezvous, spawn, node lost, signal."""
    return Failure(
        rank=-1,
        local_rank=-1,
        cause=cause,
        category="infra",
        detector=detector,
        ts=ts,
        round=round_,
        message=message,
    )


def of_signal(signum: int, *, ts: float, round_: int) -> Failure:
    name = errors.signal_name(signum)
    return of_agent(
        f"agent_{name.lower()}",
        detector="signal",
        message=f"the agent received {name}",
        ts=ts,
        round_=round_,
    )
