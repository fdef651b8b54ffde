"""Writers forked from the fork server: they share no page the trainer writes afterwards, save
and commit like any writer, report how they ended, die with the trainer, and a server that is
gone leaves writers forking from the trainer again."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from procs import worker_env
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.persisting import forkserver


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _faults_writing(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t += 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.parametrize("served", [False, True])
def test_a_served_writer_shares_no_page_the_trainer_writes(tmp_path: Path, served: bool) -> None:
    with forkserver.serving() if served else contextlib.nullcontext():
        model = torch.nn.Linear(64, 64)
        big = torch.ones(16 << 20)  # 64 MB written before the writer starts: 16384 pages
        with Checkpointer(tmp_path, memory_tier=False) as ck:
            ck.save(0, {"model": model})
            ck.wait()
            writer = ck.writer_pid
            assert writer is not None
            server = forkserver.current()
            assert _ppid(writer) == (server.pid if served and server else os.getpid())
            faults = _faults_writing(big)
    # Forked from the trainer, each page the trainer writes is copied once; from the server,
    # forked before the tensor existed, none is.
    if served:
        assert faults < 2000
    else:
        assert faults > 12000
    assert ck.latest() == 0


def test_a_killed_served_writer_reports_its_signal_and_the_next_one_forks(tmp_path: Path) -> None:
    with forkserver.serving():
        ck = Checkpointer(tmp_path, memory_tier=False)
        ck.save(0, {"w": torch.arange(8.0)})
        ck.wait()
        first = ck.writer_pid
        assert first is not None
        client = ck._saves.inflight.writer
        assert client is not None
        ck.abort()  # SIGKILLs the writer
        assert client.proc.wait(timeout=5.0) == -signal.SIGKILL
        with Checkpointer(tmp_path, memory_tier=False) as again:
            assert again.restore({"w": torch.zeros(8)}) == 0
            again.save(1, {"w": torch.arange(8.0) + 1})
            assert again.writer_pid not in (None, first)
    assert again.latest() == 1


def test_nested_serving_keeps_the_outer_server() -> None:
    with forkserver.serving():
        outer = forkserver.current()
        assert outer is not None
        with forkserver.serving():
            assert forkserver.current() is outer
        assert forkserver.current() is outer
    assert forkserver.current() is None


def test_a_server_that_is_gone_leaves_writers_forking_from_the_trainer(tmp_path: Path) -> None:
    with forkserver.serving():
        server = forkserver.current()
        assert server is not None
        os.kill(server.pid, signal.SIGKILL)
        with Checkpointer(tmp_path, memory_tier=False) as ck:
            ck.save(0, {"w": torch.arange(8.0)})
            writer = ck.writer_pid
            assert writer is not None and _ppid(writer) == os.getpid()
    assert ck.latest() == 0


@pytest.mark.slow
def test_the_server_and_its_writers_die_with_the_trainer(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from unbroken.checkpoint import Checkpointer
        from unbroken.checkpoint.persisting import forkserver
        with forkserver.serving():
            ck = Checkpointer({str(tmp_path)!r}, memory_tier=False)
            ck.save(0, {{"w": torch.arange(8.0)}})
            print(forkserver.current().pid, ck.writer_pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(x) for x in proc.stdout.split()]
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"

    deadline = time.monotonic() + 10.0
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(map(alive, pids))
