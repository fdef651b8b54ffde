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

``run_node`` is the same emulation around a job that has its own recovery (``unbroken-run``):
it only steps in where Kubernetes would, when the node itself is lost (a ``node-loss`` fault
killed the launcher agent and everything under it), and relaunches the node's launcher after
the pod-restart delay; the job resumes from its last committed checkpoint on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from unbroken import env as envnames
from unbroken.faults import fired_faults
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

    def backoff_s(self, consecutive: int) -> float:
        """CrashLoopBackOff: the delay before relaunch after ``consecutive`` earlier ones."""
        return min(self.max_delay_s, self.restart_delay_s * (2**consecutive))


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
            delay = cfg.backoff_s(consecutive)
            ledger.emit(ev.RESTART_BEGIN, layer="orchestrator", delay_s=delay, emulated=True)
            logger.info(
                "emulated pod restart in %.2fs (CrashLoopBackOff step %d)", delay, consecutive
            )
            time.sleep(delay)
            consecutive += 1
            attempt += 1
    finally:
        ledger.close()


def _run_streaming(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None,
    timeout_s: float,
    on_line: Callable[[str], None] | None,
) -> tuple[int, str]:
    """Run ``cmd`` in its own session to its end (killed with its group after ``timeout_s``),
    passing each output line to ``on_line``; (returncode, output)."""
    proc = subprocess.Popen(
        list(cmd),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    killer = threading.Timer(max(0.0, timeout_s), kill_group)
    killer.start()
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)
        proc.wait()
    finally:
        killer.cancel()
        kill_group()  # stragglers of the session, if any
        if proc.stdout is not None:
            proc.stdout.close()
        proc.wait()
    return proc.returncode, "".join(lines)


def run_node(
    cmd: Sequence[str],
    *,
    run_dir: Path,
    cfg: OrchestratorConfig,
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    run_id: str | None = None,
) -> OrchestratorResult:
    """Run one node's launcher (``cmd``: ``unbroken-run ...`` writing its faults under
    ``run_dir``) as Kubernetes runs the node's pod. When the launcher dies of a signal after a
    ``node-loss`` fault fired (the node went away, with the launcher's own recovery), the pod is
    relaunched after ``cfg.restart_delay_s`` (doubling per consecutive loss, capped at
    ``cfg.max_delay_s``; at most ``cfg.max_restarts`` times). Any other ending is final: the
    launcher recovers everything else itself. ``cfg.nproc`` and ``collective_timeout_s`` are
    not used; ``cfg.job_timeout_s`` bounds all launches together.

    Ledger (rank -1, layer "orchestrator", ``emulated``), only when a node is lost:
    ``fault_detected`` (cause "node-loss", detector "orchestrator") at the launcher's exit,
    ``restart_begin`` with the delay, ``restart_end`` as the next launch starts."""
    run_id = run_id or run_dir.name
    deadline = time.monotonic() + cfg.job_timeout_s
    ledger: Ledger | None = None
    outputs: list[str] = []
    handled = 0  # node-loss faults already answered with a relaunch
    attempt = consecutive = 0
    try:
        while True:
            if ledger is not None:
                ledger.set_context(attempt=attempt)
                ledger.emit(ev.RESTART_END, layer="orchestrator", emulated=True)
            code, out = _run_streaming(
                cmd, env=env, timeout_s=deadline - time.monotonic(), on_line=on_line
            )
            exit_ts = time.time()
            outputs.append(out)
            lost = [r for r in fired_faults(run_dir) if r.get("kind") == "node-loss"]
            if code >= 0 or len(lost) <= handled or time.monotonic() >= deadline:
                return OrchestratorResult(code, attempt + 1, "".join(outputs))
            fault, handled = lost[handled], len(lost)
            if ledger is None:
                ledger = Ledger(run_dir, run=run_id, rank=ev.LAUNCHER_RANK, attempt=attempt)
            ledger.emit(
                ev.FAULT_DETECTED,
                ts=exit_ts,
                cause="node-loss",
                detector="orchestrator",
                layer="orchestrator",
                fault_rank=fault.get("rank"),
                exit_code=code,
                emulated=True,
            )
            if attempt >= cfg.max_restarts:
                ledger.emit(ev.JOB_END, status="failed", launches=attempt + 1, emulated=True)
                return OrchestratorResult(code, attempt + 1, "".join(outputs))
            delay = cfg.backoff_s(consecutive)
            ledger.emit(ev.RESTART_BEGIN, layer="orchestrator", delay_s=delay, emulated=True)
            logger.info("node lost: emulated pod restart in %.2fs", delay)
            time.sleep(delay)
            consecutive += 1
            attempt += 1
    finally:
        if ledger is not None:
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
