"""``/metrics``: the runs' figures in the Prometheus exposition format, through prometheus_client.

Every value comes from a ``RunWatch`` (its ``RunReport`` and snapshot), so it agrees with
``unbroken report``. Naming follows Prometheus: base units (seconds, bytes), ``_total`` counters,
ratios in 0-1, a ``run`` label on every series and no per-step labels.

Counters stay monotonic: the exporter keeps each counter series' highest value and never exports
less. The ledger can revise a figure downward: a record written when its interval ends
re-assigns time already counted (a restarted worker's start-up phase over what was recovery
time until then), and a rolled-back step's time moves from productive to re-executed. Such a
counter holds until the run passes it again. So an exporter that watched a run may end slightly
above the report's figure for such a category; a fresh exporter (a new process reading the
ledger) exports exactly the report's figures. Since the launcher's exporter lives as long as the
job, worker restarts never reset its counters.

Checkpoint storage (``unbroken.ledger.unprotected``): ``unbroken_checkpoint_storage_failing`` is 1
while the newest failed save is newer than the newest commit (the run has no durable checkpoint
newer than that failure); ``unbroken_checkpoint_unprotected_seconds`` is the report's
``storage.unprotected_s``; ``unbroken_checkpoint_saves_failed_total`` counts failed saves.

Per fault class (``unbroken.ledger.fault_classes``): ``unbroken_faults_total`` carries the
fault's ``kind``, ``class`` and ``phase``; ``unbroken_failed_restarts_total{class}`` counts
restart rounds that did not bring training back; ``unbroken_fault_recovery_seconds{class}`` is
a summary whose quantiles 0.5, 0.95 and 1 (the max) are the report's ``by_class`` figures, and
``unbroken_fault_recovery_ratio{class}`` its recovery rate.

``unbroken-run --ft-metrics-port`` serves the same collector over its run directory
(``MetricsServer``).
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.samples import Sample

from unbroken.dashboard.runs import RunSet, RunWatch
from unbroken.ledger import events as ev
from unbroken.ledger.fault_classes import UNKNOWN_PHASE
from unbroken.ledger.fault_summary import failed_restarts
from unbroken.ledger.goodput import BADPUT_CATEGORIES, RunReport

logger = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _histogram(name: str, doc: str, rows: list[tuple[str, list[float]]]) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=["run"])
    for run, values in rows:
        buckets = [(repr(le), float(sum(1 for v in values if v <= le))) for le in SECONDS_BUCKETS]
        buckets.append(("+Inf", float(len(values))))
        h.add_metric([run], buckets, sum_value=float(sum(values)))
    return h


QUANTILES = (("0.5", "recovery_s_p50"), ("0.95", "recovery_s_p95"), ("1", "recovery_s_max"))
"""The recovery summary's quantiles: (label, ``FaultFigures`` field)."""


def _recovery_by_class(rows: list[tuple[str, RunReport]]) -> SummaryMetricFamily:
    name = "unbroken_fault_recovery_seconds"
    s = SummaryMetricFamily(
        name, "Fault to every rank training again, by fault class", labels=["run", "class"]
    )
    for run, rep in rows:
        for cls, g in rep.by_class.items():
            values = [
                f.recovery_s
                for f in rep.faults
                if f.fault_class == cls and f.recovery_s is not None
            ]
            for q, attr in QUANTILES:
                v = getattr(g, attr)
                if v is not None:
                    s.samples.append(Sample(name, {"run": run, "class": cls, "quantile": q}, v))
            s.add_metric([run, cls], len(values), float(sum(values)))
    return s


