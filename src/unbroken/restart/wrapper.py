"""``run(fn)``: call ``fn`` until it returns on every rank, restarting it in-process on faults.

One iteration, on every rank (main thread):

1. form the default process group on a fresh store prefix (``i<k>/pg/``; gloo and NCCL pick
   fresh ports themselves), emit ``restart_end`` if this is a restart, call ``fn(ctx)``;
2. a fault anywhere ends ``fn`` everywhere: the rank that raised (or whose watchdog fired)
   publishes a report that wakes every other rank's monitor, and closes its group's
   connections, which fails every collective on them at once; every rank's monitor closes its
   own connections too and interrupts ``fn`` until it returns (monitor.py);
3. barrier A, then (after a fault) health checks, barrier B and the decision (barrier.py):
   if all returned, tear the group down and return ``fn``'s value; else renumber the healthy
   ranks and go to 1, or escalate;
4. a rank left out raises ``RankExcluded``; on escalation every rank raises ``Escalated``.

When another node is lost, its agent may pause this worker (``handover``): ``fn`` is interrupted
as for a peer's fault, and ``run`` raises ``NewRound`` once the next round has formed.

With ``RestartConfig(enabled=False)`` none of this happens: ``fn`` runs once (``solo``).

A configuration error is not a fault: no restart fixes it. ``fn`` raising ``ConfigError``, or
any ``ValueError`` before it completed its first step in the first iteration of the first
launcher attempt (bad input found while setting up), ends ``run`` on that rank at once as a
``ConfigError`` (``unbroken.main`` exits with ``EXIT_CONFIG``; ``unbroken-run`` then ends the
job with exit code 2); its peers are told, as for ``KeyboardInterrupt``. So does a ``StopJob``
(storage that failed for good under ``on_storage_failure="stop"``, a graceful preemption), also
when a peer's interrupt replaced it on its way out: it is re-raised as it is. A ``Preempted``
is no fault: no ``fault_detected`` or ``restart_begin`` is recorded for it, and a peer told of
it is not interrupted (it is on its way to its own, at the same step).

Before returning (or raising), every rank writes ``bye/<member>``; the rank that started the
store server waits for every member's bye, then stops it. No thread or process of ours
outlives ``run``.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from unbroken.env import WorkerEnv
from unbroken.errors import ConfigError, Preempted, stop_job_of
from unbroken.ledger import NULL, Recorder
from unbroken.ledger import events as ev
from unbroken.restart import assign, pg, solo
from unbroken.restart.barrier import Between, Interrupted
from unbroken.restart.calibrate import Calibrator, state_path
from unbroken.restart.config import (
    Escalated,
    RankExcluded,
    RestartConfig,
    RestartError,
    RestartInterrupt,
)
from unbroken.restart.context import RestartCause, RestartContext
from unbroken.restart.handover import Handover
from unbroken.restart.health import default_checks
from unbroken.restart.interrupt import Interrupter
from unbroken.restart.monitor import Armed, Monitor
from unbroken.restart.store import Keys, locate, register

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _log_error(rank: int, error: BaseException) -> None:
    # Formatted here: a LogRecord holding exc_info would keep fn's frames (its model) alive
    # in any handler that keeps records.
    text = "".join(traceback.format_exception(error)).rstrip()
    logger.error("rank %d: fn raised:\n%s", rank, text)


def run(
    fn: Callable[[RestartContext], T],
    *,
    config: RestartConfig | None = None,
    ledger: Recorder | None = None,
    env: WorkerEnv | None = None,
    on_waiting: Callable[[str], None] | None = None,
    stopping: Callable[[], bool] | None = None,
) -> T:
    """Call ``fn(ctx)`` on every rank until it returns everywhere.

    Call from the main thread, without a default process group (``run`` forms it).
    ``KeyboardInterrupt`` and ``SystemExit`` from ``fn`` end ``run`` on that rank (its peers
    restart without it).

    Args:
        fn: The training function, called again after each in-process restart.
        config: How restarts happen (None: the defaults).
        ledger: Records the restarts (None: a ``Ledger`` of its own in the launcher's run
            directory, ``UNBROKEN_RUN_DIR``, else nothing).
        env: What the launcher handed this worker (None: read from the environment).
        on_waiting: Called with the watchdog's reason while it waits for this rank because
            its network is slow, not hung (``unbroken.run`` passes
            ``unbroken.launcher.client.waiting``, so the node agent waits too).
        stopping: Asked after a failed iteration, before the restart: True ends ``run`` on
            this rank with ``Preempted`` (``unbroken.run`` passes whether a SIGTERM asked it to
            stop: the launcher stopping the workers to restart them, after the failed
            iteration's rescue; a restart would only wait for peers that are going too).

    Returns:
        What ``fn`` returned.

    Raises:
        Escalated: When the job cannot go on in-process (exit with ``EXIT_ESCALATE``).
        Preempted: When ``stopping`` said so after a fault.
        RankExcluded: On a rank that left the job (exit with ``EXIT_EXCLUDED``).
        ValueError: When a default process group already exists.
    """
    config = config or RestartConfig()
    env = env or WorkerEnv.from_environ()
    if dist.is_initialized():
        raise ValueError(
            "unbroken.restart.run forms the default process group itself; do not call "
            "init_process_group before it"
        )
    owned = None
    recorder: Recorder = NULL if ledger is None else ledger
    if ledger is None and env.run_dir is not None:
        from unbroken.ledger import Ledger

        run_id = env.run_id if env.run_id and env.run_id != "none" else env.run_dir.name
        owned = recorder = Ledger(env.run_dir, run=run_id, rank=env.rank, attempt=env.restart_count)
    if not config.enabled:  # fn once; a fault ends the process (the launcher's)
        try:
            return solo.run_once(fn, config=config, ledger=recorder, env=env)
        finally:
            if owned is not None:
                owned.close()
    frozen = config.gc_freeze and gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    try:
        runner = _Runner(
            fn,
            config=config,
            ledger=recorder,
            env=env,
            gc_frozen=frozen,
            on_waiting=on_waiting,
            stopping=stopping,
        )
        try:
            return runner.loop()
        finally:
            runner.close()
    finally:
        if frozen:
            gc.unfreeze()
        if owned is not None:
            owned.close()


class _Runner:
    def __init__(
        self,
        fn: Callable[[RestartContext], Any],
        *,
        config: RestartConfig,
        ledger: Recorder,
        env: WorkerEnv,
        gc_frozen: bool,
        on_waiting: Callable[[str], None] | None = None,
        stopping: Callable[[], bool] | None = None,
    ) -> None:
        self.fn = fn
        self.stopping = stopping
        self.config = config
        self.ledger = ledger
        self.env = env
        self.member = env.rank
        self.members: tuple[int, ...] = tuple(range(env.world_size))
        run_id = env.run_id if env.run_id and env.run_id != "none" else ledger.run
        self.keys = Keys.for_run(run=run_id or "local", attempt=env.restart_count)
        self.backend = config.pg_backend or pg.default_backend()
        self.checks = default_checks() if config.health_checks is None else config.health_checks
        self.history = assign.History()
        self.reaper = pg.Reaper()
        self.gc_frozen = gc_frozen
        self.interrupter = Interrupter()
        self.monitor: Monitor | None = None
        self.handover: Handover | None = None
        self.host, must_register = locate(
            env, keys=self.keys, override=config.store_addr, timeout_s=config.store_timeout_s
        )
        try:
            self.client = self.host.client(timeout_s=config.store_timeout_s)
            if must_register:
                register(self.client)
            self.between = Between(
                client=self.client,
                keys=self.keys,
                config=config,
                checks=self.checks,
                member=self.member,
                local_rank=env.local_rank,
                interrupted=self._paused,
            )
            calibrator = Calibrator(
                config,
                ledger=ledger,
                path=None if env.run_dir is None else state_path(env.run_dir, self.member),
            )
            self.monitor = Monitor(
                config=config,
                ledger=self.ledger,
                interrupter=self.interrupter,
                store=self.host,
                calibrator=calibrator,
                on_waiting=on_waiting,
            )
            if env.handover:
                self.handover = Handover(
                    functools.partial(self.host.client, timeout_s=config.store_timeout_s),
                    env.handover,
                    on_pause=self.monitor.hand_over,
                )
        except BaseException:
            if self.monitor is not None:
                self.monitor.close()
            self.host.close()
            raise

    # --- the loop ----------------------------------------------------------------------------
    def loop(self) -> Any:
        cause: RestartCause | None = None
        iteration = 0
        restart_t0: float | None = None
        while True:
            rank = self.members.index(self.member)
            self.ledger.set_context(rank=rank, iteration=iteration)
            record, value, begun = self._iterate(iteration, rank, cause, restart_t0)
            if self._paused():
                raise self._hand_over()
            if record.kind != assign.OK and self.stopping is not None and self.stopping():
                pg.teardown(self.reaper, abort=True)
                # The launcher stops this worker to restart it: not a restart that failed.
                self.ledger.emit(ev.RESTART_END, layer="inprocess", status="stopped")
                stop = Preempted(f"asked to stop while recovering from {record.kind}")
                stop.unwound = True
                raise stop
            t_agree = time.time()
            try:
                decision = self._agree(iteration, record)
            except Interrupted:
                raise self._hand_over() from None
            if decision.status == assign.STATUS_OK:
                pg.teardown(self.reaper, abort=False)
                return value
            pg.teardown(self.reaper, abort=True)
            if not begun:
                self._restart_begin(cause_kind=decision.culprit.kind if decision.culprit else "")
            restart_t0 = begun or t_agree
            culprit = decision.culprit
            assert culprit is not None
            if decision.status == assign.STATUS_ESCALATE:
                self.ledger.emit(ev.ESCALATE, reason=decision.reason, layer="inprocess")
                self.ledger.flush(1.0)
                raise Escalated(decision.reason)
            if self.member not in decision.members:
                why = decision.excluded.get(str(self.member), "left out")
                self.ledger.emit(
                    ev.RESTART_END,
                    layer="inprocess",
                    status="excluded",
                    reason=why,
                    **self.between.health_summary,
                )
                raise RankExcluded(f"rank {self.member} left the job: {why}")
            self.history = decision.history
            self.members = decision.members
            cause = RestartCause(
                iteration=iteration,
                kind=culprit.kind,
                rank=culprit.rank,
                member=culprit.member,
                message=culprit.message,
                excluded=tuple(int(m) for m in decision.excluded),
            )
            logger.warning(
                "in-process restart %d: %s on rank %d (%s); world %d -> %d",
                iteration + 1,
                culprit.kind,
                culprit.rank,
                culprit.message[:200],
                len(self.members) + len(decision.excluded),
                len(self.members),
            )
            iteration += 1

    def _iterate(
        self, iteration: int, rank: int, cause: RestartCause | None, restart_t0: float | None
    ) -> tuple[assign.ExitRecord, Any, float | None]:
        """Form the group, run fn once; returns its exit record, value, and the time the
        restart began on this rank (None if fn returned and no fault was seen here)."""
        assert self.monitor is not None
        world = len(self.members)
        # Before forming the group: forming it is a barrier, so every rank's restart_end then
        # precedes every rank's first step (the report's resume threshold).
        if restart_t0 is not None and cause is not None:
            self.ledger.emit(
                ev.RESTART_END,
                layer="inprocess",
                cause=cause.kind,
                fault_rank=cause.rank,
                world_size=world,
                members=list(self.members),
                excluded=list(cause.excluded),
                restart_s=time.time() - restart_t0,
                **self.between.health_summary,
            )
        # The last iteration's model is freed (and survivors frozen) before anything of the
        # next one exists: on a GPU both models would otherwise have to fit.
        if not self.reaper.wait():
            logger.warning("the previous iteration's objects are still being freed")
        transport = pg.Transport(keep_ports=[self.host.port])
        try:
            with self.ledger.phase("pg_init"):
                pg.form(
                    self.client,
                    prefix=self.keys.pg_prefix(iteration),
                    rank=rank,
                    world_size=world,
                    backend=self.backend,
                    timeout_s=self.config.pg_timeout_s,
                    local_rank=self.env.local_rank,
                )
        except Exception as e:  # noqa: BLE001 - a group that cannot form is a fault like others
            logger.exception("rank %d: forming the process group failed", rank)
            transport.close()
            pg.teardown(self.reaper, abort=True)
            record = assign.ExitRecord(
                member=self.member,
                rank=rank,
                kind=assign.PG_INIT,
                detector="pg_init",
                message=f"{type(e).__name__}: {e}"[:500],
            )
            return record, None, self._restart_begin(cause_kind=assign.PG_INIT)
        self.ledger.mark()
        ctx = RestartContext(
            iteration=iteration,
            cause=cause,
            rank=rank,
            world_size=world,
            local_rank=self.env.local_rank,
            member=self.member,
            run_dir=self.env.run_dir,
            ledger=self.ledger,
            monitor=self.monitor,
        )
        self.monitor.arm(
            Armed(
                iteration=iteration,
                keys=self.keys,
                member=self.member,
                rank=rank,
                members=self.members,
                transport=transport,
            )
        )
        interrupts_before = self.interrupter.delivered
        outcome = self.interrupter.invoke(self.fn, ctx)
        detection, seq = self.monitor.fn_exited(outcome.error)
        ctx._exited(outcome.error)
        config_error = self._config_error(outcome.error, iteration, ctx.last_step)
        stop = stop_job_of(outcome.error)
        fatal = (
            config_error is not None
            or stop is not None
            or isinstance(outcome.error, (KeyboardInterrupt, SystemExit))
        )
        if detection is None:
            record = assign.ExitRecord(
                member=self.member, rank=rank, kind=assign.OK, last_step=ctx.last_step
            )
            return record, outcome.value, None
        began = None  # a graceful stop (Preempted) or a handover begins no restart here
        if detection.kind not in (assign.STOP, assign.HANDOVER):
            began = self._restart_begin(
                cause_kind=detection.kind,
                detector=detection.detector,
                sockets_closed=transport.closed,
                interrupts=self.interrupter.delivered - interrupts_before,
            )
        pg.teardown(self.reaper, abort=True)
        error = outcome.error
        quiet = (RestartInterrupt, Preempted)  # no fault: no traceback to show
        if detection.origin and error is not None and not isinstance(error, quiet):
            # Logged on the reaper: formatting a traceback takes milliseconds.
            self.reaper.call(functools.partial(_log_error, rank, error))
        record = assign.ExitRecord(
            member=self.member,
            rank=rank,
            kind=detection.kind,
            detector=detection.detector,
            seq=seq,
            message=detection.message,
            restore_point=ctx.first_step,
            last_step=ctx.last_step,
        )
        if fatal:  # leave at once; tell the peers so that they need not wait for us
            assert error is not None
            try:
                self.client.set(self.keys.exit(iteration, self.member), record.to_json())
                self.client.set(self.keys.health(iteration, self.member), '{"ok": false}')
            except (RuntimeError, dist.DistStoreError):
                pass
            raise config_error or stop or error
        # fn's frames (its model, its process group) die on the reaper, off this path.
        self.reaper.drop((outcome, ctx))
        self.reaper.call(self._collect)
        del outcome, ctx, error
        return record, None, began

    def _config_error(
        self, error: BaseException | None, iteration: int, last_step: int | None
    ) -> ConfigError | None:
        """``error`` as a configuration error (see the module docstring), else None."""
        if isinstance(error, ConfigError):
            return error
        setting_up = iteration == 0 and self.env.restart_count == 0 and last_step is None
        if setting_up and isinstance(error, ValueError):
            config_error = ConfigError(
                f"{type(error).__name__} before the first step: {error} (a configuration "
                "error: not restarted; fix the input and start the job again)"
            )
            config_error.__cause__ = error
            return config_error
        return None

    def _collect(self) -> None:
        """On the reaper, while the main thread waits for it: free the failed iteration, then
        freeze what survives (modules fn imported lazily, ...), so that the next collection
        only walks what the next iteration builds (FSDP's first use imports many objects)."""
        gc.collect()
        if self.gc_frozen:
            gc.freeze()

    def _restart_begin(self, *, cause_kind: str, detector: str = "", **data: Any) -> float:
        """Ledger: fn has stopped on this rank (data: how it was aborted)."""
        self.ledger.emit(
            ev.RESTART_BEGIN, layer="inprocess", cause=cause_kind, detector=detector, **data
        )
        return time.time()

    # --- handed over to the next round (restart.handover) -------------------------------------
    def _paused(self) -> bool:
        return self.handover is not None and self.handover.paused is not None

    def _hand_over(self) -> BaseException:
        """What to raise once the next round has formed (``NewRound``, or ``Preempted``)."""
        assert self.handover is not None
        pg.teardown(self.reaper, abort=True)
        stopping = self.stopping or (lambda: False)
        return self.handover.leave(self.ledger, round_=self.env.restart_count, stopping=stopping)

    # --- between iterations ------------------------------------------------------------------
    def _agree(self, iteration: int, record: assign.ExitRecord) -> assign.Decision:
        try:
            return self.between.agree(
                iteration=iteration, members=self.members, record=record, history=self.history
            )
        except RestartError:
            raise
        except (RuntimeError, dist.DistStoreError) as e:
            self.ledger.emit(ev.ESCALATE, reason=f"coordination store failed: {e}")
            raise Escalated(f"the coordination store failed between iterations: {e}") from e
        except (ValueError, KeyError, TypeError) as e:  # a value no rank of ours wrote
            self.ledger.emit(ev.ESCALATE, reason=f"malformed coordination store value: {e}")
            raise Escalated(f"a malformed value in the coordination store: {e!r}") from e

    # --- the end -----------------------------------------------------------------------------
    def close(self) -> None:
        if self.handover is not None:
            self.handover.close()
        if self.monitor is not None:
            self.monitor.close()
        if dist.is_initialized():
            pg.teardown(self.reaper, abort=True)
        self.reaper.call(gc.collect)  # the last iteration's groups (gloo threads, sockets)
        self.reaper.close()
        try:
            self.between.leave(members=self.members, wait_for_others=self.host.server is not None)
        except (RuntimeError, dist.DistStoreError) as e:
            logger.warning("could not check out of the coordination store: %s", e)
        finally:
            del self.client
            self.host.close()
