"""Stragglers by busy ratio and the cost of degradation windows, on hand-built timelines:
the pure functions, the report, the folded digest, the dashboard, the alert and /metrics."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from timelines import rec, slowed_run, write
from unbroken.dashboard import snapshot
from unbroken.dashboard.alerts import AlertConfig, evaluate
from unbroken.dashboard.index import EventIndex
from unbroken.dashboard.metrics import registry_for
from unbroken.dashboard.runs import RunSet
from unbroken.ledger import events as ev
from unbroken.ledger import read_run
from unbroken.ledger import report as text_report
from unbroken.ledger.degraded import cost
from unbroken.ledger.goodput import compute
from unbroken.ledger.stragglers import MIN_WINDOW_S, find, judge, window_for


def test_judge_names_the_rank_that_leads_the_others_by_the_margin() -> None:
    assert judge({0: 0.3, 1: 0.95, 2: 0.35, 3: 0.3}) == [1]
    assert judge({0: 0.9, 1: 0.95}) == []  # balanced and all busy: nobody waits for anyone
    assert judge({0: 0.5, 1: 0.7}) == []  # a lead under the margin
    assert judge({0: 0.1, 1: 0.38}) == []  # a lead, but not busy enough to be the cause
    assert judge({0: 0.99}) == []  # one rank: no one to wait for it
    assert judge({}) == []


def _samples(events):
    out: dict[int, list] = {}
    for e in events:
        if e.kind == ev.STEP:
            out.setdefault(e.rank, []).append((e.ts, e.dur_s, e.get("busy_s")))
    return out


def test_find_names_the_throttled_rank_for_its_window_only() -> None:
    events = slowed_run(slow=(10.0, 20.0), rank=1, ranks=(0, 1, 2, 3))
    samples = _samples(events)
    window = window_for(d for _, d, _ in samples[0])
    assert window == pytest.approx(2.5)  # 5 steps of 0.5 s
    (x,) = find(samples, t0=0.0, t1=35.0, window_s=window)
    assert x.rank == 1
    # The episode covers the throttled time, give or take the windows at its edges (which
    # also hold some undegraded steps).
    assert 10.0 - window <= x.begin_ts <= 10.0 and 20.0 <= x.end_ts <= 20.0 + window
    assert 0.85 <= x.busy_ratio <= 0.95
    assert 0.2 <= x.others_ratio <= 0.3  # 0.6 x 0.5 s of work in 1.5 s steps
    assert x.steps >= 7 and x.windows >= 2


def test_no_straggler_without_a_slow_rank_or_without_busy_figures() -> None:
    samples = _samples(slowed_run(slow=None))
    assert find(samples, t0=0.0, t1=31.0, window_s=2.5) == []
    one = {0: samples[0]}
    assert find(one, t0=0.0, t1=31.0, window_s=2.5) == []
    missing = {r: [(t, d, float("nan")) for t, d, _ in rows] for r, rows in samples.items()}
    assert find(missing, t0=0.0, t1=31.0, window_s=2.5) == []


def test_a_lead_in_a_single_window_is_noise() -> None:
    # 1.5 s of throttling: one 2.5 s window at most, so no episode.
    samples = _samples(slowed_run(slow=(10.0, 11.5), slow_dur=0.5))
    assert find(samples, t0=0.0, t1=31.0, window_s=2.5) == []


def _quiet(samples, rank: int, start: float, end: float):
    """``rank`` busy like the others for the steps ending in [start, end)."""
    rows = samples[rank]
    samples[rank] = [(t, d, 0.2 * d if start <= t < end else b) for t, d, b in rows]
    return samples


def test_one_quiet_window_does_not_split_an_episode_but_two_do() -> None:
    samples = _quiet(_samples(slowed_run(slow=(10.0, 40.0), end=50.0)), 1, 21.0, 22.5)
    (x,) = find(samples, t0=0.0, t1=51.0, window_s=2.5)
    assert x.rank == 1 and x.begin_ts <= 10.0 and x.end_ts >= 40.0
    samples = _quiet(_samples(slowed_run(slow=(10.0, 40.0), end=50.0)), 1, 20.0, 27.5)
    first, second = find(samples, t0=0.0, t1=51.0, window_s=2.5)
    assert first.rank == second.rank == 1 and first.end_ts < 21.0 and second.begin_ts > 24.0


def test_steps_slower_than_a_window_are_still_judged() -> None:
    # 5 s steps while windows are 1 s: windows merge until each rank has 2 steps.
    samples = _samples(slowed_run(slow=(5.0, 45.0), slow_dur=5.0, end=60.0, dur=0.2))
    assert window_for(d for _, d, _ in samples[0]) == MIN_WINDOW_S
    (x,) = find(samples, t0=0.0, t1=61.0, window_s=MIN_WINDOW_S)
    assert x.rank == 1 and 0.9 <= x.busy_ratio <= 0.95 and x.windows >= 2
    assert x.begin_ts <= 5.0 and x.end_ts >= 45.0


def test_cost_is_the_step_time_beyond_undegraded_steps() -> None:
    steps = [(float(i), i + 1.0) for i in range(10)]  # 1 s steps
    steps += [(10.0 + 2 * i, 12.0 + 2 * i) for i in range(3)]  # 3 steps of 2 s in [10, 16]
    steps += [(16.0 + i, 17.0 + i) for i in range(4)]
    outside, per, total = cost(steps, [(10.0, 16.0)])
    assert outside == 1.0
    assert per == [(2.0, 3.0)] and total == 3.0
    # Overlapping windows count their steps once; no window, no cost.
    _, per, total = cost(steps, [(10.0, 14.0), (12.0, 16.0)])
    assert [p[1] for p in per] == [2.0, 2.0] and total == 3.0
    assert cost(steps, []) == (None, [], 0.0)
    # Faster steps inside a window cost nothing (never negative).
    assert cost([(0.0, 1.0), (1.0, 1.5)], [(1.0, 2.0)])[2] == 0.0


def test_the_report_prices_the_window_and_names_the_straggler() -> None:
    rep = compute(slowed_run(slow=(10.0, 20.0)))
    (f,) = rep.faults
    assert f.kind == "slow-rank" and not f.disruptive and f.window_s == 10.0
    assert f.step_s_inside == 1.5 and rep.step_time_s_outside == 0.5
    # Steps overlapping [10, 20]: 7 of 1.5 s (10.0-20.5), each 1 s more than undegraded.
    assert f.degraded_s == pytest.approx(7.0) and rep.degraded_s == pytest.approx(7.0)
    assert [x.rank for x in rep.stragglers] == [1]
    assert rep.badput_s["recovery"] == 0.0 and rep.infra_goodput == 1.0  # no outage
    text = text_report.format_table(rep)
    assert "degradation (undegraded median step 0.500 s; cost 7.000 s)" in text
    assert "stragglers" in text and "0.89" in text
    d = rep.to_dict()
    assert d["stragglers"][0]["rank"] == 1 and d["faults"][0]["degraded_s"] == pytest.approx(7.0)


def test_a_clean_run_has_no_degradation_section() -> None:
    rep = compute(slowed_run(slow=None))
    assert rep.stragglers == [] and rep.degraded_s == 0.0 and rep.step_time_s_outside is None
    text = text_report.format_table(rep)
    assert "degradation" not in text and "stragglers" not in text


def test_folded_steps_give_the_same_stragglers(tmp_path: Path) -> None:
    events = slowed_run(slow=(10.0, 20.0), ranks=(0, 1, 2))
    # A rank whose first records had no busy figure: the digest's column is padded.
    events += [rec(ev.STEP, 0.25, rank=2, dur_s=0.25, step=-1)]
    write(tmp_path, events)
    folded = read_run(tmp_path, fold_steps_except=0)
    assert folded.digest is not None and set(folded.digest.busy) == {1, 2}
    a = compute(folded.events, digest=folded.digest)
    b = compute(read_run(tmp_path).events)
    assert a == b and [x.rank for x in a.stragglers] == [1]


def _snapshot(events, now: float):
    index = EventIndex(events)
    return snapshot.build(index, compute(events), name="r", now=now, alerts=[], ledger={"files": 1})


def test_the_dashboard_flags_the_rank_that_straggles_now() -> None:
    slowing = slowed_run(slow=(10.0, 80.0), end=50.0)  # still throttled at the end
    snap = _snapshot(slowing, now=51.0)
    ranks = {r["rank"]: r for r in snap["ranks"]}
    assert ranks[1]["straggler"] and not ranks[0]["straggler"]
    assert ranks[1]["busy_ratio"] == pytest.approx(0.95)
    assert ranks[0]["busy_ratio"] == pytest.approx(0.2)
    assert ranks[0]["step_time_s"] == ranks[1]["step_time_s"]  # step time cannot tell
    assert [x["rank"] for x in snap["stragglers"]] == [1]
    # Over: the recent steps are balanced again, the episode stays in the record.
    snap = _snapshot(slowed_run(slow=(10.0, 20.0)), now=31.0)
    assert not any(r["straggler"] for r in snap["ranks"])
    assert [x["rank"] for x in snap["stragglers"]] == [1]
    assert snap["figures"]["degraded_s"] == pytest.approx(7.0)


def test_the_straggler_alert_fires_once_per_episode() -> None:
    events = slowed_run(slow=(10.0, 20.0))
    alerts = evaluate(events, compute(events), now=31.0, cfg=AlertConfig())
    (a,) = [a for a in alerts if a.name == "straggler"]
    assert a.severity == "warning" and a.labels == {"rank": "1"}
    assert a.value is not None and a.value > 0.85 and "rank 1 is a straggler" in a.summary
    later = slowed_run(slow=(10.0, 20.0), end=40.0)
    again = evaluate(later, compute(later), now=41.0, cfg=AlertConfig())
    assert [x.key for x in again if x.name == "straggler"] == [a.key]
    clean = slowed_run(slow=None)
    assert "straggler" not in [
        x.name for x in evaluate(clean, compute(clean), now=31.0, cfg=AlertConfig())
    ]


def _metrics(tmp_path: Path) -> dict[str, dict[tuple, float]]:
    runs = RunSet(tmp_path, record_alerts=False)
    try:
        text = generate_latest(registry_for(runs, refresh=True)).decode()
    finally:
        runs.close()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def test_metrics_export_busy_ratios_stragglers_and_the_cost(tmp_path: Path) -> None:
    events = slowed_run(slow=(10.0, 80.0), end=50.0)
    write(tmp_path, events)
    m = _metrics(tmp_path)
    assert m["unbroken_rank_busy_ratio"][(("rank", "1"),)] == pytest.approx(0.95)
    assert m["unbroken_rank_busy_ratio"][(("rank", "0"),)] == pytest.approx(0.2)
    assert m["unbroken_straggler"] == {(("rank", "0"),): 0.0, (("rank", "1"),): 1.0}
    assert m["unbroken_straggler_episodes_total"] == {(("rank", "1"),): 1.0}
    assert m["unbroken_degraded_seconds_total"][()] == pytest.approx(compute(events).degraded_s)
    assert compute(events).degraded_s > 0


def test_metrics_without_busy_figures_export_no_straggler_gauge(tmp_path: Path) -> None:
    events = [
        e
        if e.kind != ev.STEP
        else rec(ev.STEP, e.ts, rank=e.rank, dur_s=e.dur_s, step=e.get("step"))
        for e in slowed_run(slow=None)
    ]
    write(tmp_path, events)
    m = _metrics(tmp_path)
    assert "unbroken_straggler" not in m and "unbroken_rank_busy_ratio" not in m
    assert list(itertools.islice(m, 1))  # the rest is there
