"""The runs a dashboard watches: one ``RunWatch`` per run directory, kept fresh by ``RunSet``.

``RunWatch.refresh()`` tails the run's ledger (``LedgerTail``: only appended bytes are read),
recomputes the report when records arrived (``goodput.compute``, the same figures as
``unbroken report``), rebuilds the snapshot, evaluates the alert rules and records each new alert
as an ``alert`` ledger record in its own file (rank ``WATCHER_RANK``). An alert whose key is
already in the ledger (from this or an earlier dashboard) is not recorded again. A run directory
that cannot be written to still shows its alerts; they are then not recorded (logged once).

``RunSet`` finds the runs under a path (the path itself when it holds ``events/``, else its
sub-directories up to two levels down that do) and refreshes them from one background thread
every ``refresh_s``; viewers wait on ``changed`` for a new version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.dashboard import alerts as alerts_
from unbroken.dashboard import snapshot
from unbroken.dashboard.index import EventIndex
from unbroken.ledger import Ledger
from unbroken.ledger import events as ev
from unbroken.ledger.events import Event
from unbroken.ledger.goodput import RunReport, compute
from unbroken.ledger.tail import LedgerTail

logger = logging.getLogger(__name__)

AlertSink = Callable[["RunWatch", list[alerts_.Alert]], None]
BUDGET_FACTOR = 10.0


class RunWatch:
    """One run directory, its current report, snapshot and alerts."""

    def __init__(
        self,
        run_dir: Path,
        *,
        name: str,
        alert_config: alerts_.AlertConfig,
        record_alerts: bool = True,
        on_alerts: AlertSink | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.name = name
        self.alert_config = alert_config
        self.record_alerts = record_alerts
        self.on_alerts = on_alerts
        self.tail = LedgerTail(run_dir)
        self.index = EventIndex()
        """The run's records (alert records excluded), by kind."""
        self.report: RunReport | None = None
        self.snapshot: dict[str, Any] = self._waiting()
        self.version = 0
        self.alerts: dict[str, alerts_.Alert] = {}
        """Every alert known for the run, by key: recorded in the ledger or raised here."""
        self._ledger: Ledger | None = None
        self._generation = 0
        self.compute_s = 0.0
        """CPU seconds the last refresh's thread spent (tail, report, alerts, snapshot)."""
        self.due = 0.0
        """Monotonic time before which ``refresh(force=False)`` skips this run (the CPU budget)."""
        self._window: tuple[float, float | None] = (float("-inf"), None)

    def _waiting(self) -> dict[str, Any]:
        where = self.tail.events_dir
        note = (
            f"no ledger records yet in {where}"
            if self.tail.exists()
            else f"waiting for the job to create {where}"
        )
        return {"name": self.name, "status": "waiting", "note": note, "alerts": []}

    @property
    def status(self) -> str:
        return str(self.snapshot.get("status", "waiting"))

    @property
    def events(self) -> list[Event]:
        """The run's records, alert records excluded, in arrival order."""
        return self.index.all

    def refresh(self, now: float | None = None, *, force: bool = True) -> bool:
        """Read what the ledger gained; True when the snapshot changed.

        With ``force=False`` a run is skipped until ``due``: a refresh that cost c CPU seconds
        is followed by the next no sooner than ``BUDGET_FACTOR * c`` later, so watching a long
        run takes at most about 1/BUDGET_FACTOR of a core, whatever its size. The cost is the
        thread's CPU time, not the wall time: on a busy machine a refresh waits for a core (and
        for the GIL while a viewer's stream is serialized), and counting that wait would space
        the refreshes out, and the page fall behind the job, exactly when the job is busy.
        """
        mono = time.monotonic()
        if not force and mono < self.due:
            return False
        t = time.thread_time()
        now = time.time() if now is None else now
        new = self.tail.poll()
        if self.tail.generation != self._generation:
            self._generation = self.tail.generation
            self.index, self.alerts = EventIndex(), {}
            self._window = (float("-inf"), None)
            new = list(self.tail.events)
        for e in new:
            if e.kind == ev.ALERT:
                a = alerts_.Alert.from_event(e)
                self.alerts.setdefault(a.key, a)
        self.index.add(new)
        try:
            return self._refresh(now, new)
        finally:
            self.compute_s = time.thread_time() - t
            self.due = mono + BUDGET_FACTOR * self.compute_s

    def _refresh(self, now: float, new: list[Event]) -> bool:
        if not self.index:
            changed = self.snapshot.get("status") != "waiting" or bool(new)
            self.snapshot = self._waiting()
            self.version += changed
            return changed
        finished = self.report is not None and self.status != "running"
        if not new and (finished or self.status == "error"):
            return False  # a finished (or unreadable) run changes only when records arrive
        try:
            self._update(now, recompute=bool(new) or self.report is None)
        except (ValueError, TypeError, KeyError) as e:  # a record that parses but makes no sense
            logger.warning("%s: cannot compute the report: %s", self.name, e)
            self.report = None
            self.snapshot = {
                "name": self.name,
                "status": "error",
                "note": f"the ledger in {self.tail.events_dir} has a record the goodput math "
                f"cannot use ({type(e).__name__}: {e}); `unbroken report` fails on it too",
                "alerts": [],
            }
        self.version += 1
        return True

    def _windowed_goodput(self) -> float | None:
        """The windowed goodput for the low-goodput rule, recomputed at most every 1/20 window."""
        cfg = self.alert_config
        at, value = self._window
        if self.index.t1 - at >= cfg.goodput_window_s / 20:
            value = alerts_.windowed_goodput(self.index, cfg.goodput_window_s)
            self._window = (self.index.t1, value)
        return value

    def _update(self, now: float, *, recompute: bool) -> None:
        if recompute or self.report is None:
            self.report = compute(self.index.all)
        raised = alerts_.evaluate(
            self.index,
            self.report,
            now=now,
            cfg=self.alert_config,
            goodput_window=self._windowed_goodput(),
        )
        fresh = [a for a in raised if a.key not in self.alerts]
        for a in fresh:
            self.alerts[a.key] = a
        if fresh:
            self._record(fresh)
        self.snapshot = snapshot.build(
            self.index,
            self.report,
            name=self.name,
            now=now,
            alerts=[_alert_json(a) for a in sorted(self.alerts.values(), key=lambda a: a.ts)],
            ledger={
                "files": self.tail.files,
                "torn_lines": self.tail.torn_lines,
                "bad_lines": len(self.tail.bad_lines),
                "bad_line_positions": self.tail.bad_lines[:20],
                "records": len(self.index),
            },
        )

    def _record(self, fresh: list[alerts_.Alert]) -> None:
        for a in fresh:
            logger.info("%s: alert %s (%s): %s", self.name, a.name, a.severity, a.summary)
        if self.record_alerts and self._ledger is None:
            run = self.report.run if self.report is not None else self.name
            try:
                self._ledger = Ledger(self.run_dir, run=run, rank=ev.WATCHER_RANK)
            except OSError as e:
                logger.warning(
                    "%s: cannot record alerts in %s (%s); they are shown, not recorded",
                    self.name,
                    self.run_dir,
                    e,
                )
                self.record_alerts = False
        if self._ledger is not None:
            for a in fresh:
                self._ledger.emit(ev.ALERT, **a.data())
        if self.on_alerts is not None:
            self.on_alerts(self, fresh)

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None


