"""The emulated cluster's network: one address per pod, names as the cluster DNS serves them.

Two modes, both an emulation and labelled so (``Network.mode``):

- ``netns`` (root, iproute2 and util-linux): every pod is a network namespace with its own
  ``eth0`` on a bridge that lives in a namespace of its own (the host's network is never
  touched), its own hostname (a UTS namespace) and its own PID namespace (its first process
  is PID 1; killing it kills the pod). DNS is a hosts file per pod
  (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` binds over ``/etc/hosts``) mapping
  ``<hostname>.<subdomain>[.<ns>.svc.cluster.local]`` and Service names to the pods' current
  addresses, as a headless Service does; it is rewritten in place when a pod comes or goes.
  A lost node's link goes down before its processes die, so its peers see silence, not resets.
- ``loopback`` (anywhere): pods are process trees on the host; each gets an address of its own
  in 127.210.0.0/16 (all of it is the host's loopback); names cannot be given, so the
  controller writes addresses where the manifests name pods or Services, and remaps fixed
  ports to free ones.

Every namespace and hosts directory is named ``<prefix><pid>-<n>-...`` (the creating process's
pid): ``close()`` removes them, and a later ``NetnsNetwork`` removes those of dead processes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "ub10-"
"""Prefix of every namespace and hosts directory the emulation creates."""
NETNS_ETC = Path("/etc/netns")
_HOSTS_SIZE = 4096  # the hosts file is rewritten with one page-sized write, never truncated
_clusters = itertools.count()


@dataclass
class PodNet:
    """A pod's place on the network."""

    ip: str
    """Its address (new for every pod, never reused within a cluster)."""
    netns: str | None = None
    """Its network namespace (netns mode)."""


def netns_unavailable() -> str | None:
    """Why pods cannot be network namespaces here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', b'') or e!s}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove namespaces and hosts directories left by dead processes; returns their names."""
    pattern = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    removed = []
    for name in sorted(names):
        m = pattern.match(name)
        if m and not _pid_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            removed.append(name)
    return removed


class Network:
    """Addresses and names of an emulated cluster's pods (see the module docstring)."""

    mode = "abstract"

    def __init__(self) -> None:
        self._n = 0
        self.hosts_lines: list[str] = []

    def _next_index(self) -> int:
        self._n += 1
        return self._n

    def attach(self, pod_name: str) -> PodNet:
        raise NotImplementedError

    def detach(self, net: PodNet) -> None:
        """The pod is gone: free what it held (its address is never handed out again)."""

    def cut(self, net: PodNet) -> None:
        """Take the pod off the network at once (its peers see silence)."""

    def publish(self, records: dict[str, list[str]], own: dict[str, tuple[str, list[str]]]) -> None:
        """The cluster DNS: ``records`` maps an address to its names; ``own`` maps a netns to the
        pod's own (address, names) line, which comes first in its hosts file."""

    def wrap(self, argv: list[str], *, net: PodNet, hostname: str) -> list[str]:
        """The command line that runs ``argv`` inside the pod."""
        return argv

    def close(self) -> None:
        """Remove everything this network created."""


class LoopbackNetwork(Network):
    """Pods as process trees on the host, one 127.210.x.y address each, no names."""

    mode = "loopback"

    def attach(self, pod_name: str) -> PodNet:
        n = self._next_index()
        return PodNet(ip=f"127.210.{n // 250}.{n % 250 + 2}")


class NetnsNetwork(Network):
    """Pods as network + UTS + PID namespaces on a bridge of their own (root only)."""

    mode = "netns"

    def __init__(self, *, subnet: str = "10.210") -> None:
        super().__init__()
        why = netns_unavailable()
        if why is not None:
            raise OSError(f"netns mode unavailable: {why}")
        stale = sweep_stale()
        if stale:
            logger.info("removed %d namespaces left by dead processes", len(stale))
        self.subnet = subnet
        self.tag = f"{PREFIX}{os.getpid()}-{next(_clusters)}"
        self.bridge_ns = f"{self.tag}-net"
        self._live: dict[str, PodNet] = {}
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")

    def attach(self, pod_name: str) -> PodNet:
        n = self._next_index()
        ns = f"{self.tag}-{n}"
        net = PodNet(ip=f"{self.subnet}.{n // 250}.{n % 250 + 2}", netns=ns)
        _ip("netns", "add", ns)
        self._live[ns] = net
        peer = f"v{n}"  # inside the bridge's namespace
        _ip(
            "-n",
            self.bridge_ns,
            "link",
            "add",
            peer,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        _ip("-n", self.bridge_ns, "link", "set", peer, "master", "br0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{net.ip}/16", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("# emulated cluster DNS: the hosts file only\n")
        (etc / "hosts").write_bytes(b"#" * (_HOSTS_SIZE - 1) + b"\n")
        logger.debug("pod %s: netns %s, %s", pod_name, ns, net.ip)
        return net

    def cut(self, net: PodNet) -> None:
        if net.netns is not None:
            with contextlib.suppress(OSError):
                _ip("-n", net.netns, "link", "set", "eth0", "down")

    def detach(self, net: PodNet) -> None:
        if net.netns is None or self._live.pop(net.netns, None) is None:
            return
        subprocess.run(["ip", "netns", "del", net.netns], capture_output=True)
        shutil.rmtree(NETNS_ETC / net.netns, ignore_errors=True)

    def publish(self, records: dict[str, list[str]], own: dict[str, tuple[str, list[str]]]) -> None:
        for ns in self._live:
            lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
            if ns in own:
                ip, names = own[ns]
                lines.append(f"{ip}\t{' '.join(names)}")
            lines += [
                f"{ip}\t{' '.join(names)}"
                for ip, names in sorted(records.items())
                if ns not in own or ip != own[ns][0]
            ]
            text = ("\n".join(lines) + "\n").encode()
            if len(text) >= _HOSTS_SIZE:
                raise OSError(f"emulated hosts file over {_HOSTS_SIZE} bytes: too many pods")
            page = text + b"#" * (_HOSTS_SIZE - len(text) - 1) + b"\n"
            path = NETNS_ETC / ns / "hosts"
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(fd, page, 0)
                finally:
                    os.close(fd)

    def wrap(self, argv: list[str], *, net: PodNet, hostname: str) -> list[str]:
        assert net.netns is not None
        return [
            "ip",
            "netns",
            "exec",
            net.netns,
            "unshare",
            "--uts",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "sh",
            "-c",
            # The shell stays PID 1, as a container runtime's init would (tini): the
            # container's process may signal itself; its exit status is the pod's.
            'hostname "$0" && "$@"',
            hostname,
            *argv,
        ]

    def close(self) -> None:
        for net in list(self._live.values()):
            self.detach(net)
        subprocess.run(["ip", "netns", "del", self.bridge_ns], capture_output=True)
        shutil.rmtree(NETNS_ETC / self.bridge_ns, ignore_errors=True)
