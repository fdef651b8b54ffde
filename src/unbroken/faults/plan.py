"""The deterministic fault plan: what fires, where, when.

A plan is YAML (or the equivalent dict)::

    faults:
      - {step: 12, rank: 1, kind: sigkill}
      - {step: 30, rank: 0, kind: exception}

Each entry fires once per run, after the given rank completes the given step (in the step hook,
before that step's checkpoint), even across restarts. Extra keys of an entry are
kind-specific parameters and are kept in ``params``; the kinds in ``PARAMS`` accept only the
parameters listed there (checked when the plan is parsed), ``FaultSpec.settings()`` fills in
their defaults::

      - {step: 20, rank: 0, kind: slow-storage, mbps: 2, saves: 3, ranks: all}
      - {step: 30, rank: 0, kind: storage-fail, error: full, saves: 2, ranks: [1]}
      - {step: 40, rank: 1, kind: checkpoint-corruption, target: manifest}
      - {step: 60, rank: 1, kind: node-loss}
      - {step: 80, rank: 1, kind: slow-rank, cpu: 0.5, seconds: 30}
      - {step: 90, rank: 0, kind: network, delay_ms: 50, loss: 1, seconds: 20, peers: [1]}

An entry with ``phase`` fires on entry into that phase instead of after a step
(``unbroken.ledger.phases``: unbroken's own ``init``, ``recovery``, ``restore``, ``save``,
``persist``, ``shutdown``; the user's ``data``, ``validation`` or any name given to
``RestartContext.phase``), once per run like any fault: at the first entry on its rank after the
rank completed ``step`` in this process (steps done before a launcher restart do not count:
the restarted process counts from its first step), or at the ``occurrence``-th entry into the
phase on that rank in the run (counted across restarts: the way to aim at a restart's
``restore``, ``init`` or ``recovery``); with neither, at the first entry::

      - {phase: data, step: 12, rank: 0, kind: exception}
      - {phase: restore, occurrence: 2, rank: 1, kind: sigkill}
      - {phase: recovery, rank: 0, kind: exception}   # a second fault while one is recovered

Several entries may fire at the same step or phase on several ranks (compound faults).

A seeded random schedule expands deterministically into entries (added to any listed ones)::

    random: {count: 5, kinds: [exception, sigkill], seed: 42, steps: [10, 90], ranks: [0, 1]}

Steps are drawn without replacement from ``[lo, hi]`` (one fault per step), kinds and ranks
uniformly; ``ranks`` defaults to every rank of the world, so such a plan needs the world size
(``resolve_plan``/``load_plan(world_size=...)``).
"""

from __future__ import annotations

import random as _random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, get_args

import yaml

from unbroken.faults.params import PARAMS, STALL_S, check_params, is_int, names
from unbroken.ledger.phases import check_name

FaultKind = Literal[
    "exception",
    "sigkill",
    "sigterm",
    "hang",
    "hang-collective",
    "hang-native",
    "segfault",
    "oom-kill",
    "slow-storage",
    "storage-fail",
    "checkpoint-corruption",
    "node-loss",
    "slow-rank",
    "network",
]

# kind -> what it does (shown by `unbroken faults show`), in FaultKind's order
KINDS: dict[FaultKind, str] = {
    "exception": "raise InjectedFault in the training loop",
    "sigkill": "the rank's process kills itself with SIGKILL",
    "sigterm": "the rank's process sends itself SIGTERM",
    "hang": "the rank stops making progress (a Python loop that never returns)",
    "hang-collective": (
        "the rank blocks in a point-to-point receive from its neighbour that never comes (in "
        "torch.distributed, native code); its peers block in their next collective"
    ),
    "hang-native": (
        "the rank blocks forever in a native call outside torch (a pipe read: no Python runs "
        "and no abort reaches it); its peers block in their next collective"
    ),
    "segfault": "the rank's process dies of a real SIGSEGV (a read of address 0)",
    "oom-kill": (
        "the rank enters a child memory cgroup limited to limit_mb (default 256) more than it "
        "uses and grows until the kernel's OOM killer ends it; where no cgroup can be made, "
        "emulated (grow, then SIGKILL) and recorded so"
    ),
    "slow-storage": (
        "from this step on, checkpoint writes of the rank (of every rank with ranks: all) are "
        "throttled to mbps MB/s (default 5) for its next saves saves (default 3) or for seconds "
        "s; training goes on, saves due meanwhile are skipped, nothing restarts"
    ),
    "storage-fail": (
        "from this step on, the next saves saves (default 1) of the checkpoint writer of every "
        "rank (ranks: a list of them) fail as failing storage fails them: error full (ENOSPC, "
        "the default), readonly (EROFS), eio (EIO), vanish (ENOENT: the save's directory is "
        "gone), flock (ENOLCK) or stall (the write blocks for stall_s s, default 3600, until "
        "persist_timeout_s kills the writer); emulated: raised at the writer's I/O boundary, "
        "not by a file system; the fault ends no process"
    ),
    "checkpoint-corruption": (
        "flip bytes in the middle of the newest committed checkpoint's data file of the rank "
        "(target: manifest - its manifest), fsync, then SIGKILL: restore must reject it and "
        "fall back to the previous checkpoint"
    ),
    "node-loss": (
        "the whole node dies at once: SIGKILL to the launcher agent (unbroken-run or torchrun), "
        "its warm pool, every worker and checkpoint writer; the orchestrator must relaunch it"
    ),
    "slow-rank": (
        "the rank's process gets only cpu (default 0.5) of one CPU for seconds s (default 30): "
        "a cpu cgroup quota (else emulated: SIGSTOP/SIGCONT); it trains on, slower, as a "
        "straggler that must not be restarted as hung"
    ),
    "network": (
        "the emulated cluster delays each packet between the rank's pod and its peers' pods "
        "(peers: all, or a list of ranks) by delay_ms ms (default 50) each way and drops loss "
        "% of them (default 1) for seconds s (default 20); outside the emulated cluster it is "
        "recorded as not applied"
    ),
}

