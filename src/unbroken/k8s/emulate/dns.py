"""The emulated cluster DNS, and what loopback mode writes in place of names.

``Dns.answers(pods)`` is what the cluster DNS would answer now:

- a pod selected by the headless Service named by its ``subdomain`` has the records
  ``<hostname>.<subdomain>``, ``...<ns>``, ``...<ns>.svc``, ``...<ns>.svc.<domain>`` from the
  moment it has an address until it ends (``publishNotReadyAddresses``);
- a ClusterIP Service's name (same four forms) points at the one running pod it selects
  (emulated: the pod's address instead of a virtual IP).

In netns mode these become the pods' hosts files (``publish``). In loopback mode, where names
cannot be given, ``Localizer`` writes the addresses into the container's arguments and
environment instead, and maps every declared container port to a free host port (pods share the
host's ports there): ``name[:port]``, ``--port=N`` and ``*PORT=N`` are rewritten.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from unbroken.k8s.emulate.net import Network
from unbroken.k8s.emulate.pod import Pod
from unbroken.ports import spare_port


@dataclass
class Service:
    selector: dict[str, str]
    namespace: str
    headless: bool


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class Dns:
    """The Services of a cluster and the names they give."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self.services: dict[str, Service] = {}

    def answers(self, pods: Iterable[Pod]) -> dict[str, str]:
        """DNS name -> address, now."""
        live = [p for p in pods if p.net is not None and p.exit_code is None]
        out: dict[str, str] = {}
        for pod in live:
            svc = self.services.get(pod.subdomain or "")
            if svc is not None and svc.headless and selects(svc.selector, pod.labels):
                out.update(dict.fromkeys(pod.names(self.domain), str(pod.ip)))
        for name, svc in self.services.items():
            target = next((p for p in live if selects(svc.selector, p.labels)), None)
            if not svc.headless and target is not None:
                ns = svc.namespace
                names = (f"{name}.{ns}.svc.{self.domain}", f"{name}.{ns}.svc", f"{name}.{ns}", name)
                out.update(dict.fromkeys(names, str(target.ip)))
        return out

    def publish(self, network: Network, pods: list[Pod]) -> None:
        """Write the answers into every pod's hosts file (netns mode), its own line first."""
        records: dict[str, list[str]] = {}
        for name, ip in sorted(self.answers(pods).items(), key=lambda kv: -len(kv[0])):
            records.setdefault(ip, []).append(name)
        own = {
            pod.net.netns: (pod.net.ip, [*pod.names(self.domain), pod.hostname])
            for pod in pods
            if pod.net is not None and pod.net.netns and pod.exit_code is None
        }
        network.publish(records, own)


class Localizer:
    """Loopback mode: addresses where the manifests name pods and Services, free host ports
    for the declared container ports (one host port per declared port, for the cluster's life)."""

    def __init__(self) -> None:
        self.ports: dict[int, int] = {}

    def port(self, port: int) -> int:
        if port not in self.ports:
            self.ports[port] = spare_port()
        return self.ports[port]

    def rewrite(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        answers: dict[str, str],
        templates: Iterable[dict[str, Any]],
        pod: Pod,
    ) -> tuple[list[str], dict[str, str]]:
        declared = {
            int(p["containerPort"])
            for t in templates
            for c in t["spec"]["containers"]
            for p in c.get("ports") or []
        }
        alternatives = "|".join(re.escape(n) for n in sorted(answers, key=len, reverse=True))
        name = re.compile(rf"(?<![\w.-])({alternatives})(?::(\d+))?(?![\w.-])") if answers else None

        def mapped(port: str) -> str:
            return str(self.port(int(port))) if int(port) in declared else port

        def address(m: re.Match[str]) -> str:
            return answers[m.group(1)] + (f":{mapped(m.group(2))}" if m.group(2) else "")

        def sub(text: str) -> str:
            if name is not None:
                text = name.sub(address, text)
            flag = re.match(r"^(--port=)(\d+)$", text)
            return flag.group(1) + mapped(flag.group(2)) if flag else text

        argv = [sub(a) for a in argv]
        env = {
            k: mapped(v) if k.endswith("PORT") and v.isdigit() else sub(v) for k, v in env.items()
        }
        if argv and argv[0] == "unbroken-run":  # the node's address, as its name would give it
            argv = [argv[0], f"--local-addr={pod.ip}", *argv[1:]]
        return argv, env
