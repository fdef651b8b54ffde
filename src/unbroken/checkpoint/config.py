"""The Checkpointer's configuration and its errors."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from unbroken.env import Overrides
from unbroken.errors import EXIT_STORAGE, StopJob, UnbrokenError

logger = logging.getLogger(__name__)

Mode = Literal["async", "sync"]
OnBusy = Literal["skip", "wait"]
WriterStart = Literal["auto", "fork", "spawn"]
OnStorageFailure = Literal["continue", "stop"]
MODES: tuple[Mode, ...] = get_args(Mode)
ON_BUSY: tuple[OnBusy, ...] = get_args(OnBusy)
WRITER_STARTS: tuple[WriterStart, ...] = get_args(WriterStart)
ON_STORAGE_FAILURE: tuple[OnStorageFailure, ...] = get_args(OnStorageFailure)


def split_peer(text: str) -> tuple[str, int, str]:
    """(host, port, token) of a peer service address ``host:port#token``; ValueError else."""
    host, _, rest = text.rpartition(":")
    port, _, token = rest.partition("#")
    if not host or not port.isdigit() or not token:
        raise ValueError(f"a peer is host:port#token, got {text!r}")
    return host.strip("[]"), int(port), token


class CheckpointError(UnbrokenError):
    """A checkpoint is unusable, a restore failed, or the Checkpointer is closed."""


