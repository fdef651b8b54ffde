"""The built-in health checks on a CPU machine, and how failures are reported."""

from __future__ import annotations

import pytest

from unbroken.restart import (
    CudaDeviceCheck,
    FaultCountCheck,
    HealthInfo,
    HostMemoryCheck,
    NvmlCheck,
    default_checks,
)
from unbroken.restart.health import run_checks

INFO = HealthInfo(member=1, rank=1, local_rank=1, iteration=0, faults=1)


def test_defaults_pass_on_a_cpu_job_without_nvml() -> None:
    ok, results, _ = run_checks(default_checks(), INFO)
    assert ok, results
    by_name = {r.name: r for r in results}
    assert set(by_name) == {"cuda_device", "nvml", "host_memory"}


def test_cpu_job_skips_cuda_and_absent_nvml_is_not_a_failure() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert "skipped" in CudaDeviceCheck()(INFO).detail
    result = NvmlCheck()(INFO)
    assert result.ok


def test_host_memory_and_fault_count_fail_past_their_limits() -> None:
    assert HostMemoryCheck(0)(INFO).ok
    assert not HostMemoryCheck(1 << 60)(INFO).ok
    assert FaultCountCheck(2)(INFO).ok
    assert not FaultCountCheck(1)(INFO).ok
    with pytest.raises(ValueError, match="max_faults"):
        FaultCountCheck(0)


def test_a_check_that_raises_fails_the_rank() -> None:
    class Broken:
        name = "broken"

        def __call__(self, info):
            raise OSError("device gone")

    ok, results, seconds = run_checks([HostMemoryCheck(0), Broken()], INFO)
    assert not ok and seconds >= 0
    assert [r.ok for r in results] == [True, False]
    assert "OSError: device gone" in results[1].detail
