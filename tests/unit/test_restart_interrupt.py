"""Interrupting the main thread from another thread, and the executing-Python probe.

pytest runs tests in the main thread, which is what the Interrupter requires.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from unbroken.restart import RestartInterrupt
from unbroken.restart.interrupt import Interrupter, python_probe


def _interrupt_until(intr: Interrupter, done: threading.Event, every_s: float = 0.005) -> None:
    while not done.is_set():
        intr.interrupt()
        time.sleep(every_s)


def run_interrupted(fn, *, every_s: float = 0.005):
    intr = Interrupter()
    done = threading.Event()
    t = threading.Thread(target=_interrupt_until, args=(intr, done, every_s), name="unbroken-test")
    t.start()
    try:
        return intr, intr.invoke(fn, None)
    finally:
        done.set()
        t.join()


def test_invoke_returns_the_value_or_the_error() -> None:
    intr = Interrupter()
    assert intr.invoke(lambda ctx: 42, None).value == 42
    err = intr.invoke(lambda ctx: 1 / 0, None).error
    assert isinstance(err, ZeroDivisionError)
    assert intr.interrupt() is False  # nothing runs: nothing to interrupt


def test_a_python_loop_is_interrupted() -> None:
    def spin(ctx):
        while True:
            time.sleep(0.001)

    intr, out = run_interrupted(spin)
    assert isinstance(out.error, RestartInterrupt)
    assert intr.delivered >= 1


def test_user_code_that_swallows_interrupts_is_interrupted_again() -> None:
    caught = []

    def swallow(ctx):
        while len(caught) < 5:
            try:
                time.sleep(0.001)
            except BaseException as e:  # noqa: BLE001
                caught.append(e)
        while True:
            time.sleep(0.001)

    intr, out = run_interrupted(swallow)
    assert isinstance(out.error, RestartInterrupt) and len(caught) == 5
    assert intr.delivered >= 6


def test_a_finally_block_that_raises_replaces_the_interrupt_and_still_ends_fn() -> None:
    def cleanup_fails(ctx):
        try:
            while True:
                time.sleep(0.001)
        finally:
            raise ValueError("cleanup failed")

    _, out = run_interrupted(cleanup_fails)
    assert isinstance(out.error, ValueError)


def test_interrupts_swallowed_by_del_are_delivered_again(monkeypatch: pytest.MonkeyPatch) -> None:
    hits = []

    class Slow:
        def __del__(self) -> None:
            try:
                time.sleep(0.01)
            except BaseException:
                hits.append(1)
                raise  # ignored by Python: "Exception ignored in __del__"

    def churn(ctx):
        while len(hits) < 2:
            obj = Slow()
            del obj
        while True:
            time.sleep(0.001)

    # Python reports an exception leaving __del__ through sys.unraisablehook; pytest's own
    # hook runs Python code that a later interrupt could land in, so use a C one here
    # (Python's default hook is C too).
    monkeypatch.setattr(sys, "unraisablehook", id)
    _, out = run_interrupted(churn, every_s=0.02)
    assert isinstance(out.error, RestartInterrupt) and len(hits) == 2


def test_no_interrupt_escapes_invoke_when_fn_returns_under_fire() -> None:
    """Interrupts racing fn's return are caught or cleared inside invoke, never after it."""
    intr = Interrupter()
    done = threading.Event()
    t = threading.Thread(target=_interrupt_until, args=(intr, done, 0), name="unbroken-test")
    t.start()
    try:
        outcomes = [intr.invoke(lambda ctx: sum(range(50)), None) for _ in range(2000)]
        time.sleep(0.01)  # a stray pending interrupt would fire here
    finally:
        done.set()
        t.join()
    kinds = {type(o.error).__name__ if o.error else "ok" for o in outcomes}
    assert kinds <= {"ok", "RestartInterrupt"}


def test_probe_tells_python_from_native_code() -> None:
    probe = python_probe()

    def silent_for(work) -> float:
        done = threading.Event()
        worst = []

        def sample() -> None:
            now = time.monotonic()
            probe.reset(now)
            while not done.wait(0.01):
                worst.append(probe.poll(time.monotonic()))

        t = threading.Thread(target=sample, name="unbroken-test-probe")
        t.start()
        work()
        done.set()
        t.join()
        return max(worst)

    def python_loop() -> None:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            time.sleep(0.002)

    assert silent_for(python_loop) < 0.2
    assert silent_for(lambda: time.sleep(0.5)) > 0.3
