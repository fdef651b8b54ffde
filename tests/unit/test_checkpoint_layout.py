"""The on-disk layout: what counts as committed, checksum checks, retention, config checks."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from unbroken.checkpoint import layout
from unbroken.checkpoint.config import CheckpointConfig


def _commit(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """A committed checkpoint made with the same helpers the coordinator uses."""
    part = layout.partial_dir(root, step)
    part.mkdir(parents=True)
    entries = {}
    for name, data in files.items():
        (part / name).write_bytes(data)
        entries[name] = layout.file_entry(len(data), zlib.crc32(data))
    manifest = layout.manifest_bytes(step=step, world_size=1, files=entries)
    crc = layout.write_durable(part / layout.MANIFEST, manifest)
    final = layout.step_dir(root, step)
    os.rename(part, final)
    layout.write_durable(
        final / layout.COMMITTED, layout.committed_bytes(step=step, manifest_crc32=crc)
    )
    return final


def _files(seed: int) -> dict[str, bytes]:
    return {"__0_0.distcp": bytes([seed]) * 5000 + os.urandom(3000), ".metadata": b"md%d" % seed}


def test_only_committed_checkpoints_are_listed_newest_first(tmp_path: Path) -> None:
    for step in (3, 10, 7):
        _commit(tmp_path, step, _files(step))
    layout.partial_dir(tmp_path, 12).mkdir()  # a save in progress or torn
    torn = layout.step_dir(tmp_path, 11)  # renamed, but COMMITTED never written
    torn.mkdir()
    (torn / layout.MANIFEST).write_text("{}")
    assert layout.committed_steps(tmp_path) == [10, 7, 3]
    assert layout.committed_steps(tmp_path / "absent") == []


def test_a_sound_checkpoint_verifies(tmp_path: Path) -> None:
    ckpt = _commit(tmp_path, 1, _files(1))
    assert layout.verify(ckpt) is None
    assert layout.manifest_files(ckpt) == [".metadata", "__0_0.distcp"]


def test_a_flipped_byte_is_caught_and_named(tmp_path: Path) -> None:
    ckpt = _commit(tmp_path, 1, _files(1))
    path = ckpt / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[4321] ^= 0x01
    path.write_bytes(data)
    why = layout.verify(ckpt)
    assert why is not None and "__0_0.distcp" in why and "checksum mismatch" in why
    # The cheap check (sizes only) does not read the bytes, so it cannot see a flip.
    assert layout.verify(ckpt, checksums=False) is None
    # A share of the files that does not include the damaged one passes.
    assert layout.verify(ckpt, files=[".metadata"]) is None


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest", "marker"])
def test_damage_of_any_kind_is_caught(tmp_path: Path, damage: str) -> None:
    ckpt = _commit(tmp_path, 1, _files(1))
    if damage == "truncate":
        with open(ckpt / "__0_0.distcp", "r+b") as f:
            f.truncate(100)
    elif damage == "delete":
        (ckpt / ".metadata").unlink()
    elif damage == "manifest":
        raw = (ckpt / layout.MANIFEST).read_text().replace('"world_size": 1', '"world_size": 2')
        (ckpt / layout.MANIFEST).write_text(raw)
    else:
        (ckpt / layout.COMMITTED).write_text("not json")
    assert layout.verify(ckpt) is not None


def test_retention_keeps_the_newest_and_sweeps_leftovers(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _commit(tmp_path, step, _files(step))
    layout.partial_dir(tmp_path, 2).mkdir(exist_ok=True)  # abandoned older partial
    layout.partial_dir(tmp_path, 9).mkdir()  # a newer save in flight: must stay
    (tmp_path / "step-3.old-0123abcd").mkdir()  # a replaced checkpoint, removal cut short
    removed = layout.retain(tmp_path, keep=2, newest=4)
    assert sorted(removed) == ["step-1", "step-2", "step-2.partial", "step-3.old-0123abcd"]
    assert layout.committed_steps(tmp_path) == [4, 3]
    assert layout.partial_dir(tmp_path, 9).is_dir()
    assert layout.retain(tmp_path, keep=1, newest=4) == ["step-3"]
    assert layout.committed_steps(tmp_path) == [4]  # never the only one
    assert layout.verify(layout.step_dir(tmp_path, 4)) is None


def test_retention_never_removes_the_checkpoint_just_committed(tmp_path: Path) -> None:
    # A run that restored step 2 (step 6 was rejected and quarantined; step 5 is left over
    # from an older run) commits step 3: the new checkpoint stays even though it is not the
    # highest; rejected directories of steps below it go.
    for step in (2, 5, 3):
        _commit(tmp_path, step, _files(step))
    (tmp_path / "step-1.rejected-0a0b0c0d").mkdir()
    (tmp_path / "step-6.rejected-0a0b0c0d").mkdir()
    removed = layout.retain(tmp_path, keep=1, newest=3)
    assert sorted(removed) == ["step-1.rejected-0a0b0c0d", "step-2"]
    assert layout.committed_steps(tmp_path) == [5, 3]
    assert (tmp_path / "step-6.rejected-0a0b0c0d").is_dir()


def test_sweep_removes_every_leftover_but_committed_checkpoints(tmp_path: Path) -> None:
    _commit(tmp_path, 4, _files(4))
    for name in ("step-9.partial", "step-2.partial", "step-6", "step-4.old-00ff00ff"):
        (tmp_path / name).mkdir()
    layout.write_marker(tmp_path / "step-9.partial" / layout.skip_marker(1), {"reason": "x"})
    assert layout.sweep_incomplete(tmp_path) == [
        "step-2.partial",
        "step-4.old-00ff00ff",
        "step-6",
        "step-9.partial",
    ]
    assert os.listdir(tmp_path) == ["step-4"]


def test_config_rejects_bad_values_and_says_which() -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointConfig(keep=0)
    with pytest.raises(ValueError, match="on_busy must be one of"):
        CheckpointConfig(on_busy="drop")
    with pytest.raises(ValueError, match="mode must be one of"):
        CheckpointConfig(mode="lazy")
    with pytest.raises(ValueError, match="every_steps must be >= 0"):
        CheckpointConfig(every_steps=-1)
    cfg = CheckpointConfig(every_steps=5)
    assert [s for s in range(16) if cfg.due(s)] == [4, 9, 14]
    assert not any(CheckpointConfig().due(s) for s in range(10))


def test_the_coordinator_abandons_a_step_another_rank_skipped_or_failed(tmp_path: Path) -> None:
    from unbroken.checkpoint.persisting.commit import Abandoned, wait_for_ranks

    def never(point: str) -> None:
        raise AssertionError(f"reached {point}")

    part = layout.partial_dir(tmp_path, 8)
    part.mkdir()
    (part / layout.done_record(0)).write_bytes(b"x")
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not finish"):
        wait_for_ranks(part, world_size=3, deadline=0.0, at=never)
    layout.write_marker(part / layout.skip_marker(2), {"reason": "busy"})
    with pytest.raises(Abandoned, match="rank-2 skipped this step"):
        wait_for_ranks(part, world_size=3, deadline=1e12, at=never)
    other = layout.partial_dir(tmp_path, 9)
    layout.write_marker(other / layout.fail_marker(1), {"error": "ENOSPC"})
    with pytest.raises(Abandoned, match="rank-1 failed.*ENOSPC"):
        wait_for_ranks(other, world_size=2, deadline=1e12, at=never)


def test_a_done_record_is_durable_though_the_coordinator_commits_its_directory_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 renames ``step-N.partial`` to ``step-N`` as soon as the last done record is in,
    which may be before that record's writer has fsynced the directory: the writer must not
    fail a save that was committed (it fsyncs the directory it opened, renamed or not)."""
    from unbroken.ledger import durable

    part = layout.partial_dir(tmp_path, 3)
    part.mkdir()
    rename = os.replace

    def replace_then_commit(src: Path, dst: Path) -> None:
        rename(src, dst)
        if Path(dst).parent == part:  # the record is in: the coordinator commits now
            rename(part, layout.step_dir(tmp_path, 3))

    monkeypatch.setattr(durable.os, "replace", replace_then_commit)
    layout.write_durable(part / layout.done_record(1), b"record")
    assert (layout.step_dir(tmp_path, 3) / layout.done_record(1)).read_bytes() == b"record"
    assert not part.exists()
