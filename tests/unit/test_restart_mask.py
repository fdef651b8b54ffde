"""Cleanup that the restart interrupt cannot break: ``unbroken.mask.masked``.

The interrupt is delivered at chosen points inside the cleanup (a profile hook calls
``Interrupter.interrupt`` when the named function is entered), and by a real thread firing
continuously; the cleanup must complete (writer process reaped, reader thread gone, no
descriptor left open, the ledger record written) and the interrupt still end ``fn``.
pytest runs tests in the main thread, which is what the Interrupter requires.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from unbroken.checkpoint import CheckpointConfig, Checkpointer
from unbroken.ledger import Ledger, read_events
from unbroken.mask import masked
from unbroken.restart import RestartInterrupt
from unbroken.restart.interrupt import Interrupter, Invocation


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _interrupt_on_entry(intr: Interrupter, name: str) -> Callable[..., Any]:
    """A profile hook that interrupts fn once, on entering the function called ``name``."""

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_qualname == name:
            sys.setprofile(None)
            assert intr.interrupt()

    return hook


def _invoke_with_hook(
    intr: Interrupter, hook: Callable[..., Any], body: Callable[[], None]
) -> Invocation:
    def fn(ctx: Any) -> None:
        sys.setprofile(hook)
        try:
            body()
        finally:
            sys.setprofile(None)

    return intr.invoke(fn, None)


def test_an_interrupt_in_a_masked_function_is_raised_as_it_returns() -> None:
    intr = Interrupter()
    log: list[str] = []

    def inner() -> None:
        log.append("inner")

    @masked
    def cleanup() -> None:
        inner()
        log.append("cleanup done")

    @masked
    def outer() -> None:
        cleanup()
        log.append("outer done")  # the inner masked function's return raises nothing

    def body() -> None:
        outer()
        log.append("after")  # never: the interrupt lands as outer returns

    out = _invoke_with_hook(
        intr,
        _interrupt_on_entry(
            intr, "test_an_interrupt_in_a_masked_function_is_raised_as_it_returns.<locals>.inner"
        ),
        body,
    )
    assert isinstance(out.error, RestartInterrupt)
    assert log == ["inner", "cleanup done", "outer done"]
    assert intr.delivered == 1


def test_an_interrupt_outside_masked_code_lands_at_once() -> None:
    intr = Interrupter()
    log: list[str] = []

    def inner() -> None:
        log.append("inner")

    def body() -> None:
        inner()
        log.append("after")

    out = _invoke_with_hook(
        intr,
        _interrupt_on_entry(
            intr, "test_an_interrupt_outside_masked_code_lands_at_once.<locals>.inner"
        ),
        body,
    )
    assert isinstance(out.error, RestartInterrupt) and log == []


def test_an_interrupt_never_leaves_a_condition_lock_held() -> None:
    """Between ``Condition.__enter__`` acquiring the lock and returning, an interrupt would
    leave the lock held with no ``__exit__`` to come: it waits for the method to return."""
    intr = Interrupter()
    cond = threading.Condition(threading.Lock())

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_return" and frame.f_code is threading.Condition.__enter__.__code__:
            sys.setprofile(None)
            assert intr.interrupt()

    def body() -> None:
        while True:
            with cond:
                pass

    stop = threading.Event()
    monitor = threading.Thread(target=_redeliver, args=(intr, stop), name="unbroken-test")
    monitor.start()
    try:
        out = _invoke_with_hook(intr, hook, body)
    finally:
        stop.set()
        monitor.join()
    assert isinstance(out.error, RestartInterrupt)
    assert not cond._lock.locked()  # type: ignore[attr-defined]


def _redeliver(intr: Interrupter, stop: threading.Event) -> None:
    """The monitor's part: once a restart is asked for, interrupt again every few ms."""
    while not stop.wait(0.005):
        if intr.requested:
            intr.interrupt()


# --- a real Checkpointer and its writer process -------------------------------------------------
def _saved_checkpointer(root: Path) -> Checkpointer:
    ckpt = Checkpointer(
        root,
        memory_tier=False,
        persist_timeout_s=60.0,
        config=CheckpointConfig(writer_start="fork"),
    )
    ckpt.save(0, {"w": torch.arange(1024, dtype=torch.float32)})
    ckpt.wait()
    return ckpt


