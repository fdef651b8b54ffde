"""The ``network`` fault, the worker's side: ask the emulated cluster to degrade the links
between this rank's pod and its peers' pods, and wait for its answer.

A pod cannot reach into its peers' network namespaces (nor should it): the orchestration side
applies the fault, as a real network fault comes from outside the job. The protocol is two
files under ``<run_dir>/faults/network/``, both written atomically:

- ``<index>.json``, the request (this module): ``index``, ``rank``, ``host`` (this pod's
  hostname), ``peers`` ("all" or ranks), ``delay_ms``, ``loss`` (percent), ``seconds``, ``ts``;
- ``<index>.answer.json``, the answer (the orchestrator's): ``applied`` (bool), with ``ts``
  (when the links were degraded), ``until``, ``pods`` (the peer pods' hostnames) and ``ip``
  when applied, else ``reason``.

Only an emulated cluster that serves these requests sets ``UNBROKEN_LINK_FAULTS`` in its pods
(``unbroken.bench.netfaults``); without it, and when no answer comes within
``ANSWER_TIMEOUT_S``, the fault's record says ``applied: false`` and why (a warning is logged):
never silently nothing. Applied, the record carries ``window_s``, the degradation window that
the report prices (``ledger.degraded``).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

from unbroken import env as envnames
from unbroken.faults.plan import FaultSpec
from unbroken.ledger.durable import write_atomic

logger = logging.getLogger(__name__)

DIR = "network"
"""Requests and answers live in ``<run_dir>/faults/<DIR>/``."""
ANSWER_TIMEOUT_S = 10.0
"""How long a rank waits for the orchestrator's answer."""
POLL_S = 0.01


def requests_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "faults" / DIR


def answer_path(request: Path) -> Path:
    return request.with_name(f"{request.stem}.answer.json")


def request(
    spec: FaultSpec, *, fired_dir: Path, timeout_s: float = ANSWER_TIMEOUT_S
) -> dict[str, Any]:
    """Ask for ``spec`` (a network fault) and wait for the answer; the ledger record's fields.
    ``fired_dir`` is the injector's ``<run_dir>/faults/fired``."""
    cfg = spec.settings()
    out: dict[str, Any] = {k: cfg[k] for k in ("delay_ms", "loss", "seconds", "peers")}
    if not envnames.lookup(envnames.UNBROKEN_LINK_FAULTS):
        reason = (
            f"not applicable: no emulated cluster applies network faults here "
            f"({envnames.UNBROKEN_LINK_FAULTS} is not set); nothing was degraded"
        )
        logger.warning("network fault %s: %s", spec.describe(), reason)
        return {**out, "applied": False, "reason": reason}
    folder = fired_dir.parent / DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{spec.index}.json"
    body = {"index": spec.index, "rank": spec.rank, "host": socket.gethostname(), **out}
    write_atomic(path, json.dumps({**body, "ts": time.time()}), durable=False)
    answer = answer_path(path)
    deadline = time.monotonic() + timeout_s
    while not answer.exists():
        if time.monotonic() > deadline:
            reason = f"no answer from the emulated cluster within {timeout_s:g} s ({answer})"
            logger.warning("network fault %s: not applied: %s", spec.describe(), reason)
            return {**out, "applied": False, "reason": reason}
        time.sleep(POLL_S)
    try:
        got = json.loads(answer.read_text())
    except (OSError, ValueError) as e:
        return {**out, "applied": False, "reason": f"unreadable answer {answer}: {e}"}
    if not got.get("applied"):
        reason = str(got.get("reason", "the emulated cluster did not apply it"))
        logger.warning("network fault %s: not applied: %s", spec.describe(), reason)
        return {**out, "applied": False, "reason": reason}
    logger.warning("network fault %s: links to %s degraded", spec.describe(), got.get("pods"))
    return {
        **out,
        "applied": True,
        "pods": got.get("pods"),
        "window_s": float(got.get("until", 0.0)) - time.time(),
    }
