"""kill -9 of a training process in the middle of a save, at each step of the commit protocol:
the previous checkpoint stays restorable, no torn one is visible, the writer does not outlive
its trainer, and the next save of the same step commits over the debris."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hooks import paused_marker
from procs import SRC, worker_env
from unbroken.checkpoint import Checkpointer, layout
from unbroken.checkpoint.persisting.hooks import POINTS

TESTS = Path(__file__).resolve().parents[1]

TRAINER = textwrap.dedent(
    """
    import sys, torch
    from hooks import PauseAt
    from unbroken.checkpoint import Checkpointer
    w = torch.zeros(1 << 18)
    with Checkpointer(sys.argv[1], keep=3, hooks=PauseAt(sys.argv[2], 2)) as ck:
        for step in (1, 2):
            w.fill_(step)
            ck.save(step, {"w": w})
            ck.wait()
    """
)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.parametrize("point", POINTS)
def test_kill_9_during_a_save_leaves_the_previous_checkpoint(tmp_path: Path, point: str) -> None:
    root = tmp_path / "ckpt"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(root), point],
        env=worker_env(PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)])),
        start_new_session=True,
    )
    try:
        marker = paused_marker(root, point)
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert trainer.poll() is None, f"trainer exited with {trainer.returncode}"
            assert time.monotonic() < deadline, "the writer never reached the pause point"
            time.sleep(0.02)
        writer_pid = int(marker.read_text())
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=10)
        t0 = time.monotonic()
        while not _gone(writer_pid):  # no orphan: the writer dies with its trainer
            assert time.monotonic() - t0 < 1.0, f"writer {writer_pid} outlived its trainer"
            time.sleep(0.01)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()

    assert layout.committed_steps(root) == [1]
    assert not (layout.step_dir(root, 2) / layout.COMMITTED).exists()
    w = torch.zeros(1 << 18)
    with Checkpointer(root, mode="sync") as ck:
        assert ck.latest() == 1
        assert ck.restore({"w": w}) == 1
        assert torch.equal(w, torch.ones(1 << 18))
        w.fill_(2)
        assert ck.save(2, {"w": w})  # over whatever the killed save left
    assert layout.committed_steps(root) == [2, 1]
    assert layout.verify(layout.step_dir(root, 2)) is None
    assert not any(n.startswith("step-2.") for n in os.listdir(root))
