"""Storage faults for real: a checkpoint directory on a small tmpfs that fills up, or that is
remounted read-only in the middle of a save. The previous checkpoint stays intact and
restorable, the error is clear and in the ledger, it is never raised into training (a storage
fault is not a training fault), and the next attempt, once the storage is back, commits."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hooks import PauseUntil, paused_marker
from unbroken.checkpoint import CheckpointConfig, Checkpointer, layout
from unbroken.launcher import errors
from unbroken.ledger import Ledger, read_events

MiB = 1 << 20


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\0" * MiB
        while True:
            try:
                os.write(fd, chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
    finally:
        os.close(fd)


def _restored(root: Path) -> tuple[int | None, torch.Tensor]:
    w = torch.zeros(MiB // 4)
    with Checkpointer(root, run="r", eager_writer=False) as ck:
        return ck.restore({"w": w}), w


def test_a_full_disk_fails_one_save_and_keeps_the_last_checkpoint(
    tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    mnt = tmpfs("6m")
    root = mnt / "ckpt"
    led = Ledger(tmp_path / "run", run="r", rank=0)
    w = torch.zeros(MiB // 4)  # 1 MiB
    error_file = mnt / "error.json"
    errors.write_error_file(error_file, exit_code=3, failures=[], restarts=0, run_id="r")
    old_error = error_file.read_bytes()
    try:
        config = CheckpointConfig(storage_retry_s=0.05)
        with Checkpointer(root, run="r", ledger=led, keep=1, config=config) as ck:
            w.fill_(1.0)
            ck.save(0, {"w": w})
            ck.wait()
            filler = mnt / "filler"
            _fill(filler)
            # Files that must survive a crash: a failed rewrite keeps the old one, no debris.
            with pytest.raises(OSError, match="No space left"):
                errors.write_error_file(
                    error_file, exit_code=4, failures=[], restarts=1, run_id="r"
                )
            assert error_file.read_bytes() == old_error
            assert [n for n in os.listdir(mnt) if "tmp" in n] == []
            assert _restored(root)[0] == 0  # restorable while the disk is full
            os.truncate(filler, filler.stat().st_size - MiB // 2)  # room for half a save
            w.fill_(2.0)
            assert ck.save(1, {"w": w})  # async: staged, then the writer hits ENOSPC
            assert ck.wait() is False  # recorded, not raised
            assert "No space left on device" in str(ck.storage.last_error)
            assert layout.verify(layout.step_dir(root, 0)) is None
            # Less room than a save unless the failed one gave back what it had written.
            os.truncate(filler, filler.stat().st_size - 3 * MiB // 4)
            w.fill_(3.0)
            time.sleep(0.1)  # past the back-off
            ck.save(2, {"w": w})  # training went on; the next save retries, and commits
            assert ck.wait() is True and not ck.storage.failing
    finally:
        led.close()
    assert layout.committed_steps(root) == [2]
    step, got = _restored(root)
    assert step == 2 and torch.equal(got, torch.full_like(got, 3.0))
    fails = [e for e in read_events(tmp_path / "run") if e.kind == "ckpt_fail"]
    assert [e.get("step") for e in fails] == [1] and "No space left" in fails[0].get("error")


def test_storage_turning_read_only_during_a_save(
    tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    mnt = tmpfs("16m")
    root = mnt / "ckpt"
    go = tmp_path / "go"
    led = Ledger(tmp_path / "run", run="r", rank=0)
    w = torch.zeros(MiB // 4)
    try:
        hooks = PauseUntil("done", 1, go)  # every rank's data written, nothing published yet
        with Checkpointer(
            root,
            run="r",
            ledger=led,
            keep=2,
            hooks=hooks,
            config=CheckpointConfig(writer_start="fork", storage_retry_s=0.05),
        ) as ck:
            w.fill_(1.0)
            ck.save(0, {"w": w})
            ck.wait()
            w.fill_(2.0)
            ck.save(1, {"w": w})
            deadline = time.monotonic() + 60
            while not paused_marker(root, "done").exists():
                assert time.monotonic() < deadline, "the writer never reached its pause"
                time.sleep(0.01)
            published = mnt / "published"  # a copy, never claimed before the disk turned read-only
            shutil.copytree(layout.step_dir(root, 0), published / "step-0")
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            go.touch()
            assert ck.wait() is False  # recorded, not raised
            assert "Read-only file system" in str(ck.storage.last_error)
            assert layout.committed_steps(root) == [0]
            assert layout.verify(layout.step_dir(root, 0)) is None
            for where in (root, published):  # restorable from the read-only disk
                step, got = _restored(where)
                assert step == 0 and torch.equal(got, torch.ones_like(got))
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
            w.fill_(3.0)
            time.sleep(0.1)  # past the back-off (0.05 s): a save before it is held back
            assert ck.save(2, {"w": w})
            assert ck.wait() is True
    finally:
        led.close()
    assert layout.committed_steps(root) == [2, 0]
    fails = [e for e in read_events(tmp_path / "run") if e.kind == "ckpt_fail"]
    assert [e.get("step") for e in fails] == [1] and "Read-only" in fails[0].get("error")
