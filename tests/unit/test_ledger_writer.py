from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from unbroken.ledger import Event, Ledger, read_events, read_run, writer
from unbroken.ledger import events as ev


def test_emit_close_read_back_in_order(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="r1", rank=3, attempt=2)
    led.set_context(iteration=1)
    for i in range(500):
        led.emit(ev.STEP, step=i, dur_s=0.01)
    led.close()
    got = read_events(tmp_path)
    assert [e.get("step") for e in got] == list(range(500))
    assert {(e.run, e.rank, e.attempt, e.iteration) for e in got} == {("r1", 3, 2, 1)}


def test_flush_makes_records_readable_before_close(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="r", rank=0)
    try:
        led.emit(ev.PROCESS_START, pid=os.getpid())
        assert led.flush(timeout_s=5)
        assert [e.kind for e in read_events(tmp_path)] == [ev.PROCESS_START]
    finally:
        led.close()


def test_step_intervals_tile_from_the_boundary(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="r", rank=0)
    with led.phase("model_build"):
        time.sleep(0.01)
    led.step(0)
    led.step(1)
    led.close()
    phase, s0, s1 = read_events(tmp_path)
    assert phase.get("name") == "model_build" and phase.dur_s >= 0.01
    assert s0.begin == pytest.approx(phase.ts, abs=1e-6)
    assert s1.begin == pytest.approx(s0.ts, abs=1e-6)


def test_a_short_phase_is_written_with_the_next_step_and_a_long_one_at_once(
    tmp_path: Path,
) -> None:
    """One writer wake-up a step: the data phase's record waits for the step's (or a flush);
    a phase longer than LAZY_PHASE_S wakes the writer itself."""
    led = Ledger(tmp_path, run="r", rank=0)
    try:
        with led.phase("data"):
            pass
        time.sleep(0.2)  # a woken writer writes in microseconds
        assert read_events(tmp_path) == []
        led.step(0)
        assert led.flush(timeout_s=5)
        assert [(e.kind, e.get("name")) for e in read_events(tmp_path)] == [
            ("phase", "data"),
            ("step", None),
        ]
        with led.phase("validation"):
            pass
        assert led.flush(timeout_s=5)  # a flush takes a waiting phase along
        assert read_events(tmp_path)[-1].get("name") == "validation"
        with led.phase("validation"):
            time.sleep(writer.LAZY_PHASE_S)
        deadline = time.monotonic() + 5
        while (
            read_events(tmp_path)[-1].get("name") != "validation" or len(read_events(tmp_path)) < 4
        ):
            assert time.monotonic() < deadline, "a long phase waited for another record"
            time.sleep(0.01)
    finally:
        led.close()


def test_close_writes_a_waiting_phase(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="r", rank=0)
    with led.phase("data"):
        pass
    led.close()
    assert [e.get("name") for e in read_events(tmp_path)] == ["data"]


def test_bad_inputs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown event kind"):
        Event(kind="nope")
    with pytest.raises(ValueError, match="redefine common"):
        Event(kind=ev.STEP, data={"rank": 3})
    led = Ledger(tmp_path, run="r", rank=0)
    try:
        with pytest.raises(ValueError, match=r"redefine common fields: \['rank'\]"):
            led.step(0, rank=3)  # the step record's own path says it too
        with pytest.raises(ValueError, match="redefine common"), led.phase("data", ts=1.0):
            pass
        invalid = pytest.raises(ValueError, match="phase name 'lunch break' is not valid")
        with invalid, led.phase("lunch break"):
            pass
        with led.phase("lunch"):  # a user's phase (``RestartContext.phase``)
            pass
    finally:
        led.close()


def test_torn_last_line_is_skipped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "events").mkdir()
    good = Event(kind=ev.STEP, ts=1.0, data={"step": 0}).to_json()
    (tmp_path / "events" / "a.jsonl").write_text(good + "\n" + good[:17])
    (tmp_path / "events" / "b.jsonl").write_text("not json\n" + good + "\n")
    res = read_run(tmp_path)
    assert len(res.events) == 2
    assert res.torn_lines == 1
    assert res.bad_lines == ["b.jsonl:1"]