def _alert_json(a: alerts_.Alert) -> dict[str, Any]:
    return {
        "name": a.name,
        "severity": a.severity,
        "key": a.key,
        "summary": a.summary,
        "ts": a.ts,
        "labels": a.labels,
        "value": a.value,
    }


def find_runs(root: Path, *, depth: int = 2) -> dict[str, Path]:
    """Run directories (holding ``events/``) at ``root`` or under it, by name (relative path)."""
    if (root / "events").is_dir():
        return {root.name or str(root): root}
    found: dict[str, Path] = {}
    level = [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                children = sorted(p for p in d.iterdir() if p.is_dir())
            except OSError:
                continue
            for c in children:
                if (c / "events").is_dir():
                    found[c.relative_to(root).as_posix()] = c
                elif not c.name.startswith("."):
                    nxt.append(c)
        level = nxt
    return found


class RunSet:
    """Every run under ``root``, refreshed together; ``changed`` is notified on any change."""

    def __init__(
        self,
        root: Path,
        *,
        alert_config: alerts_.AlertConfig | None = None,
        record_alerts: bool = True,
        on_alerts: AlertSink | None = None,
        refresh_s: float = 1.0,
        scan_s: float = 5.0,
    ) -> None:
        if not root.exists():
            raise FileNotFoundError(
                f"{root} does not exist: pass a run directory (the --run-dir of a job) or a "
                "folder of them"
            )
        if not root.is_dir():
            raise ValueError(f"{root} is not a directory: pass a run directory or a folder of them")
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.root = root
        self.alert_config = alert_config or alerts_.AlertConfig()
        self.record_alerts = record_alerts
        self.on_alerts = on_alerts
        self.refresh_s = refresh_s
        self.scan_s = scan_s
        self.watches: dict[str, RunWatch] = {}
        self.changed = threading.Condition()
        self.version = 0
        self._lock = threading.Lock()
        self._next_scan = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def single(self) -> bool:
        """True when the root is itself a run directory."""
        return (self.root / "events").is_dir()

    def scan(self) -> None:
        for name, path in find_runs(self.root).items():
            if name not in self.watches:
                self.watches[name] = RunWatch(
                    path,
                    name=name,
                    alert_config=self.alert_config,
                    record_alerts=self.record_alerts,
                    on_alerts=self.on_alerts,
                )

    def refresh(self) -> bool:
        """Rescan (every ``scan_s``) and refresh every run; True when anything changed."""
        with self._lock:
            now = time.monotonic()
            if now >= self._next_scan:
                before = len(self.watches)
                self.scan()
                self._next_scan = now + self.scan_s
                grew = len(self.watches) != before
            else:
                grew = False
            changed = grew
            for w in list(self.watches.values()):
                try:
                    changed |= w.refresh(force=False)
                except Exception:  # one bad run must not stop the others
                    logger.exception("refreshing %s failed", w.name)
        if changed:
            with self.changed:
                self.version += 1
                self.changed.notify_all()
        return changed

    def get(self, name: str) -> RunWatch | None:
        with self._lock:
            return self.watches.get(name)

    def all(self) -> list[RunWatch]:
        with self._lock:
            return list(self.watches.values())

    def start(self) -> None:
        """Refresh now, then every ``refresh_s`` from a background thread."""
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="unbroken-dashboard", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        with self.changed:
            self.changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for w in self.all():
            w.close()
