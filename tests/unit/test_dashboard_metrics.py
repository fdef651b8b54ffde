"""/metrics: Prometheus naming, agreement with the goodput report, monotonic counters, and the
shipped Prometheus rules file naming only metrics we export."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from timelines import fault, faulty_run, rec, steps, write
from unbroken.dashboard.metrics import registry_for
from unbroken.dashboard.runs import RunSet
from unbroken.ledger import events as ev
from unbroken.ledger import read_events
from unbroken.ledger.goodput import compute


def _scrape(runs: RunSet) -> dict[str, dict[tuple, float]]:
    text = generate_latest(registry_for(runs, refresh=True)).decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def _families(runs: RunSet) -> list:
    return list(
        text_string_to_metric_families(generate_latest(registry_for(runs, refresh=True)).decode())
    )


def test_figures_equal_the_report(tmp_path: Path) -> None:
    write(tmp_path, faulty_run())
    runs = RunSet(tmp_path, record_alerts=False)
    try:
        m = _scrape(runs)
    finally:
        runs.close()
    rep = compute(read_events(tmp_path))
    assert m["unbroken_productive_seconds_total"][()] == pytest.approx(rep.productive_s)
    assert m["unbroken_wall_seconds_total"][()] == pytest.approx(rep.wall_s)
    for cat, s in rep.badput_s.items():
        assert m["unbroken_badput_seconds_total"][(("category", cat),)] == pytest.approx(s)
    assert m["unbroken_fault_seconds_total"][()] == pytest.approx(rep.fault_s)
    assert rep.fault_s > 0
    assert m["unbroken_steps_lost_total"][()] == sum(f.steps_lost for f in rep.faults)
    assert m["unbroken_restarts_total"] == {(("cause", "exception"), ("layer", "inprocess")): 3.0}
    assert m["unbroken_recovery_seconds_count"][()] == 3
    assert m["unbroken_recovery_seconds_sum"][()] == pytest.approx(
        sum(f.recovery_s for f in rep.faults)
    )
    assert m["unbroken_goodput_ratio"][(("kind", "training"),)] == pytest.approx(
        rep.training_goodput
    )
    assert m["unbroken_steps_completed"][()] == rep.steps_completed
    assert m["unbroken_job_running"][()] == 0
    assert m["unbroken_alerts"][(("name", "fault_recurring"), ("severity", "page"))] == 3
    assert set(m["unbroken_heartbeat_age_seconds"]) == {(("rank", "0"),), (("rank", "1"),)}


def test_naming_follows_prometheus_rules(tmp_path: Path) -> None:
    write(tmp_path, faulty_run())
    runs = RunSet(tmp_path, record_alerts=False)
    try:
        families = _families(runs)
    finally:
        runs.close()
    units = ("_seconds", "_bytes", "_ratio", "_timestamp_seconds")
    for fam in families:
        assert re.fullmatch(r"unbroken_[a-z_]+", fam.name), fam.name
        if fam.type == "counter":
            assert all(
                s.name.endswith("_total") or s.name.endswith("_created") for s in fam.samples
            )
        for s in fam.samples:
            assert "step" not in s.labels  # no per-step labels
            if fam.name != "unbroken_build_info":
                assert s.labels.get("run") == "run-1"
            if fam.name.endswith("_ratio") and "deviation" not in fam.name:
                assert 0.0 <= s.value <= 1.0, (s.name, s.value)
        if "seconds" in fam.name or "bytes" in fam.name:
            assert any(fam.name.endswith(u) or fam.name.endswith(u + "_total") for u in units), (
                fam.name
            )


def test_counters_never_go_down_when_the_ledger_revises_them(tmp_path: Path) -> None:
    """A record that arrives later can re-assign time already counted (a restarted worker's
    start-up phase is written when it ends, over time that was recovery until then): the
    exporter's counter holds its value instead of dropping."""
    early = [
        *steps(0, 8, 0.0),
        *fault(10.0, restored=None),
        rec(ev.WORKER_EXIT, 11.5, rank=ev.LAUNCHER_RANK, exit_code=1),
    ]
    late = [rec(ev.PHASE, 12.0, dur_s=1.0, name="import"), *steps(5, 8, 12.0)]
    path = write(tmp_path, early)
    runs = RunSet(tmp_path, record_alerts=False)
    try:
        registry = registry_for(runs, refresh=True)

        def scrape() -> dict[str, float]:
            return {
                s.name + str(sorted(s.labels.items())): s.value
                for fam in text_string_to_metric_families(generate_latest(registry).decode())
                if fam.type == "counter"
                for s in fam.samples
            }

        first = scrape()
        with open(path, "a") as f:
            f.write("".join(e.to_json() + "\n" for e in late))
        second = scrape()
    finally:
        runs.close()
    key = "unbroken_badput_seconds_total[('category', 'recovery'), ('run', 'run-1')]"
    revised = compute(early + late).badput_s["recovery"]
    assert revised < first[key]  # the ledger's figure went down ...
    assert second[key] == first[key]  # ... the counter did not
    for k, v in first.items():
        assert second[k] >= v, k


