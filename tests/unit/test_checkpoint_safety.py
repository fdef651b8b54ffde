"""Nothing outside is deleted: retention, quarantine and the restore sweep never follow a
symlink out of the checkpoint directory, never quarantine on a transient I/O error, and every
file that must survive a crash is written atomically and fsynced, directory included."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from unbroken.checkpoint import Checkpointer, CheckpointError, layout
from unbroken.checkpoint.restoring import restore
from unbroken.launcher import errors


def _fake_checkpoint(path: Path) -> None:
    """A committed checkpoint as far as listing and retention look (marker + manifest)."""
    path.mkdir(parents=True)
    manifest = layout.manifest_bytes(step=0, world_size=1, files={})
    crc = layout.write_durable(path / layout.MANIFEST, manifest)
    layout.write_durable(
        path / layout.COMMITTED, layout.committed_bytes(step=0, manifest_crc32=crc)
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_retention_and_the_restore_sweep_never_follow_a_symlink_out(tmp_path: Path) -> None:
    """Before: retention deleted the COMMITTED marker of the checkpoint a link pointed to."""
    outside = tmp_path / "elsewhere"
    for name in ("old", "partial", "uncommitted"):
        _fake_checkpoint(outside / name)
    before = _tree(outside)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "step-0").symlink_to(outside / "old")  # an older "committed" step
    (root / "step-1.partial").symlink_to(outside / "partial")
    (root / "step-2").symlink_to(outside / "uncommitted")
    w = torch.arange(3.0)
    with Checkpointer(root, run="r", mode="sync", keep=1) as ck:
        assert ck.restore({"w": w}) is None  # the sweep ran, and nothing restorable was seen
        for step in (3, 4):
            ck.save(step, {"w": w})
    assert layout.committed_steps(root) == [4]
    assert _tree(outside) == before
    assert layout.sweep_incomplete(root) == [] and _tree(outside) == before
    assert all((root / n).is_symlink() for n in ("step-0", "step-1.partial", "step-2"))


def test_a_transient_io_error_is_retried_and_never_quarantines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an EIO while checking the only checkpoint renamed it out of sight
    (``.rejected``), and a later retention deleted it. EIO is injected: no device fails here."""
    root = tmp_path / "ckpt"
    w = torch.arange(8.0)
    with Checkpointer(root, run="r", mode="sync") as ck:
        ck.save(7, {"w": w})
    real = layout.file_crc32
    failures = {"left": 2}

    def flaky(path: Path) -> tuple[int, int]:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(layout, "file_crc32", flaky)
    monkeypatch.setattr(restore, "IO_RETRY_BACKOFF_S", (0.01, 0.01, 0.01))
    target = torch.zeros(8)
    with Checkpointer(root, run="r", eager_writer=False) as ck:
        assert ck.restore({"w": target}) == 7  # two failures, then it read
    assert torch.equal(target, w)
    failures["left"] = 100  # the storage stays broken: reported, and left in place
    before = sorted(os.listdir(root))
    with (
        Checkpointer(root, run="r", eager_writer=False) as ck,
        pytest.raises(CheckpointError, match="after 4 attempts .* left in place, not rejected"),
    ):
        ck.restore({"w": target})
    assert sorted(os.listdir(root)) == before and layout.committed_steps(root) == [7]


def test_the_error_file_is_fsynced_with_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: tmp + rename without fsync; a machine crash could leave an empty error file."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    path = tmp_path / "run" / "error.json"
    errors.write_error_file(path, exit_code=4, failures=[], restarts=2, run_id="r")
    assert json.loads(path.read_text())["launcher_exit_code"] == 4
    assert any(".tmp-" in s and "error.json" in s for s in synced)  # the data, before rename
    assert str(tmp_path / "run") in synced  # the rename
