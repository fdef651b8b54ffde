"""The host's rights and services: cgroups (slow-rank faults), network namespaces (the emulated
cluster), ports, clocks."""

from __future__ import annotations

import socket
import time

from unbroken.doctor.config import Check, DoctorConfig
from unbroken.ports import ephemeral_range

_SANE_WALL = (1_704_067_200.0, 4_102_444_800.0)  # 2024-01-01 .. 2100-01-01, UTC


def check_cgroup(cfg: DoctorConfig) -> Check:
    """A cpu quota can be put on a child cgroup (what a slow-rank fault does)."""
    from unbroken.faults import slowrank

    mechanism, where = slowrank.probe()
    if mechanism == "emulated":
        return Check(
            "cgroup",
            "warn",
            f"{where}: slow-rank faults fall back to stopping and continuing the rank",
            "for real cpu throttling: cgroup v2 with the cpu controller delegated and cpu.max "
            "writable (or v1 cpu.cfs_quota_us) for this user",
        )
    return Check("cgroup", "ok", f"{mechanism}: a cpu quota was set on a child of {where}")


def check_netns(cfg: DoctorConfig) -> Check:
    """Network namespaces can be made (only the emulated cluster needs them)."""
    from unbroken.k8s.emulate.net import netns_unavailable

    why = netns_unavailable()
    if why is not None:
        return Check(
            "netns",
            "warn",
            f"{why}: the emulated cluster runs in loopback mode",
            "only for `unbroken bench k8s` and the emulated cluster: run as root with iproute2",
        )
    return Check("netns", "ok", "a network namespace was created and removed (ip netns)")


# --- ports and clocks -------------------------------------------------------------------------
def _bind(port: int) -> int:
    """Bind and listen on ``port`` of every interface, as a store does; the port bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
        s.listen(1)
        return int(s.getsockname()[1])


def check_port(cfg: DoctorConfig) -> Check:
    """Port 0 gets a free port (every test and in-process store uses it) and ``port``, when
    given, is free to bind."""
    try:
        got = _bind(0)
    except OSError as e:
        return Check("port", "fail", f"cannot bind port 0: {e}", "check the network sandbox")
    if cfg.port is None or cfg.port == 0:
        return Check("port", "ok", f"port 0 binds (got {got}); pass --port to check the job's")
    try:
        _bind(cfg.port)
    except OSError as e:
        return Check(
            "port",
            "fail",
            f"port {cfg.port} cannot be bound: {e.strerror or e}",
            f"pick a free port (`ss -ltnp 'sport = :{cfg.port}'` shows who holds it)",
        )
    found = f"port {cfg.port} is free; port 0 binds"
    eph = ephemeral_range()
    if eph and eph[0] <= cfg.port <= eph[1]:
        return Check(
            "port",
            "warn",
            f"{found}, but {cfg.port} lies in the ephemeral range {eph[0]}-{eph[1]}: an outgoing "
            "connection may take it before the job binds it",
            f"pick a port below {eph[0]} (torchrun's default 29500 is)",
        )
    return Check("port", "ok", found)


def check_clock(cfg: DoctorConfig) -> Check:
    """The monotonic clock advances and agrees with the wall clock, which reads a sane date
    (ledger records of different nodes are ordered by it)."""
    m0, w0 = time.monotonic(), time.time()
    time.sleep(0.05)
    m1, w1 = time.monotonic(), time.time()
    fix_ntp = "sync the clock (NTP/chrony) on every node"
    if not m1 > m0:
        return Check("clock", "fail", f"time.monotonic() did not advance ({m0} -> {m1})", "")
    if not _SANE_WALL[0] <= w1 <= _SANE_WALL[1]:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(w1))
        return Check("clock", "fail", f"the wall clock reads {when}", fix_ntp)
    drift = abs((w1 - w0) - (m1 - m0))
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(w1))
    if drift > 0.5:
        return Check(
            "clock",
            "warn",
            f"the wall clock moved {drift:.2f} s against the monotonic one in 50 ms (stepped?)",
            fix_ntp,
        )
    return Check("clock", "ok", f"monotonic advances; wall clock {when}")
