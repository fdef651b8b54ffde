"""Fire planned faults from the training step hook, once per run.

Once-per-run: before a fault fires, its claim file ``<run_dir>/faults/fired/<index>.json`` is
created exclusively (``O_EXCL``) and fsynced with its directory, so a restarted worker (a new
process or a new in-process iteration) sees it and does not fire again, even when the fault
killed the machine's page cache along with the process.

Phase-targeted faults (``FaultSpec.phase``) fire from ``on_phase``, which ``unbroken.run`` makes
a listener of ``unbroken.ledger.phases``; their record says ``phase``. The entries into a phase
that an ``occurrence`` fault counts are kept in ``<run_dir>/faults/phases/r<rank>-<phase>``
(only for phases such a fault targets), so the count goes on across restarts.

The ``fault_injected`` record is flushed before anything lethal. A kind that changes state
first (``checkpoint-corruption``: the bytes it flipped; ``node-loss``: who dies) records what
it did in that record; a kind that ends no process (``slow-storage``, ``storage-fail``,
``slow-rank``, ``network``) says ``disruptive: false``, so that goodput opens no outage for it, and one that
degrades for a while (``slow-rank``: ``slowrank``; ``network``: ``link``, applied by the
emulated cluster) records its ``window_s`` and how it was applied (``mechanism``,
``applied``), or why not.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from unbroken.checkpoint import layout
from unbroken.faults import link, node, oom, slowrank, storage, storagefail, throttle
from unbroken.faults.plan import FaultPlan, FaultSpec
from unbroken.ledger import NULL, Recorder
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)


Hooks = throttle.SlowStorage | storagefail.FailingStorage | storagefail.Combined
"""The checkpoint writer hooks a plan may need (``FaultInjector.writer_hooks``)."""


class InjectedFault(RuntimeError):
    """The exception raised by an ``exception`` fault."""


def fired_faults(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The faults fired in a run, for whoever watches it from outside (an orchestrator
    relaunching a node).

    Args:
        run_dir: The run directory.

    Returns:
        Their claim records (index, step, rank, kind, ts, pid), by index.
    """
    out = []
    for p in (Path(run_dir) / "faults" / "fired").glob("*.json"):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):  # a claim being written: its fault has not fired yet
            continue
    return sorted(out, key=lambda r: int(r.get("index", -1)))


