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
  guards; while the in-process watchdog waits for a rank whose collective crawls over a slow
  network, it tells the launcher so (``client.waiting``), which then waits too;
- the fault plan named by ``UNBROKEN_FAULTS`` (or ``fault_plan``) fires from ``ctx.step_done``
  and on entry into the phases it targets (``unbroken.ledger.phases``: ``init`` as ``fn`` is
  first called in a process, ``recovery`` as it is called again after a fault or in a process
  the launcher restarted, the Checkpointer's and the script's own), so a script's recovery is
  tested with the plans that test unbroken's own, without changing the script; a Checkpointer
  made in ``fn`` gets the plan's storage-fault hooks;
- the environment's overrides (``unbroken.env.Overrides``: ``UNBROKEN_INPROCESS``,
  ``UNBROKEN_SOFT_TIMEOUT_S`` ...) win over ``config``, as the checkpoint ones win over a
  Checkpointer's arguments: a benchmark configures the script from outside;
- a named phase (``ctx.phase``) that has lasted long before tells the launcher, which then
  gives it its initial timeout instead of the step-sized one until the next step;
- Checkpointers that a failed ``fn`` left open are aborted, so that no writer process outlives
  its iteration and the next one restores from memory.
- a Checkpointer's wait for a commit (``close`` after the loop, ``wait``, a sync save) is
  a known region without progress: a "finishing" heartbeat and ``ctx.no_hang_protection``
  around it (``unbroken.checkpoint.node.waiting``), so a long final save is no hang;
- when another node is lost, the node agent may hand this process over to the next round
  (``unbroken.restart.handover``): ``fn`` runs again here, as a worker of that round;
- checkpoint writers fork from a server forked before ``fn`` builds anything
  (``unbroken.checkpoint.persisting.forkserver``), not from the trainer: the writer an in-process restart
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
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from unbroken import restart
from unbroken.checkpoint import node, preempt
from unbroken.checkpoint.checkpointer import Checkpointer, open_checkpointers
from unbroken.checkpoint.persisting import forkserver, hooks, inflight
from unbroken.env import Overrides, WorkerEnv, standby_start
from unbroken.errors import EXIT_CONFIG, ConfigError, Preempted, StopJob
from unbroken.faults import FaultInjector, load_plan
from unbroken.launcher.client import heartbeat, waiting
from unbroken.launcher.client import reset as reset_heartbeat
from unbroken.ledger import NULL, Ledger, phases, process_start_time
from unbroken.ledger import events as ev
from unbroken.ledger.active import activate
from unbroken.ledger.process import open_for_process, record_failure, sigterm_taken_by
from unbroken.restart import Escalated, RankExcluded, RestartConfig, RestartContext
from unbroken.restart.handover import NewRound

logger = logging.getLogger(__name__)

T = TypeVar("T")

LONG_PHASE_S = 0.1
"""A named phase that once lasted this long tells the launcher on entry (see the docstring)."""


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


