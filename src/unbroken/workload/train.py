"""The reference training script: a Llama-style model on a synthetic language.

Runs as a single process (``python -m unbroken.workload.train``) and under torchrun or
``unbroken-run``. Its flags are a contract that tests, benchmarks and the demo rely on. At the
end it prints ``final_state_sha256=<hex>`` (a hash over the gathered model and optimizer state,
identical on every rank) and rank 0 writes it, with the loss curve, to ``<run_dir>/final.json``.

It adopts unbroken as any script does, through the public API only: ``unbroken.main`` (the
ledger, in-process restart or not, the fault plan, the node's memory tiers, the fork server),
``unbroken.Checkpointer`` and the context's ``step_done`` and ``phase``. Its flags become a
``RestartConfig`` and Checkpointer arguments; the environment's overrides win over them.

Ledger phases: import (process start → main), pg_init, model_build, data (at set-up, and the
batch of every step), steps, shutdown.

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
import functools
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import unbroken
from unbroken.checkpoint import CheckpointConfig, state_sha256
from unbroken.env import WorkerEnv
from unbroken.errors import EXIT_CONFIG
from unbroken.ledger.durable import write_atomic
from unbroken.ledger.owner import DirectoryOwned
from unbroken.log import init_logging
from unbroken.workload import data as wdata
from unbroken.workload import model as wmodel
from unbroken.workload import saving
from unbroken.workload.flags import WRITER_PRIORITIES, build_parser, check_args
from unbroken.workload.parallel import wrap_model
from unbroken.workload.rundir import claim_dirs, default_run_dir, job_identity

logger = logging.getLogger("unbroken.workload.train")


def _device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def final_state_hash(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """Hash of the full (gathered) model and optimizer state; collective on every rank."""
    opts = StateDictOptions(full_state_dict=True)
    state = {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, optim, options=opts),
    }
    return state_sha256(state)


class _Progress:
    """The loss curve so far, so that a resumed run reports the whole curve."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = [float(x) for x in state["losses"]]


def _checkpointer(args: argparse.Namespace, run_dir: Path) -> unbroken.Checkpointer | None:
    if args.ckpt_every == 0 and args.snapshot_every == 0:
        return None
    nice, idle = WRITER_PRIORITIES[args.writer_priority]
    return unbroken.Checkpointer(
        Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "ckpt",
        run=args.job,
        allow_foreign=args.resume,
        keep=args.ckpt_keep,
        mode=args.ckpt_mode,
        on_busy=args.ckpt_on_busy,
        overlap=True,
        snapshot_every=args.snapshot_every,
        memory_tier=not args.no_memory_tier,
        rescue=not args.no_rescue,
        # Peers: unbroken.run offers them in a multi-node job; naming none keeps them out.
        peers=() if args.no_peer_replica else None,
        config=CheckpointConfig(
            every_steps=args.ckpt_every,  # with the adaptive interval's bounds: checked together
            snapshot_budget=0.0,  # --snapshot-every 0 is off, not a measured interval
            writer_nice=nice,
            writer_idle=idle,
            **saving.checkpointer_fields(args),
        ),
    )


def restart_config(args: argparse.Namespace) -> unbroken.RestartConfig:
    """The in-process restart the flags ask for (``--no-inprocess``: none)."""
    return unbroken.RestartConfig(
        enabled=not args.no_inprocess,
        pg_backend="nccl" if _device(args.device, 0).type == "cuda" else "gloo",
        pg_timeout_s=args.pg_timeout_s,
        soft_timeout_s=args.soft_timeout_s,
        hard_timeout_s=args.hard_timeout_s,
        barrier_timeout_s=max(120.0, (args.hard_timeout_s or 0.0) + 60.0),
        max_rank_faults=args.max_rank_faults,
    )


def train(args: argparse.Namespace, ctx: unbroken.RestartContext) -> str:
    """The training loop in the process group ``unbroken.run`` formed, from the newest
    checkpoint (or step 0); returns the final state hash. Called again after an in-process
    restart, possibly with fewer ranks."""
    rank, world_size = ctx.rank, ctx.world_size
    assert ctx.run_dir is not None  # unbroken.main is given one
    device = _device(args.device, ctx.local_rank)
    global_batch = check_args(args, world_size)
    ckpt: unbroken.Checkpointer | None = None
    try:
        # Before the model: a restarted process's adopted snapshots warm up meanwhile (tiers).
        ckpt = _checkpointer(args, ctx.run_dir)
        with ctx.phase("model_build"):
            cfg = wmodel.get_config(args.model)
            model: torch.nn.Module = wmodel.build_model(cfg, seed=args.seed).to(device)
            model = wrap_model(model, parallel=args.parallel, device=device)
            optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        with ctx.phase("data"):
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
            "data": sampler,  # the RNG streams: the Checkpointer's own (CheckpointConfig.rng)
            "progress": progress,
        }
        start = 0 if ckpt is None else ckpt.resume(state)
        for step in range(start, args.steps):
            with ctx.phase("data"):
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
            if ckpt is not None:  # before a fault can fire: every step done is staged or noted
                ckpt.maybe_save(step, state)
            ctx.step_done(step, loss=loss_value)  # ledger step, heartbeat, fault plan
        with ctx.phase("shutdown"):
            if ckpt is not None:
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
                write_atomic(ctx.run_dir / "final.json", json.dumps(out, indent=1))
        # One write per line: ranks share the launcher's stdout, and print() writes the
        # newline apart.
        sys.stdout.write(f"final_state_sha256={digest}\n")
        sys.stdout.flush()
        return digest
    finally:
        if ckpt is not None:
            ckpt.abort()  # after an error: stop the writer; a no-op once closed


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, claim the run directory, then ``unbroken.main`` (which exits); returns
    an exit code only for a usage error found before that."""
    env = WorkerEnv.from_environ()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # under a launcher, a usage error must not be restarted
        if e.code == 2 and env.launched:
            raise SystemExit(EXIT_CONFIG) from None
        raise
    init_logging()
    try:
        check_args(args, env.world_size)
        saving.checkpointer_fields(args)
    except ValueError as e:  # no restart fixes it
        logger.error("configuration error: %s", e)
        return EXIT_CONFIG
    run_dir = Path(args.run_dir or env.run_dir or default_run_dir(env)).resolve()
    args.job = job_identity(env)
    try:
        claim_dirs(args, run_dir)  # held until the process exits
    except DirectoryOwned as e:  # a usage error: under a launcher, not to be restarted
        logger.error("%s", e)
        return EXIT_CONFIG if env.launched else 2
    unbroken.main(
        functools.partial(train, args),
        config=restart_config(args),
        run_dir=run_dir,
        fault_plan=args.faults,
        meta={"args": vars(args)},
        exit_fast=True,  # the reference keeps nothing in atexit handlers or open files
    )


if __name__ == "__main__":
    sys.exit(main())
