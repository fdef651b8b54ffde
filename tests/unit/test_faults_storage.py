"""slow-storage and checkpoint-corruption: what they do on disk, and how goodput counts them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from sinks import Sink
from unbroken.checkpoint import layout
from unbroken.faults import FaultInjector, parse_plan, storage, throttle
from unbroken.ledger.events import CKPT_SKIP, FAULT_INJECTED, STEP, Event
from unbroken.ledger.goodput import compute

SRC = Path(__file__).parents[2] / "src"


# --- slow storage ----------------------------------------------------------------------------
def test_slow_storage_fires_without_ending_anything(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    plan = parse_plan(
        {"faults": [{"step": 2, "rank": 1, "kind": "slow-storage", "mbps": 2, "saves": 2}]}
    )
    sink = Sink()
    FaultInjector(plan, run_dir=tmp_path, rank=1, sink=sink).on_step(2)  # returns
    ((kind, data),) = sink.events
    assert kind == "fault_injected" and sink.flushes == 1
    assert data["disruptive"] is False and data["fault"] == "slow-storage"
    assert (data["mbps"], data["saves"], data["seconds"], data["ranks"]) == (2.0, 2, None, [1])
    assert Path(data["control"]).parent == throttle.control_dir(ckpt)
    # Rank 0's writer is not slowed; rank 1's is, for exactly two saves (counted on disk, so
    # a restarted writer does not start over).
    assert throttle.save_rate(ckpt, rank=0, now=time.time()) is None
    assert throttle.save_rate(ckpt, rank=1, now=time.time()) == 2e6
    assert throttle.save_rate(ckpt, rank=1, now=time.time()) == 2e6
    assert throttle.save_rate(ckpt, rank=1, now=time.time()) is None


def test_slow_storage_for_seconds_on_every_rank_and_the_lowest_rate_wins(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    throttle.write_control(ckpt, index=0, ranks=None, bytes_per_s=3e6, saves=None, seconds=5)
    throttle.write_control(ckpt, index=1, ranks=[1], bytes_per_s=1e6, saves=1, seconds=None)
    now = time.time()
    assert throttle.save_rate(ckpt, rank=0, now=now) == 3e6
    assert throttle.save_rate(ckpt, rank=1, now=now) == 1e6  # both apply: the slower
    assert throttle.save_rate(ckpt, rank=1, now=now) == 3e6  # the 1-save fault is used up
    assert throttle.save_rate(ckpt, rank=0, now=now + 6) is None  # the 5 s are over
    # A torn or foreign file is ignored, not fatal to the writer.
    (throttle.control_dir(ckpt) / "slow-9.json").write_text("{")
    assert throttle.save_rate(ckpt, rank=0, now=now) == 3e6


def test_slow_storage_without_checkpoints_says_so(tmp_path: Path) -> None:
    plan = parse_plan({"faults": [{"step": 0, "rank": 0, "kind": "slow-storage"}]})
    sink = Sink()
    FaultInjector(plan, run_dir=tmp_path, rank=0, sink=sink).on_step(0)
    data = sink.events[0][1]
    assert data["control"] is None and "no checkpoint directory" in data["reason"]
    assert not (tmp_path / "ckpt").exists()


# --- corruption ------------------------------------------------------------------------------
def _commit(root: Path, step: int, *, world: int = 2) -> Path:
    """A committed checkpoint as the coordinator writes it (random bytes for the data)."""
    ckpt = layout.step_dir(root, step)
    ckpt.mkdir(parents=True)
    files = {}
    for name in [layout.data_file(r) for r in range(world)] + [layout.DCP_METADATA]:
        payload = os.urandom(4096 + 17 * step)
        (ckpt / name).write_bytes(payload)
        files[name] = layout.file_entry(len(payload), zlib.crc32(payload))
    manifest = layout.manifest_bytes(step=step, world_size=world, files=files)
    (ckpt / layout.MANIFEST).write_bytes(manifest)
    marker = layout.committed_bytes(step=step, manifest_crc32=zlib.crc32(manifest))
    (ckpt / layout.COMMITTED).write_bytes(marker)
    assert layout.verify(ckpt) is None
    return ckpt


@pytest.mark.parametrize("target", ["data", "manifest"])
def test_corruption_hits_the_newest_committed_checkpoint_only(tmp_path: Path, target: str) -> None:
    root = tmp_path / "ckpt"
    older, newest = _commit(root, 3), _commit(root, 7)
    (root / "step-11").mkdir()  # a directory without COMMITTED is not a checkpoint
    before = (newest / layout.data_file(1)).read_bytes()
    out = storage.corrupt_newest(root, rank=1, target=target, settle_s=0.0)
    assert out["checkpoint"] == str(newest) and out["bytes"] == 16
    name = layout.data_file(1) if target == "data" else layout.MANIFEST
    assert out["file"] == str(newest / name)
    why = layout.verify(newest)
    assert why is not None
    assert ("checksum mismatch" in why) and (name in why if target == "data" else True)
    assert layout.verify(older) is None
    if target == "data":
        after = (newest / name).read_bytes()
        assert len(after) == len(before)  # same size: only the checksum can tell
        diff = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
        assert diff == list(range(out["offset"], out["offset"] + 16))


def test_corruption_waits_for_a_save_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _commit(root, 3)
    part = layout.partial_dir(root, 7)
    part.mkdir()
    out = storage.corrupt_newest(root, rank=0, target="data", settle_s=0.2)
    assert out["waited_s"] >= 0.2 and out["in_flight"] == ["step-7.partial"]
    assert out["checkpoint"] == str(layout.step_dir(root, 3))
    (part / layout.skip_marker(1)).write_text("{}")  # abandoned: nothing to wait for
    assert storage.saves_in_flight(root) == []


def test_a_checkpoint_renamed_into_place_but_not_yet_committed_is_in_flight(
    tmp_path: Path,
) -> None:
    """The coordinator renames step-N.partial to step-N, fsyncs, then writes COMMITTED: a
    corruption in between must wait for it, or it corrupts the older one (seen when faster
    persists moved the commit next to the fault)."""
    root = tmp_path / "ckpt"
    _commit(root, 3)
    layout.step_dir(root, 7).mkdir()
    assert storage.saves_in_flight(root) == ["step-7"]
    out = storage.corrupt_newest(root, rank=0, target="data", settle_s=0.05)
    assert out["in_flight"] == ["step-7"] and out["checkpoint"] == str(layout.step_dir(root, 3))
    layout.step_dir(root, 7).rmdir()
    _commit(root, 7)  # as the coordinator leaves it: COMMITTED written
    assert storage.saves_in_flight(root) == []


def test_corruption_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    out = storage.corrupt_newest(tmp_path / "ckpt", rank=0, target="data", settle_s=0.0)
    assert out["checkpoint"] is None and out["file"] is None
    assert "no committed checkpoint" in out["reason"]


def test_corruption_records_then_kills_the_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _commit(root, 3)
    newest = _commit(root, 7)
    code = textwrap.dedent(
        f"""
        from unbroken.faults import FaultInjector, parse_plan
        from unbroken.ledger import Ledger
        plan = parse_plan({{"faults": [{{"step": 0, "rank": 1, "kind": "checkpoint-corruption"}}]}})
        ledger = Ledger({str(tmp_path)!r}, run="r", rank=1)
        FaultInjector(plan, run_dir={str(tmp_path)!r}, rank=1, sink=ledger).on_step(0)
        print("survived")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and b"survived" not in proc.stdout
    from unbroken.ledger import read_events

    (event,) = [e for e in read_events(tmp_path) if e.kind == FAULT_INJECTED]
    assert event.get("file") == str(newest / layout.data_file(1))
    assert "checksum mismatch" in (layout.verify(newest) or "")


