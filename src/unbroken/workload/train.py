"""The reference training script: a Llama-style model on a synthetic language.

Runs as a single process (``python -m unbroken.workload.train``) and under torchrun or
``unbroken-run``. Its flags are a contract that tests, benchmarks and the demo rely on. At the
end it prints ``final_state_sha256=<hex>`` (a hash over the gathered model and optimizer state,
identical on every rank) and rank 0 writes it, with the loss curve, to ``<run_dir>/final.json``.

Ledger phases: import (process start → main), pg_init, model_build, data, steps, shutdown.

Checkpoints (``--ckpt-every N``): on start the newest sound checkpoint under ``--ckpt-dir`` is
restored (model, optimizer, sampler position, per-rank RNG state, loss curve) and training
continues with the step after it; after every N completed steps a save is staged (async: the
trainer is blocked only for the copy, overlapped with the next forward/backward); the
checkpointer is closed (last save durable) before the final hash. ``--snapshot-every N``
also stages a snapshot held in memory only after every N steps (1: every step), so a restart
resumes from the last step done: an in-process one loses none, a launcher restart at most one
(under ``unbroken-run`` the agent holds the snapshots). A step's save comes before its fault
hook, so a fault injected after step k finds step k staged.

One job per directory: see ``unbroken.workload.rundir`` (without ``--run-dir`` the run
directory is ``runs/<the job's identity>``; a directory another job used needs ``--resume``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import socket
import sys
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from unbroken import heartbeat, restart
from unbroken.checkpoint import Checkpointer, PerRank, WriterHooks, forkserver
from unbroken.checkpoint.interval import AdaptiveInterval
from unbroken.env import WorkerEnv, standby_start
from unbroken.errors import EXIT_CONFIG, ConfigError
from unbroken.faults import FaultInjector, FaultPlan, load_plan
from unbroken.ledger import Ledger, install_sigterm_flush, process_start_time
from unbroken.ledger import events as ev
from unbroken.ledger.durable import write_atomic
from unbroken.ledger.owner import DirectoryOwned
from unbroken.log import init_logging
from unbroken.workload import data as wdata
from unbroken.workload import model as wmodel
from unbroken.workload import saving
from unbroken.workload.dist import default_backend, init_process_group
from unbroken.workload.flags import WRITER_PRIORITIES, build_parser, check_args
from unbroken.workload.parallel import wrap_model
from unbroken.workload.rng import capture_rng_state, restore_rng_state
from unbroken.workload.rundir import claim_dirs, default_run_dir, job_identity
from unbroken.workload.statehash import state_sha256

logger = logging.getLogger("unbroken.workload.train")


def _device(choice: str, env: WorkerEnv) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def final_state_hash(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """Hash of the full (gathered) model and optimizer state; collective on every rank."""
    opts = StateDictOptions(full_state_dict=True)
    state = {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, optim, options=opts),
    }
    return state_sha256(state)


class _RngState:
    """This process's RNG streams as a Stateful (saved per rank)."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state)


