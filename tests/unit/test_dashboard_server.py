"""The dashboard's HTTP server in-process over real sockets: routes, bad input, live updates,
alert records and the Alertmanager webhook."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from timelines import faulty_run, steps, write
from unbroken.dashboard.alerts import AlertConfig
from unbroken.dashboard.runs import RunSet
from unbroken.dashboard.server import DashboardServer
from unbroken.dashboard.webhook import Webhook
from unbroken.ledger import events as ev
from unbroken.ledger import read_run
from unbroken.ledger import writer as ledger_writer


class Served:
    def __init__(self, root: Path, **kw) -> None:
        self.runs = RunSet(root, refresh_s=0.05, **kw)
        self.server = DashboardServer(self.runs, port=0, kb_path=root / "kb.sqlite")
        self.runs.start()
        self.server.start()

    def get(self, path: str) -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(self.server.url.rstrip("/") + path, timeout=10) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers["Content-Type"], e.read().decode()

    def json(self, path: str):
        code, _, body = self.get(path)
        return code, json.loads(body)

    def close(self) -> None:
        self.server.close()
        self.runs.close()


@pytest.fixture
def served(tmp_path: Path):
    made: list[Served] = []

    def make(root: Path, **kw) -> Served:
        s = Served(root, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _wait(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_folder_of_runs_pages_and_errors(tmp_path: Path, served) -> None:
    write(tmp_path / "a", faulty_run())
    write(tmp_path / "nested" / "b", faulty_run(faults_at=(10.0,)))
    s = served(tmp_path)
    code, runs = s.json("/api/runs")
    assert code == 200 and not runs["single"]
    assert sorted(r["name"] for r in runs["runs"]) == ["a", "nested/b"]
    code, ctype, body = s.get("/")
    assert code == 200 and "text/html" in ctype and 'id="search"' in body
    code, _, body = s.get("/run/nested/b")
    assert code == 200 and 'id="step-chart"' in body
    code, snap = s.json("/api/run/nested/b")
    assert code == 200 and snap["figures"]["faults"] == 1 and snap["status"] == "ok"
    code, err = s.json("/api/run/nope")
    assert code == 404 and "no run named 'nope'" in err["error"] and "nested/b" in err["error"]
    code, ctype, body = s.get("/run/nope")
    assert code == 404 and "text/html" in ctype and "Traceback" not in body
    assert s.get("/static/../runs.py")[0] == 404
    assert s.get("/static/vendor/uplot/uPlot.iife.min.js")[0] == 200
    code, ctype, body = s.get("/metrics")
    assert code == 200 and ctype.startswith("text/plain") and 'run="run-1"' in body
    code, alerts = s.json("/api/alerts")
    assert code == 200 and {a["run"] for a in alerts} == {"a", "nested/b"}


def test_single_run_redirects_and_shows_a_run_being_written(tmp_path: Path, served) -> None:
    run = tmp_path / "job"
    run.mkdir()
    s = served(run)
    code, runs = s.json("/api/runs")
    assert runs["runs"] == []  # nothing yet: not an error
    events = faulty_run()
    write(run, events[:30])
    s.runs._next_scan = 0  # rescan now instead of in scan_s
    snap = _wait(lambda: (lambda r: r[1] if r[0] == 200 else None)(s.json("/api/run/job")))
    first = _wait(lambda: s.json("/api/run/job")[1].get("figures"))
    assert snap["status"] in ("waiting", "running")
    req = urllib.request.urlopen(s.server.url, timeout=10)  # / redirects to the only run
    assert req.url.endswith("/run/job")
    path = write(run, events[30:60])
    with open(path, "a") as f:
        f.write('{"kind": "step", "ts": 99, "st')  # a record cut mid-write
    grown = _wait(
        lambda: (lambda f: f if f and f["steps_completed"] > first["steps_completed"] else None)(
            s.json("/api/run/job")[1].get("figures")
        )
    )
    snap = s.json("/api/run/job")[1]
    assert snap["status"] == "running" and snap["ledger"]["torn_lines"] == 1
    assert grown["steps_completed"] > first["steps_completed"]


def test_garbage_and_nonsense_records_give_a_message_not_a_crash(tmp_path: Path, served) -> None:
    path = write(tmp_path / "r", faulty_run())
    with open(path, "a") as f:
        f.write("garbage\n[1]\n")
    write(tmp_path / "s", [*steps(0, 3, 0.0), ev.Event(kind=ev.STEP, ts=9.0, data={"step": "x"})])
    s = served(tmp_path)
    snap = s.json("/api/run/r")[1]
    assert snap["ledger"]["bad_lines"] == 2 and snap["figures"]["faults"] == 3
    code, snap = s.json("/api/run/s")  # a step that is no integer: a bad line, not a crash
    assert code == 200 and snap["ledger"]["bad_lines"] == 1
    assert snap["figures"]["steps_completed"] == 4  # steps 0..3; the bad one is left out


def test_stream_sends_a_snapshot_at_each_change(tmp_path: Path, served) -> None:
    events = faulty_run()
    path = write(tmp_path, events[:20])
    s = served(tmp_path)
    resp = urllib.request.urlopen(s.server.url + "api/run/" + tmp_path.name + "/stream", timeout=10)
    assert resp.headers["Content-Type"] == "text/event-stream"

    def next_snapshot() -> dict:
        while True:
            line = resp.readline().decode()
            if line.startswith("data: "):
                return json.loads(line[6:])

    a = next_snapshot()
    with open(path, "a") as f:
        f.write("".join(e.to_json() + "\n" for e in events[20:]))
    b = next_snapshot()
    while b["figures"]["steps_completed"] == a["figures"]["steps_completed"]:
        b = next_snapshot()
    assert len(b["series"]["t"]) > len(a["series"]["t"])
    resp.close()


def test_alerts_are_recorded_once_across_dashboards(tmp_path: Path, served) -> None:
    write(tmp_path, faulty_run())
    s = served(tmp_path)
    snap = s.json(f"/api/run/{tmp_path.name}")[1]
    assert [a["name"] for a in snap["alerts"]].count("fault_recurring") == 3
    s.close()

    def recorded() -> list:
        return [e for e in read_run(tmp_path).events if e.kind == ev.ALERT]

    first = _wait(lambda: recorded() if len(recorded()) == 6 else None)
    assert {e.rank for e in first} == {ev.WATCHER_RANK}
    again = RunSet(tmp_path)  # a second dashboard on the same run
    again.refresh()
    again.close()
    assert len(recorded()) == 6  # nothing recorded twice
    # The report does not change because alerts were recorded.
    from unbroken.ledger.goodput import compute

    assert compute(read_run(tmp_path).events).to_dict() == compute(faulty_run()).to_dict()


def test_a_run_that_cannot_be_written_shows_its_alerts_without_recording(
    tmp_path: Path, served
) -> None:
    write(tmp_path, faulty_run())
    # Where this process's ledger file would go, a directory: opening it fails (even as root).
    blocker = tmp_path / "events" / ledger_writer.file_name()
    blocker.mkdir()
    s = served(tmp_path)
    assert len(s.json(f"/api/run/{tmp_path.name}")[1]["alerts"]) == 6
    assert not s.runs.all()[0].record_alerts
    blocker.rmdir()
    assert not [e for e in read_run(tmp_path).events if e.kind == ev.ALERT]


def test_webhook_posts_alertmanager_payloads(tmp_path: Path, served) -> None:
    got: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a) -> None:
            pass

    receiver = HTTPServer(("127.0.0.1", 0), Receiver)
    t = threading.Thread(target=receiver.serve_forever, daemon=True)
    t.start()
    hook = Webhook(f"http://127.0.0.1:{receiver.server_address[1]}/hook")
    try:
        write(tmp_path, faulty_run())
        s = served(
            tmp_path,
            record_alerts=False,
            alert_config=AlertConfig(recurring_count=2),
            on_alerts=lambda w, fresh: hook.send(fresh, run=w.report.run),
        )
        assert s.json(f"/api/run/{tmp_path.name}")[0] == 200
        _wait(lambda: got)
    finally:
        hook.close()
        receiver.shutdown()
        receiver.server_close()
    body = got[0]
    assert (
        body["version"] == "4"
        and body["status"] == "firing"
        and body["groupLabels"] == {"run": "run-1"}
    )
    names = [a["labels"]["alertname"] for a in body["alerts"]]
    assert "fault_recurring" in names and "fault_recovered" in names
    for a in body["alerts"]:
        assert a["status"] == "firing" and a["labels"]["run"] == "run-1"
        assert a["labels"]["severity"] in ("info", "page") and a["annotations"]["summary"]
        assert a["startsAt"].endswith("+00:00") and len(a["fingerprint"]) == 16
    assert hook.sent == 1 and hook.failed == 0


def test_webhook_refuses_a_bad_url_and_survives_a_dead_receiver() -> None:
    with pytest.raises(ValueError, match="http"):
        Webhook("ftp://x")
    hook = Webhook("http://127.0.0.1:9/none", timeout_s=0.5, retries=0)  # port 9: nothing there
    from unbroken.dashboard.alerts import Alert

    hook.send([Alert(name="x", severity="info", key="k", summary="s", ts=1.0)], run="r")
    hook.close()
    assert hook.failed == 1 and hook.sent == 0


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RunSet(tmp_path / "nope")


def test_index_search_goes_to_the_knowledge_base(tmp_path: Path, served) -> None:
    from unbroken.kb import KnowledgeBase

    write(tmp_path / "a", faulty_run())
    s = served(tmp_path)
    code, res = s.json("/api/search?q=exception")
    assert code == 200 and res["hits"] == [] and "unbroken kb ingest" in res["note"]
    with KnowledgeBase(tmp_path / "kb.sqlite") as kb:
        kb.ingest(tmp_path / "a")
    code, res = s.json("/api/search?q=exception")
    assert code == 200 and [h["served_as"] for h in res["hits"]] == ["a"]
    code, res = s.json("/api/search?q=" + urllib.parse.quote('"unbalanced AND ('))
    assert code == 200 and res["hits"] == []  # not FTS5 syntax: searched as words, no error
    code, res = s.json("/api/search?q=")
    assert code == 400 and "empty search" in res["error"]


def test_the_refresh_budget_counts_cpu_not_the_wait_for_a_core(tmp_path: Path) -> None:
    """A refresh that waits (here for the GIL, held by a spinning thread half the time) is not
    charged for the wait: its next one is due after 10x its CPU time, not 10x its wall time, so
    the page keeps up with a job on a busy machine. Charged by wall time, a CI run's dashboard
    once skipped the whole 23 s of a live job's training after one slow refresh."""
    from unbroken.dashboard.runs import BUDGET_FACTOR, RunWatch

    write(tmp_path, steps(0, 2000, 0.0, dur=0.1))
    watch = RunWatch(tmp_path, name="job", alert_config=AlertConfig())
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        t0 = time.monotonic()
        watch.refresh(force=False)
        wall = time.monotonic() - t0
    finally:
        stop.set()
        spinner.join()
    assert watch.snapshot["figures"]["steps_completed"] == 2001
    # The spinner holds the GIL for about half of the refresh, so its CPU time is about half
    # its wall time; by wall time the ratio would be 1.
    assert 0 < watch.compute_s < 0.8 * wall, (watch.compute_s, wall)
    assert watch.due < t0 + BUDGET_FACTOR * 0.8 * wall