class LedgerCollector:
    """A prometheus_client collector over the runs that ``watches()`` returns."""

    def __init__(self, watches: Callable[[], list[RunWatch]], *, version: str) -> None:
        self.watches = watches
        self.version = version
        self._high: dict[tuple[str, tuple[str, ...]], float] = {}

    def _counter(self, name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=["run", *labels])

    def _add(self, family: CounterMetricFamily, labels: list[str], value: float) -> None:
        """A counter sample, never below what this exporter exported before."""
        key = (family.name, tuple(labels))
        value = max(float(value), self._high.get(key, 0.0))
        self._high[key] = value
        family.add_metric(labels, value)

    def describe(self) -> Iterable[Metric]:
        return []  # families are known only after a ledger is read

    def collect(self) -> Iterable[Metric]:
        watches = [w for w in self.watches() if w.report is not None]
        info = GaugeMetricFamily(
            "unbroken_build_info", "unbroken's version", labels=["version", "python"]
        )
        info.add_metric([self.version, platform.python_version()], 1.0)
        yield info
        g = _Gauges()
        wall = self._counter("unbroken_wall_seconds", "Wall time of the run so far", [])
        productive = self._counter(
            "unbroken_productive_seconds", "Time of steps that survived (productive)", []
        )
        badput = self._counter(
            "unbroken_badput_seconds", "Wall time lost, by badput category", ["category"]
        )
        ml_badput = self._counter(
            "unbroken_ml_badput_seconds",
            "Wall time lost, by Google ml-goodput-measurement category",
            ["category"],
        )
        phase_s = self._counter(
            "unbroken_phase_seconds", "Time in the script's own phases (custom badput)", ["phase"]
        )
        fault_cost = self._counter(
            "unbroken_fault_seconds",
            "What the faults cost: fault to training resumed, and the steps redone",
            [],
        )
        degraded = self._counter(
            "unbroken_degraded_seconds",
            "What degradations cost: step time in their windows beyond undegraded steps",
            [],
        )
        stragglers = self._counter(
            "unbroken_straggler_episodes", "Straggler episodes, by rank", ["rank"]
        )
        restarts = self._counter(
            "unbroken_restarts", "Faults restarted by a recovery layer", ["layer", "cause"]
        )
        faults = self._counter(
            "unbroken_faults", "Faults seen (injected or natural)", ["kind", "class", "phase"]
        )
        failed = self._counter(
            "unbroken_failed_restarts",
            "Restart rounds that did not bring training back, by fault class",
            ["class"],
        )
        lost = self._counter("unbroken_steps_lost", "Steps rolled back by faults", [])
        skipped = self._counter("unbroken_checkpoint_saves_skipped", "Checkpoint saves skipped", [])
        commits = self._counter("unbroken_checkpoint_commits", "Checkpoints committed", [])
        failed_saves = self._counter(
            "unbroken_checkpoint_saves_failed", "Checkpoint saves that failed", []
        )
        launcher = self._counter(
            "unbroken_launcher_restarts", "Launcher restart rounds (all nodes)", []
        )
        recovery: list[tuple[str, list[float]]] = []
        detection: list[tuple[str, list[float]]] = []
        blocking: list[tuple[str, list[float]]] = []
        persist: list[tuple[str, list[float]]] = []
        reports: list[tuple[str, RunReport]] = []
        for w in watches:
            rep, snap = w.report, w.snapshot
            assert rep is not None
            run = rep.run or w.name
            self._add(wall, [run], rep.wall_s)
            self._add(productive, [run], rep.productive_s)
            for cat in BADPUT_CATEGORIES:
                self._add(badput, [run, cat], rep.badput_s[cat])
            for cat, seconds in rep.ml_badput_s().items():
                self._add(ml_badput, [run, cat], seconds)
            for name, seconds in rep.custom_s.items():
                self._add(phase_s, [run, name], seconds)
            self._add(fault_cost, [run], rep.fault_s)
            self._add(degraded, [run], rep.degraded_s)
            episodes: dict[int, int] = {}
            for x in rep.stragglers:
                episodes[x.rank] = episodes.get(x.rank, 0) + 1
            for r, n in sorted(episodes.items()):
                self._add(stragglers, [run, str(r)], n)
            by_layer: dict[tuple[str, str], int] = {}
            by_kind: dict[tuple[str, str, str], int] = {}
            by_class: dict[str, int] = {}
            for f in rep.faults:
                k3 = (str(f.kind), f.fault_class, f.phase or UNKNOWN_PHASE)
                by_kind[k3] = by_kind.get(k3, 0) + 1
                by_class[f.fault_class] = by_class.get(f.fault_class, 0) + failed_restarts(f)
                if f.disruptive and f.layer is not None:
                    k = (f.layer, str(f.cause or f.kind))
                    by_layer[k] = by_layer.get(k, 0) + 1
            for (layer, cause), n in sorted(by_layer.items()):
                self._add(restarts, [run, layer, cause], n)
            for (kind, cls, phase), n in sorted(by_kind.items()):
                self._add(faults, [run, kind, cls, phase], n)
            for cls, n in sorted(by_class.items()):
                self._add(failed, [run, cls], n)
            for cls, fig in rep.by_class.items():
                g.set("unbroken_fault_recovery_ratio", [run, cls], fig.recovery_rate)
            reports.append((run, rep))
            self._add(lost, [run], sum(f.steps_lost or 0 for f in rep.faults))
            ck = snap.get("checkpoint", {})
            self._add(skipped, [run], ck.get("skipped_total", 0))
            self._add(commits, [run], len(w.index.get(ev.CKPT_COMMIT)))
            self._add(failed_saves, [run], rep.storage.failed_saves)
            rs = snap.get("restarts", {})
            self._add(launcher, [run], rs.get("launcher_used", 0))
            g.run(run, w, snap)
            recovery.append((run, [f.recovery_s for f in rep.faults if f.recovery_s is not None]))
            detection.append(
                (run, [f.detection_s for f in rep.faults if f.detection_s is not None])
            )
            blocking.append((run, _durations(w, ev.CKPT_STAGE)))
            persist.append((run, _durations(w, ev.CKPT_PERSIST)))
        yield from (
            wall,
            productive,
            badput,
            ml_badput,
            phase_s,
            fault_cost,
            degraded,
            stragglers,
            restarts,
            faults,
            lost,
            skipped,
            commits,
            failed_saves,
        )
        yield from (launcher, failed, _recovery_by_class(reports))
        yield _histogram(
            "unbroken_recovery_seconds", "Fault to every rank training again", recovery
        )
        yield _histogram("unbroken_detection_seconds", "Fault to its detection", detection)
        yield _histogram(
            "unbroken_checkpoint_blocking_seconds",
            "Time the trainer was blocked per save (reference rank)",
            blocking,
        )
        yield _histogram(
            "unbroken_checkpoint_persist_seconds",
            "Background write time per save (reference rank)",
            persist,
        )
        yield from g.families.values()


