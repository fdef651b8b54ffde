"""Health checks each rank runs between iterations; a rank that fails one leaves the job.

A check is any callable ``check(info: HealthInfo) -> HealthResult`` with a ``name``; raising
counts as failing. Built in:

- ``CudaDeviceCheck``: the rank's CUDA device runs a kernel and synchronizes (skipped, i.e.
  healthy, when CUDA is not available: a CPU job);
- ``NvmlCheck``: NVML sees the device and reports no pending page retirement or row-remap
  failure (skipped when ``pynvml`` or the NVML library is absent: absent NVML is not a fault);
- ``HostMemoryCheck``: the host has at least ``min_available_bytes`` of MemAvailable;
- ``FaultCountCheck``: this rank caused fewer than ``max_faults`` faults so far (off by
  default; add it to drop a rank that keeps failing while the rest continue).

``default_checks()`` = CUDA device, NVML, host memory.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class HealthInfo:
    """What a check may want to know about the rank it runs on."""

    member: int
    """The rank's launch rank (its identity across iterations)."""
    rank: int
    """Its rank in the iteration that just ended."""
    local_rank: int
    """Its rank on this node (its GPU index)."""
    iteration: int
    """The iteration that just ended."""
    faults: int
    """Faults this rank has caused so far, the one that just ended the iteration included."""


@dataclass(frozen=True, kw_only=True)
class HealthResult:
    """One check's verdict."""

    name: str
    """The check's name."""
    ok: bool
    """False: the rank must leave."""
    detail: str = ""
    """Why (or what was skipped)."""


class HealthCheck(Protocol):
    """A health check."""

    name: str

    def __call__(self, info: HealthInfo) -> HealthResult: ...


class CudaDeviceCheck:
    """The rank's CUDA device runs a kernel and synchronizes."""

    name = "cuda_device"

    def __call__(self, info: HealthInfo) -> HealthResult:
        import torch

        if not torch.cuda.is_available():
            return HealthResult(name=self.name, ok=True, detail="skipped: no CUDA")
        device = torch.device("cuda", info.local_rank)
        x = torch.ones(1024, device=device)
        total = float(x.add_(1).sum())
        torch.cuda.synchronize(device)
        if total != 2048.0:
            return HealthResult(
                name=self.name, ok=False, detail=f"wrong result {total} on {device}"
            )
        return HealthResult(name=self.name, ok=True, detail=str(device))


class NvmlCheck:
    """NVML reports the rank's GPU without pending page retirements or row-remap failures."""

    name = "nvml"

    def __call__(self, info: HealthInfo) -> HealthResult:
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            return HealthResult(name=self.name, ok=True, detail="skipped: pynvml not installed")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            return HealthResult(name=self.name, ok=True, detail=f"skipped: no NVML ({e})")
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return HealthResult(name=self.name, ok=True, detail="skipped: no GPU")
            handle = pynvml.nvmlDeviceGetHandleByIndex(info.local_rank)
            problems = []
            try:
                if pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                    problems.append("retired pages pending")
            except pynvml.NVMLError:
                pass  # not supported on this GPU
            try:
                remap = pynvml.nvmlDeviceGetRemappedRows(handle)
                if remap[3]:  # (correctable, uncorrectable, pending, failure)
                    problems.append("row remapping failed")
            except pynvml.NVMLError:
                pass
            if problems:
                return HealthResult(name=self.name, ok=False, detail=", ".join(problems))
            return HealthResult(name=self.name, ok=True, detail=f"gpu {info.local_rank}")
        except pynvml.NVMLError as e:
            return HealthResult(name=self.name, ok=False, detail=f"NVML error: {e}")
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()


class HostMemoryCheck:
    """At least ``min_available_bytes`` of host memory are available (MemAvailable).

    Args:
        min_available_bytes: The least a healthy rank's host has available.

    Raises:
        ValueError: When ``min_available_bytes`` < 0.
    """

    name = "host_memory"

    def __init__(self, min_available_bytes: int = 256 << 20) -> None:
        if min_available_bytes < 0:
            raise ValueError(f"min_available_bytes must be >= 0, got {min_available_bytes}")
        self.min_available_bytes = min_available_bytes

    def __call__(self, info: HealthInfo) -> HealthResult:
        available = _mem_available()
        if available is None:
            return HealthResult(name=self.name, ok=True, detail="skipped: no /proc/meminfo")
        ok = available >= self.min_available_bytes
        return HealthResult(
            name=self.name,
            ok=ok,
            detail=f"{available >> 20} MiB available, need {self.min_available_bytes >> 20} MiB",
        )


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class FaultCountCheck:
    """Fails a rank that has caused ``max_faults`` faults or more.

    Args:
        max_faults: Faults a rank may cause before it is excluded.

    Raises:
        ValueError: When ``max_faults`` < 1.
    """

    name = "fault_count"

    def __init__(self, max_faults: int) -> None:
        if max_faults < 1:
            raise ValueError(f"max_faults must be >= 1, got {max_faults}")
        self.max_faults = max_faults

    def __call__(self, info: HealthInfo) -> HealthResult:
        ok = info.faults < self.max_faults
        return HealthResult(
            name=self.name, ok=ok, detail=f"{info.faults} fault(s), limit {self.max_faults}"
        )


def default_checks() -> tuple[HealthCheck, ...]:
    """The checks ``RestartConfig`` runs unless given others.

    Returns:
        The CUDA device, NVML and host memory checks.
    """
    return (CudaDeviceCheck(), NvmlCheck(), HostMemoryCheck())


def run_checks(
    checks: Sequence[HealthCheck], info: HealthInfo
) -> tuple[bool, list[HealthResult], float]:
    """Run every check (a raising check fails); returns (all ok, results, seconds)."""
    t0 = time.perf_counter()
    results = []
    for check in checks:
        name = getattr(check, "name", type(check).__name__)
        try:
            result = check(info)
        except Exception as e:  # noqa: BLE001 - a check that cannot run is a failed check
            logger.warning("health check %s raised: %r", name, e)
            result = HealthResult(name=name, ok=False, detail=f"raised {type(e).__name__}: {e}")
        results.append(result)
        if not result.ok:
            logger.warning("health check %s failed: %s", result.name, result.detail)
    return all(r.ok for r in results), results, time.perf_counter() - t0