def _rules() -> dict:
    text = resources.files("unbroken.dashboard").joinpath("rules/unbroken-alerts.yaml").read_text()
    return yaml.safe_load(text)


def test_prometheus_rules_file_is_well_formed_and_names_exported_metrics(tmp_path: Path) -> None:
    events = faulty_run()
    events.append(rec(ev.CKPT_STAGE, 4.0, dur_s=0.1, step=3, staging_bytes=10, bytes=9))
    events.append(rec(ev.CKPT_COMMIT, 4.5, step=3))
    events.append(rec(ev.CKPT_FAIL, 9.5, step=8, error="OSError: [Errno 28] No space left"))
    events += steps(36, 37, 41.0, busy_s=0.5)  # busy figures: the straggler gauges
    write(tmp_path, events)
    runs = RunSet(tmp_path, record_alerts=False)
    try:
        exported = {s.name for fam in _families(runs) for s in fam.samples}
    finally:
        runs.close()
    doc = _rules()
    assert set(doc) == {"groups"}
    names = set()
    for group in doc["groups"]:
        assert set(group) <= {"name", "rules", "interval"} and group["name"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert re.fullmatch(r"Unbroken[A-Za-z]+", rule["alert"])
            assert rule["labels"]["severity"] in ("info", "warning", "page")
            assert rule["annotations"]["summary"]
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"])
            expr = rule["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]")
            used = set(re.findall(r"\bunbroken_[a-z_]+", expr))
            assert used, expr
            missing = used - exported
            assert not missing, f"{rule['alert']} names metrics nobody exports: {missing}"
            names.add(rule["alert"])
    # One Prometheus rule per ledger rule (and one for a silent rank).
    assert {
        "UnbrokenFaultRecovered",
        "UnbrokenFaultRecurring",
        "UnbrokenNoProgress",
        "UnbrokenRestartBudgetNearlySpent",
        "UnbrokenNoCheckpoint",
        "UnbrokenLowGoodput",
        "UnbrokenCheckpointSavesSkipped",
        "UnbrokenCheckpointStorageFailing",
        "UnbrokenStraggler",
    } <= names


def test_fault_figures_per_class_equal_the_report(tmp_path: Path) -> None:
    """faulty_run's three exceptions (recovered, one restart round each) and a crash the
    launcher tried twice and never recovered."""
    events = faulty_run()[:-1] + [
        rec(ev.FAULT_INJECTED, 39.0, rank=0, fault="sigkill", step=38, index=3, phase="save"),
        rec(ev.RESTART_BEGIN, 39.2, rank=ev.LAUNCHER_RANK, layer="launcher", round=1),
        rec(ev.RESTART_BEGIN, 39.2, rank=ev.LAUNCHER_RANK, layer="launcher", round=1),
        rec(ev.RESTART_BEGIN, 39.8, rank=ev.LAUNCHER_RANK, layer="launcher", round=2),
        rec(ev.JOB_END, 40.5, rank=0, status="failed"),
    ]
    write(tmp_path, events)
    runs = RunSet(tmp_path, record_alerts=False)
    try:
        m = _scrape(runs)
        families = {f.name: f for f in _families(runs)}
    finally:
        runs.close()
    rep = compute(read_events(tmp_path))
    exc, crash = rep.by_class["exception"], rep.by_class["crash"]
    assert m["unbroken_faults_total"] == {
        (("class", "exception"), ("kind", "exception"), ("phase", "step")): 3.0,
        (("class", "crash"), ("kind", "sigkill"), ("phase", "save")): 1.0,
    }
    assert m["unbroken_failed_restarts_total"] == {
        (("class", "exception"),): 0.0,
        (("class", "crash"),): 2.0,
    }
    assert families["unbroken_fault_recovery_seconds"].type == "summary"
    summary = m["unbroken_fault_recovery_seconds"]
    for q, value in (
        ("0.5", exc.recovery_s_p50),
        ("0.95", exc.recovery_s_p95),
        ("1", exc.recovery_s_max),
    ):
        assert summary[(("class", "exception"), ("quantile", q))] == pytest.approx(value)
    assert (("class", "crash"), ("quantile", "0.5")) not in summary  # never recovered
    assert m["unbroken_fault_recovery_seconds_count"] == {
        (("class", "exception"),): 3.0,
        (("class", "crash"),): 0.0,
    }
    assert m["unbroken_fault_recovery_ratio"] == {
        (("class", "exception"),): 1.0,
        (("class", "crash"),): 0.0,
    }
    assert crash.failed_restarts == 2 and exc.recovery_rate == 1.0