assert tuple(KINDS) == get_args(FaultKind), "KINDS describes every FaultKind, in order"

NON_DISRUPTIVE = frozenset({"slow-storage", "storage-fail", "slow-rank", "network"})
"""Kinds that end no process: nothing restarts, so goodput counts no outage for them (their
``fault_injected`` record says ``disruptive: false``)."""

MAX_RANDOM = 10_000
"""Most faults a random schedule may draw (a plan is read by every rank at start-up)."""


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One planned fault."""

    index: int
    """Position in the plan; names the fault in the fired record."""
    step: int | None
    """Fires after this step completes on ``rank`` (with ``phase``: at the phase's first entry
    once the rank completed it; None only with ``phase``)."""
    rank: int
    """Global rank that suffers the fault."""
    kind: FaultKind
    """One of KINDS."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Kind-specific parameters (extra keys of the entry)."""
    phase: str | None = None
    """Fire on entry into this phase instead of after a step (see the module docstring)."""
    occurrence: int | None = None
    """With ``phase``: fire at this entry into the phase on ``rank`` (1: the first), counted
    over the run; instead of ``step``."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"fault #{self.index}: unknown kind {self.kind!r}; valid kinds: {', '.join(KINDS)}"
            )
        where = f"fault #{self.index}"
        if self.step is None and self.phase is None:
            raise ValueError(f"{where}: step is required unless the fault names a phase")
        if self.step is not None and self.step < 0:
            raise ValueError(f"{where}: step must be >= 0, got {self.step}")
        if self.phase is not None:
            try:
                check_name(self.phase)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        if self.occurrence is not None:
            if self.phase is None:
                raise ValueError(f"{where}: occurrence needs a phase (the phase entry to fire at)")
            if self.step is not None:
                raise ValueError(
                    f"{where}: give step (after which step) or occurrence (which entry into "
                    f"phase {self.phase}), not both"
                )
            if not (is_int(self.occurrence) and self.occurrence >= 1):
                raise ValueError(
                    f"{where}: occurrence must be an integer >= 1, got {self.occurrence!r}"
                )
        if self.rank < 0:
            raise ValueError(f"fault #{self.index}: rank must be >= 0, got {self.rank}")
        check_params(self.kind, self.params, where=f"fault #{self.index} ({self.kind})")
        peers = self.params.get("peers") if self.kind == "network" else None
        if isinstance(peers, list) and self.rank in peers:
            raise ValueError(
                f"fault #{self.index} (network): peers {peers} include the fault's own rank "
                f"{self.rank}; list the ranks at the other end of its links"
            )

    @property
    def disruptive(self) -> bool:
        """False for kinds that end no process (see NON_DISRUPTIVE)."""
        return self.kind not in NON_DISRUPTIVE

    def settings(self) -> dict[str, Any]:
        """The fault's parameters.

        Returns:
            The parameters with their defaults filled in (kinds in PARAMS), else ``params``.
        """
        if self.kind not in PARAMS:
            return dict(self.params)
        out = {
            name: self.params.get(name, default) for name, (default, _) in PARAMS[self.kind].items()
        }
        if self.kind == "slow-storage":
            if "seconds" in self.params:
                out["saves"] = None
            if out["ranks"] is None:
                out["ranks"] = [self.rank]
            out["mbps"] = float(out["mbps"])
        if self.kind == "storage-fail" and out["error"] == "stall":
            out["stall_s"] = float(STALL_S if out["stall_s"] is None else out["stall_s"])
        for name in ("cpu", "seconds", "delay_ms", "loss"):
            if self.kind in ("slow-rank", "network") and name in out:
                out[name] = float(out[name])
        return out

    def targets(self) -> list[int] | None:
        """The ranks the fault acts on.

        Returns:
            Every rank it acts on, sorted (None: every rank of the world).
        """
        if self.kind in ("slow-storage", "storage-fail"):
            ranks = self.settings()["ranks"]
            return None if ranks == "all" else sorted(set(ranks))
        if self.kind == "network":  # the rank's links to its peers
            peers = self.settings()["peers"]
            return None if peers == "all" else sorted({self.rank, *peers})
        return [self.rank]

    def describe(self) -> str:
        """The fault in words, for messages.

        Returns:
            Its index, when it fires, its rank, kind and parameters.
        """
        extra = "".join(
            f" {k}={v}" for k, v in sorted(self.params.items(), key=lambda kv: str(kv[0]))
        )
        return f"#{self.index}: {self.when()}, rank {self.rank}: {self.kind}{extra}"

    def when(self) -> str:
        """When it fires, in words.

        Returns:
            "step 12", "phase data after step 12", "phase restore #2" or "phase init".
        """
        if self.phase is None:
            return f"step {self.step}"
        if self.occurrence is not None:
            return f"phase {self.phase} #{self.occurrence}"
        if self.step is not None:
            return f"phase {self.phase} after step {self.step}"
        return f"phase {self.phase}"

    def to_entry(self) -> dict[str, Any]:
        """The fault as a plan entry.

        Returns:
            The entry it was read from (a plan of these reads back the same).
        """
        out: dict[str, Any] = {"rank": self.rank, "kind": self.kind}
        if self.step is not None:
            out["step"] = self.step
        if self.phase is not None:
            out["phase"] = self.phase
        if self.occurrence is not None:
            out["occurrence"] = self.occurrence
        return {**out, **dict(self.params)}


@dataclass(frozen=True)
class FaultPlan:
    """An ordered list of faults (by step, then rank, then plan order)."""

    faults: tuple[FaultSpec, ...] = ()
    """The faults, in that order."""

    def at(self, step: int, rank: int) -> list[FaultSpec]:
        """The faults that fire after a step.

        Args:
            step: The step just completed.
            rank: The rank that completed it.

        Returns:
            The faults planned for ``rank`` after ``step`` (not the phase-targeted ones).
        """
        return [f for f in self.faults if f.step == step and f.rank == rank and f.phase is None]

    def in_phase(self, rank: int) -> dict[str, list[FaultSpec]]:
        """The faults that fire on entry to a named phase.

        Args:
            rank: The rank they target.

        Returns:
            Phase name -> the phase-targeted faults of ``rank``.
        """
        out: dict[str, list[FaultSpec]] = {}
        for f in self.faults:
            if f.phase is not None and f.rank == rank:
                out.setdefault(f.phase, []).append(f)
        return out

    def check_world(self, world_size: int) -> None:
        """Check that every rank the faults target exists.

        Args:
            world_size: Ranks in the job.

        Raises:
            ValueError: When a fault targets a rank outside the world.
        """
        for f in self.faults:
            for rank in [f.rank, *(f.targets() or [])]:
                if rank >= world_size:
                    raise ValueError(
                        f"fault {f.describe()} targets rank {rank}, but the world has "
                        f"{world_size} ranks; fix the plan or the world size"
                    )

    def __len__(self) -> int:
        return len(self.faults)


_REQUIRED = ("rank", "kind")
_WHEN = ("step", "phase", "occurrence")


_RANDOM_KEYS = {"count", "kinds", "seed", "steps", "ranks"}


def _expand_random(spec: Any, *, source: str, world_size: int | None) -> list[dict[str, Any]]:
    """The entries of a seeded random schedule, in draw order."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"{source}: 'random' must be a mapping, got {spec!r:.80}")
    unknown = set(spec) - _RANDOM_KEYS
    missing = {"count", "kinds", "seed", "steps"} - set(spec)
    if unknown or missing:
        raise ValueError(
            f"{source}: 'random' has unknown keys {names(unknown)} / lacks {names(missing)}; "
            f"it takes {sorted(_RANDOM_KEYS)} (ranks optional)"
        )
    count, kinds, seed, steps = spec["count"], spec["kinds"], spec["seed"], spec["steps"]
    if not is_int(count) or not 0 <= count <= MAX_RANDOM:
        raise ValueError(
            f"{source}: random.count must be an integer from 0 to {MAX_RANDOM}, got {count!r:.80}"
        )
    if (
        not isinstance(kinds, list)
        or not kinds
        or any(not isinstance(k, str) or k not in KINDS for k in kinds)
    ):
        raise ValueError(f"{source}: random.kinds must be a non-empty list of {list(KINDS)}")
    if not is_int(seed):
        raise ValueError(f"{source}: random.seed must be an integer, got {seed!r:.80}")
    if (
        not isinstance(steps, list)
        or len(steps) != 2
        or not all(is_int(v) for v in steps)
        or not 0 <= steps[0] <= steps[1]
    ):
        raise ValueError(f"{source}: random.steps must be [lo, hi] with 0 <= lo <= hi")
    lo, hi = steps
    if count > hi - lo + 1:
        raise ValueError(
            f"{source}: random.count={count} faults do not fit in steps [{lo}, {hi}] "
            "(one fault per step); widen the range or lower the count"
        )
    ranks = spec.get("ranks")
    if ranks is None:
        if world_size is None:
            raise ValueError(
                f"{source}: a random schedule without 'ranks' needs the world size; "
                "pass --world-size or list ranks"
            )
        ranks = list(range(world_size))
    if not isinstance(ranks, list) or not ranks or not all(is_int(r) and r >= 0 for r in ranks):
        raise ValueError(f"{source}: random.ranks must be a non-empty list of integers >= 0")
    rng = _random.Random(seed)
    chosen = sorted(rng.sample(range(lo, hi + 1), count))
    return [{"step": st, "rank": rng.choice(ranks), "kind": rng.choice(kinds)} for st in chosen]


