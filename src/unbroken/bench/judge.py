"""Did a recovered run end where a fault-free one does? By hash where the script is
deterministic, by loss curve where it is not.

The hash is the ``final_state_sha256=`` a script prints, or else (``ledger_digest``) the digest
of every rank's final state its Checkpointers recorded in the ledger.

Every fault-free run of a benchmark (``clean``, the ``-nofault`` twins) is a reference. When
they all printed the same ``final_state_sha256``, the script is deterministic here, and a
faulted run matches when its hash equals theirs. When they printed different hashes, the
script is not bit-deterministic on its own (many real scripts are not: unseeded shuffles,
nondeterministic kernels, time), and a hash comparison would fail for reasons no fault caused.
A faulted run is then judged by its loss curve: at every step the fault-free runs reached, its
loss (the reference rank's surviving execution, from the ledger's ``step`` records) must lie
within the fault-free runs' band widened by its own width on each side (at least ``REL_TOL``
of the loss: identical twins leave no width); ``WITHIN`` of the steps must. Without losses in
the ledger (a plain script) or without any hash, nothing is checked, and the row says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from unbroken.ledger import Event, read_run
from unbroken.ledger import events as ev

REL_TOL = 1e-4
"""The least band half-width, relative to the loss."""
WITHIN = 0.95
"""Share of the steps whose loss must lie in the band."""


@dataclass(frozen=True)
class Verdict:
    """How a faulted run compares with the fault-free ones."""

    by: str
    """"hash", "loss" or "none" (not checked)."""
    ok: bool | None
    """True: it matches; False: it does not; None: not checked."""
    within: float | None = None
    """By loss: the share of steps inside the band."""

    def text(self) -> str:
        if self.by == "hash":
            return "yes" if self.ok else "NO"
        if self.by == "loss":
            share = f"{100 * (self.within or 0):.0f}%"
            return f"loss {share}" if self.ok else f"LOSS {share}"
        return "unchecked"


def losses(run_dir: Path, *, rank: int = 0) -> dict[int, float]:
    """``rank``'s loss per step number, from its surviving executions (the last one)."""
    out: dict[int, tuple[float, float]] = {}
    for e in read_run(run_dir).events:
        if e.kind != ev.STEP or e.rank != rank:
            continue
        step, loss = e.get("step"), e.get("loss")
        if step is None or loss is None:
            continue
        if int(step) not in out or e.ts >= out[int(step)][0]:
            out[int(step)] = (e.ts, float(loss))
    return {k: v for k, (_, v) in out.items()}


def ledger_digest(events: Sequence[Event]) -> str | None:
    """The run's final state as its Checkpointers recorded it (``final_state`` records, the
    last one of each rank): one hex SHA-256 over the ranks' digests in rank order; None when a
    run recorded none (no Checkpointer, or ``UNBROKEN_FINAL_DIGEST`` unset)."""
    last: dict[int, tuple[float, str]] = {}
    for e in events:
        if e.kind != ev.FINAL_STATE or e.rank < 0 or not e.get("digest"):
            continue
        if e.rank not in last or e.ts >= last[e.rank][0]:
            last[e.rank] = (e.ts, str(e.get("digest")))
    if not last:
        return None
    joined = ";".join(f"{rank}:{digest}" for rank, (_, digest) in sorted(last.items()))
    return hashlib.sha256(joined.encode()).hexdigest()


def references_agree(hashes: Sequence[str | None]) -> bool | None:
    """True: the fault-free runs printed one hash; False: several; None: too few to tell
    (fewer than two hashes)."""
    seen = [h for h in hashes if h is not None]
    if len(seen) < 2:
        return None
    return len(set(seen)) == 1


def by_loss(curve: dict[int, float], references: Sequence[dict[int, float]]) -> Verdict:
    """``curve`` against the band of the ``references`` (see the module docstring)."""
    refs = [r for r in references if r]
    steps = sorted(set.intersection(*(set(r) for r in refs))) if refs else []
    if not steps or not curve:
        return Verdict("none", None)
    inside = 0
    for s in steps:
        values = [r[s] for r in refs]
        lo, hi = min(values), max(values)
        pad = max(hi - lo, REL_TOL * abs(0.5 * (lo + hi)))
        x = curve.get(s)
        if x is not None and lo - pad <= x <= hi + pad:
            inside += 1
    share = inside / len(steps)
    return Verdict("loss", share >= WITHIN, share)


def judge(
    hash_: str | None,
    curve: dict[int, float],
    *,
    reference_hashes: Sequence[str | None],
    reference_curves: Sequence[dict[int, float]],
) -> Verdict:
    """A faulted run's verdict against the fault-free runs (see the module docstring)."""
    agree = references_agree(reference_hashes)
    known = [h for h in reference_hashes if h is not None]
    if known and agree is not False:
        return Verdict("hash", hash_ == known[0])
    return by_loss(curve, reference_curves)
