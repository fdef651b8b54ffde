"""The reference training script: a Llama-style model on a synthetic language.

Runs as a single process (``python -m unbroken.workload.train``) and under torchrun or
``unbroken-run``. Its flags are a contract that tests, benchmarks and the demo rely on. At the
end it prints ``final_state_sha256=<hex>`` (a hash over the gathered model and optimizer state,
identical on every rank) and rank 0 writes it, with the loss curve, to ``<run_dir>/final.json``.

Ledger phases: import (process start → main), pg_init, model_build, data, steps, shutdown.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
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
from torch.distributed.elastic.multiprocessing.errors import record

from unbroken.env import WorkerEnv
from unbroken.faults import FaultInjector, FaultPlan, load_plan
from unbroken.ledger import Ledger, install_sigterm_flush, process_start_time
from unbroken.ledger import events as ev
from unbroken.workload import data as wdata
from unbroken.workload import model as wmodel
from unbroken.workload.dist import default_backend, init_process_group
from unbroken.workload.parallel import wrap_model
from unbroken.workload.statehash import state_sha256

logger = logging.getLogger("unbroken.workload.train")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m unbroken.workload.train",
        description="unbroken's reference training job (Llama-style model, synthetic language).",
    )
    p.add_argument("--model", default="tiny", help="model size: %(default)s; see SIZES")
    p.add_argument("--steps", type=int, default=50, help="number of training steps")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per step across all ranks (overrides --batch-size; must divide evenly)",
    )
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, data and order")
    p.add_argument("--parallel", choices=["fsdp", "ddp", "none"], default="fsdp")
    p.add_argument("--run-dir", default=None, help="where the ledger and results go")
    p.add_argument("--faults", default=None, help="a fault plan (YAML)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--num-samples", type=int, default=1 << 16, help="samples per epoch")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--pg-timeout-s", type=float, default=60.0, help="collective timeout")
    p.add_argument("--log-every", type=int, default=10, help="log the loss every N steps")
    return p


def _check_args(args: argparse.Namespace, world_size: int) -> int:
    """Validate flags against the world; returns the global batch."""
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}")
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


def run_id_for(env: WorkerEnv, run_dir: Path) -> str:
    return env.run_id if env.run_id and env.run_id != "none" else run_dir.name


def train(args: argparse.Namespace, env: WorkerEnv, ledger: Ledger, run_dir: Path) -> str:
    """The training job; returns the final state hash."""
    global_batch = _check_args(args, env.world_size)
    plan = load_plan(args.faults) if args.faults else FaultPlan()
    plan.check_world(env.world_size)
    injector = FaultInjector(plan, run_dir=run_dir, rank=env.rank, sink=ledger)
    device = _device(args.device, env)
    run = ledger.run

    with ledger.phase("pg_init"):
        init_process_group(
            env,
            run=run,
            backend=default_backend(device),
            timeout=timedelta(seconds=args.pg_timeout_s),
        )
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
                rank=env.rank,
                world_size=env.world_size,
                seed=args.seed,
            )
        losses: list[float] = []
        for step in range(args.steps):
            inputs, targets = dataset.get_batch(sampler.next_indices())
            inputs, targets = inputs.to(device), targets.to(device)
            loss = wmodel.loss_fn(model(inputs), targets)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            loss_value = float(global_loss) / env.world_size
            losses.append(loss_value)
            ledger.step(step, loss=loss_value)
            if env.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                logger.info("step %d loss %.4f", step, loss_value)
            injector.on_step(step)
        with ledger.phase("shutdown"):
            digest = final_state_hash(model, optim)
            hashes: list[Any] = [None] * env.world_size
            dist.all_gather_object(hashes, digest)
            if len(set(hashes)) != 1:
                raise RuntimeError(f"ranks disagree on the final state: {hashes}")
            if env.rank == 0:
                out = {
                    "final_state_sha256": digest,
                    "steps": args.steps,
                    "world_size": env.world_size,
                    "global_batch": global_batch,
                    "model": args.model,
                    "parallel": args.parallel,
                    "seed": args.seed,
                    "losses": losses,
                }
                tmp = run_dir / "final.json.tmp"
                tmp.write_text(json.dumps(out, indent=1))
                os.replace(tmp, run_dir / "final.json")
        return digest
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@record
def main(argv: Sequence[str] | None = None) -> int:
    started = process_start_time()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s"
    )
    env = WorkerEnv.from_environ()
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
    )
    ledger.interval(ev.PHASE, begin=started, name="import")
    ledger.mark()
    if env.restart_count > 0:
        ledger.emit(ev.RESTART_END, layer="launcher")
    try:
        digest = train(args, env, ledger, run_dir)
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            ledger.emit(
                ev.FAULT_DETECTED,
                cause=type(e).__name__,
                detector="exception",
                fault_rank=env.rank,
                message=str(e)[:500],
            )
        ledger.close()
        raise
    if env.rank == 0:
        ledger.emit(ev.JOB_END, status="ok", final_state_sha256=digest)
    ledger.close()
    # One write per line: ranks share the launcher's stdout, and print() writes the newline apart.
    sys.stdout.write(f"final_state_sha256={digest}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
