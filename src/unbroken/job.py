"""``unbroken.run(fn)`` and ``unbroken.main(fn)``: a user's training function as a job.

``run`` is the in-process restart (``unbroken.restart.run``) with the other layers attached, so
that a script adopts unbroken in a few lines and its report has every figure:

- a ledger in the run directory: ``unbroken-run``'s (``--ft-run-dir``, or its default); for a
  process started by hand, ``runs/<script>-<time>-<pid>``; under another launcher that names the
  run (torchrun ``--standalone``), ``runs/<run id>``; else none. It records the process's
  start-up, launcher restarts and the job's end, and it is the *active* ledger while ``fn``
  runs: a ``Checkpointer`` created in ``fn`` records into it without being handed it;
- under ``unbroken-run``, that Checkpointer also gets the node agent's memory keeper and, in a
  multi-node job, the peers (``unbroken.checkpoint.node``): a SIGKILLed rank's successor
  restores from the snapshots the agent held, a lost node's ranks from another node's memory;
- every ``ctx.step_done`` also sends the launcher heartbeat (``unbroken.heartbeat``) with the
  newest step an open Checkpointer saw committed, for the launcher's hang and no-progress
  guards;
- the fault plan named by ``UNBROKEN_FAULTS`` fires from ``ctx.step_done``, so a script's
  recovery is tested with the plans that test unbroken's own, without changing the script;
- Checkpointers that a failed ``fn`` left open are aborted, so that no writer process outlives
  its iteration and the next one restores from memory.
- a Checkpointer's wait for a commit (``close`` after the loop, ``wait``, a sync save) is
  a known region without progress: a "finishing" heartbeat and ``ctx.no_hang_protection``
  around it (``unbroken.checkpoint.node.waiting``), so a long final save is no hang;
- checkpoint writers fork from a server forked before ``fn`` builds anything
  (``unbroken.checkpoint.forkserver``), not from the trainer: the writer an in-process restart
  starts shares no page of the model, so the next steps copy none (copy-on-write).

``main(fn)`` is a script's entry point: ``run``, then exit with the code the launcher expects.

The top of the package: it composes restart, checkpoint, faults, the launcher's worker client and
the ledger (and so imports torch; ``import unbroken`` loads it on first use of ``run``).

Imports of ours: ``unbroken.errors``, ``unbroken.env``, ``unbroken.log``, ``unbroken.ledger``,
``unbroken.checkpoint``, ``unbroken.faults``, ``unbroken.restart``, ``unbroken.launcher.client``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from unbroken import restart
from unbroken.checkpoint import forkserver, node
from unbroken.checkpoint.checkpointer import Checkpointer, open_checkpointers
from unbroken.env import WorkerEnv, standby_start
from unbroken.errors import EXIT_CONFIG, ConfigError
from unbroken.faults import FaultInjector, load_plan
from unbroken.launcher.client import heartbeat
from unbroken.ledger import NULL, Ledger, install_sigterm_flush, process_start_time
from unbroken.ledger import events as ev
from unbroken.ledger.active import activate
from unbroken.restart import Escalated, RankExcluded, RestartConfig, RestartContext

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run_dir_for(env: WorkerEnv, script: str = "") -> Path | None:
    """Where a job's ledger and checkpoints go (see the module docstring); None: nowhere
    every rank would agree on."""
    if env.run_dir is not None:
        return env.run_dir
    if not env.launched:
        stem = Path(script).stem if Path(script).is_file() else "unbroken"
        return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    if env.run_id and env.run_id != "none":
        return Path("runs") / env.run_id
    return None


def _node_tiers(env: WorkerEnv) -> node.NodeTiers:
    """What ``unbroken-run`` handed this worker of its node's memory tiers."""
    return node.NodeTiers(
        memory_keeper=env.memory_keeper or "",
        peers=env.peers,
        peer_index=env.group_rank if env.peers else -1,
    )


def run(fn: Callable[[RestartContext], T], *, config: RestartConfig | None = None) -> T:
    """Call ``fn(ctx)`` on every rank until it returns everywhere, restarting it in-process
    after a fault; returns its value. See ``unbroken.restart.run`` for the contract of ``fn``
    (call from the main thread; ``run`` forms the process group) and the module docstring for
    what is attached.

    What may escape, and what to do with it (``main`` does it):
    ``Escalated``: in-process restart gave up; exit with ``Escalated.exit_code`` (75), the
    launcher restarts the workers. ``RankExcluded``: this rank left the job, its peers go on;
    exit with ``RankExcluded.exit_code`` (0: a non-zero exit would stop the peers too).
    Anything else (a bad ``UNBROKEN_FAULTS`` plan, an unreachable store, ``KeyboardInterrupt``):
    let it end the process.
    """
    env = WorkerEnv.from_environ()
    run_dir = run_dir_for(env, sys.argv[0])
    if run_dir is not None:
        run_dir = run_dir.resolve()
        env = dataclasses.replace(env, run_dir=run_dir)
    ledger = _open_ledger(env, run_dir) if run_dir is not None else None
    try:
        try:
            injector = _injector(env, ledger)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from e
        with (
            activate(NULL if ledger is None else ledger),
            node.provide(_node_tiers(env)),
            forkserver.serving(),  # before fn builds anything: its writers share no page of it
        ):
            value = restart.run(_with_hooks(fn, injector), config=config, ledger=ledger, env=env)
    except (Escalated, RankExcluded, ConfigError, KeyboardInterrupt, SystemExit):
        if ledger is not None:
            ledger.close()
        raise
    except BaseException as e:
        if ledger is not None:
            ledger.emit(
                ev.FAULT_DETECTED,
                cause=type(e).__name__,
                detector="exception",
                fault_rank=ledger.rank,
                message=str(e)[:500],
            )
            ledger.close()
        raise
    if ledger is not None:
        if ledger.rank == 0:
            ledger.emit(ev.JOB_END, status="ok")
        ledger.close()
    return value


