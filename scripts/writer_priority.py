"""What the persisting writer takes from training, per writer priority (a short comparison).

Run under torchrun, e.g. on 2 CPU ranks:

    torchrun --standalone --nproc-per-node 2 scripts/writer_priority.py --variants nice0,default

Each rank trains the reference model (``small`` by default) and saves asynchronously every
``--every`` steps; for each variant of the writer's priority (applied inside the forked writer
through ``writer.lower_priority``) it prints, on rank 0, the median step time while a save is
persisting and while none is, and the median persist time. Variants run interleaved
(``--rounds``) so that a change of the machine's load hits them alike.

- ``nice0``: the writer at the trainer's priority;
- ``default``: what ``writer.lower_priority`` does (the shipped behaviour);
- ``nice19``: niceness +19 only;
- ``idle``: SCHED_IDLE (runs only on a core nothing else wants).

"persisting" excludes the step right after a save (shown apart: it also runs the trainer's
overlapped copy into the staging arena). Also printed: the writer's CPU time per save (user + system, from /proc), what it takes from
a saturated machine whatever its priority.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.persisting import writer as cwriter
from unbroken.workload import data as wdata
from unbroken.workload import model as wmodel
from unbroken.workload.parallel import wrap_model

SHIPPED = cwriter.lower_priority
VARIANTS = {
    "nice0": lambda nice: None,
    "default": SHIPPED,
    "nice19": lambda nice: os.nice(19),
    "idle": lambda nice: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)),
}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    variant: str, args: argparse.Namespace, root: Path
) -> tuple[float, float, float, float, float]:
    cwriter.lower_priority = VARIANTS[variant]  # inherited by the writer forked below
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = wmodel.get_config(args.model)
    model = wrap_model(wmodel.build_model(cfg, seed=0), parallel="fsdp", device=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = wdata.SyntheticDataset(
        wdata.MarkovLanguage(cfg.vocab_size, seed=0), seq_len=args.seq_len, num_samples=1 << 16
    )
    sampler = wdata.ResumableSampler(
        1 << 16, global_batch=args.batch_size * world, rank=rank, world_size=world, seed=0
    )
    state = {"model": model, "optim": optim, "data": sampler}
    busy, quiet, after = [], [], []  # persisting, not, the step right after a save
    saved = False
    with Checkpointer(root / variant, every_steps=args.every, keep=1) as ckpt:
        for step in range(args.steps):
            t0 = time.perf_counter()
            s = ckpt.stats()
            persisting = s.saves > len(s.persist_s) + s.failed
            inputs, targets = dataset.get_batch(sampler.next_indices())
            wmodel.loss_fn(model(inputs), targets).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            dist.barrier()
            dur = time.perf_counter() - t0
            if step >= args.every:  # the first save allocates the arena and starts the writer
                # The step after a save also runs the overlapped copy into the arena (in the
                # trainer, not the writer).
                (after if saved else busy if persisting else quiet).append(dur)
            saved = ckpt.maybe_save(step, state)
        ckpt.wait()
        persist = ckpt.stats().persist_s[1:]
        assert ckpt.writer_pid is not None
        writer_cpu = cpu_s(ckpt.writer_pid) / max(1, ckpt.stats().saves)
    return (
        statistics.median(busy) if busy else float("nan"),
        statistics.median(quiet) if quiet else float("nan"),
        statistics.median(persist) if persist else float("nan"),
        writer_cpu,
        statistics.median(after) if after else float("nan"),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="nice0,default")
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=1, help="samples per rank per step")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict[str, list[tuple[float, float, float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [tmp]  # rank 0's directory for every rank
        dist.broadcast_object_list(paths)
        for _ in range(args.rounds):
            for v in args.variants.split(","):
                results.setdefault(v, []).append(measure(v, args, Path(paths[0])))
    if dist.get_rank() == 0:
        print(f"load average {os.getloadavg()}")
        print(
            f"{'variant':<10} {'after save ms':>13} {'persisting ms':>13} {'quiet ms':>9} "
            f"{'slower ms':>10} {'persist s':>10} {'writer cpu s/save':>18}"
        )
        for v, rows in results.items():
            b = statistics.median(r[0] for r in rows)
            q = statistics.median(r[1] for r in rows)
            per = statistics.median(r[2] for r in rows)
            cpu = statistics.median(r[3] for r in rows)
            a = statistics.median(r[4] for r in rows)
            print(
                f"{v:<10} {a * 1e3:>13.1f} {b * 1e3:>13.1f} {q * 1e3:>9.1f} {(b - q) * 1e3:>10.1f} "
                f"{per:>10.2f} {cpu:>18.2f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