def _durations(w: RunWatch, kind: str) -> list[float]:
    return [float(e.dur_s) for e in w.index.get(kind) if e.rank == 0 and e.dur_s is not None]


class _Gauges:
    """The gauge families, filled run by run."""

    SPECS: dict[str, tuple[str, list[str]]] = {
        "unbroken_job_running": ("1 while the job runs (no job_end yet)", []),
        "unbroken_steps_completed": ("Distinct steps with a surviving execution", []),
        "unbroken_last_step": ("The reference rank's newest step", []),
        "unbroken_steps_per_second": ("Step rate over the last 30 s of the ledger", []),
        "unbroken_step_duration_seconds": ("Median duration of surviving steps", []),
        "unbroken_goodput_ratio": ("Goodput so far (training, infrastructure)", ["kind"]),
        "unbroken_availability_ratio": ("1 - fault-to-resume time / wall time", []),
        "unbroken_checkpoint_efficiency_ratio": ("1 - blocking save time / loop time", []),
        "unbroken_checkpoint_last_commit_timestamp_seconds": ("Newest commit, epoch s", []),
        "unbroken_checkpoint_last_commit_step": ("Step of the newest commit", []),
        "unbroken_checkpoint_steps_since_commit": ("Steps completed since it", []),
        "unbroken_checkpoint_skipped_in_a_row": ("Saves skipped since the last commit", []),
        "unbroken_checkpoint_in_flight": ("Saves staged, not yet committed", []),
        "unbroken_checkpoint_storage_failing": (
            "1 while the newest failed save is newer than the newest commit, else 0",
            [],
        ),
        "unbroken_checkpoint_unprotected_seconds": (
            "Time from a failed save to the next commit (or the ledger's end), summed",
            [],
        ),
        "unbroken_checkpoint_staging_bytes": ("Memory the staging arena takes", []),
        "unbroken_checkpoint_writer_rss_bytes": ("RSS of the checkpoint writer", []),
        "unbroken_heartbeat_age_seconds": ("Seconds since the rank's last step", ["rank"]),
        "unbroken_rank_step_duration_seconds": ("Median of the rank's last steps", ["rank"]),
        "unbroken_rank_step_deviation_ratio": ("Rank step time / median over ranks - 1", ["rank"]),
        "unbroken_rank_busy_ratio": (
            "Rank's time on or waiting for a CPU / step time, its last steps",
            ["rank"],
        ),
        "unbroken_straggler": (
            "1 while the rank is a straggler by its busy ratio, else 0",
            ["rank"],
        ),
        "unbroken_restart_budget_used_ratio": ("Launcher restarts used / --max-restarts", []),
        "unbroken_alerts": ("Alerts raised, by rule and severity", ["name", "severity"]),
        "unbroken_fault_recovery_ratio": (
            "Faults after which training resumed / faults, by fault class",
            ["class"],
        ),
        "unbroken_ledger_torn_lines": ("Ledger files whose last line is cut", []),
        "unbroken_ledger_bad_lines": ("Complete ledger lines that did not parse", []),
    }

    def __init__(self) -> None:
        self.families = {
            name: GaugeMetricFamily(name, doc, labels=["run", *labels])
            for name, (doc, labels) in self.SPECS.items()
        }

    def set(self, name: str, labels: list[str], value: Any) -> None:
        if value is not None:
            self.families[name].add_metric(labels, float(value))

    def run(self, run: str, w: RunWatch, snap: dict[str, Any]) -> None:
        fig, ck = snap.get("figures", {}), snap.get("checkpoint", {})
        s = self.set
        s("unbroken_job_running", [run], snap.get("status") == "running")
        s("unbroken_steps_completed", [run], fig.get("steps_completed"))
        s("unbroken_last_step", [run], fig.get("last_step"))
        s("unbroken_steps_per_second", [run], fig.get("step_rate"))
        s("unbroken_step_duration_seconds", [run], fig.get("step_time_s_median"))
        s("unbroken_goodput_ratio", [run, "training"], fig.get("training_goodput"))
        s("unbroken_goodput_ratio", [run, "infrastructure"], fig.get("infra_goodput"))
        s("unbroken_availability_ratio", [run], fig.get("availability"))
        s("unbroken_checkpoint_efficiency_ratio", [run], fig.get("checkpoint_efficiency"))
        s("unbroken_checkpoint_last_commit_timestamp_seconds", [run], ck.get("last_commit_ts"))
        s("unbroken_checkpoint_last_commit_step", [run], ck.get("last_commit_step"))
        s("unbroken_checkpoint_steps_since_commit", [run], ck.get("steps_since_commit"))
        if ck.get("enabled"):
            s("unbroken_checkpoint_skipped_in_a_row", [run], ck.get("skipped_in_a_row"))
            s("unbroken_checkpoint_in_flight", [run], ck.get("in_flight"))
            s("unbroken_checkpoint_storage_failing", [run], bool(ck.get("storage_failing")))
            s("unbroken_checkpoint_unprotected_seconds", [run], ck.get("unprotected_s", 0.0))
        s("unbroken_checkpoint_staging_bytes", [run], ck.get("staging_bytes"))
        s("unbroken_checkpoint_writer_rss_bytes", [run], ck.get("writer_rss_bytes"))
        for r in snap.get("ranks", []):
            rank = [run, str(r["rank"])]
            s("unbroken_heartbeat_age_seconds", rank, r.get("heartbeat_age_s"))
            s("unbroken_rank_step_duration_seconds", rank, r.get("step_time_s"))
            s("unbroken_rank_step_deviation_ratio", rank, r.get("deviation"))
            if r.get("busy_ratio") is not None:
                s("unbroken_rank_busy_ratio", rank, r.get("busy_ratio"))
                s("unbroken_straggler", rank, bool(r.get("straggler")))
        rs = snap.get("restarts", {})
        if rs.get("launcher_budget"):
            s(
                "unbroken_restart_budget_used_ratio",
                [run],
                rs["launcher_used"] / rs["launcher_budget"],
            )
        counts: dict[tuple[str, str], int] = {}
        for a in snap.get("alerts", []):
            k = (a["name"], a["severity"])
            counts[k] = counts.get(k, 0) + 1
        for (name, sev), n in sorted(counts.items()):
            s("unbroken_alerts", [run, name, sev], n)
        led = snap.get("ledger", {})
        s("unbroken_ledger_torn_lines", [run], led.get("torn_lines"))
        s("unbroken_ledger_bad_lines", [run], led.get("bad_lines"))


def registry_for(runs: RunSet, *, refresh: bool) -> CollectorRegistry:
    """A registry with the ledger collector over ``runs``; ``refresh``: read the ledgers at
    every scrape (when no background thread keeps them fresh)."""
    from unbroken.version import __version__

    def watches() -> list[RunWatch]:
        if refresh:
            runs.refresh()
        return runs.all()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(watches, version=__version__))  # type: ignore[arg-type]
    return registry


class MetricsServer:
    """``/metrics`` of one run directory on a port of its own (the launcher's exporter)."""

    def __init__(self, run_dir: Path, *, port: int, host: str = "0.0.0.0") -> None:
        (run_dir / "events").mkdir(parents=True, exist_ok=True)  # one run, not a folder of runs
        self.runs = RunSet(run_dir, record_alerts=False)
        registry = registry_for(self.runs, refresh=True)
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise OSError(
                f"cannot serve /metrics on {host}:{port}: {e.strerror or e}; pick another "
                "--ft-metrics-port (0: any free port)"
            ) from None
        self.port = int(self._httpd.server_address[1])
        logger.info("serving /metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self.runs.close()