def main(fn: Callable[[RestartContext], Any], *, config: RestartConfig | None = None) -> NoReturn:
    """A training script's entry point: ``run(fn, config=config)``, then exit the process with
    the code the launcher expects: 0 when ``fn`` returned; ``Escalated.exit_code`` (75) when
    in-process restart gave up (the launcher takes over); ``RankExcluded.exit_code`` (0) on a
    rank that left the job; ``EXIT_CONFIG`` (78) on a ``ConfigError`` (see ``unbroken.restart.run``:
    ``unbroken-run`` ends the job with exit code 2). Any other error propagates (a traceback, exit 1; the launcher's
    error file names it). Sets up logging unless the script already did."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from unbroken.log import init_logging

    init_logging()
    try:
        run(fn, config=config)
    except (Escalated, RankExcluded) as e:
        logger.error("%s: %s; exit code %d", type(e).__name__, e, e.exit_code)
        sys.exit(e.exit_code)
    except ConfigError as e:  # no restart fixes it: the launcher ends the job (exit 2)
        get_error_handler().record_exception(e)
        logger.error("configuration error: %s; exit code %d", e, EXIT_CONFIG)
        sys.exit(EXIT_CONFIG)
    except Exception as e:
        get_error_handler().record_exception(e)  # the launcher reads the root cause from it
        raise
    sys.exit(0)


def _open_ledger(env: WorkerEnv, run_dir: Path) -> Ledger:
    """The process's ledger, with its start-up (process start -> now) and, after a launcher
    restart, the restart's end."""
    started = standby_start() or process_start_time()
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = env.run_id if env.run_id and env.run_id != "none" else run_dir.name
    ledger = Ledger(run_dir, run=run_id, rank=env.rank, attempt=env.restart_count)
    install_sigterm_flush(ledger)
    ledger.emit(
        ev.PROCESS_START,
        ts=started,
        pid=os.getpid(),
        local_rank=env.local_rank,
        world_size=env.world_size,
    )
    ledger.interval(ev.PHASE, begin=started, name="import")
    ledger.mark()
    if env.restart_count > 0:
        ledger.emit(ev.RESTART_END, layer="launcher")
    return ledger


def _injector(env: WorkerEnv, ledger: Ledger | None) -> FaultInjector | None:
    """The injector of the ``UNBROKEN_FAULTS`` plan, or None without one."""
    if env.fault_plan is None:
        return None
    if env.run_dir is None:
        raise ValueError(
            f"UNBROKEN_FAULTS={env.fault_plan} needs a run directory to record which faults "
            "fired; run the script under unbroken-run (or torchrun --standalone)"
        )
    if not env.fault_plan.is_file():
        raise ValueError(
            f"UNBROKEN_FAULTS={env.fault_plan}: no such file; name a fault plan (YAML), "
            f"absolute or relative to the working directory {Path.cwd()}"
        )
    plan = load_plan(env.fault_plan, world_size=env.world_size)
    plan.check_world(env.world_size)
    return FaultInjector(
        plan,
        run_dir=env.run_dir,
        rank=env.rank,
        sink=NULL if ledger is None else ledger,
        agent_pid=env.agent_pid,
    )


def _committed_step() -> int | None:
    """The newest step an open Checkpointer of this process saw committed (rank 0 commits)."""
    steps = [c.last_committed for c in open_checkpointers() if c.last_committed is not None]
    return max(steps, default=None)


def _beat(step: int) -> None:
    heartbeat(step, committed_step=_committed_step())


def _with_hooks(
    fn: Callable[[RestartContext], T], injector: FaultInjector | None
) -> Callable[[RestartContext], T]:
    """``fn`` with the heartbeat and the fault plan on its steps, and the Checkpointers it
    leaves open when it fails aborted once it has ended."""

    def iteration(ctx: RestartContext) -> T:
        ctx.add_step_hook(_beat)
        if injector is not None:
            ctx.add_step_hook(injector.on_step)
        ctx.add_exit_hook(functools.partial(_abort_new, set(open_checkpointers())))
        ctx.add_exit_hook(_restarting)
        with node.provide_waiting(functools.partial(_waiting, ctx)):
            return fn(ctx)

    return iteration


@contextlib.contextmanager
def _waiting(ctx: RestartContext) -> Iterator[None]:
    """A Checkpointer waiting for a commit (``node.waiting``): the launcher gets its initial
    timeout until the next step's heartbeat, and the hang watchdog waits."""
    heartbeat(finishing=True)
    with ctx.no_hang_protection():
        yield


def _restarting(error: BaseException | None) -> None:
    """After a failed iteration: the launcher gives the restart its initial timeout, not the
    steady one sized for steps (the next step's heartbeat ends that)."""
    if error is not None:
        heartbeat(finishing=True)


def _abort_new(before: set[Checkpointer], error: BaseException | None) -> None:
    """After a failed iteration: abort the Checkpointers it opened and left open (their
    writers stop; each keeps its staged snapshot for the next iteration's restore)."""
    if error is None:
        return
    for ckpt in open_checkpointers():
        if ckpt not in before:
            ckpt.abort()
