"""Between two iterations: who caused the fault, whether to go on, and who gets which rank.

Pure functions of data every rank reads from the store, so every rank computes the same
answer; the store's ``compare_set`` then makes the first written answer the one everyone
adopts (the two only differ when barrier timeouts left ranks out differently).

The culprit of an iteration is the origin report with the lowest sequence number (the order in
which ranks published their detection; a victim whose collective failed because the culprit
closed its connections publishes later, by causality). One exception: when the first report
is a rank *stuck* in native code and another rank reports a *hang* (no progress while running
Python), the hang is the culprit: the stuck rank was waiting for it in a collective.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from unbroken.restart.config import RestartConfig

# Kinds of an iteration's end, as this rank saw it.
OK = "ok"
EXCEPTION = "exception"  # fn raised
HANG = "hang"  # watchdog: no progress, Python running
STUCK = "stuck"  # watchdog: no progress, no Python running
PEER = "peer"  # interrupted because another rank reported a fault
PG_INIT = "pg_init"  # the process group could not be formed
STOP = "stop"  # fn stopped on purpose, every rank at the same step (a graceful preemption)
HANDOVER = "handover"  # the node agent hands the worker to the next round (restart.handover)

STATUS_OK = "ok"
STATUS_RESTART = "restart"
STATUS_ESCALATE = "escalate"


@dataclass(frozen=True, kw_only=True)
class ExitRecord:
    """How one rank's iteration ended; written to the store before the first barrier."""

    member: int
    """Launch rank (identity across iterations)."""
    rank: int
    """Rank in the iteration."""
    kind: str
    """OK, EXCEPTION, HANG, STUCK, PEER or PG_INIT."""
    detector: str = ""
    """What noticed it: "exception", "watchdog", "peer", "pg_init"."""
    seq: int | None = None
    """Order of this rank's published report among the iteration's reports; None if none."""
    message: str = ""
    """Short description (exception type and message, watchdog figures)."""
    restore_point: int | None = None
    """The first step this rank completed in the iteration, or None."""
    last_step: int | None = None
    """The last step this rank completed in the iteration, or None."""

    @property
    def ok(self) -> bool:
        return self.kind == OK

    @property
    def origin(self) -> bool:
        """Detected the fault itself (rather than being told by a peer)."""
        return self.seq is not None and self.kind != OK

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ExitRecord:
        return cls(**json.loads(raw))


@dataclass(frozen=True, kw_only=True)
class History:
    """Fault accounting carried from iteration to iteration (identical on every rank)."""

    member_faults: Mapping[str, int] = field(default_factory=dict)
    """Faults caused per member (keys are str(member) so the JSON round trip is exact)."""
    restore_point: int | None = None
    """The restore point of the last fault."""
    restore_point_faults: int = 0
    """Consecutive faults from that restore point."""

    def faults_of(self, member: int) -> int:
        return int(self.member_faults.get(str(member), 0))


def find_culprit(records: Sequence[ExitRecord]) -> ExitRecord | None:
    """The record of the rank that caused the iteration's fault; None if all were OK."""
    faulty = [r for r in records if not r.ok]
    if not faulty:
        return None
    origins = sorted((r for r in faulty if r.origin), key=lambda r: (r.seq, r.member))
    if not origins:  # nobody published (e.g. reports lost): the lowest member that failed
        return min(faulty, key=lambda r: r.member)
    first = origins[0]
    if first.kind == STUCK:
        hung = [r for r in origins if r.kind == HANG]
        if hung:
            return hung[0]
    return first


def account(history: History, culprit: ExitRecord, records: Sequence[ExitRecord]) -> History:
    """The history after a fault whose culprit is ``culprit``."""
    faults = dict(history.member_faults)
    faults[str(culprit.member)] = faults.get(str(culprit.member), 0) + 1
    points = [r.restore_point for r in records if r.restore_point is not None]
    point = min(points) if points else None
    # Failing before completing a step: no evidence of a new restore point, so the same one.
    same = history.restore_point_faults > 0 and (point is None or point == history.restore_point)
    return History(
        member_faults=faults,
        restore_point=history.restore_point if point is None and same else point,
        restore_point_faults=history.restore_point_faults + 1 if same else 1,
    )


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What every rank does next; agreed through the store."""

    status: str
    """STATUS_OK (return), STATUS_RESTART (next iteration) or STATUS_ESCALATE (give up)."""
    iteration: int
    """The iteration that just ended."""
    members: tuple[int, ...] = ()
    """The next iteration's members, in rank order (rank i is members[i])."""
    excluded: Mapping[str, str] = field(default_factory=dict)
    """Members left out (str(member) -> why)."""
    culprit: ExitRecord | None = None
    """The rank that caused the fault."""
    history: History = field(default_factory=History)
    """Fault accounting after this iteration."""
    reason: str = ""
    """Why it escalates, or a summary."""

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Decision:
        d: dict[str, Any] = json.loads(raw)
        d["members"] = tuple(d["members"])
        d["culprit"] = ExitRecord(**d["culprit"]) if d["culprit"] else None
        d["history"] = History(**d["history"])
        return cls(**d)


def decide(
    *,
    iteration: int,
    members: Sequence[int],
    records: Sequence[ExitRecord],
    healthy: Mapping[int, bool],
    history: History,
    config: RestartConfig,
) -> Decision:
    """The next step after ``iteration`` ended with ``records`` (one per present member).

    ``healthy`` has a verdict per present member (a missing one counts as unhealthy).
    """
    present = {r.member for r in records}
    excluded = {str(m): "did not reach the barrier" for m in members if m not in present}
    culprit = find_culprit(records)
    if culprit is None:
        return Decision(
            status=STATUS_OK,
            iteration=iteration,
            members=tuple(m for m in members if m in present),
            excluded=excluded,
            history=history,
            reason="every rank returned",
        )
    history = account(history, culprit, records)
    for m in members:
        if m in present and not healthy.get(m, False):
            excluded[str(m)] = "failed its health check"
    nxt = tuple(m for m in members if str(m) not in excluded)
    reason = ""
    if iteration + 1 >= config.max_iterations:
        reason = f"max_iterations={config.max_iterations} reached"
    elif history.faults_of(culprit.member) >= config.max_rank_faults:
        reason = (
            f"rank {culprit.member} caused {history.faults_of(culprit.member)} faults "
            f"(max_rank_faults={config.max_rank_faults})"
        )
    elif history.restore_point_faults >= config.max_restore_point_faults:
        reason = (
            f"{history.restore_point_faults} faults in a row from restore point "
            f"{history.restore_point} (max_restore_point_faults="
            f"{config.max_restore_point_faults})"
        )
    elif len(nxt) < config.min_world_size:
        reason = (
            f"only {len(nxt)} healthy rank(s) left, below min_world_size={config.min_world_size}"
        )
    return Decision(
        status=STATUS_ESCALATE if reason else STATUS_RESTART,
        iteration=iteration,
        members=nxt,
        excluded=excluded,
        culprit=culprit,
        history=history,
        reason=reason or f"{culprit.kind} on rank {culprit.rank}: restarting",
    )
