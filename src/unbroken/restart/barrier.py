"""Between two iterations, over the coordination store: who made it, who is healthy, what next.

Barrier A: every rank writes its ``ExitRecord`` under ``exit/<member>`` and waits for every
member's; a member missing after ``barrier_timeout_s`` is left out, and the set of members
present is agreed through ``compare_set`` on ``present`` (the first proposal wins, so ranks
whose timeouts fired at different moments still agree). If every record is OK, ``fn``
returned everywhere. Otherwise each rank runs its health checks (knowing how many faults it
caused, this one included), barrier B waits for ``health/<member>``, every rank computes the
decision from the same data (``assign.decide``), and ``compare_set`` on ``decision`` makes the
first one written the one everybody follows.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from unbroken.restart import assign
from unbroken.restart.config import RankExcluded, RestartConfig
from unbroken.restart.health import HealthCheck, HealthInfo, run_checks
from unbroken.restart.store import Keys

logger = logging.getLogger(__name__)


WAIT_SLICE_S = 0.1
"""How often a barrier that can be interrupted asks whether it is."""


class Interrupted(Exception):  # noqa: N818 - a control-flow signal
    """A barrier was left because ``interrupted()`` said so (the worker is handed over)."""


def wait_for(
    client: Any,
    keys: Sequence[str],
    members: Sequence[int],
    *,
    timeout_s: float,
    interrupted: Callable[[], bool] | None = None,
) -> list[int]:
    """Wait until every key exists; returns the members whose key exists (all, or those there
    when ``timeout_s`` ran out). With ``interrupted``, asked every ``WAIT_SLICE_S``: True
    raises ``Interrupted``."""
    deadline = time.monotonic() + timeout_s
    while True:
        began = time.monotonic()
        wait_s = max(0.001, deadline - began)
        if interrupted is not None:
            wait_s = min(wait_s, WAIT_SLICE_S)
        try:
            client.wait(list(keys), timedelta(seconds=wait_s))
            return list(members)
        except (RuntimeError, dist.DistStoreError):
            if interrupted is not None and interrupted():
                raise Interrupted from None
            now = time.monotonic()
            if now < deadline and now - began >= wait_s / 2:  # a slice ran out: wait on
                continue
        arrived = [m for m, k in zip(members, keys, strict=True) if client.check([k])]
        logger.warning(
            "barrier timed out after %.1fs; present: %s of %s", timeout_s, arrived, list(members)
        )
        return arrived


@dataclass
class Between:
    """One rank's side of the protocol; ``agree`` once per ended iteration."""

    client: Any
    keys: Keys
    config: RestartConfig
    checks: Sequence[HealthCheck]
    member: int
    local_rank: int
    health_summary: dict[str, Any] = field(default_factory=dict)
    """This rank's last health results, for the ledger."""
    interrupted: Callable[[], bool] | None = None
    """Asked while a barrier waits: True leaves it (``Interrupted``)."""

    def agree(
        self,
        *,
        iteration: int,
        members: Sequence[int],
        record: assign.ExitRecord,
        history: assign.History,
    ) -> assign.Decision:
        """What every rank does after ``iteration`` ended with ``record`` on this rank.
        Raises RankExcluded when this rank reached barrier A too late."""
        keys, it, client = self.keys, iteration, self.client
        client.set(keys.exit(it, self.member), record.to_json())
        arrived = wait_for(
            client,
            [keys.exit(it, m) for m in members],
            members,
            timeout_s=self.config.barrier_timeout_s,
            interrupted=self.interrupted,
        )
        agreed = client.compare_set(keys.present(it), "", json.dumps(arrived))
        present = [int(m) for m in json.loads(agreed)]
        if self.member not in present:
            raise RankExcluded(
                f"rank {self.member} reached the barrier of iteration {it} after "
                f"barrier_timeout_s={self.config.barrier_timeout_s}; the others went on"
            )
        raws = client.multi_get([keys.exit(it, m) for m in present])
        records = [assign.ExitRecord.from_json(r) for r in raws]
        culprit = assign.find_culprit(records)
        healthy: dict[int, bool] = {}
        if culprit is not None:
            faults = assign.account(history, culprit, records).faults_of(self.member)
            healthy = self._health(it, members, present, faults)
        decision = assign.decide(
            iteration=it,
            members=members,
            records=records,
            healthy=healthy,
            history=history,
            config=self.config,
        )
        if decision.status == assign.STATUS_OK:
            return decision
        return assign.Decision.from_json(
            client.compare_set(keys.decision(it), "", decision.to_json())
        )

    def _health(
        self, iteration: int, members: Sequence[int], present: Sequence[int], faults: int
    ) -> dict[int, bool]:
        info = HealthInfo(
            member=self.member,
            rank=list(members).index(self.member),
            local_rank=self.local_rank,
            iteration=iteration,
            faults=faults,
        )
        ok, results, seconds = run_checks(self.checks, info)
        self.health_summary = {
            "healthy": ok,
            "health_s": round(seconds, 6),
            "checks": {r.name: r.detail if r.ok else f"FAILED: {r.detail}" for r in results},
        }
        keys = [self.keys.health(iteration, m) for m in present]
        self.client.set(self.keys.health(iteration, self.member), json.dumps({"ok": ok}))
        arrived = wait_for(
            self.client,
            keys,
            present,
            timeout_s=self.config.barrier_timeout_s,
            interrupted=self.interrupted,
        )
        raws = self.client.multi_get([self.keys.health(iteration, m) for m in arrived])
        return {m: bool(json.loads(r)["ok"]) for m, r in zip(arrived, raws, strict=True)}

    def leave(self, *, members: Sequence[int], wait_for_others: bool) -> None:
        """Check out (``bye/<member>``); the rank that hosts the store waits for the others'
        (briefly) before stopping it."""
        self.client.set(self.keys.bye(self.member), "1")
        others = [m for m in members if m != self.member]
        if wait_for_others and others:
            wait_for(
                self.client,
                [self.keys.bye(m) for m in others],
                others,
                timeout_s=min(10.0, self.config.barrier_timeout_s),
            )
