"""``unbroken dashboard``: the HTTP server (standard library) over a ``RunSet``.

Why the standard library and not Starlette + uvicorn: the work behind every request is reading
files and running the goodput math, which is synchronous and CPU-bound, so an event loop buys
nothing; a thread per connection serves the few people who watch a job (server-sent events
included) and the Prometheus scrapes. One server implementation serves both the dashboard and
``unbroken-run --ft-metrics-port`` (prometheus_client's own server is the same
``http.server``), binding a port in use fails at once with a clear message, and a pod image needs
no ASGI stack.

Routes (GET): ``/`` the index (a single run redirects to its page), ``/run/NAME`` a run's page,
``/static/...`` the page's files (uPlot included: no CDN), ``/api/runs``, ``/api/run/NAME``
(the snapshot), ``/api/run/NAME/stream`` (server-sent events: a snapshot at every change),
``/api/alerts``, ``/api/search?q=`` (the knowledge base), ``/metrics``. An error is a short
message (JSON for ``/api``), never a traceback; the traceback goes to the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mimetypes
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlparse

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from unbroken.dashboard.metrics import registry_for
from unbroken.dashboard.runs import RunSet

logger = logging.getLogger(__name__)

KEEPALIVE_S = 15.0


class _NotFound(Exception):
    pass


class _BadRequest(Exception):
    pass


def _static_root() -> Any:
    return resources.files("unbroken.dashboard").joinpath("static")


def _run_summary(w: Any) -> dict[str, Any]:
    snap = w.snapshot
    fig = snap.get("figures", {})
    return {
        "name": w.name,
        "path": str(w.run_dir),
        "status": snap.get("status"),
        "note": snap.get("note"),
        "steps_completed": fig.get("steps_completed"),
        "training_goodput": fig.get("training_goodput"),
        "infra_goodput": fig.get("infra_goodput"),
        "faults": fig.get("faults"),
        "alerts": len(snap.get("alerts", [])),
        "pages": sum(1 for a in snap.get("alerts", []) if a["severity"] == "page"),
        "wall_s": snap.get("wall_s"),
    }


class DashboardServer:
    """Serves ``runs`` on ``host:port`` from a background thread until ``close()``."""

    def __init__(
        self, runs: RunSet, *, host: str = "127.0.0.1", port: int = 8765, kb_path: Path | None
    ) -> None:
        self.runs = runs
        self.kb_path = kb_path
        self.registry = registry_for(runs, refresh=False)
        self.stopping = threading.Event()
        handler = type("Handler", (_Handler,), {"app": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise OSError(
                f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port "
                "(0: any free port)"
            ) from None
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False  # type: ignore[attr-defined]
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="unbroken-dashboard-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.stopping.set()
        with self.runs.changed:
            self.runs.changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)

    # --- answers -----------------------------------------------------------------------------
    def watch(self, name: str) -> Any:
        w = self.runs.get(name)
        if w is None:
            known = ", ".join(sorted(self.runs.watches)) or "none yet"
            raise _NotFound(f"no run named {name!r} under {self.runs.root} (runs: {known})")
        return w

    def runs_json(self) -> dict[str, Any]:
        return {
            "root": str(self.runs.root),
            "single": self.runs.single,
            "kb": str(self.kb_path) if self.kb_path is not None else None,
            "runs": [_run_summary(w) for w in self.runs.all()],
        }

    def alerts_json(self) -> list[dict[str, Any]]:
        out = []
        for w in self.runs.all():
            for a in w.snapshot.get("alerts", []):
                out.append({"run": w.name, **a})
        return sorted(out, key=lambda a: a["ts"])

    def search_json(self, query: str) -> dict[str, Any]:
        from unbroken.kb import KnowledgeBase

        if self.kb_path is None or not self.kb_path.is_file():
            return {
                "query": query,
                "hits": [],
                "note": f"no knowledge base at {self.kb_path}: run 'unbroken kb ingest RUN_DIR...'",
            }
        served = {str(w.run_dir.resolve()): w.name for w in self.runs.all()}
        try:
            with KnowledgeBase(self.kb_path, create=False) as kb:
                hits = kb.search(query)
        except ValueError as e:
            raise _BadRequest(str(e)) from None
        return {
            "query": query,
            "hits": [{**h.__dict__, "served_as": served.get(h.path)} for h in hits],
        }


class _Handler(BaseHTTPRequestHandler):
    app: DashboardServer
    server_version = "unbroken-dashboard"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _send(
        self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, code: int = 200) -> None:
        self._send(code, json.dumps(obj, default=str).encode(), "application/json")

    def _error(self, code: int, message: str) -> None:
        if self.path.startswith("/api/"):
            self._json({"error": message}, code)
        else:
            text = f"<!doctype html><title>unbroken dashboard</title><p>{_esc(message)}</p>"
            text += '<p><a href="/">all runs</a></p>'
            self._send(code, text.encode(), "text/html; charset=utf-8")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        try:
            self._route()
        except _NotFound as e:
            self._error(404, str(e))
        except _BadRequest as e:
            self._error(400, str(e))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the viewer went away
        except Exception as e:
            logger.exception("%s failed", self.path)
            with contextlib.suppress(OSError):
                self._error(
                    500, f"internal error ({type(e).__name__}: {e}); see the dashboard's log"
                )

    def _route(self) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        app = self.app
        if path == "/":
            if app.runs.single and app.runs.all():
                name = app.runs.all()[0].name
                self._send(302, b"", "text/plain", {"Location": "/run/" + quote(name)})
                return
            self._static("index.html")
        elif path.startswith("/run/"):
            app.watch(path[len("/run/") :])
            self._static("run.html")
        elif path.startswith("/static/"):
            self._static(path[len("/static/") :])
        elif path == "/api/runs":
            self._json(app.runs_json())
        elif path == "/api/alerts":
            self._json(app.alerts_json())
        elif path == "/api/search":
            self._json(app.search_json(parse_qs(url.query).get("q", [""])[0]))
        elif path.startswith("/api/run/") and path.endswith("/stream"):
            self._stream(app.watch(path[len("/api/run/") : -len("/stream")]))
        elif path.startswith("/api/run/"):
            self._json(app.watch(path[len("/api/run/") :]).snapshot)
        elif path == "/metrics":
            self._send(200, generate_latest(app.registry), CONTENT_TYPE_LATEST)
        elif path == "/favicon.ico":
            self._send(204, b"", "image/x-icon")
        else:
            raise _NotFound(f"no page {path}")

    def _static(self, rel: str) -> None:
        parts = [p for p in rel.split("/") if p]
        if not parts or any(p in (".", "..") or p.startswith(".") for p in parts):
            raise _NotFound(f"no file {rel}")
        node = _static_root()
        for p in parts:
            node = node.joinpath(p)
        if not node.is_file():
            raise _NotFound(f"no file {rel}")
        ctype = mimetypes.guess_type(parts[-1])[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        self._send(200, node.read_bytes(), ctype)

    def _stream(self, watch: Any) -> None:
        """Server-sent events: the snapshot now and after every change, until the viewer leaves."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        runs, stopping = self.app.runs, self.app.stopping
        sent = -1
        while not stopping.is_set():
            if watch.version != sent:
                sent = watch.version
                data = json.dumps(watch.snapshot, default=str)
                self.wfile.write(f"event: snapshot\ndata: {data}\n\n".encode())
            else:
                self.wfile.write(b": keep-alive\n\n")
            self.wfile.flush()
            with runs.changed:
                if watch.version == sent and not stopping.is_set():
                    runs.changed.wait(KEEPALIVE_S)


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
