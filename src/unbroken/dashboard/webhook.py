"""POST new alerts to a webhook in Alertmanager's webhook format (payload ``version`` "4").

A receiver written for Alertmanager (a chat bridge, an incident tool) takes these as they are:
one POST per run and refresh, ``status`` "firing", one entry in ``alerts`` per new alert with
``labels`` (``alertname``, ``severity``, ``run`` and the rule's own), ``annotations``
(``summary``), ``startsAt`` (RFC 3339) and a ``fingerprint`` (the dedup key's hash). Sending
happens on a thread of its own with a bounded queue, so a slow or dead receiver never delays the
dashboard; a failed POST is retried ``retries`` times, then logged and dropped.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import queue
import threading
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlparse

from unbroken.dashboard.alerts import Alert

logger = logging.getLogger(__name__)

_STOP = object()


def _rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc).isoformat()


def payload(alerts: list[Alert], *, run: str, external_url: str = "") -> dict[str, Any]:
    """The Alertmanager webhook body for new alerts of one run."""
    items = []
    for a in alerts:
        labels = {"alertname": a.name, "severity": a.severity, "run": run, **a.labels}
        items.append(
            {
                "status": "firing",
                "labels": labels,
                "annotations": {"summary": a.summary},
                "startsAt": _rfc3339(a.ts),
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": external_url,
                "fingerprint": hashlib.sha256(f"{run}/{a.key}".encode()).hexdigest()[:16],
            }
        )
    common = {"run": run}
    if len({a.name for a in alerts}) == 1:
        common["alertname"] = alerts[0].name
    return {
        "version": "4",
        "groupKey": f'{{}}:{{run="{run}"}}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "unbroken",
        "groupLabels": {"run": run},
        "commonLabels": common,
        "commonAnnotations": {},
        "externalURL": external_url,
        "alerts": items,
    }


class Webhook:
    """Sends alert batches to ``url`` in the background; ``close()`` drains what is queued."""

    def __init__(
        self, url: str, *, timeout_s: float = 5.0, retries: int = 2, external_url: str = ""
    ) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"--webhook must be an http(s) URL like http://host:9093/hook, got {url!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"webhook timeout_s must be > 0, got {timeout_s}")
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.external_url = external_url
        self.sent = 0
        """Batches delivered."""
        self.failed = 0
        """Batches dropped after their retries."""
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=1000)
        self._thread = threading.Thread(target=self._run, name="unbroken-webhook", daemon=True)
        self._thread.start()

    def send(self, alerts: list[Alert], *, run: str) -> None:
        if not alerts:
            return
        try:
            self._queue.put_nowait(payload(alerts, run=run, external_url=self.external_url))
        except queue.Full:
            logger.warning("webhook queue full: dropping %d alert(s) of %s", len(alerts), run)

    def _post(self, body: dict[str, Any]) -> None:
        req = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            resp.read()

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            if body is _STOP:
                return
            for attempt in range(self.retries + 1):
                try:
                    self._post(body)
                    self.sent += 1
                    break
                except (urllib.error.URLError, OSError, ValueError) as e:
                    if attempt == self.retries:
                        self.failed += 1
                        logger.warning(
                            "webhook %s: %s; %d alert(s) dropped", self.url, e, len(body["alerts"])
                        )

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=self.timeout_s * (self.retries + 1) + 1)
