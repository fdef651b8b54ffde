"""``unbroken bench writer``'s figures, from a real ledger: the step right after each durable
save against the others, rank 0 only, the warm-up left out."""

from __future__ import annotations

import pytest

from unbroken.bench.writer import SKIP, figures
from unbroken.ledger import Ledger
from unbroken.ledger import events as ev


def test_the_cost_is_the_step_after_a_durable_save_over_the_others(tmp_path) -> None:
    ranks = [Ledger(tmp_path, run="w", rank=r) for r in (0, 1)]
    t = 1000.0
    for step in range(SKIP + 30):
        # rank 0: 100 ms steps, 160 ms right after a durable save (every 5th step), a snapshot
        # every other step does not count; the warm-up steps are 900 ms and left out
        dur = 0.9 if step < SKIP else 0.16 if step % 5 == 0 and step > 0 else 0.1
        t += dur
        ranks[0].emit(ev.STEP, ts=t, step=step, dur_s=dur)
        ranks[1].emit(ev.STEP, ts=t, step=step, dur_s=5.0)  # another rank: not read
        if step % 5 == 4:
            ranks[0].emit(ev.CKPT_STAGE, ts=t, step=step, dur_s=0.002, durable=True)
            ranks[0].emit(ev.CKPT_PERSIST, ts=t + 0.05, step=step, dur_s=0.2 + step / 1e3)
        elif step % 2 == 0:
            ranks[0].emit(ev.CKPT_STAGE, ts=t, step=step, dur_s=0.001, durable=False)
    for led in ranks:
        led.close()
    got = figures(tmp_path)
    assert got["saves"] == 6  # steps 20, 25, ..., 45 follow a durable save
    assert got["after_ms"] == pytest.approx(160)
    assert got["other_ms"] == pytest.approx(100)
    assert got["cost_ms"] == pytest.approx(60)
    assert got["mean_step_ms"] == pytest.approx((6 * 160 + 24 * 100) / 30)
    assert got["persist_s"] == pytest.approx(0.2 + 26.5 / 1e3)  # median of steps 4, 9 .. 49


def test_a_run_without_a_save_to_compare_says_so(tmp_path) -> None:
    led = Ledger(tmp_path, run="w", rank=0)
    for step in range(SKIP + 5):
        led.emit(ev.STEP, ts=1000.0 + step, step=step, dur_s=0.1)
    led.close()
    with pytest.raises(RuntimeError, match="no step after a durable save"):
        figures(tmp_path)
