"""Storage faults for real: a checkpoint directory on a small tmpfs that fills up, or that is
remounted read-only in the middle of a save. The previous checkpoint stays intact and
restorable, the error is clear and in the ledger, it is raised once (the in-process restart's
policy takes it from there), and the next save, once the storage is back, commits."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hooks import PauseUntil, paused_marker
from unbroken.checkpoint import CheckpointConfig, Checkpointer, CheckpointError, layout
from unbroken.launcher import errors
from unbroken.ledger import Ledger, read_events

MiB = 1 << 20


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("8m")``: a fresh tmpfs of that size under tmp_path, unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"mnt{len(mounted)}"
        mnt.mkdir()
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {res.stderr}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


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
        with Checkpointer(root, run="r", ledger=led, keep=1) as ck:
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
            with pytest.raises(CheckpointError, match="No space left on device"):
                ck.wait()
            assert layout.verify(layout.step_dir(root, 0)) is None
            # Less room than a save unless the failed one gave back what it had written.
            os.truncate(filler, filler.stat().st_size - 3 * MiB // 4)
            w.fill_(3.0)
            ck.save(2, {"w": w})  # training went on; the next save retries, and commits
            ck.wait()
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
            config=CheckpointConfig(writer_start="fork"),
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
            with pytest.raises(CheckpointError, match="Read-only file system"):
                ck.wait()
            assert layout.committed_steps(root) == [0]
            assert layout.verify(layout.step_dir(root, 0)) is None
            for where in (root, published):  # restorable from the read-only disk
                step, got = _restored(where)
                assert step == 0 and torch.equal(got, torch.ones_like(got))
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
            w.fill_(3.0)
            ck.save(2, {"w": w})
            ck.wait()
    finally:
        led.close()
    assert layout.committed_steps(root) == [2, 0]
    fails = [e for e in read_events(tmp_path / "run") if e.kind == "ckpt_fail"]
    assert [e.get("step") for e in fails] == [1] and "Read-only" in fails[0].get("error")