def parse_plan(obj: Any, *, source: str = "plan", world_size: int | None = None) -> FaultPlan:
    """Build a plan from parsed YAML.

    Args:
        obj: The parsed YAML: a mapping with a ``faults`` list and/or a ``random`` schedule
            (None: an empty plan).
        source: Names the plan in error messages.
        world_size: Ranks in the job, which a random schedule without ``ranks`` draws from
            (None: unknown).

    Returns:
        The plan.

    Raises:
        ValueError: Naming the bad entry.
    """
    if obj is None:
        return FaultPlan()
    if not isinstance(obj, Mapping) or not ({"faults", "random"} & set(obj)):
        raise ValueError(
            f"{source}: expected a mapping with a 'faults' list and/or a 'random' schedule, "
            f"got {obj!r:.80}"
        )
    unknown = set(obj) - {"faults", "random"}
    if unknown:
        raise ValueError(
            f"{source}: unknown top-level keys {names(unknown)}; expected 'faults', 'random'"
        )
    entries = obj.get("faults") or []
    if not isinstance(entries, list):
        raise ValueError(f"{source}: 'faults' must be a list, got {type(entries).__name__}")
    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{source}: fault #{i} must be a mapping, got {entry!r:.80}")
        missing = [k for k in _REQUIRED if k not in entry]
        if "step" not in entry and "phase" not in entry:
            missing.insert(0, "step")
        if missing:
            raise ValueError(
                f"{source}: fault #{i} lacks {missing}; each needs rank, kind and step "
                "(or a phase: see `unbroken faults show --help`)"
            )
        for key in ("step", "rank", "occurrence"):
            if key in entry and not is_int(entry[key]):
                raise ValueError(
                    f"{source}: fault #{i}: {key} must be an integer, got {entry[key]!r:.80}"
                )
        params = {k: v for k, v in entry.items() if k not in _REQUIRED and k not in _WHEN}
        try:
            spec = FaultSpec(
                index=i,
                step=entry.get("step"),
                rank=entry["rank"],
                kind=cast(FaultKind, str(entry["kind"])),  # checked by FaultSpec
                params=params,
                phase=None if entry.get("phase") is None else str(entry["phase"]),
                occurrence=entry.get("occurrence"),
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        specs.append(spec)
    if "random" in obj:
        for entry in _expand_random(obj["random"], source=source, world_size=world_size):
            specs.append(FaultSpec(index=len(specs), **entry))
    specs.sort(key=lambda f: (-1 if f.step is None else f.step, f.rank, f.index))
    return FaultPlan(tuple(specs))


def load_plan(path: str | Path, *, world_size: int | None = None) -> FaultPlan:
    """Read a YAML plan.

    Args:
        path: The plan file.
        world_size: As for ``parse_plan``.

    Returns:
        The plan.

    Raises:
        FileNotFoundError: When there is no such file.
        ValueError: When it is not valid YAML or not a valid plan.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"fault plan {p} does not exist")
    try:
        obj = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{p}: not valid YAML (UTF-8): {e}; fix the file") from None
    except OSError as e:
        raise ValueError(f"{p}: cannot read the fault plan: {e}") from None
    return parse_plan(obj, source=str(p), world_size=world_size)