class _Progress:
    """The loss curve so far, so that a resumed run reports the whole curve."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = [float(x) for x in state["losses"]]


def _checkpointer(
    args: argparse.Namespace, run_dir: Path, ledger: Ledger, hooks: WriterHooks | None
) -> Checkpointer | None:
    if args.ckpt_every == 0 and args.snapshot_every == 0:
        return None
    env = WorkerEnv.from_environ()
    nice, idle = WRITER_PRIORITIES[args.writer_priority]
    return Checkpointer(
        Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "ckpt",
        ledger=ledger,
        hooks=hooks,
        run=args.job,
        allow_foreign=args.resume,
        every_steps=args.ckpt_every,
        keep=args.ckpt_keep,
        mode=args.ckpt_mode,
        on_busy=args.ckpt_on_busy,
        overlap=True,
        snapshot_every=args.snapshot_every,
        memory_tier=not args.no_memory_tier,
        rescue=not args.no_rescue,
        memory_keeper=env.memory_keeper or "",
        peers=() if args.no_peer_replica else env.peers,
        peer_index=env.group_rank if env.peers else -1,
        writer_nice=nice,
        writer_idle=idle,
    )


def run_id_for(env: WorkerEnv, run_dir: Path) -> str:
    return env.run_id if env.run_id and env.run_id != "none" else run_dir.name


class _NoRestartContext:
    """The part of RestartContext that ``train_once`` uses, for --no-inprocess."""

    def __init__(self, env: WorkerEnv, ledger: Ledger) -> None:
        self.rank, self.world_size, self._ledger = env.rank, env.world_size, ledger
        self._hooks: list[Any] = []

    def add_step_hook(self, hook: Any) -> None:
        self._hooks.append(hook)

    def step_done(self, step: int, **data: Any) -> None:
        self._ledger.step(step, **data)
        for hook in self._hooks:
            hook(step)

    def no_hang_protection(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def train(args: argparse.Namespace, env: WorkerEnv, ledger: Ledger, run_dir: Path) -> str:
    """The training job; returns the final state hash."""
    try:  # bad flags, a bad plan: no restart fixes them (exit EXIT_CONFIG, see main)
        global_batch = check_args(args, env.world_size)
        plan = load_plan(args.faults, world_size=env.world_size) if args.faults else FaultPlan()
        plan.check_world(env.world_size)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e
    injector = FaultInjector(
        plan,
        run_dir=run_dir,
        rank=env.rank,
        sink=ledger,
        ckpt_dir=Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "ckpt",
        agent_pid=env.agent_pid,
    )
    device = _device(args.device, env)
    policy = saving.policy_for(
        args,
        ckpt_dir=Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "ckpt",
        ledger=ledger,
        relaunched=env.restart_count > 0,
    )

    def once(ctx: Any) -> str:
        if policy is not None and getattr(ctx, "cause", None) is not None:
            policy.restarted()
        ctx.add_step_hook(injector.on_step)
        if not args.no_inprocess:  # fn ended (a restart): the launcher's step-sized timeout
            ctx.add_exit_hook(lambda error: heartbeat(finishing=True) if error else None)
        return train_once(
            ctx,
            args,
            ledger,
            run_dir,
            device=device,
            global_batch=global_batch,
            hooks=injector.writer_hooks(),
            policy=policy,
        )

    if not args.no_inprocess:
        config = restart.RestartConfig(
            pg_backend=default_backend(device),
            pg_timeout_s=args.pg_timeout_s,
            soft_timeout_s=args.soft_timeout_s,
            hard_timeout_s=args.hard_timeout_s,
            barrier_timeout_s=max(120.0, (args.hard_timeout_s or 0.0) + 60.0),
            max_rank_faults=args.max_rank_faults,
        )
        return restart.run(once, config=config, ledger=ledger, env=env)
    with ledger.phase("pg_init"):
        init_process_group(
            env,
            run=ledger.run,
            backend=default_backend(device),
            timeout=timedelta(seconds=args.pg_timeout_s),
        )
    try:
        return once(_NoRestartContext(env, ledger))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train_once(
    ctx: Any,
    args: argparse.Namespace,
    ledger: Ledger,
    run_dir: Path,
    *,
    device: torch.device,
    global_batch: int,
    hooks: WriterHooks | None = None,
    policy: AdaptiveInterval | None = None,
) -> str:
    """The training loop in the process group that exists, from the newest checkpoint (or step
    0); returns the final state hash. ``ctx`` is a RestartContext: ``run`` calls this again
    after an in-process restart, possibly with fewer ranks. ``hooks`` go to the checkpoint
    writer (the fault plan's, see ``FaultInjector.writer_hooks``); ``policy``: the adaptive
    save interval (``saving``)."""
    rank, world_size = ctx.rank, ctx.world_size
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} does not divide the world size {world_size}")
    ckpt: Checkpointer | None = None
    try:
        # Before the model: a restarted process's adopted snapshots warm up meanwhile (tiers).
        ckpt = _checkpointer(args, run_dir, ledger, hooks)
        with ledger.phase("model_build"):
            cfg = wmodel.get_config(args.model)
            model: torch.nn.Module = wmodel.build_model(cfg, seed=args.seed).to(device)
            model = wrap_model(model, parallel=args.parallel, device=device)
            optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        with ledger.phase("data"):
            language = wdata.MarkovLanguage(cfg.vocab_size, seed=args.seed)
            dataset = wdata.SyntheticDataset(
                language, seq_len=args.seq_len, num_samples=args.num_samples
            )
            sampler = wdata.ResumableSampler(
                args.num_samples,
                global_batch=global_batch,
                rank=rank,
                world_size=world_size,
                seed=args.seed,
            )
        progress = _Progress()
        state = {
            "model": model,
            "optim": optim,
            "data": sampler,
            "rng": PerRank(_RngState()),
            "progress": progress,
        }
        # The launcher's heartbeat carries the newest committed step: its no-progress guard
        # counts restarts without a new commit.
        ctx.add_step_hook(
            lambda s: heartbeat(s, committed_step=None if ckpt is None else ckpt.last_committed)
        )
        start = 0
        if ckpt is not None:
            restored = ckpt.restore(state)
            start = 0 if restored is None else restored + 1
            ledger.mark()
        saver = None
        if ckpt is not None:
            saver = saving.Saver(ckpt, policy, start=start, rank=rank, device=device)
        for step in range(start, args.steps):
            inputs, targets = dataset.get_batch(sampler.next_indices())
            inputs, targets = inputs.to(device), targets.to(device)
            loss = wmodel.loss_fn(model(inputs), targets)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            loss_value = float(global_loss) / world_size
            progress.losses.append(loss_value)
            if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                logger.info("step %d loss %.4f", step, loss_value)
            if saver is not None:  # before a fault can fire: a snapshot of every step done
                saver.step_done(step, state, ctx)
            ctx.step_done(step, loss=loss_value)  # ledger step, heartbeat, fault injector
        with ledger.phase("shutdown"):
            # The last save's commit and the exit are no step: the launcher's finishing timeout.
            heartbeat(
                args.steps - 1,
                committed_step=None if ckpt is None else ckpt.last_committed,
                finishing=True,
            )
            if ckpt is not None:
                with ctx.no_hang_protection():
                    ckpt.close()  # the last save is durable
            digest = final_state_hash(model, optim)
            hashes: list[Any] = [None] * world_size
            dist.all_gather_object(hashes, digest)
            if len(set(hashes)) != 1:
                raise RuntimeError(f"ranks disagree on the final state: {hashes}")
            if rank == 0:
                out = {
                    "final_state_sha256": digest,
                    "steps": args.steps,
                    "world_size": world_size,
                    "global_batch": global_batch,
                    "model": args.model,
                    "parallel": args.parallel,
                    "seed": args.seed,
                    "losses": progress.losses,
                }
                write_atomic(run_dir / "final.json", json.dumps(out, indent=1))
        return digest
    finally:
        if ckpt is not None:
            ckpt.abort()  # after an error: stop the writer; a no-op once closed


@record
def main(argv: Sequence[str] | None = None) -> int:
    started = standby_start() or process_start_time()
    env = WorkerEnv.from_environ()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # under a launcher, a usage error must not be restarted
        if e.code == 2 and env.launched:
            raise SystemExit(EXIT_CONFIG) from None
        raise
    init_logging()
    run_dir = Path(args.run_dir or env.run_dir or default_run_dir(env)).resolve()
    args.job = job_identity(env)
    try:
        claim_dirs(args, run_dir)  # held until the process exits
    except DirectoryOwned as e:  # a usage error: under a launcher, not to be restarted
        logger.error("%s", e)
        return EXIT_CONFIG if env.launched else 2
    ledger = Ledger(run_dir, run=run_id_for(env, run_dir), rank=env.rank, attempt=env.restart_count)
    install_sigterm_flush(ledger)
    ledger.emit(
        ev.PROCESS_START,
        ts=started,
        pid=os.getpid(),
        local_rank=env.local_rank,
        world_size=env.world_size,
        host=socket.gethostname(),
        args=vars(args),
        python=platform.python_version(),
        torch=torch.__version__,
    )
    ledger.interval(ev.PHASE, begin=started, name="import")
    ledger.mark()
    if env.restart_count > 0:
        ledger.emit(ev.RESTART_END, layer="launcher")
    try:
        with forkserver.serving():  # before any model: writers share no page with it
            digest = train(args, env, ledger, run_dir)
    except (restart.Escalated, restart.RankExcluded) as e:
        # In-process restart gave up (the launcher takes over) or dropped this rank.
        logger.error("%s", e)
        ledger.close()
        return e.exit_code
    except (KeyboardInterrupt, SystemExit):
        ledger.close()
        raise
    except ConfigError as e:  # not a fault: the launcher ends the job (exit 2)
        get_error_handler().record_exception(e)
        logger.error("configuration error: %s", e)
        ledger.close()
        return EXIT_CONFIG
    except BaseException as e:
        ledger.emit(
            ev.FAULT_DETECTED,
            cause=type(e).__name__,
            detector="exception",
            fault_rank=env.rank,
            message=str(e)[:500],
        )
        ledger.close()
        # Fail fast: the record is durable; the interpreter's teardown with torch loaded (module
        # finalizers, process-group destructors) takes ~0.25 s here, and the launcher's restart
        # and the peers' detection wait for the exit. The error file that @record would write
        # (the launcher reads the cause from it) is written here first.
        get_error_handler().record_exception(e)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if env.rank == 0:
        ledger.emit(ev.JOB_END, status="ok", final_state_sha256=digest)
    ledger.close()
    # One write per line: ranks share the launcher's stdout, and print() writes the newline apart.
    sys.stdout.write(f"final_state_sha256={digest}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