class FaultInjector:
    """Fires the faults of ``plan`` that target ``rank``.

    Args:
        plan: The fault plan.
        run_dir: The run directory: where the fired faults are claimed (once per run).
        rank: This process's rank.
        sink: Records each fault injected (the ledger).
        ckpt_dir: The checkpoint directory the storage faults act on (default
            ``<run_dir>/ckpt``).
        agent_pid: The launcher agent a ``node-loss`` kills with its tree (unbroken-run hands
            it to workers as ``UNBROKEN_AGENT_PID``; None: this process's parent when it is a
            recognisable launcher, else only this process).
        corruption_settle_s: How long a checkpoint-corruption waits for saves in flight to
            commit first.
    """

    def __init__(
        self,
        plan: FaultPlan,
        *,
        run_dir: str | os.PathLike[str],
        rank: int,
        sink: Recorder = NULL,
        ckpt_dir: str | os.PathLike[str] | None = None,
        agent_pid: int | None = None,
        corruption_settle_s: float = 10.0,
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.sink = sink
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else Path(run_dir) / "ckpt"
        self.agent_pid = agent_pid
        self.corruption_settle_s = corruption_settle_s
        """How long a checkpoint-corruption waits for saves in flight to commit first."""
        self.fired_dir = Path(run_dir) / "faults" / "fired"
        self.fired_dir.mkdir(parents=True, exist_ok=True)
        self.counts_dir = Path(run_dir) / "faults" / "phases"
        self.last_step: int | None = None
        """The newest step this process completed (``on_step``)."""
        self._phased = plan.in_phase(rank)

    def hooks_for(self, root: Path) -> Hooks | None:
        """A Checkpointer under ``root`` was made: the storage faults act on its directory
        from now on.

        Args:
            root: The new Checkpointer's directory.

        Returns:
            The writer hooks it needs (``writer_hooks``).
        """
        self.ckpt_dir = Path(root)
        return self.writer_hooks()

    def writer_hooks(self) -> Hooks | None:
        """The checkpoint writer hooks this plan needs (``Checkpointer(hooks=...)``).

        Returns:
            ``storagefail.FailingStorage`` when the plan holds a storage-fail fault,
                ``throttle.SlowStorage`` when it holds a slow-storage fault (either may target
                any rank), both in a ``storagefail.Combined`` when it holds both, else None.
        """
        kinds = {f.kind for f in self.plan.faults}
        hooks: list[storagefail.FailingStorage | throttle.SlowStorage] = []
        if "storage-fail" in kinds:  # first: a save failed at its start is not slowed
            hooks.append(storagefail.FailingStorage())
        if "slow-storage" in kinds:
            hooks.append(throttle.SlowStorage())
        if len(hooks) > 1:
            return storagefail.Combined(*hooks)
        return hooks[0] if hooks else None

    def fired(self) -> list[int]:
        """The faults already fired in this run (by any process).

        Returns:
            Their indices in the plan, sorted.
        """
        return sorted(int(p.stem) for p in self.fired_dir.glob("*.json"))

    def on_step(self, step: int) -> None:
        """Call after a step completes: fires the faults due. May raise, hang, or end the
        process.

        Args:
            step: The step just completed.

        Raises:
            InjectedFault: When an ``exception`` fault fires.
        """
        self.last_step = step
        for spec in self.plan.at(step, self.rank):
            if self._claim(spec):
                self._fire(spec)

    def on_phase(self, name: str) -> None:
        """Call on entry into a named phase (a ``phases`` listener): fires the faults due. May
        raise, hang, or end the process; a dictionary lookup when no fault targets the phase.

        Args:
            name: The phase entered.

        Raises:
            InjectedFault: When an ``exception`` fault fires.
        """
        specs = self._phased.get(name)
        if not specs:
            return
        count = self._count(name) if any(f.occurrence for f in specs) else 0
        for spec in specs:
            if spec.occurrence is not None:
                due = count >= spec.occurrence
            else:
                due = spec.step is None or (
                    self.last_step is not None and self.last_step >= spec.step
                )
            if due and self._claim(spec):
                self._fire(spec)

    def _count(self, name: str) -> int:
        """One more entry into phase ``name`` on this rank in the run; returns the count."""
        path = self.counts_dir / f"r{self.rank}-{name}"
        try:
            count = int(path.read_text()) + 1
        except (OSError, ValueError):
            count = 1
        self.counts_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(str(count))
        os.replace(tmp, path)
        return count

    def _claim(self, spec: FaultSpec) -> bool:
        """Create the fault's claim file (True), or find it there (False: fired already). Not
        fsynced yet: the ledger's record comes first (``_fire``), so a process killed from
        outside meanwhile (a compound fault) loses microseconds, not an fsync's wait."""
        path = self.fired_dir / f"{spec.index}.json"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            record = {
                "index": spec.index,
                "step": spec.step if spec.step is not None else self.last_step,
                "phase": spec.phase,
                "rank": spec.rank,
                "kind": spec.kind,
                "ts": time.time(),
                "pid": os.getpid(),
            }
            os.write(fd, json.dumps(record).encode())
        finally:
            os.close(fd)
        return True

    def _claimed(self, spec: FaultSpec) -> None:
        """Make the claim durable (after the ledger's record of it)."""
        fd = os.open(self.fired_dir / f"{spec.index}.json", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        layout.fsync_dir(self.fired_dir)

    def _fire(self, spec: FaultSpec) -> None:
        logger.warning("injecting fault %s", spec.describe())
        extra: dict[str, Any] = {}
        victims: node.Node | None = None
        if spec.kind == "oom-kill":
            extra["mechanism"] = oom.mechanism()
        elif spec.kind == "slow-storage":
            extra = self._slow_storage(spec)
        elif spec.kind == "storage-fail":
            extra = self._storage_fail(spec)
        elif spec.kind == "checkpoint-corruption":
            extra = self._corrupt(spec)
        elif spec.kind == "slow-rank":
            extra = _slow_rank(spec)
        elif spec.kind == "network":
            extra = link.request(spec, fired_dir=self.fired_dir)
        elif spec.kind == "node-loss":
            victims = node.find_node(self.agent_pid)
            extra = {"scope": victims.scope, "agent_pid": victims.agent_pid, "pids": victims.pids}
            if victims.how:
                extra["found_by"] = victims.how
        if not spec.disruptive:
            extra["disruptive"] = False
        try:
            if spec.phase is not None:
                extra["phase"] = spec.phase
            step = spec.step if spec.step is not None else self.last_step
            self.sink.emit(ev.FAULT_INJECTED, fault=spec.kind, step=step, index=spec.index, **extra)
            self.sink.flush()
            self._claimed(spec)
        except BaseException:
            if victims is not None:  # its agent is stopped: never leave it so
                node.lose(victims)
            raise
        if not spec.disruptive:
            return  # nothing dies: training goes on, slower
        if spec.kind == "exception":
            raise InjectedFault(f"injected fault {spec.describe()}")
        if spec.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif spec.kind == "hang":
            _hang()
        elif spec.kind == "hang-collective":
            _hang_collective()
        elif spec.kind == "hang-native":
            _hang_native()
        elif spec.kind == "segfault":
            _segfault()
        elif spec.kind == "oom-kill":
            oom.oom_kill(int(spec.params.get("limit_mb", 256)))
        elif spec.kind == "checkpoint-corruption":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "node-loss":
            assert victims is not None
            node.lose(victims)
        else:  # pragma: no cover - FaultSpec validates kinds
            raise AssertionError(spec.kind)
        # A signal handler may have returned (sigterm with a handler that does not exit);
        # give the signal a moment to take effect, as a real fault would.
        time.sleep(1.0)

    def _slow_storage(self, spec: FaultSpec) -> dict[str, Any]:
        cfg = spec.settings()
        targets = spec.targets()
        out: dict[str, Any] = {
            "mbps": cfg["mbps"],
            "saves": cfg["saves"],
            "seconds": cfg["seconds"],
            "ranks": "all" if targets is None else targets,
        }
        if not self.ckpt_dir.is_dir():
            out["control"] = None
            out["reason"] = f"no checkpoint directory {self.ckpt_dir}: nothing to slow down"
            return out
        path = throttle.write_control(
            self.ckpt_dir,
            index=spec.index,
            ranks=targets,
            bytes_per_s=cfg["mbps"] * 1e6,
            saves=cfg["saves"],
            seconds=cfg["seconds"],
        )
        out["control"] = str(path)
        return out

    def _storage_fail(self, spec: FaultSpec) -> dict[str, Any]:
        cfg = spec.settings()
        targets = spec.targets()
        out: dict[str, Any] = {
            "error": cfg["error"],
            "saves": cfg["saves"],
            "ranks": "all" if targets is None else targets,
            "emulated": True,  # raised at the writer's I/O boundary, not by a file system
        }
        if cfg["stall_s"] is not None:
            out["stall_s"] = cfg["stall_s"]
        if not self.ckpt_dir.is_dir():
            out["control"] = None
            out["reason"] = f"no checkpoint directory {self.ckpt_dir}: no save to fail"
            return out
        path = storagefail.write_control(
            self.ckpt_dir,
            index=spec.index,
            ranks=targets,
            error=cfg["error"],
            saves=cfg["saves"],
            stall_s=cfg["stall_s"],
        )
        out["control"] = str(path)
        return out

    def _corrupt(self, spec: FaultSpec) -> dict[str, Any]:
        target = spec.settings()["target"]
        try:
            out = storage.corrupt_newest(
                self.ckpt_dir, rank=self.rank, target=target, settle_s=self.corruption_settle_s
            )
        except OSError as e:  # record it and crash anyway: the restart still has to happen
            out = {"target": target, "file": None, "reason": f"corruption failed: {e}"}
        if out.get("file") is None:
            logger.warning("checkpoint-corruption: %s", out.get("reason"))
        else:
            logger.warning("checkpoint-corruption: flipped bytes of %s", out["file"])
        return out


def _slow_rank(spec: FaultSpec) -> dict[str, Any]:
    """Throttle this process (``slowrank``); the record's window is its ``window_s``."""
    cfg = spec.settings()
    out: dict[str, Any] = {"cpu": cfg["cpu"], "seconds": cfg["seconds"]}
    try:
        out.update(slowrank.slow(os.getpid(), cpu=cfg["cpu"], seconds=cfg["seconds"]))
    except OSError as e:  # not even a watcher: say so, train on at full speed
        logger.warning("slow-rank: not applied: %s", e)
        return {**out, "applied": False, "reason": f"no watcher process could start: {e}"}
    out["window_s"] = cfg["seconds"]
    return out


def _hang() -> None:
    """Keep executing Python without ever making progress."""
    while True:
        time.sleep(0.01)


def _hang_collective() -> None:
    """Block in a receive the neighbour never sends (needs an initialized process group).

    An abort of the group (closing its connections) frees it, as it frees the peers.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        _hang_native()  # nothing to wait on: the closest equivalent
    src = (dist.get_rank() + 1) % dist.get_world_size()
    dist.recv(torch.zeros(1), src=src, tag=0x7FFF)  # nobody sends with this tag
    raise RuntimeError("hang-collective: the receive returned without a sender")


def _hang_native() -> None:
    """Block forever inside one native call: no Python bytecode runs on this thread again."""
    r, _w = os.pipe()
    os.read(r, 1)  # nobody ever writes to _w


def _segfault() -> None:
    """A real segmentation fault: read address 0."""
    import ctypes

    ctypes.string_at(0)
