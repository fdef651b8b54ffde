"""The writer is background work (``writer.lower_priority``): a session of its own, whose
autogroup gets the lowest share where the kernel has autogroups, SCHED_IDLE, its niceness."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from unbroken.checkpoint import Checkpointer


def _autogroup(pid: int) -> tuple[str, int] | None:
    """(autogroup name, its niceness) of ``pid``, or None where the kernel has none."""
    try:
        name, _, nice = Path(f"/proc/{pid or 'self'}/autogroup").read_text().split()
    except OSError:
        return None
    return name, int(nice)


def _served(ck: Checkpointer) -> int:
    """The writer's pid once it has served a save (it lowers its priority before serving)."""
    pid = ck.writer_pid
    assert pid is not None and pid != os.getpid()
    ck.save(0, {"w": torch.arange(10.0)})
    ck.wait()
    return pid


def test_the_writer_leaves_the_trainers_session_and_runs_on_what_training_leaves(tmp_path):
    with Checkpointer(tmp_path / "ckpt", writer_start="fork") as ck:
        pid = _served(ck)
        assert os.getsid(pid) == pid != os.getsid(0)
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(
            19, os.getpriority(os.PRIO_PROCESS, 0) + ck.config.writer_nice
        )
        mine, theirs = _autogroup(0), _autogroup(pid)
        if mine is not None:  # this machine and CI have autogroups: the writer's is its own
            assert theirs is not None and theirs[0] != mine[0] and theirs[1] == 19


def test_a_writer_at_the_trainers_priority_stays_in_its_session(tmp_path):
    with Checkpointer(
        tmp_path / "ckpt", writer_start="fork", writer_nice=0, writer_idle=False
    ) as ck:
        pid = _served(ck)
        assert os.getsid(pid) == os.getsid(0)
        assert os.sched_getscheduler(pid) == os.sched_getscheduler(0)
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)
        assert _autogroup(pid) == _autogroup(0)
