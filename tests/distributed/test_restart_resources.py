"""100 in-process restarts leave nothing behind: descriptors, threads, zombie children, shared
memory (/dev/shm entries and memfds) and cgroups stay flat.

One rank in the test process (a real gloo group of one); every iteration builds a real
Checkpointer (its writer process forked, its arena adopted from the memory tier), saves, and
then fails: by an exception, or by a hang the watchdog interrupts while ``fn`` unwinds through
the ``finally`` that aborts the Checkpointer.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import torch

from procs import one_rank
from unbroken.checkpoint import CheckpointConfig, Checkpointer
from unbroken.restart import RestartConfig, RestartContext, run

RESTARTS = 100

ENV = one_rank("resources")


def _own_cgroup() -> Path | None:
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    path = Path("/sys/fs/cgroup") / line.split(":", 2)[2].lstrip("/")
    return path if path.is_dir() else None


def resources() -> dict[str, int]:
    """What a leak would grow, for this process."""
    fds = os.listdir("/proc/self/fd")
    memfds = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            memfds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    zombies = 0
    for child in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
        with contextlib.suppress(OSError):
            zombies += Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    cgroup = _own_cgroup()
    return {
        "fds": len(fds),
        "memfds": memfds,
        "threads": threading.active_count(),
        "children": len(
            Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
        ),
        "zombies": zombies,
        "shm": len(os.listdir("/dev/shm")),
        "cgroups": sum(1 for p in cgroup.iterdir() if p.is_dir()) if cgroup else 0,
    }


def _spin() -> None:
    while True:
        time.sleep(0.001)


def test_resources_stay_flat_over_100_in_process_restarts(store_addr: str, tmp_path: Path) -> None:
    samples: list[dict[str, int]] = []
    restored: list[int | None] = []

    def fn(ctx: RestartContext) -> int:
        samples.append(resources())
        state = {"w": torch.zeros(256)}
        ckpt = Checkpointer(
            tmp_path / "ckpt",
            persist_timeout_s=60.0,
            config=CheckpointConfig(writer_start="fork"),
        )
        try:
            with ctx.no_hang_protection():
                restored.append(ckpt.restore(state))
                state["w"] += 1
                ckpt.save(ctx.iteration, state)
                ckpt.wait()
            ctx.step_done(ctx.iteration)
            if ctx.iteration == RESTARTS:
                with ctx.no_hang_protection():  # as the abort below: stopping is no hang
                    ckpt.close()
                return ctx.iteration
            if ctx.iteration % 3 == 1:
                _spin()  # a hang: the watchdog interrupts it, and the abort below
            raise RuntimeError(f"fault {ctx.iteration}")
        finally:
            with ctx.no_hang_protection():  # stopping the writer is no hang, however slow
                ckpt.abort()  # a no-op once closed

    config = RestartConfig(
        store_addr=store_addr,
        monitor_interval_s=0.005,
        soft_timeout_s=0.05,
        hard_timeout_s=30.0,
        initial_soft_timeout_s=30.0,
        initial_hard_timeout_s=60.0,
        exit_timeout_s=10.0,
        barrier_timeout_s=40.0,
        backstop_margin_s=None,
        health_checks=(),
        max_iterations=RESTARTS + 2,
        max_rank_faults=RESTARTS + 1,
        max_restore_point_faults=RESTARTS + 1,
    )
    before = resources()
    t0 = time.monotonic()
    assert run(fn, config=config, env=ENV) == RESTARTS
    wall_s = time.monotonic() - t0
    after = resources()
    assert restored[1:] == list(range(RESTARTS))  # each restart restored the last save
    warm, last = samples[5], samples[-1]
    slack = {"fds": 3, "threads": 1}
    for key, value in last.items():
        assert value <= warm[key] + slack.get(key, 0), (key, warm, last)
    for key, value in after.items():
        assert value <= before[key] + slack.get(key, 0), (key, before, after)
    assert wall_s < 120.0
