"""An emulation of what Kubernetes alone does when one rank of a job fails (the baseline).

Labelled an emulation everywhere it is reported. What it does, per the published run:
- the job's ranks run as plain processes (one per "pod"), with no in-job recovery;
- a rank fails (exits non-zero or is killed): Kubernetes sees the container exit at once, but
  the other ranks keep waiting in their collectives until their collective timeout ends them
  (here: until they exit on their own, or ``collective_timeout_s`` passes, then SIGKILL, as a
  NCCL watchdog abort would);
- the whole job is relaunched after a pod-restart delay that doubles on every consecutive
  failure (CrashLoopBackOff: ``restart_delay_s * 2**k``, capped at ``max_delay_s``), and
  resumes from its last checkpoint.
Every transition is written to the run's ledger (rank -1, layer "orchestrator"), so the
baseline's figures come from the same goodput code as ours.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from unbroken import env as envnames
from unbroken.ledger import Ledger
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
    """The emulated orchestrator's timings."""

    nproc: int = 2
    """Ranks (pods) of the job."""
    restart_delay_s: float = 2.0
    """Pod restart delay before the first relaunch (doubles per consecutive failure)."""
    max_delay_s: float = 300.0
    """Cap of the CrashLoopBackOff delay (Kubernetes caps at 5 minutes)."""
    collective_timeout_s: float = 5.0
    """How long surviving ranks wait in a collective before they are torn down."""
    max_restarts: int = 10
    """Relaunches before the job is declared failed (a Job's backoffLimit)."""
    job_timeout_s: float = 600.0
    """Safety net: the whole emulated job is killed after this long."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        for name in ("restart_delay_s", "collective_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_delay_s < self.restart_delay_s:
            raise ValueError(
                f"max_delay_s ({self.max_delay_s}) must be >= restart_delay_s "
                f"({self.restart_delay_s})"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")


@dataclass
class OrchestratorResult:
    """How the emulated job ended."""

    returncode: int
    """0 when the last launch succeeded on every rank."""
    launches: int
    """How many times the job was launched."""
    output: str
    """Combined output of every rank of every launch."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(
    cmd: Sequence[str], cfg: OrchestratorConfig, attempt: int, run_id: str, log_dir: Path
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    port = _free_port()  # a fresh "pod IP:port" per launch, as new pods get
    procs = []
    for rank in range(cfg.nproc):
        env = dict(os.environ)
        env.update(
            {
                envnames.RANK: str(rank),
                envnames.LOCAL_RANK: "0",
                envnames.WORLD_SIZE: str(cfg.nproc),
                envnames.LOCAL_WORLD_SIZE: "1",
                envnames.GROUP_RANK: str(rank),
                envnames.MASTER_ADDR: "127.0.0.1",
                envnames.MASTER_PORT: str(port),
                envnames.RESTART_COUNT: str(attempt),
                envnames.UNBROKEN_RUN_ID: run_id,
                envnames.OMP_NUM_THREADS: "1",
            }
        )
        env.pop(envnames.USE_AGENT_STORE, None)
        log = log_dir / f"launch{attempt}-rank{rank}.log"
        with open(log, "wb") as out:
            procs.append(
                (
                    subprocess.Popen(
                        list(cmd),
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    log,
                )
            )
    return procs


def _kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def run_orchestrated(
    cmd: Sequence[str], *, run_dir: Path, cfg: OrchestratorConfig, run_id: str | None = None
) -> OrchestratorResult:
    """Run ``cmd`` as ``cfg.nproc`` ranks under the emulated orchestrator."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = run_dir / "orchestrator"
    log_dir.mkdir(exist_ok=True)
    run_id = run_id or run_dir.name
    ledger = Ledger(run_dir, run=run_id, rank=ev.LAUNCHER_RANK)
    deadline = time.monotonic() + cfg.job_timeout_s
    outputs: list[str] = []
    attempt = 0
    consecutive = 0
    try:
        while True:
            ledger.set_context(attempt=attempt)
            if attempt:
                ledger.emit(ev.RESTART_END, layer="orchestrator", emulated=True)
            launched = _launch(cmd, cfg, attempt, run_id, log_dir)
            procs = [p for p, _ in launched]
            failed_at = None
            first_fail: tuple[int, int] | None = None
            while [p.poll() for p in procs].count(None):  # poll every rank, no short-circuit
                if time.monotonic() > deadline:
                    _kill(procs)
                    raise TimeoutError(f"emulated job exceeded {cfg.job_timeout_s}s")
                if failed_at is None:
                    for rank, p in enumerate(procs):
                        if p.returncode not in (None, 0):
                            failed_at, first_fail = time.time(), (rank, p.returncode)
                            break
                elif time.time() - failed_at > cfg.collective_timeout_s:
                    _kill(procs)  # the survivors' collective timeout ends them
                time.sleep(0.005)
            for _, log in launched:
                outputs.append(log.read_text(errors="replace"))
            codes = [p.returncode for p in procs]
            if all(c == 0 for c in codes):
                ledger.emit(ev.JOB_END, status="ok", launches=attempt + 1)
                return OrchestratorResult(0, attempt + 1, "".join(outputs))
            if first_fail is None:  # every failure came at once
                first_fail = next((r, c) for r, c in enumerate(codes) if c != 0)
                failed_at = time.time()
            rank, code = first_fail
            ledger.emit(
                ev.FAULT_DETECTED,
                ts=failed_at,
                cause=_cause(code),
                detector="pod-exit",
                layer="orchestrator",
                fault_rank=rank,
                exit_code=code,
                emulated=True,
            )
            for r, c in enumerate(codes):
                ledger.emit(ev.WORKER_EXIT, worker_rank=r, exit_code=c)
            if attempt >= cfg.max_restarts:
                ledger.emit(ev.JOB_END, status="failed", launches=attempt + 1)
                return OrchestratorResult(1, attempt + 1, "".join(outputs))
            delay = min(cfg.max_delay_s, cfg.restart_delay_s * (2**consecutive))
            ledger.emit(ev.RESTART_BEGIN, layer="orchestrator", delay_s=delay, emulated=True)
            logger.info(
                "emulated pod restart in %.2fs (CrashLoopBackOff step %d)", delay, consecutive
            )
            time.sleep(delay)
            consecutive += 1
            attempt += 1
    finally:
        ledger.close()


def _cause(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def train_command(args: Sequence[str]) -> list[str]:
    """The reference script as a plain process: no launcher and no in-process restart (the
    baseline has no in-job recovery; a fault ends the process)."""
    return [sys.executable, "-m", "unbroken.workload.train", "--no-inprocess", *args]
