"""One emulated pod: its identity, its container's process, its end.

A pod runs one container (the manifests here have one per pod). Its process is started inside
the pod's network place (``net.Network.wrap``) with the environment Kubernetes would give it:
the container's ``env`` (values and ``fieldRef``s to the pod's name, namespace, IP and
annotations), ``$(VAR)`` references in the command expanded from it.

Ending a pod, as Kubernetes does:
- ``terminate(grace_s)``: SIGTERM to the container's main process, SIGKILL after the grace
  (a deleted pod: a Job that failed, a JobSet restart);
- ``lose()``: a lost node. The pod gets the ``DisruptionTarget`` condition, its link goes down
  at once (peers see silence), then every process of it dies of SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.k8s.emulate.net import Network, PodNet

logger = logging.getLogger(__name__)

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD = re.compile(r"^metadata\.annotations\['([^']+)'\]$")
DISRUPTION = "DisruptionTarget"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, others kept."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _children(pid: int) -> list[int]:
    try:
        raw = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in raw.split()]


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


@dataclass
class Pod:
    """One pod of the emulated cluster."""

    name: str
    """Unique pod name ("<job>-<index>-<n>" for a Job's pod)."""
    hostname: str
    """Its hostname (the part before the subdomain in its DNS name)."""
    subdomain: str | None
    """The headless Service that gives it a DNS name, if any."""
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    owner: str
    """What created it ("Job/x", "Deployment/y")."""
    index: int | None = None
    """Completion index (Job pods)."""
    net: PodNet | None = None
    conditions: set[str] = field(default_factory=set)
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    """time.time() when its process started."""
    exit_code: int | None = None
    """The container's exit code once it ended (128 + N for signal N, as Kubernetes reports)."""
    ended: float | None = None
    log: Path | None = None
    _kill_at: float | None = None

    @property
    def ip(self) -> str | None:
        return None if self.net is None else self.net.ip

    @property
    def running(self) -> bool:
        return self.proc is not None and self.exit_code is None

    def names(self, cluster_domain: str = "cluster.local") -> list[str]:
        """Its DNS names, the fully qualified one first."""
        if not self.subdomain:
            return []
        short = f"{self.hostname}.{self.subdomain}"
        ns = self.namespace
        return [f"{short}.{ns}.svc.{cluster_domain}", f"{short}.{ns}.svc", f"{short}.{ns}", short]

    def field(self, path: str) -> str | None:
        """A downward-API ``fieldRef`` of this pod."""
        if path == "metadata.name":
            return self.name
        if path == "metadata.namespace":
            return self.namespace
        if path == "status.podIP":
            return self.ip
        m = _FIELD.match(path)
        return self.annotations.get(m.group(1)) if m else None

    def container_env(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's environment variables, in order, ``$(VAR)`` expanded."""
        env: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = expand(str(item["value"]), env)
            else:
                ref = (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath", "")
                value = self.field(ref)
                if value is None:
                    raise ValueError(
                        f"pod {self.name}: env {item['name']}: unsupported ref {ref!r}"
                    )
                env[item["name"]] = value
        return env

    def start(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        network: Network,
        log: Path,
        cwd: str | None = None,
    ) -> None:
        """Start the container's process (in ``cwd``, its ``workingDir``; None: ours)."""
        assert self.net is not None
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                network.wrap(argv, net=self.net, hostname=self.hostname),
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.started = time.time()
        logger.debug("pod %s started (pid %d, %s)", self.name, self.proc.pid, self.ip)

    def main_pid(self) -> int | None:
        """The container's main process (the child of the PID namespace's init in netns mode)."""
        if self.proc is None:
            return None
        if self.net is None or not self.net.netns:
            return self.proc.pid
        for init in _children(self.proc.pid):  # unshare -> the PID namespace's init (sh)
            kids = _children(init)
            if kids:
                return kids[0]
        return None

    def poll(self, now: float) -> bool:
        """Reap the process if it ended; SIGKILL it when a termination's grace ran out.
        True once (when it is first seen ended)."""
        if self.proc is None or self.exit_code is not None:
            return False
        if self._kill_at is not None and now >= self._kill_at:
            self.kill()
        code = self.proc.poll()
        if code is None:
            return False
        self.exit_code = 128 - code if code < 0 else code
        self.ended = time.time()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of a loopback pod
        return True

    def terminate(self, grace_s: float, now: float) -> None:
        """SIGTERM to the main process now, SIGKILL after ``grace_s`` (see ``poll``)."""
        if not self.running or self._kill_at is not None:
            return
        pid = self.main_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        self._kill_at = now + grace_s

    def kill(self) -> None:
        """SIGKILL every process of the pod."""
        if self.proc is None or self.proc.poll() is not None:
            return
        victims = _tree(self.proc.pid)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def lose(self, network: Network) -> None:
        """The node is lost: DisruptionTarget, off the network, every process SIGKILLed."""
        self.conditions.add(DISRUPTION)
        if self.net is not None:
            network.cut(self.net)
        self.kill()
