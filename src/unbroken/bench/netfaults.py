"""The orchestration side of ``network`` faults: serve a run's requests on the emulated cluster.

A ``network`` fault fires inside a worker, in its pod's namespace, which cannot reach its
peers' namespaces; the worker writes a request and waits (``unbroken.faults.link``). Here a
thread (``unbroken-netfaults``) beside the code that drives the emulated cluster (the
orchestrator: ``bench.k8s.emulated_cluster`` starts one per cluster, over the runs on its
volume, and it ends when the cluster closes) reads each new request, finds the requesting pod
by its hostname and the peers' pods by their ranks (each rank's newest ``process_start``
record in the run's ledger names its host), degrades the links between them
(``Cluster.degrade``: a user-space delay-and-loss forwarder) and answers: applied, with the
window, or not, with the reason (a loopback cluster, no peer pod, a forwarder that failed).

Only a cluster served this way tells its pods so (``UNBROKEN_LINK_FAULTS``), so a worker
elsewhere records its network fault as not applicable at once instead of waiting.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from unbroken import env as envnames
from unbroken.faults import link
from unbroken.k8s.emulate import Cluster
from unbroken.k8s.emulate.pod import Pod
from unbroken.ledger import events as ev
from unbroken.ledger import read_events
from unbroken.ledger.durable import write_atomic

logger = logging.getLogger(__name__)


class NetworkFaults:
    """Serves the network-fault requests of the run directories in ``root`` (or of ``root``, a
    run directory) on ``cluster`` until the cluster closes (or ``close()``).

    Create it before the cluster starts pods (it sets ``UNBROKEN_LINK_FAULTS`` in their
    environment when the cluster can degrade links: netns mode)."""

    def __init__(self, cluster: Cluster, root: Path, *, poll_s: float = 0.01) -> None:
        self.cluster = cluster
        self.root = Path(root)
        self.poll_s = poll_s
        self.answers: list[dict[str, Any]] = []
        """Every answer given, in order (with its request's ``index``)."""
        if cluster.mode == "netns":
            cluster.env[envnames.UNBROKEN_LINK_FAULTS] = "1"
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="unbroken-netfaults", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> NetworkFaults:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _requests(self) -> list[Path]:
        pattern = f"faults/{link.DIR}/*.json"
        found = [*self.root.glob(pattern), *self.root.glob(f"*/{pattern}")]
        return sorted(p for p in found if not p.name.endswith(".answer.json"))

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s) and not self.cluster.closing:
            for path in self._requests():
                if str(path) in self._seen:
                    continue
                self._seen.add(str(path))
                try:
                    self._serve(path)
                except Exception:  # one bad request must not end the service
                    logger.exception("network fault request %s failed", path)

    def _serve(self, path: Path) -> None:
        req = json.loads(path.read_text())
        run_dir = path.parents[2]  # <run_dir>/faults/network/<index>.json
        try:
            pod = self.cluster.pod(str(req["host"]))
            peers = self._peers(run_dir, pod, req.get("peers", "all"))
            ready = self.cluster.degrade(
                pod,
                peers,
                delay_ms=float(req["delay_ms"]),
                loss=float(req["loss"]),
                seconds=float(req["seconds"]),
                seed=int(req["index"]),
            )
            answer: dict[str, Any] = {
                "applied": True,
                "ts": ready["ts"],
                "until": ready["until"],
                "pods": [p.hostname for p in peers],
                "ip": pod.ip,
            }
        except (LookupError, OSError) as e:
            answer = {"applied": False, "reason": str(e)}
        logger.info("network fault #%s of rank %s: %s", req.get("index"), req.get("rank"), answer)
        self.answers.append({"index": req.get("index"), **answer})
        write_atomic(link.answer_path(path), json.dumps(answer), durable=False)

    def _peers(self, run_dir: Path, pod: Pod, peers: Any) -> list[Pod]:
        """The running pods of the peer ranks (every other rank's for "all"), not ``pod``."""
        hosts: dict[int, str] = {}
        for e in sorted(read_events(run_dir), key=lambda e: e.ts):
            if e.kind == ev.PROCESS_START and e.rank >= 0 and e.get("host"):
                hosts[e.rank] = str(e.get("host"))
        ranks = sorted(hosts) if peers == "all" else [int(r) for r in peers]
        missing = [r for r in ranks if r not in hosts]
        if missing:
            raise LookupError(f"no process_start record names the host of rank(s) {missing}")
        names = sorted({hosts[r] for r in ranks} - {pod.hostname})
        if not names:
            raise LookupError(f"ranks {ranks} all run on {pod.hostname}: no link to degrade")
        return [self.cluster.pod(h) for h in names]
