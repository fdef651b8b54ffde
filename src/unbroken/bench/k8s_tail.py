"""What the node-loss benchmark reads of a running job: its ledger, tailed (new complete lines
only), asked for the step rank 0 reached, the agents that reached or re-joined the rendezvous
store, and the host of a group rank; and, after it, a drain's outage (``drain_outage``) and
the table of the runs (``format_table``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from unbroken.ledger import events as ev


class LedgerTail:
    """Reads a run's ledger files incrementally (new complete lines only)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir) / "events"
        self._pos: dict[Path, int] = {}
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        for path in sorted(self.dir.glob("*.jsonl")) if self.dir.is_dir() else []:
            pos = self._pos.get(path, 0)
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._pos[path] = pos + end
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        self.records += new
        return new

    def step(self, rank: int = 0) -> int:
        """The highest step ``rank`` completed so far (-1: none)."""
        return max(
            (r["step"] for r in self.records if r["kind"] == "step" and r["rank"] == rank),
            default=-1,
        )

    def _agent_hosts(self, kind: str, field: str, value: str) -> set[str]:
        """Hosts of the agents' records of ``kind`` whose ``field`` is ``value``."""
        return {
            str(r.get("host"))
            for r in self.records
            if r["rank"] == ev.LAUNCHER_RANK and r["kind"] == kind and r.get(field) == value
        }

    def connected(self) -> set[str]:
        """Hosts whose agent has reached the rendezvous store (can join, or wait as a spare)."""
        return self._agent_hosts(ev.PHASE, "name", "connect")

    def rejoined(self) -> set[str]:
        """Hosts whose agent re-joined the rendezvous store after losing it."""
        return self._agent_hosts(ev.RDZV_STORE, "state", "rejoined")

    def host_of_group_rank(self, group_rank: int) -> str | None:
        """The host of ``group_rank`` in the latest round."""
        rounds = [
            r
            for r in self.records
            if r["rank"] == ev.LAUNCHER_RANK
            and r["kind"] == ev.PHASE
            and r.get("name") == "rendezvous"
        ]
        if not rounds:
            return None
        last = max(r["round"] for r in rounds)
        return next(
            (r.get("host") for r in rounds if r["round"] == last and r["group_rank"] == group_rank),
            None,
        )


def drain_outage(events: list[Any], since: float) -> float | None:
    """A drain's outage: the job trains on until the step every rank saves, so the figure is
    from the last rank's end of that save (its ``preemption`` phase) to every rank having
    completed a step in the next round (None without both). The next round is the survivors'
    restart; when every pod was drained (no agent survived to restart), the new pods'."""
    ends = [e.ts for e in events if e.kind == ev.RESTART_END and e.rank == ev.LAUNCHER_RANK]
    restart = min((t for t in ends if t > since), default=None)
    saved = [
        e.ts
        for e in events
        if e.kind == ev.PHASE
        and e.get("name") == "preemption"
        and since < e.ts < (restart if restart is not None else math.inf)
    ]
    if not saved:
        return None
    start = restart if restart is not None else max(saved)
    firsts: dict[int, float] = {}
    for e in events:
        if e.kind == ev.STEP and e.ts > start:
            firsts[e.rank] = min(firsts.get(e.rank, e.ts), e.ts)
    return max(firsts.values()) - max(saved) if firsts else None


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':<10} {'emulation':>9} {'lost node':>10} {'node loss -> training s':>24} "
        f"{'lost':>4} {'restored from':<18} {'goodput':>8} {'wall s':>7} {'= clean':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        rec = "–" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        gp = "–" if r["training_goodput"] is None else f"{100 * r['training_goodput']:.1f}%"
        lost = "–" if r.get("steps_lost") is None else str(r["steps_lost"])
        tiers = " ".join(f"{k}:{v}" for k, v in sorted((r.get("tiers") or {}).items())) or "–"
        lines.append(
            f"{r['config']:<10} {r['emulation']:>9} {r['lost'] or '–':>10} {rec:>24} {lost:>4} "
            f"{tiers:<18} {gp:>8} "
            f"{(r['wall_s'] or 0):>7.1f} {('yes' if r['matches_clean'] else 'NO'):>8}"
        )
    return "\n".join(lines)
