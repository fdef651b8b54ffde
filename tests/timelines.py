"""Hand-built run ledgers for the dashboard, alert, metrics and knowledge-base tests."""

from __future__ import annotations

from pathlib import Path

from unbroken.ledger import events as ev
from unbroken.ledger.events import Event

RUN = "run-1"


def rec(kind: str, ts: float, *, rank: int = 0, attempt: int = 0, **data) -> Event:
    return Event(kind=kind, ts=ts, run=RUN, rank=rank, attempt=attempt, data=data)


def steps(first: int, last: int, start: float, *, dur: float = 1.0, ranks=(0, 1), **kw):
    """Steps ``first..last`` back to back from ``start`` on every rank of ``ranks``."""
    out = []
    for k, n in enumerate(range(first, last + 1)):
        for r in ranks:
            out.append(rec(ev.STEP, start + (k + 1) * dur, rank=r, dur_s=dur, step=n, **kw))
    return out


def fault(
    ts: float,
    *,
    rank: int = 1,
    kind: str = "exception",
    step: int | None = None,
    layer: str = "inprocess",
    detect_s: float = 0.1,
    restored: int | None = None,
):
    """An injected fault, its detection, restart and the restore that follows (a timeline piece)."""
    out = [
        rec(ev.FAULT_INJECTED, ts, rank=rank, fault=kind, step=step, index=0),
        rec(
            ev.FAULT_DETECTED,
            ts + detect_s,
            rank=rank,
            cause=kind,
            detector="exception",
            layer=layer,
            fault_rank=rank,
            message=f"injected {kind} on rank {rank}",
        ),
        rec(ev.RESTART_BEGIN, ts + detect_s, rank=rank, layer=layer, cause=kind),
    ]
    if restored is not None:
        out.append(rec(ev.CKPT_LOAD, ts + 0.5, dur_s=0.2, step=restored, tier="disk"))
    return out


def faulty_run(*, faults_at=(10.0, 20.0, 30.0), rank: int = 1, restored: int = 5) -> list[Event]:
    """40 s of 1 s steps on two ranks; each fault at time T rolls the job back to ``restored``.

    Before the first fault the job makes steps 0..8 (t = 1..9); after each fault it resumes at
    T + 1 from ``restored`` and runs until the next fault (or 40 s).
    """
    events = [
        rec(ev.PROCESS_START, 0.0, rank=ev.LAUNCHER_RANK, max_restarts=4, argv=["x"]),
        rec(
            ev.PROCESS_START,
            0.0,
            rank=0,
            args={"ckpt_every": 5, "ckpt_mode": "async"},
            world_size=2,
            host="h",
        ),
        rec(ev.PHASE, 0.0, rank=0, name="import", dur_s=0.0),
    ]
    events += steps(0, 8, 0.0)
    bounds = [*faults_at, 40.0]
    for i, t in enumerate(faults_at):
        events += fault(t, rank=rank, restored=restored)
        n = int(bounds[i + 1] - (t + 1)) - 1
        events += steps(restored, restored + n - 1, t + 1)
    events.append(rec(ev.JOB_END, 40.5, rank=0, status="ok", final_state_sha256="ab" * 32))
    return events


def write(run_dir: Path, events: list[Event], *, name: str = "x.jsonl") -> Path:
    (run_dir / "events").mkdir(parents=True, exist_ok=True)
    path = run_dir / "events" / name
    with open(path, "a") as f:
        f.write("".join(e.to_json() + "\n" for e in events))
    return path


def slowed_run(
    *,
    slow: tuple[float, float] | None = (10.0, 20.0),
    rank: int = 1,
    ranks: tuple[int, ...] = (0, 1),
    end: float = 30.0,
    dur: float = 0.5,
    slow_dur: float = 1.5,
    busy: float = 0.6,
    slow_busy: float = 0.95,
    kind: str = "slow-rank",
) -> list[Event]:
    """Synchronous steps on ``ranks`` from 0 to about ``end`` s, each rank's training thread busy
    ``busy`` of each ``dur`` s step (the ranks wait a little for each other); from slow[0] to
    slow[1] ``rank`` is throttled (a non-disruptive ``kind`` fault at slow[0], its window
    ``slow[1] - slow[0]``): steps take ``slow_dur`` s, ``rank`` busy ``slow_busy`` of them, the
    others busy only for their own work (``busy x dur``) and waiting the rest."""
    events = [
        rec(ev.PROCESS_START, 0.0, rank=r, world_size=len(ranks), host=f"h{r}") for r in ranks
    ]
    if slow is not None:
        events.append(
            rec(
                ev.FAULT_INJECTED,
                slow[0],
                rank=rank,
                fault=kind,
                step=None,
                index=0,
                disruptive=False,
                window_s=slow[1] - slow[0],
            )
        )
    t, n = 0.0, 0
    while t < end:
        slowed = slow is not None and slow[0] <= t < slow[1]
        d = slow_dur if slowed else dur
        t += d
        for r in ranks:
            b = (slow_busy * d if r == rank else busy * dur) if slowed else busy * d
            events.append(rec(ev.STEP, t, rank=r, dur_s=d, step=n, busy_s=round(b, 6)))
        n += 1
    return events