def _assert_stopped(ckpt: Checkpointer, pid: int, fds_before: set[str]) -> None:
    assert ckpt.closed
    assert not Path(f"/proc/{pid}").exists(), "the writer process is still there (or a zombie)"
    readers = [t.name for t in threading.enumerate() if t.name.startswith("unbroken-ckpt-reader")]
    assert readers == []
    assert _fds() - fds_before == set(), "descriptors left open"


ABORT_POINTS = [
    "Checkpointer.abort",
    "Inflight.kill_writer",
    "Staging.stop",
    "Inflight.close",
    "WriterClient.close",
    "Staging.close",
]


@pytest.mark.parametrize("point", ABORT_POINTS)
def test_abort_completes_when_the_interrupt_lands_inside_it(tmp_path: Path, point: str) -> None:
    intr = Interrupter()
    fds_before = _fds()
    ckpt = _saved_checkpointer(tmp_path / "ckpt")
    pid = ckpt.writer_pid
    assert pid is not None

    def body() -> None:
        try:
            raise RuntimeError("a fault in the training step")
        finally:
            ckpt.abort()

    out = _invoke_with_hook(intr, _interrupt_on_entry(intr, point), body)
    _assert_stopped(ckpt, pid, fds_before)
    assert isinstance(out.error, RestartInterrupt)  # delivered, as abort returned
    assert intr.delivered == 1


@pytest.mark.parametrize("point", ["Checkpointer._stop", "Inflight.close", "Staging.close"])
def test_close_completes_when_the_interrupt_lands_inside_its_end(
    tmp_path: Path, point: str
) -> None:
    intr = Interrupter()
    fds_before = _fds()
    ckpt = _saved_checkpointer(tmp_path / "ckpt")
    pid = ckpt.writer_pid
    assert pid is not None
    out = _invoke_with_hook(intr, _interrupt_on_entry(intr, point), ckpt.close)
    _assert_stopped(ckpt, pid, fds_before)
    assert isinstance(out.error, RestartInterrupt)


def _abort_under_fire(root: Path) -> tuple[Invocation, Checkpointer, int]:
    intr = Interrupter()
    ckpt = _saved_checkpointer(root)
    pid = ckpt.writer_pid
    assert pid is not None
    stop = threading.Event()
    started = threading.Event()

    def fire() -> None:
        started.wait()
        while not stop.is_set():
            intr.interrupt()
            time.sleep(0.0002)

    def fn(ctx: Any) -> None:
        try:
            started.set()
            while True:
                time.sleep(0.001)
        finally:
            ckpt.abort()

    t = threading.Thread(target=fire, name="unbroken-test-interrupter")
    t.start()
    try:
        return intr.invoke(fn, None), ckpt, pid
    finally:
        stop.set()
        t.join()


def test_abort_completes_under_a_thread_interrupting_without_pause(tmp_path: Path) -> None:
    """The monitor's way: another thread interrupts over and over while fn unwinds."""
    fds_before = _fds()
    for i in range(3):
        out, ckpt, pid = _abort_under_fire(tmp_path / f"ckpt{i}")
        assert isinstance(out.error, RestartInterrupt)
        _assert_stopped(ckpt, pid, fds_before)


# --- the ledger ---------------------------------------------------------------------------------
@pytest.mark.parametrize("point", ["Ledger.emit", "Event.__post_init__"])
def test_a_ledger_record_is_written_when_the_interrupt_lands_in_emit(
    tmp_path: Path, point: str
) -> None:
    intr = Interrupter()
    ledger = Ledger(tmp_path, run="r", rank=0)
    try:
        out = _invoke_with_hook(
            intr, _interrupt_on_entry(intr, point), lambda: ledger.emit("fault_detected", n=1)
        )
        assert ledger.flush(2.0), "a record counted but never queued"
        assert isinstance(out.error, RestartInterrupt)
    finally:
        ledger.close()
    assert [e.kind for e in read_events(tmp_path)] == ["fault_detected"]
