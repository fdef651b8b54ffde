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
checkpointer is closed (last save durable) before the final hash.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import socket
import sys
import time
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
from unbroken.checkpoint import Checkpointer, PerRank, WriterHooks
from unbroken.env import WorkerEnv
from unbroken.errors import EXIT_CONFIG, ConfigError
from unbroken.faults import FaultInjector, FaultPlan, load_plan
from unbroken.ledger import Ledger, install_sigterm_flush, process_start_time
from unbroken.ledger import events as ev
from unbroken.log import init_logging
from unbroken.workload import data as wdata
from unbroken.workload import model as wmodel
from unbroken.workload.dist import default_backend, init_process_group
from unbroken.workload.parallel import wrap_model
from unbroken.workload.rng import capture_rng_state, restore_rng_state
from unbroken.workload.statehash import state_sha256

logger = logging.getLogger("unbroken.workload.train")


def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        with contextlib.suppress(ValueError):
            if (value := int(text)) >= low:
                return value
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")

    return parse


def _positive(text: str) -> float:
    """A finite number > 0 (nan and inf are refused)."""
    try:
        if math.isfinite(value := float(text)) and value > 0:
            return value
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m unbroken.workload.train",
        description="unbroken's reference training job (Llama-style model, synthetic language).",
    )
    p.add_argument("--model", default="tiny", help="model size: %(default)s; see SIZES")
    p.add_argument("--steps", type=_int_at_least(0), default=50, help="number of training steps")
    p.add_argument(
        "--batch-size", type=_int_at_least(1), default=8, help="samples per rank per step"
    )
    p.add_argument(
        "--global-batch",
        type=_int_at_least(1),
        default=None,
        help="samples per step across all ranks (overrides --batch-size; must divide evenly)",
    )
    p.add_argument("--seq-len", type=_int_at_least(2), default=64, help="tokens per sample")
    p.add_argument(
        "--seed", type=_int_at_least(0), default=0, help="seed of the model, data and order"
    )
    p.add_argument("--parallel", choices=["fsdp", "ddp", "none"], default="fsdp")
    p.add_argument("--run-dir", default=None, help="where the ledger and results go")
    p.add_argument("--faults", default=None, help="a fault plan (YAML)")
    p.add_argument("--lr", type=_positive, default=3e-3, help="AdamW learning rate")
    p.add_argument(
        "--num-samples", type=_int_at_least(1), default=1 << 16, help="samples per epoch"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--pg-timeout-s", type=_positive, default=60.0, help="collective timeout")
    p.add_argument(
        "--log-every", type=_int_at_least(1), default=10, help="log the loss every N steps"
    )
    p.add_argument(
        "--no-inprocess",
        action="store_true",
        help="no in-process restart: a fault ends the process (the launcher restarts it)",
    )
    p.add_argument(
        "--soft-timeout-s", type=_positive, default=60.0, help="no step for this long: restart"
    )
    p.add_argument(
        "--hard-timeout-s",
        type=_positive,
        default=90.0,
        help="no step for this long: kill the rank",
    )
    p.add_argument(
        "--max-rank-faults",
        type=_int_at_least(1),
        default=3,
        help="in-process restart hands over to the launcher once one rank caused this many faults",
    )
    p.add_argument(
        "--ckpt-every",
        type=_int_at_least(0),
        default=0,
        help="checkpoint after every N steps (0: off)",
    )
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (<run_dir>/ckpt)")
    p.add_argument("--ckpt-mode", choices=["async", "sync"], default="async")
    p.add_argument(
        "--ckpt-keep", type=_int_at_least(1), default=2, help="committed checkpoints to keep"
    )
    p.add_argument(
        "--ckpt-on-busy",
        choices=["skip", "wait"],
        default="skip",
        help="a save due while the previous one persists: skip it, or wait for the previous",
    )
    return p


def _check_args(args: argparse.Namespace, world_size: int) -> int:
    """Validate flags against the world; returns the global batch."""
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.ckpt_every < 0:
        raise ValueError(f"--ckpt-every must be >= 0 (0: no checkpoints), got {args.ckpt_every}")
    wmodel.get_config(args.model)  # ValueError naming the valid sizes
    global_batch = args.global_batch or args.batch_size * world_size
    if global_batch <= 0 or global_batch % world_size:
        raise ValueError(
            f"global batch {global_batch} is not a positive multiple of the world size "
            f"{world_size}; pick --global-batch or --batch-size accordingly"
        )
    return int(global_batch)


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
    if args.ckpt_every == 0:
        return None
    return Checkpointer(
        Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "ckpt",
        ledger=ledger,
        hooks=hooks,
        every_steps=args.ckpt_every,
        keep=args.ckpt_keep,
        mode=args.ckpt_mode,
        on_busy=args.ckpt_on_busy,
        overlap=True,
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
        global_batch = _check_args(args, env.world_size)
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

    def once(ctx: Any) -> str:
        ctx.add_step_hook(injector.on_step)
        return train_once(
            ctx,
            args,
            ledger,
            run_dir,
            device=device,
            global_batch=global_batch,
            hooks=injector.writer_hooks(),
        )

    if not args.no_inprocess:
        config = restart.RestartConfig(
            pg_backend=default_backend(device),
            pg_timeout_s=args.pg_timeout_s,
            soft_timeout_s=args.soft_timeout_s,
            hard_timeout_s=args.hard_timeout_s,
            barrier_timeout_s=args.hard_timeout_s + 60.0,
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
) -> str:
    """The training loop in the process group that exists, from the newest checkpoint (or step
    0); returns the final state hash. ``ctx`` is a RestartContext: ``run`` calls this again
    after an in-process restart, possibly with fewer ranks. ``hooks`` go to the checkpoint
    writer (the fault plan's, see ``FaultInjector.writer_hooks``)."""
    rank, world_size = ctx.rank, ctx.world_size
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} does not divide the world size {world_size}")
    ckpt: Checkpointer | None = None
    try:
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
        ckpt = _checkpointer(args, run_dir, ledger, hooks)
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
            ctx.step_done(step, loss=loss_value)  # ledger step, heartbeat, fault injector
            if ckpt is not None:
                with ctx.no_hang_protection():  # a sync save, or one waiting for the last
                    ckpt.maybe_save(step, state)
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
                tmp = run_dir / "final.json.tmp"
                tmp.write_text(json.dumps(out, indent=1))
                os.replace(tmp, run_dir / "final.json")
        return digest
    finally:
        if ckpt is not None:
            ckpt.abort()  # after an error: stop the writer; a no-op once closed


@record
def main(argv: Sequence[str] | None = None) -> int:
    started = process_start_time()
    env = WorkerEnv.from_environ()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # under a launcher, a usage error must not be restarted
        if e.code == 2 and env.launched:
            raise SystemExit(EXIT_CONFIG) from None
        raise
    init_logging()
    run_dir = Path(
        args.run_dir or env.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    ).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
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