def run(
    fn: Callable[[RestartContext], T],
    *,
    config: RestartConfig | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    fault_plan: str | os.PathLike[str] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> T:
    """Call ``fn(ctx)`` on every rank until it returns everywhere, restarting it in-process
    after a fault; returns its value. See ``unbroken.restart.run`` for the contract of ``fn``
    (call from the main thread; ``run`` forms the process group) and the module docstring for
    what is attached.

    Args:
        fn: the training function; called again after an in-process restart.
        config: how faults are detected and restarted (default ``RestartConfig()``); the
            environment's overrides win over it.
        run_dir: where the ledger (and, by the script's choice, checkpoints) go; default: the
            launcher's run directory, else see ``run_dir_for``.
        fault_plan: a fault plan (YAML) to fire; default: ``UNBROKEN_FAULTS``, if set.
        meta: more fields of this process's ``process_start`` ledger record (e.g. the
            script's flags, JSON-serialisable); the knowledge base indexes them.

    Returns:
        What ``fn`` returned in its last, successful call.

    Raises:
        Escalated: in-process restart gave up; exit with ``Escalated.exit_code`` (75), the
            launcher restarts the workers.
        RankExcluded: this rank left the job, its peers go on; exit with
            ``RankExcluded.exit_code`` (0: a non-zero exit would stop the peers too).
        ConfigError: a bad fault plan or override; no restart fixes it.
        Exception: anything else ``fn`` raised with in-process restart off
            (``UNBROKEN_INPROCESS=0``), or an unreachable store: let it end the process.
    """
    env = WorkerEnv.from_environ()
    if run_dir is not None:
        env = dataclasses.replace(env, run_dir=Path(run_dir))
    if fault_plan is not None:
        env = dataclasses.replace(env, fault_plan=Path(fault_plan))
    where = run_dir_for(env, sys.argv[0])
    if where is not None:
        env = dataclasses.replace(env, run_dir=where.resolve())
    try:
        overrides = Overrides.from_environ()
        config = _restart_config(config or RestartConfig(), overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    ledger = _open_ledger(env, env.run_dir, meta, overrides) if env.run_dir is not None else None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(activate(NULL if ledger is None else ledger))
            # Before fn builds anything: its writers share no page of it.
            stack.enter_context(forkserver.serving())
            stack.enter_context(_preemptible())
            while True:
                try:
                    value = _run_round(fn, env, config, ledger, overrides)
                    break
                except NewRound as new:  # the agent handed this worker to the next round
                    new.apply(NULL if ledger is None else ledger)
                    reset_heartbeat()  # sent under the new rank and round
                    now = WorkerEnv.from_environ()
                    env = dataclasses.replace(now, run_dir=env.run_dir, fault_plan=env.fault_plan)
    except (Escalated, RankExcluded, ConfigError, Preempted, KeyboardInterrupt, SystemExit):
        if ledger is not None:
            ledger.close()
        raise
    except BaseException as e:
        if ledger is not None:
            record_failure(ledger, e, fault_rank=ledger.rank)
            ledger.close()
        raise
    if ledger is not None:
        if ledger.rank == 0:
            ledger.emit(ev.JOB_END, status="ok")
        ledger.close()
    return value


def main(
    fn: Callable[[RestartContext], Any],
    *,
    config: RestartConfig | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    fault_plan: str | os.PathLike[str] | None = None,
    meta: Mapping[str, Any] | None = None,
    exit_fast: bool = False,
) -> NoReturn:
    """A training script's entry point: ``run(fn, ...)`` (same arguments), then exit the
    process with the code the launcher expects. Sets up logging unless the script already did.

    Args:
        fn: as for ``run``.
        config: as for ``run``.
        run_dir: as for ``run``.
        fault_plan: as for ``run``.
        meta: as for ``run``.
        exit_fast: on an error, or after a graceful preemption's committed save, exit at
            once (``os._exit``) once the ledger, the error file and the traceback are
            written, skipping the interpreter's teardown with torch loaded (module
            finalizers, process-group destructors: a fraction of a second the launcher and
            the peers would wait for, before the next round of a multi-node job). The
            script's atexit handlers and its own unflushed files are lost then: only for
            scripts that keep nothing there.

    Exit codes: 0 when ``fn`` returned; ``Escalated.exit_code`` (75) when in-process restart
    gave up (the launcher takes over); ``RankExcluded.exit_code`` (0) on a rank that left the
    job; ``EXIT_CONFIG`` (78) on a ``ConfigError`` (``unbroken-run`` then ends the job with
    exit code 2); a ``StopJob``'s ``exit_code``: ``EXIT_STORAGE`` (74) when checkpoint storage
    failed for good (``unbroken-run`` then ends the job with exit code 6), ``EXIT_PREEMPTED``
    (143) after a graceful preemption saved the step every rank stopped at; 1 on any other
    error (a traceback; the launcher's error file names it).
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from unbroken.log import init_logging

    init_logging()
    try:
        run(fn, config=config, run_dir=run_dir, fault_plan=fault_plan, meta=meta)
    except (Escalated, RankExcluded) as e:
        logger.error("%s: %s; exit code %d", type(e).__name__, e, e.exit_code)
        sys.exit(e.exit_code)
    except ConfigError as e:  # no restart fixes it: the launcher ends the job (exit 2)
        get_error_handler().record_exception(e)
        logger.error("configuration error: %s; exit code %d", e, EXIT_CONFIG)
        sys.exit(EXIT_CONFIG)
    except Preempted as e:  # asked to stop, and the newest step is saved: not an error
        logger.warning("%s; exit code %d", e, e.exit_code)
        if exit_fast or e.unwound:  # the ledger closed, and nothing else to wait for
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
        sys.exit(e.exit_code)
    except StopJob as e:  # the job ends on purpose (failed storage): the launcher ends it
        get_error_handler().record_exception(e)
        logger.error("%s: %s; exit code %d", type(e).__name__, e, e.exit_code)
        sys.exit(e.exit_code)
    except Exception as e:
        get_error_handler().record_exception(e)  # the launcher reads the root cause from it
        if not exit_fast:
            raise
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(0)


def _run_round(
    fn: Callable[[RestartContext], T],
    env: WorkerEnv,
    config: RestartConfig,
    ledger: Ledger | None,
    overrides: Overrides,
) -> T:
    """``fn`` under in-process restart, as a worker of ``env``'s launcher round."""
    try:
        injector = _injector(env, ledger)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e
    with contextlib.ExitStack() as stack:
        stack.enter_context(node.provide(_node_tiers(env)))
        offer = node.JobOffer(overrides=overrides, relaunched=env.restart_count > 0)
        stack.enter_context(node.provide_job(offer))
        if injector is not None:
            stack.enter_context(phases.listening(injector.on_phase))
            stack.enter_context(hooks.offer(injector.hooks_for))
        return restart.run(
            _with_hooks(fn, injector, relaunched=env.restart_count > 0),
            config=config,
            ledger=ledger,
            env=env,
            on_waiting=waiting,
            stopping=_stop_requested,
        )


def _restart_config(config: RestartConfig, overrides: Overrides) -> RestartConfig:
    """``config`` with the environment's overrides applied; ValueError naming them."""
    fields: dict[str, Any] = {}
    if overrides.inprocess is not None:
        fields["enabled"] = overrides.inprocess
    for name in ("soft_timeout_s", "hard_timeout_s", "pg_timeout_s", "max_rank_faults"):
        value = getattr(overrides, name)
        if value is not None:
            fields[name] = value
    if overrides.phase_timeouts_s:
        fields["phase_timeouts_s"] = {
            **config.phase_timeouts_s,
            **dict(overrides.phase_timeouts_s),
        }
    hard = fields.get("hard_timeout_s", config.hard_timeout_s)
    if hard is not None and hard + 60.0 > config.barrier_timeout_s:  # peers wait out a kill
        fields["barrier_timeout_s"] = hard + 60.0
    if not fields:
        return config
    try:
        return dataclasses.replace(config, **fields)
    except ValueError as e:
        raise ValueError(
            f"the environment's overrides {sorted(overrides.given())} do not fit the script's "
            f"RestartConfig: {e}"
        ) from None


def _open_ledger(
    env: WorkerEnv, run_dir: Path, meta: Mapping[str, Any] | None, overrides: Overrides
) -> Ledger:
    """The process's ledger (``open_for_process``): its start-up (process start -> now), what
    it was given (argv, the overrides, ``meta``) and, after a launcher restart, its end."""
    import torch

    given = overrides.given()
    return open_for_process(
        run_dir,
        run=env.run_id if env.run_id and env.run_id != "none" else run_dir.name,
        rank=env.rank,
        attempt=env.restart_count,
        started=standby_start() or process_start_time(),
        local_rank=env.local_rank,
        world_size=env.world_size,
        argv=list(sys.argv),
        torch=torch.__version__,
        adopted=True,
        **({"overrides": given} if given else {}),
        **dict(meta or {}),
    )


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


_committed: tuple[int, int | None] = (-1, None)  # (inflight.generation() then, the step)


def _committed_step() -> int | None:
    """The newest step an open Checkpointer of this process saw committed (rank 0 commits),
    computed again only when it may have changed (it is asked every step)."""
    global _committed
    seen = inflight.generation()
    if seen != _committed[0]:
        steps = [c.last_committed for c in open_checkpointers() if c.last_committed is not None]
        _committed = (seen, max(steps, default=None))
    return _committed[1]


def _beat(step: int) -> None:
    heartbeat(step, committed_step=_committed_step())


def _saving() -> bool:
    """Whether an open Checkpointer saves on its own (``maybe_save``: it can stop gracefully)."""
    return any(c.config.every_steps > 0 or c.config.adaptive for c in open_checkpointers())


def _take_sigterm() -> bool:
    """A SIGTERM asks for a graceful preemption while a Checkpointer that saves is open."""
    if not _saving():
        return False
    if preempt.requested() is None:
        preempt.request()
        logger.warning("SIGTERM: stopping (while training: at a step every rank saves first)")
    return True


def _stop_requested() -> bool:
    return preempt.requested() is not None


@contextlib.contextmanager
def _preemptible() -> Iterator[None]:
    """SIGTERM asks for a graceful preemption (``unbroken.checkpoint.preempt``: the next
    ``maybe_save`` agrees on a step with the other ranks, saves it and raises ``Preempted``)
    while a Checkpointer that saves is open; otherwise it ends the process as before (the
    ledger's SIGTERM flush: ``unbroken.ledger.process.install_sigterm_flush``)."""
    previous = None
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # no ledger

        def on_term(signum: int, frame: Any) -> None:
            if not _take_sigterm():
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with sigterm_taken_by(_take_sigterm):
            yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        preempt.clear()


def _with_hooks(
    fn: Callable[[RestartContext], T], injector: FaultInjector | None, *, relaunched: bool
) -> Callable[[RestartContext], T]:
    """``fn`` with the heartbeat and the fault plan on its steps, the launcher told of long
    phases, the ``init``/``recovery`` phases announced, and the Checkpointers it leaves open
    when it fails aborted once it has ended."""
    beat = _PhaseBeat()

    def iteration(ctx: RestartContext) -> T:
        ctx.add_step_hook(_beat)
        if injector is not None:
            ctx.add_step_hook(injector.on_step)
        ctx.add_phase_hook(beat)
        ctx.add_exit_hook(functools.partial(_abort_new, set(open_checkpointers())))
        ctx.add_exit_hook(_restarting)
        with node.provide_waiting(functools.partial(_waiting, ctx)):
            if ctx.iteration == 0:
                phases.entered("init")
            if ctx.iteration > 0 or relaunched:
                phases.entered("recovery")
            return fn(ctx)

    return iteration


class _PhaseBeat:
    """A phase hook: on entry into a named phase that has lasted ``LONG_PHASE_S`` or more
    before (or is new), a "finishing" heartbeat: the launcher's initial timeout covers it
    instead of the step-sized one, until the next step's heartbeat. Short phases (a batch
    fetch) cost no datagram."""

    def __init__(self) -> None:
        self.longest: dict[str, float] = {}

    def __call__(self, name: str, dur_s: float | None) -> None:
        if dur_s is not None:
            if dur_s > self.longest.get(name, -1.0):
                self.longest[name] = dur_s
        elif self.longest.get(name, LONG_PHASE_S) >= LONG_PHASE_S:
            heartbeat(finishing=True)


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