class StorageFailed(CheckpointError, StopJob):
    """Checkpoint storage failed for ``storage_failure_limit_s`` and a final save failed too,
    under ``on_storage_failure="stop"``: the job stops (no restart fixes storage).

    A ``StopJob``: ``unbroken.run`` does not restart ``fn`` for it, ``unbroken.main`` exits
    with ``EXIT_STORAGE`` (74) and ``unbroken-run`` then ends the job (exit code 6). The newest
    committed checkpoint is intact: fix the storage and start the job again.
    """

    exit_code = EXIT_STORAGE


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How a Checkpointer saves, keeps and restores checkpoints."""

    every_steps: int = 0
    """``maybe_save`` saves after every this many completed steps; 0: only explicit ``save``."""
    keep: int = 2
    """Committed checkpoints to keep (the newest ones); at least 1."""
    mode: Mode = "async"
    """"async": ``save`` returns once the state is staged; "sync": once it is committed."""
    on_busy: OnBusy = "skip"
    """When a save comes while the previous one still persists: "skip" drops the new save
    (recorded as ``ckpt_skip``); "wait" blocks until the previous one is done (recorded as
    blocking time). Default "skip": blocking the trainer on storage is what collapses the
    efficiency of the published async checkpoints once a write takes as long as the interval."""
    overlap: bool = False
    """Copy parameters and optimizer state on a background thread while the next
    forward/backward runs. Every optimizer in the state gets a step pre-hook that waits for the
    copy; anything else that changes parameters in place must call ``wait_staged()`` first."""
    persist_timeout_s: float = 600.0
    """A save not durable this long after it was staged is failed as stalled storage (its
    writer is killed; the next attempt starts another)."""
    on_storage_failure: OnStorageFailure = "continue"
    """What failing checkpoint storage (full, read-only, I/O errors, a vanished directory,
    a save stalled past ``persist_timeout_s``, a writer that died) does to the job. It is never
    an exception in the training step: the failed save is recorded (``ckpt_fail``), training
    goes on with the memory tier's snapshots, and durable saves are retried with back-off
    (``storage_retry_s``). "continue" (the default) keeps going however long storage fails:
    stopping would throw away the progress the memory tier protects against process faults,
    and storage usually comes back (a disk cleaned up, a mount restored); the alert
    ``checkpoint_storage_failing`` tells someone to act. "stop": once storage has failed for
    ``storage_failure_limit_s``, a final save is attempted and waited for; if it fails too,
    ``StorageFailed`` ends the job cleanly (no restart)."""
    storage_retry_s: float = 10.0
    """After a failed save, durable saves are held back this long (memory snapshots only,
    recorded as ``ckpt_skip``); each further failure doubles it, up to
    ``storage_retry_max_s``; a save that succeeds resets it."""
    storage_retry_max_s: float = 600.0
    """The longest back-off between two attempts at a durable save while storage fails."""
    storage_failure_limit_s: float = 3600.0
    """With ``on_storage_failure="stop"``: how long storage may fail before the final save."""
    eager_writer: bool = True
    """Start the writer process with the Checkpointer, so that it imports torch (seconds)
    while the trainer builds and restores; False: at the first save (restore-only use)."""
    writer_start: WriterStart = "auto"
    """How the writer process starts: "fork" (of the trainer: ready in milliseconds, torch is
    already loaded), "spawn" (a fresh interpreter that imports torch: seconds, competing with
    training for the cores), "auto": fork where the trainer has torch loaded."""
    writer_start_timeout_s: float = 300.0
    """The writer process must be ready (it imports torch) this long after it was started;
    the persist timeout of a save counts from the later of staging and writer ready."""
    writer_nice: int = 10
    """Niceness added to the writer process: where cores are short, training steps get the
    CPU first and persisting takes longer. With it or ``writer_idle``, the writer also runs in
    a session of its own whose autogroup gets niceness 19 (``writer.lower_priority``); 0 and
    no ``writer_idle``: the trainer's session and priority."""
    writer_idle: bool = True
    """Run the writer as SCHED_IDLE (Linux): it persists on the CPU time the trainers leave."""
    throttle_mbps: float = 0.0
    """Cap the writer's write rate in MB/s to emulate slow shared storage; 0: no cap."""
    memory_tier: bool = True
    """Keep the newest staged snapshots in memory across restarts and restore the newest step
    every rank holds from there (no disk read); every rank then stages the replicated tensors
    it does not write too (see ``unbroken.checkpoint.staging.memory``)."""
    snapshot_every: int = 0
    """``maybe_save`` also snapshots to memory only (nothing persisted) after every this many
    completed steps, between durable saves; 0: at the interval ``snapshot_budget`` allows.
    Needs ``memory_tier``."""
    snapshot_budget: float = 0.01
    """With ``snapshot_every`` 0: the share of step time memory snapshots between durable saves
    may block the trainer; ``maybe_save`` measures the stall and the step and snapshots every
    ``ceil(stall / (budget x step))`` steps (``unbroken.checkpoint.schedule.snapshots``), so a
    fault that kills a process rolls back fewer steps at the same cost whatever the step. 0:
    only at durable saves."""
    rescue: bool = True
    """With the memory tier, ``maybe_save`` notes every step it neither saves nor snapshots
    (a cheap copy of the non-tensor state, recorded as a ``ckpt_stage`` of ``part`` "note"), so
    that a fault the worker unwinds from snapshots the noted step from the live state
    (``unbroken.checkpoint.staging.rescue``); False: no notes, a soft fault restores the last snapshot."""
    memory_slots: int = 1
    """Snapshots the staging arena holds (the memory tier; one may be the save persisting).
    1 (the default): one copy of the state in host memory; every rank overwrites it only
    once all ranks have agreed to (one small all-reduce per snapshot: a rank that faulted
    before its copy keeps the others from replacing the step they hold in common); a save or
    snapshot due while the writer still writes from it is held back to the next step it is
    free; a rescue goes to a spare region whose memory is used only until the next snapshot
    (``unbroken.checkpoint.staging.memory``). 2 or more, and 1 with ``peers`` (a multi-node
    job's peer tier): a ring of that many copies (at least 2), no agreement, snapshots while a
    save persists."""
    memory_keeper: str = ""
    """Address of the node agent's memory keeper (``unbroken-run`` hands workers one): the
    staging arena is given to it, so its snapshots survive this process; "": none."""
    peers: tuple[str, ...] = ()
    """Every node's peer memory service (``host:port#token``, in node order; ``unbroken-run``
    hands multi-node workers them): each snapshot is replicated, in the background, to the
    next node's, and a restore with nothing in local memory asks every one of them for this
    rank's newest snapshot (``unbroken.checkpoint.tiers.peers``); (): no peer tier."""
    peer_index: int = -1
    """This node's position in ``peers`` (its group rank); snapshots go to the next one."""
    rng: bool = True
    """Save and restore this process's random number generators (torch CPU and CUDA, Python's
    ``random``, numpy's) with every save, snapshot and note, per rank (``extras``): a resumed
    run draws the numbers the uninterrupted one would have. False: the script restores its own
    (or none)."""
    final_digest: bool = False
    """``close`` records this rank's digest of the last state it was given (a ``final_state``
    ledger record: ``digest``), which a benchmark compares across runs
    (``UNBROKEN_FINAL_DIGEST=1``); it reads the whole state once."""
    adaptive: bool = False
    """``maybe_save`` picks the durable interval itself (Young/Daly from each save's measured
    cost and the failure rate: ``unbroken.checkpoint.schedule.adaptive``), starting at ``every_steps``.
    Off by default: the failure rate is only the prior ``mtbf_prior_s`` until faults are seen."""
    adaptive_min_steps: int = 1
    """With ``adaptive``: never save more often than every this many steps."""
    adaptive_max_steps: int = 1000
    """With ``adaptive``: never save less often than every this many steps."""
    mtbf_prior_s: float = 3600.0
    """With ``adaptive``: the mean time between failures assumed before any was seen."""
    verify: bool = True
    """``restore`` checks every file's checksum before loading."""
    allow_foreign: bool = False
    """``restore`` may load a checkpoint another run wrote (its manifest names the run);
    False: such a checkpoint is refused with a CheckpointError naming that run."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(
                f"every_steps must be >= 0 (0 disables maybe_save), got {self.every_steps}"
            )
        if self.keep < 1:
            raise ValueError(
                f"keep must be >= 1 (the newest valid checkpoint is never deleted), got {self.keep}"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.on_busy not in ON_BUSY:
            raise ValueError(f"on_busy must be one of {ON_BUSY}, got {self.on_busy!r}")
        if self.persist_timeout_s <= 0:
            raise ValueError(f"persist_timeout_s must be > 0, got {self.persist_timeout_s}")
        if self.on_storage_failure not in ON_STORAGE_FAILURE:
            raise ValueError(
                f"on_storage_failure must be one of {ON_STORAGE_FAILURE}, "
                f"got {self.on_storage_failure!r}"
            )
        if not 0 < self.storage_retry_s <= self.storage_retry_max_s:
            raise ValueError(
                "storage_retry_s and storage_retry_max_s must satisfy 0 < storage_retry_s <= "
                f"storage_retry_max_s, got {self.storage_retry_s} and {self.storage_retry_max_s}"
            )
        if not self.storage_failure_limit_s > 0:
            raise ValueError(
                f"storage_failure_limit_s must be > 0, got {self.storage_failure_limit_s}"
            )
        if self.writer_start_timeout_s <= 0:
            raise ValueError(
                f"writer_start_timeout_s must be > 0, got {self.writer_start_timeout_s}"
            )
        if self.writer_start not in WRITER_STARTS:
            raise ValueError(
                f"writer_start must be one of {WRITER_STARTS}, got {self.writer_start!r}"
            )
        if not 0 <= self.writer_nice <= 19:
            raise ValueError(f"writer_nice must be in [0, 19], got {self.writer_nice}")
        if self.snapshot_every < 0:
            raise ValueError(
                f"snapshot_every must be >= 0 (0: at the interval snapshot_budget allows), "
                f"got {self.snapshot_every}"
            )
        if not 0 <= self.snapshot_budget < 1:
            raise ValueError(
                f"snapshot_budget must be in [0, 1) (a share of step time; 0: no snapshots "
                f"between durable saves), got {self.snapshot_budget}"
            )
        if self.snapshot_every and not self.memory_tier:
            raise ValueError(
                f"snapshot_every={self.snapshot_every} needs memory_tier=True (a snapshot is "
                "held only in memory); set memory_tier=True or snapshot_every=0"
            )
        if self.memory_slots < 1:
            raise ValueError(
                f"memory_slots must be >= 1 (snapshots held in memory), got {self.memory_slots}"
            )
        if self.peers and not 0 <= self.peer_index < len(self.peers):
            raise ValueError(
                f"peer_index must be this node's position in peers (0..{len(self.peers) - 1}), "
                f"got {self.peer_index}"
            )
        for peer in self.peers:
            split_peer(peer)
        if self.adaptive and not (
            1 <= self.adaptive_min_steps <= self.every_steps <= self.adaptive_max_steps
        ):
            raise ValueError(
                "adaptive=True needs 1 <= adaptive_min_steps <= every_steps (the starting "
                f"interval) <= adaptive_max_steps, got {self.adaptive_min_steps}, "
                f"{self.every_steps}, {self.adaptive_max_steps}"
            )
        if not self.mtbf_prior_s > 0:
            raise ValueError(f"mtbf_prior_s must be > 0, got {self.mtbf_prior_s}")
        if self.throttle_mbps < 0:
            raise ValueError(f"throttle_mbps must be >= 0 (0: no cap), got {self.throttle_mbps}")

    def due(self, step: int) -> bool:
        """Whether ``maybe_save`` saves after ``step``: after every ``every_steps`` completed
        steps, i.e. steps every_steps-1, 2*every_steps-1, ...

        Args:
            step: The step just completed (0-based).

        Returns:
            True when a durable save is due.
        """
        return self.every_steps > 0 and (step + 1) % self.every_steps == 0

    def snapshot_due(self, step: int) -> bool:
        """Whether ``maybe_save`` snapshots ``step`` to memory (not a durable save).

        Args:
            step: The step just completed (0-based).

        Returns:
            True when a memory snapshot is due.
        """
        return self.snapshot_every > 0 and (step + 1) % self.snapshot_every == 0

    @property
    def lean(self) -> bool:
        """The memory tier with one snapshot (``memory_slots`` 1) and a spare region; not with
        ``peers``: a node's replica is sent after its snapshot, so after a node loss the lost
        ranks' newest replica may be the step before the others' newest, which they keep too."""
        return self.memory_tier and self.memory_slots == 1 and not self.peers

    @property
    def regions(self) -> int:
        """Regions of the staging arena: ``memory_slots``, at least 2 (lean: the snapshot and
        the spare a rescue uses; with ``peers``: the two newest), or 1 without the memory tier."""
        return max(2, self.memory_slots) if self.memory_tier else 1

    @property
    def resident_regions(self) -> int:
        """Regions whose memory is in use between faults: 1 lean (its spare only from a rescue
        to the next snapshot), else ``regions``."""
        return 1 if self.lean else self.regions


SETTINGS = (
    "every_steps",
    "keep",
    "mode",
    "on_busy",
    "overlap",
    "memory_tier",
    "snapshot_every",
    "rescue",
    "memory_slots",
    "memory_keeper",
    "peers",
    "peer_index",
    "persist_timeout_s",
    "eager_writer",
    "verify",
    "allow_foreign",
)
"""The fields a ``Checkpointer`` takes as keywords, the ones a training script sets; the
others are set through its ``config``."""

NODE_FIELDS = ("memory_keeper", "peers", "peer_index")
"""The fields what the node offers (``node.NodeTiers``) may fill in."""


def merged(
    config: CheckpointConfig | None,
    settings: Mapping[str, Any],
    offered: Callable[[Mapping[str, Any]], Mapping[str, Any]],
) -> CheckpointConfig:
    """The configuration a ``Checkpointer`` runs with, before the environment's overrides.

    Args:
        config: The base configuration (None: the defaults).
        settings: The Checkpointer's keywords; None means not given (the base's value stands).
        offered: What the node offers for the fields not given (``node.NodeTiers.fields``):
            it is told the names given as keywords or set in ``config`` (the node's fields
            that differ from their defaults), and fills in only the others.

    Returns:
        ``config`` with the offered fields, then the given keywords, over it.

    Raises:
        ValueError: When the result is not a valid configuration (``CheckpointConfig``).
    """
    base = config or CheckpointConfig()
    given = {k: v for k, v in settings.items() if v is not None}
    if "peers" in given:
        given["peers"] = tuple(given["peers"])
    default = CheckpointConfig()
    chosen = {f for f in NODE_FIELDS if getattr(base, f) != getattr(default, f)}
    fixed = dict.fromkeys(chosen | given.keys())
    return dataclasses.replace(base, **{**offered(fixed), **given})


def overridden(config: CheckpointConfig, overrides: Overrides) -> CheckpointConfig:
    """``config`` with the environment's overrides (``unbroken.env.Overrides``:
    ``UNBROKEN_CKPT_MODE``, ``UNBROKEN_CKPT_EVERY``, ``UNBROKEN_SNAPSHOT_EVERY``,
    ``UNBROKEN_MEMORY_TIER``, which ``unbroken.run`` reads and offers: ``node.job``) applied:
    they win over a script's arguments, so a benchmark runs
    it under each configuration unedited. ValueError when they contradict each other."""
    fields: dict[str, Any] = {}
    if overrides.ckpt_mode is not None:
        fields["mode"] = overrides.ckpt_mode
    if overrides.ckpt_every is not None:
        fields["every_steps"] = overrides.ckpt_every
    if overrides.final_digest is not None:
        fields["final_digest"] = overrides.final_digest
    if overrides.memory_tier is False:
        if overrides.snapshot_every:
            raise ValueError(
                "UNBROKEN_SNAPSHOT_EVERY needs the memory tier, but UNBROKEN_MEMORY_TIER=0; "
                "unset one of them"
            )
        fields.update(memory_tier=False, snapshot_every=0, memory_slots=1)
    elif overrides.snapshot_every is not None:
        fields["snapshot_every"] = overrides.snapshot_every
        if overrides.snapshot_every:
            fields["memory_tier"] = True
        else:  # none between durable saves, measured or not
            fields["snapshot_budget"] = 0.0
    changed = {k: v for k, v in fields.items() if getattr(config, k) != v}
    if not changed:
        return config
    logger.info("the environment overrides the checkpoint configuration: %s", changed)
    return dataclasses.replace(config, **changed)
