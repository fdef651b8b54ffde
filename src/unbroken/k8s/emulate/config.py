"""``EmulationConfig``: how the emulated cluster behaves (its timings and its network mode)."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "netns", "loopback")
"""The values of ``EmulationConfig.mode``."""


@dataclass(frozen=True, kw_only=True)
class EmulationConfig:
    """How the emulated cluster behaves."""

    mode: str = "auto"
    """"netns" (root: namespaces), "loopback" (anywhere), "auto": netns where possible."""
    pod_start_delay_s: float = 0.0
    """From a pod's creation to its container's start (scheduling, sandbox, image): every pod."""
    failure_backoff_s: float = 0.0
    """Job controller back-off before replacing a pod whose failure counted, doubled per
    counted failure of its index (Kubernetes: 10 s); none for an ignored failure."""
    max_backoff_s: float = 360.0
    """Cap of that back-off (Kubernetes: 6 minutes)."""
    poll_s: float = 0.01
    """Period of the controllers' loop."""
    cluster_domain: str = "cluster.local"
    """The cluster's DNS domain."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("pod_start_delay_s", "failure_backoff_s", "max_backoff_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")
