"""The agent: drives ``machine.Machine`` through rendezvous, start, watch, stop, and records it.

One agent per node. Its side effects go through three ports (the real ones are
``rendezvous.C10dRendezvous``, ``workers.LocalWorkers`` and ``monitor.HeartbeatTracker``;
tests pass scripted fakes):

- RENDEZVOUS: join the next round; record a ``phase`` "rendezvous" interval.
- STARTING: start the local workers of the round; after a restart, ``restart_end`` (layer
  launcher) when they are started, and a ``phase`` "launch" interval from their start to the
  first heartbeat of every one of them.
- RUNNING: sleep until a worker exits, a heartbeat arrives, a deadline passes or a signal comes;
  a failure is recorded as ``fault_detected`` (detector "exit" or "heartbeat", layer launcher)
  plus ``restart_begin``; hung workers get SIGKILL at once (a process stuck in a C++ call or
  stopped would not act on SIGTERM anyway).
- STOPPING: stop every local worker (``worker_exit`` per worker, ``phase`` "stop").
- SUCCEEDED / FAILED: exit barrier, error file (on failure), ``job_end``.

Ledger records are written as rank -1 with ``attempt`` = the round; the goodput math reads only
the fault records from them, so the "launch" and "stop" phase names are informational.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from unbroken.errors import EXIT_PREEMPTED
from unbroken.launcher import errors
from unbroken.launcher import failures as failures_
from unbroken.launcher.args import JobSpec
from unbroken.launcher.config import LauncherConfig
from unbroken.launcher.errors import Failure
from unbroken.launcher.handover import Handover
from unbroken.launcher.machine import Machine, State, StopReason, Tick
from unbroken.launcher.monitor import HeartbeatTracker
from unbroken.launcher.rendezvous import JobOver, RoundInfo
from unbroken.launcher.signals import AgentSignal
from unbroken.launcher.workers import Events, WorkerExit
from unbroken.ledger import NULL, Recorder
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)


RESCUE_GRACE_MIN_S = 0.25
"""The least time survivors of a dead worker get to rescue their noted step before SIGKILL."""

_JOB_WIDE = frozenset(
    {
        errors.EXIT_USAGE,
        errors.EXIT_BUDGET_EXHAUSTED,
        errors.EXIT_NO_PROGRESS,
        errors.EXIT_STORAGE_FAILED,
    }
)
"""Failures every node shares (its configuration, the restart budget, progress, checkpoint
storage): the agent that gives up closes the rendezvous, ending the job for every node. Any
other end of a node (a signal, its own rendezvous or start failing) leaves it open."""


class RendezvousPort(Protocol):
    def next_round(self) -> RoundInfo: ...
    def membership(self) -> tuple[int, list[str]]: ...
    def announce_preemption(self, info: RoundInfo) -> None: ...
    def peer_preempted(self, round_: int) -> bool: ...
    def exit_barrier(self, info: RoundInfo) -> None: ...
    def leave(self) -> None: ...
    def close(self) -> None: ...


class WorkersPort(Protocol):
    warm: bool
    standby: int

    def interruptible(self, on: bool) -> None: ...
    def start(self, info: RoundInfo) -> dict[int, tuple[int, int]]: ...
    def wait(self, timeout_s: float) -> Events: ...
    def kill(self, local_ranks: list[int], sig: int) -> None: ...
    def stop(self, grace_s: float) -> list[WorkerExit]: ...
    def running(self) -> list[int]: ...
    def all_succeeded(self) -> bool: ...
    def pending_signal(self) -> int | None: ...
    def state_of(self, local_rank: int) -> str | None: ...


class Agent:
    """Runs one node's part of the job to completion; ``run()`` returns the exit code."""

    def __init__(
        self,
        *,
        spec: JobSpec,
        cfg: LauncherConfig,
        rdzv: RendezvousPort,
        workers: WorkersPort,
        tracker: HeartbeatTracker,
        ledger: Recorder = NULL,
        run_dir: Path,
        run_id: str,
        state_file: Path | None = None,
        handover: Handover | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.cfg = cfg
        self.rdzv = rdzv
        self.workers = workers
        self.tracker = tracker
        self.ledger = ledger
        self.run_dir = run_dir
        self.run_id = run_id
        self.state_file = state_file
        self.handover = handover
        """Pauses this node's workers for the next round after a lost node (None: never)."""
        self.clock = clock
        self.wall = wall
        self.machine = Machine(
            max_restarts=spec.max_restarts, max_no_progress_restarts=cfg.max_no_progress_restarts
        )
        self.info: RoundInfo | None = None
        self.error_record: dict[str, Any] | None = None
        self._restarting = False
        self._spawned_wall = 0.0
        self._launch_logged = False
        self._stop_begin = 0.0
        self._next_membership = 0.0

    # --- helpers -----------------------------------------------------------------------------
    @property
    def round(self) -> int:
        return -1 if self.info is None else self.info.round

    def _emit(self, kind: str, *, ts: float | None = None, **data: Any) -> None:
        self.ledger.emit(kind, ts=ts, **data)

    def _interval(self, begin: float, **data: Any) -> None:
        self.ledger.interval(ev.PHASE, begin=begin, end=self.wall(), **data)

    def _signal_failure(self, signum: int) -> Failure:
        return failures_.of_signal(signum, ts=self.wall(), round_=self.round)

    def _agent_failure(self, cause: str, detector: str, e: Exception) -> Failure:
        message = f"{type(e).__name__}: {e}"
        return failures_.of_agent(
            cause, detector=detector, message=message, ts=self.wall(), round_=self.round
        )

    def _record_exits(self, exits: list[WorkerExit]) -> None:
        for x in exits:
            self.tracker.forget(x.local_rank)
            self._emit(
                ev.WORKER_EXIT,
                exit_code=x.exit_code,
                round=self.round,
                signal=None if x.signum is None else errors.signal_name(x.signum),
                worker_rank=x.rank,
                local_rank=x.local_rank,
                pid=x.pid,
            )

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        self.machine.begin()
        steps = {
            State.RENDEZVOUS: self._rendezvous,
            State.STARTING: self._start,
            State.RUNNING: self._watch,
            State.STOPPING: self._stop,
        }
        while not self.machine.terminal:
            logger.debug("agent state %s", self.machine.state.value)
            steps[self.machine.state]()
        return self._finish()

    def _rendezvous(self) -> None:
        signum = self.workers.pending_signal()
        if signum is not None:  # arrived while stopping: do not start another round
            self.machine.failures.append(self._signal_failure(signum))
            self.machine.interrupt(signum)
            return
        begin = self.wall()
        self.workers.interruptible(True)
        try:
            info = self.rdzv.next_round()
        except AgentSignal as e:
            self.machine.failures.append(self._signal_failure(e.signum))
            self.machine.interrupt(e.signum)
            return
        except JobOver as e:
            logger.info("%s; this node was not needed (a spare): exiting", e)
            self.machine.job_over()
            return
        except Exception as e:
            logger.error("rendezvous failed: %s: %s", type(e).__name__, e)
            self.machine.rendezvous_failed(self._agent_failure("rendezvous", "rendezvous", e))
            return
        finally:
            self.workers.interruptible(False)
        self.info = info
        self.ledger.set_context(attempt=info.round)
        self._interval(
            begin,
            name="rendezvous",
            round=info.round,
            group_rank=info.group_rank,
            group_world_size=info.group_world_size,
            world_size=info.world_size,
            master_addr=info.master_addr,  # the round's worker store, on group rank 0's node
            host=socket.gethostname(),
        )
        logger.info(
            "round %d: node %d of %d, ranks %d-%d of %d",
            info.round,
            info.group_rank,
            info.group_world_size,
            info.rank_offset,
            info.rank_offset + self.spec.nproc_per_node - 1,
            info.world_size,
        )
        self.machine.rendezvous_done()

    def _start(self) -> None:
        assert self.info is not None
        self._spawned_wall = self.wall()
        if self.handover is not None and self.handover.paused:
            handed, exits = self.handover.hand_over(self.info)
            self._record_exits(exits)
            if handed is not None:
                self._started(handed, handover=True)
                return
            self._record_exits(self.workers.stop(self.cfg.stop_grace_s))
        self.workers.interruptible(True)
        try:
            started = self.workers.start(self.info)
        except AgentSignal as e:
            self.machine.failures.append(self._signal_failure(e.signum))
            self.machine.interrupt(e.signum)
            return
        except Exception as e:
            logger.error("could not start workers: %s: %s", type(e).__name__, e)
            self.machine.start_failed(self._agent_failure("spawn", "spawn", e))
            return
        finally:
            self.workers.interruptible(False)
        self._started(started, handover=False)

    def _started(self, started: dict[int, tuple[int, int]], *, handover: bool) -> None:
        assert self.info is not None
        self.tracker.begin_round(self.info.round, started, self.clock())
        self._launch_logged = False
        if self._restarting:
            self._emit(
                ev.RESTART_END,
                layer="launcher",
                round=self.info.round,
                warm=handover or self.workers.warm,
                standby=0 if handover else self.workers.standby,
                **({"handover": True} if handover else {}),
            )
        how = "handed over" if handover else "warm" if self.workers.warm else "cold"
        logger.info("round %d: started %d workers (%s)", self.info.round, len(started), how)
        self.machine.started()

    def _membership(self, now: float) -> tuple[int, list[str], bool]:
        """(nodes waiting to join, nodes of this round that died, another node of this round
        preempted), at most every ``membership_check_s``."""
        if self.spec.max_nodes <= 1 or now < self._next_membership:
            return 0, [], False
        self._next_membership = now + self.cfg.membership_check_s
        if self.rdzv.peer_preempted(self.round):  # it leaves on purpose: not a lost node
            return 0, [], True
        waiting, lost = self.rdzv.membership()
        # A preempted node announces, then leaves: gone now, its announcement is there too
        # (it may have come between the two reads above).
        if lost and self.rdzv.peer_preempted(self.round):
            return 0, [], True
        return waiting, lost, False

    def _watch(self) -> None:
        while self.machine.state is State.RUNNING:
            timeout = self.spec.monitor_interval_s
            deadline = self.tracker.next_deadline()
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - self.clock()))
            got = self.workers.wait(timeout)
            now = self.clock()
            for hb in got.heartbeats:
                self.tracker.record(hb, now)
            if not self._launch_logged and self.tracker.all_heartbeated():
                self._launch_logged = True
                self._interval(self._spawned_wall, name="launch", round=self.round)
            self._record_exits(got.exits)
            failures = [failures_.from_exit(x, round_=self.round) for x in got.exits if not x.ok]
            if not failures:
                hangs = self.tracker.overdue(now)
                if hangs:
                    states = {h.local_rank: self.workers.state_of(h.local_rank) for h in hangs}
                    failures = failures_.from_hangs(
                        hangs, states, ts=self.wall(), round_=self.round
                    )
                    self.workers.kill([h.local_rank for h in hangs], signal.SIGKILL)
            waiting, preempted = 0, False
            if not failures:
                waiting, lost, preempted = self._membership(now)
                if lost:
                    message = f"node(s) {', '.join(lost)} left the rendezvous (keep-alive expired)"
                    failures = [
                        failures_.of_agent(
                            "node_lost",
                            detector="rendezvous",
                            message=message,
                            ts=self.wall(),
                            round_=self.round,
                        )
                    ]
            tick = Tick(
                failures=tuple(failures),
                succeeded=self.workers.all_succeeded(),
                nodes_waiting=waiting,
                signal=got.signals[0] if got.signals else None,
                peer_preempted=preempted,
            )
            if self.machine.observe(tick) is State.STOPPING:
                self._stopping(tick)

    def _stopping(self, tick: Tick) -> None:
        self._stop_begin = self.wall()
        reason = self.machine.stop_reason
        if reason is StopReason.SIGNAL:
            assert tick.signal is not None
            self.machine.failures.append(self._signal_failure(tick.signal))
            logger.warning("received %s: stopping workers", errors.signal_name(tick.signal))
            if tick.signal == signal.SIGTERM and self.info is not None:
                self.rdzv.announce_preemption(self.info)  # the other nodes save with this one
                if self.spec.max_nodes > 1:  # and go on without it once saved: no waiting on it
                    self.rdzv.leave()
            return
        if reason is StopReason.PREEMPTION:
            logger.warning(
                "another node of round %d was preempted: every rank saves the step they agree "
                "on, then the job goes on without it",
                self.round,
            )
            self._emit(ev.RESTART_BEGIN, layer="launcher", cause="preemption", round=self.round)
            return
        if reason is StopReason.MEMBERSHIP:
            logger.info("a node is waiting to join: restarting round %d", self.round)
            self._emit(ev.RESTART_BEGIN, layer="launcher", cause="membership", round=self.round)
            return
        root = errors.root_cause(list(tick.failures))
        assert root is not None
        others = sorted({f.rank for f in tick.failures} - {root.rank})
        logger.warning(
            "round %d: rank %d failed: %s (%s) %s",
            self.round,
            root.rank,
            root.cause,
            root.category,
            root.message.splitlines()[0] if root.message else "",
        )
        self._emit(
            ev.FAULT_DETECTED,
            ts=root.ts,  # when the agent saw it (the reap, the missed deadline)
            cause=root.cause,
            detector=root.detector,
            layer="launcher",
            fault_rank=root.rank,
            local_rank=root.local_rank,
            category=root.category,
            exit_code=root.exit_code,
            signal=root.signal,
            round=self.round,
            also_ranks=others,
            message=root.message[:500],
        )
        self._emit(ev.RESTART_BEGIN, layer="launcher", cause=root.cause, round=self.round)

    def _stop_grace(self) -> float:
        """How long the workers get between SIGTERM and SIGKILL.

        A preemption (this agent, or another node's, was signalled) or a script that never
        sent a heartbeat (not adopted: it may have a SIGTERM handler of its own) gets
        ``stop_grace_s``. Adopted workers stopped for a restart get no graceful preemption
        (a save every rank must agree on, which cannot complete while a peer is gone); after
        a worker died they get ``rescue_grace`` to rescue the step they noted: their next
        collective fails at once, the fault's abort snapshots the step into the arena this
        agent keeps, and the SIGTERM then ends them. After a hang they get none (their
        collectives wait on the hung worker).
        """
        adopted = any(w.first is not None for w in self.tracker.workers.values())
        preemption = (StopReason.SIGNAL, StopReason.PREEMPTION)
        if adopted and self.machine.stop_reason not in preemption:
            failures = self.machine.failures
            died = bool(failures) and all(f.detector == "exit" for f in failures)
            return self._rescue_grace() if died and self.workers.running() else 0.0
        return self.cfg.stop_grace_s

    def _rescue_grace(self) -> float:
        """Two of the slowest steps seen (at least ``RESCUE_GRACE_MIN_S``), at most
        ``stop_grace_s``: a survivor reaches its failing collective within a step."""
        step_s = self.tracker.observed.steady_gap_max_s
        return min(self.cfg.stop_grace_s, max(RESCUE_GRACE_MIN_S, 2 * step_s))

    def _stop(self) -> None:
        if self.machine.stop_reason is not None and not self._stop_begin:
            self._stop_begin = self.wall()
        paused = (
            self.handover is not None
            and self.cfg.handover
            and self.handover.pause(self.info, self.machine.failures)
        )
        exits = [] if paused else self.workers.stop(self._stop_grace())
        self._record_exits(exits)
        ours = (signal.SIGTERM, signal.SIGKILL)
        self.machine.note(
            [
                failures_.from_exit(x, round_=self.round)
                for x in exits
                if not x.ok and x.signum not in ours and x.exit_code != EXIT_PREEMPTED
            ]
        )
        self._interval(
            self._stop_begin, name="stop", round=self.round, workers=len(exits), paused=paused
        )
        self._stop_begin = 0.0
        if self.state_file is not None:
            self.tracker.observed.save(self.state_file)
        if self.machine.stopped(progress=self.tracker.progress) is State.RENDEZVOUS:
            self._restarting = True
            logger.info(
                "restarting (%d of %d restarts used)", self.machine.restarts, self.spec.max_restarts
            )
        elif paused and self.handover is not None:  # no next round here: the paused go
            self.handover.refuse("the job ends on this node")
            self._record_exits(self.workers.stop(self.cfg.stop_grace_s))

    def _finish(self) -> int:
        m = self.machine
        code = m.exit_code if m.exit_code is not None else errors.EXIT_INTERNAL
        try:
            if m.state is State.SUCCEEDED:
                if self.info is not None:
                    self.rdzv.exit_barrier(self.info)
                self._emit(
                    ev.JOB_END, status="ok", exit_code=0, restarts=m.restarts, round=self.round
                )
                if self.info is not None:
                    logger.info("all workers finished (%d restarts)", m.restarts)
                return code
            path = self.cfg.error_path(self.run_dir)
            self.error_record = errors.write_error_file(
                path, exit_code=code, failures=m.failures, restarts=m.restarts, run_id=self.run_id
            )
            rec = self.error_record
            self._emit(
                ev.JOB_END,
                status="failed",
                exit_code=code,
                reason=rec["reason"],
                cause=rec["cause"],
                fault_rank=rec["rank"],
                restarts=m.restarts,
                round=self.round,
            )
            if m.stop_reason is StopReason.SIGNAL and m.signal is not None:
                logger.warning(
                    "stopped by %s (exit code %d); see %s",
                    errors.signal_name(m.signal),
                    code,
                    path,
                )
                return code
            logger.error(
                "giving up (%s, exit code %d): root cause rank %s %s (%s); see %s",
                rec["reason"],
                code,
                rec["rank"],
                rec["cause"],
                rec["category"],
                path,
            )
            return code
        finally:
            if self.state_file is not None:
                self.tracker.observed.save(self.state_file)
            if self.spec.max_nodes > 1 and m.state is State.FAILED and code not in _JOB_WIDE:
                self.rdzv.leave()  # this node stops; closing would end the job for every node
            else:
                self.rdzv.close()