def test_missing_ledger_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--run-dir"):
        read_run(tmp_path)


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from unbroken.ledger import Ledger, install_sigterm_flush
    mode, run_dir = sys.argv[1], sys.argv[2]
    led = Ledger(run_dir, run="r", rank=0)
    install_sigterm_flush(led)
    if mode == "step-then-kill":
        with led.phase("data"):
            pass
        led.step(0, loss=0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sigterm":
        for i in range(2000):
            led.emit("step", step=i)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    else:
        i = 0
        while True:
            led.emit("step", step=i)
            i += 1
            time.sleep(0.1)
    """
)


def _child(mode: str, run_dir: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    return subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(run_dir)], env=env)


def test_sigterm_loses_nothing(tmp_path: Path) -> None:
    proc = _child("sigterm", tmp_path)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert [e.get("step") for e in read_events(tmp_path)] == list(range(2000))


def test_a_step_and_its_phase_survive_a_sigkill_right_after_step_returns(tmp_path: Path) -> None:
    """The training thread writes its step record (and the short phase before it) itself."""
    assert _child("step-then-kill", tmp_path).wait(timeout=60) == -signal.SIGKILL
    got = [(e.kind, e.get("name"), e.get("step"), e.get("loss")) for e in read_events(tmp_path)]
    assert got == [("phase", "data", None, None), ("step", None, 0, 0.5)]


def test_slow_storage_sends_step_records_through_the_writer_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A step record write slower than the limit (here: any) pauses the training thread's own
    writes: the next records are queued, and none is lost."""
    monkeypatch.setattr(writer, "SYNC_WRITE_LIMIT_S", 0.0)
    led = Ledger(tmp_path, run="r", rank=0)
    queued: list[object] = []
    monkeypatch.setattr(led, "_queue", _Spy(led._queue, lambda item: queued.append(item)))
    try:
        with caplog.at_level("INFO", logger="unbroken.ledger.writer"):
            led.step(0)  # written by this thread, and slower than 0 s
            assert [e.get("step") for e in read_events(tmp_path)] == [0] and queued == []
            led.step(1)
            led.step(2)
        assert [item[5]["step"] for item in queued if isinstance(item, tuple)] == [1, 2]
        assert led.flush(timeout_s=5)
        assert [e.get("step") for e in read_events(tmp_path)] == [0, 1, 2]
        assert "step records go through the writer thread" in caplog.text
    finally:
        led.close()


class _Spy:
    """A queue that tells ``seen`` what is put in it."""

    def __init__(self, inner: object, seen: object) -> None:
        self._inner, self._seen = inner, seen

    def put(self, item: object) -> None:
        self._seen(item)  # type: ignore[operator]
        self._inner.put(item)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_flush_after_close_says_everything_was_written(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="r", rank=0)
    led.emit(ev.PROCESS_START, pid=os.getpid())
    led.close()
    assert led.flush(timeout_s=2)
    assert [e.kind for e in read_events(tmp_path)] == [ev.PROCESS_START]


def test_sigkill_loses_at_most_the_last_moments(tmp_path: Path) -> None:
    proc = _child("loop", tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            files = list((tmp_path / "events").glob("*.jsonl"))
            if files and files[0].read_bytes().count(b"\n") >= 5:
                break
            time.sleep(0.02)
        time.sleep(0.05)  # mid-way between two records
        killed_at = time.time()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    res = read_run(tmp_path)
    steps = [e.get("step") for e in res.events]
    assert steps == list(range(len(steps))) and len(steps) >= 5
    assert res.torn_lines == 0
    # Records are emitted every 0.1 s: everything emitted more than 0.3 s before the kill is
    # on disk (the loss window is the queue, milliseconds, not the fsync interval).
    assert res.events[-1].ts >= killed_at - 0.3


@pytest.mark.slow
def test_sigterm_is_prompt_while_the_main_thread_is_blocked_in_native_code(
    tmp_path: Path,
) -> None:
    code = textwrap.dedent(
        """
        import os, sys
        from datetime import timedelta
        import torch.distributed as dist
        from unbroken.ledger import Ledger, install_sigterm_flush
        led = Ledger(sys.argv[1], run="r", rank=0)
        install_sigterm_flush(led)
        for i in range(100):
            led.emit("step", step=i)
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(hours=1))
        print("blocked", flush=True)
        store.wait(["never"])  # C++ wait that retries on EINTR: Python handlers do not run
        """
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "blocked"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == -signal.SIGTERM
    proc.stdout.close()
    assert [e.get("step") for e in read_events(tmp_path)] == list(range(100))


@pytest.mark.parametrize(
    "data",
    [
        {"step": 3, "dur_s": 0.0123, "busy_s": 1e-06, "loss": -2.5e300},
        {"name": "data.v-2_x", "dur_s": 0.0, "ok": True, "no": False, "none": None},
        {},
    ],
)
def test_a_step_record_formatted_directly_is_what_the_event_writes(data: dict) -> None:
    item = (ev.STEP, 1733380000.123456, 1, 2, 3, data)
    event = Event(kind=ev.STEP, ts=item[1], run='r"1', rank=1, attempt=2, iteration=3, data=data)
    assert ev.plain_json('"r\\"1"', *item) == event.to_json()


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), 'say "hi"', "back\\slash", "tab\t", "é", [1], {"a": 1}]
)
def test_what_json_must_escape_or_cannot_hold_goes_through_the_event(
    tmp_path: Path, value: object
) -> None:
    assert ev.plain_json('"r"', ev.STEP, 1.0, 0, 0, 0, {"x": value}) is None
    led = Ledger(tmp_path, run="r", rank=0)
    led.step(0, x=value)
    led.close()
    (record,) = read_events(tmp_path)
    got = record.get("x")
    assert got == value or (isinstance(value, float) and str(got) == str(value))


_MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:50 / /mnt/fsx rw,relatime - lustre 10.0.0.5@tcp:/fsx rw
41 40 0:51 / /mnt/fsx/scratch rw,relatime - tmpfs tmpfs rw
42 27 0:52 / /mnt/my\\040share rw,relatime shared:7 - nfs4 server:/share rw
43 27 0:53 / /mnt/fuse rw,relatime - fuse.s3fs s3fs rw
"""


@pytest.mark.parametrize(
    ("path", "local"),
    [
        ("/work/run", True),  # ext4
        ("/mnt/fsx/run/events", False),  # Lustre (FSx)
        ("/mnt/fsx/scratch/events", True),  # a tmpfs mounted inside it: the deepest mount
        ("/mnt/fsxother/events", True),  # only starts like /mnt/fsx: on the root's ext4
        ("/mnt/my share/events", False),  # NFS, its space escaped in mountinfo
        ("/mnt/fuse/events", False),
    ],
)
def test_step_records_are_written_by_the_training_thread_only_on_a_local_file_system(
    path: str, local: bool
) -> None:
    assert writer.local_file_system(Path(path), _MOUNTINFO) is local


def test_a_ledger_on_a_network_file_system_queues_its_step_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer, "local_file_system", lambda path: False)
    led = Ledger(tmp_path, run="r", rank=0)
    queued: list[object] = []
    monkeypatch.setattr(led, "_queue", _Spy(led._queue, queued.append))
    try:
        led.step(0)
        assert led.flush(timeout_s=5)
        assert [item[5]["step"] for item in queued if isinstance(item, tuple)] == [0]
        assert [e.get("step") for e in read_events(tmp_path)] == [0]
    finally:
        led.close()