# --- goodput ---------------------------------------------------------------------------------
def _ev(kind: str, ts: float, **data: Any) -> Event:
    return Event(kind=kind, ts=ts, run="r", rank=data.pop("rank", 0), data=data)


def test_goodput_counts_no_outage_for_a_non_disruptive_fault() -> None:
    events = [_ev(STEP, float(t + 1), dur_s=1.0, step=t) for t in range(10)]
    events += [
        _ev(FAULT_INJECTED, 3.0, fault="slow-storage", step=2, index=0, disruptive=False),
        _ev(CKPT_SKIP, 5.0, step=4, reason="busy"),
        _ev(CKPT_SKIP, 5.0, step=4, reason="busy", rank=1),  # the same step on another rank
        _ev(CKPT_SKIP, 7.0, step=6, reason="busy"),
    ]
    report = compute(events)
    (fault,) = report.faults
    assert not fault.disruptive and fault.kind == "slow-storage"
    assert fault.downtime_s == 0.0 and fault.steps_lost == 0 and fault.ckpt_skips == 2
    assert fault.recovery_s is None and fault.detection_s is None and fault.layer is None
    assert report.infra_goodput == 1.0 and report.training_goodput == 1.0
    assert report.badput_s["recovery"] == 0.0 and report.recovery_s_median is None
    assert fault.to_dict()["disruptive"] is False


def test_a_later_crash_after_slow_storage_is_still_an_outage() -> None:
    events = [_ev(STEP, float(t + 1), dur_s=1.0, step=t) for t in range(5)]
    events += [_ev(STEP, 8.0 + t, dur_s=1.0, step=3 + t) for t in range(4)]
    events += [
        _ev(FAULT_INJECTED, 2.0, fault="slow-storage", step=1, index=0, disruptive=False),
        _ev(CKPT_SKIP, 3.0, step=2, reason="busy"),
        _ev(FAULT_INJECTED, 5.0, fault="sigkill", step=4, index=1),
        _ev(CKPT_SKIP, 9.0, step=5, reason="busy"),  # after the crash: not the slow storage's
    ]
    report = compute(events)
    slow, crash = report.faults
    assert slow.ckpt_skips == 1 and slow.downtime_s == 0.0
    assert crash.disruptive and crash.ckpt_skips is None
    assert crash.downtime_s == pytest.approx(2.0)  # fault at 5, resumed by the step from 7
    assert crash.steps_lost == 2
