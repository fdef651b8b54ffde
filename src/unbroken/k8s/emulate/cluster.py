"""``Cluster``: applies manifests to the emulated cluster and runs the controllers' loop.

What it emulates (everything else is not there): Services (headless ones give the pods they
select DNS names; a ClusterIP Service's name points at the one pod it selects), Deployments,
Indexed Jobs and JobSets (``workloads``), pods (``pod``) on an emulated network (``net``), a
ReadWriteMany claim as a host directory (its mount path is rewritten to that directory in the
container's arguments and environment), container commands mapped to host executables.

One thread (``unbroken-k8s-emulation``) polls the pods every ``poll_s``, reaps them, updates
the DNS, and runs the controllers' reactions and timers. ``history`` records every pod start
(with its address), end (exit code, conditions), failure decision and Job/JobSet outcome,
stamped with ``time.time()``.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.k8s.emulate import link
from unbroken.k8s.emulate.config import EmulationConfig
from unbroken.k8s.emulate.dns import Dns, Localizer, Service
from unbroken.k8s.emulate.net import LoopbackNetwork, NetnsNetwork, Network, netns_unavailable
from unbroken.k8s.emulate.pod import DISRUPTION, Pod, expand
from unbroken.k8s.emulate.workloads import DeploymentRun, JobRun, JobSetRun

logger = logging.getLogger(__name__)

_NOTABLE = frozenset({"pod_failed", "job_failed", "job_complete", "jobset_restart"})


class Cluster:
    """An emulated cluster. Use ``apply``, then ``wait``; always ``close``.

    Args:
        workdir: Where it keeps its state (pod logs under ``workdir/pods``).
        cfg: How it behaves (None: the defaults).
        commands: Container command -> the host argv that runs it (``unbroken-run`` -> this
            Python's); unmapped commands run as they are.
        volumes: PersistentVolumeClaim name -> the host directory that backs it.
        env: The environment every container starts with, under its own.
        disrupted: Tells whether a pod that failed lost its node (a node-loss fault), which
            gives it the ``DisruptionTarget`` condition.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        cfg: EmulationConfig | None = None,
        commands: dict[str, list[str]] | None = None,
        volumes: dict[str, Path] | None = None,
        env: dict[str, str] | None = None,
        disrupted: Callable[[Pod], bool] | None = None,
    ) -> None:
        self.cfg = cfg or EmulationConfig()
        self.disrupted = disrupted
        self.workdir = Path(workdir)
        self.commands = dict(commands or {})
        self.volumes = {k: Path(v).resolve() for k, v in (volumes or {}).items()}
        self.env = dict(env or {})
        mode = self.cfg.mode
        if mode == "auto":
            mode = "netns" if netns_unavailable() is None else "loopback"
        self.network: Network = NetnsNetwork() if mode == "netns" else LoopbackNetwork()
        self.mode = mode
        self.dns = Dns(self.cfg.cluster_domain)
        self.localizer = Localizer()
        self.pods: list[Pod] = []
        self.history: list[dict[str, Any]] = []
        self.workloads: list[JobRun | JobSetRun] = []
        self.deployments: list[DeploymentRun] = []
        self.closing = False
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._whens: list[tuple[Callable[[], bool], Callable[[], None]]] = []
        self._ends: dict[str, Callable[[Pod], None]] = {}
        self._templates: dict[str, dict[str, Any]] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._links: list[tuple[subprocess.Popen[str], dict[str, Any]]] = []

    # --- what the workloads call -----------------------------------------------------------
    def record(self, event: str, **data: Any) -> None:
        """Append ``event`` to ``history``, stamped with ``time.time()``.

        Args:
            event: What happened ("pod_started", "node_lost", ...).
            **data: Its details.
        """
        self.history.append({"ts": time.time(), "event": event, **data})
        # What changes the job's course at INFO; every pod start and end at DEBUG.
        level = logging.INFO if event in _NOTABLE else logging.DEBUG
        logger.log(level, "emulated k8s: %s %s", event, data)

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the controllers' loop after ``delay_s`` seconds (a workload's timer).

        Args:
            delay_s: The delay.
            fn: What to run.
        """
        heapq.heappush(self._timers, (time.monotonic() + delay_s, next(self._seq), fn))

    def when(self, cond: Callable[[], bool], fn: Callable[[], None]) -> None:
        """Run ``fn`` once, on the controllers' loop, the first time ``cond()`` holds.

        Args:
            cond: The condition, checked every ``poll_s``.
            fn: What to run.
        """
        self._whens.append((cond, fn))

    def add_headless_service(self, name: str, selector: dict[str, str], namespace: str) -> None:
        """Give the pods ``selector`` matches DNS names under ``name`` (a JobSet's Service).

        Args:
            name: The Service's name.
            selector: Pod labels it selects.
            namespace: Its namespace.
        """
        self.dns.services[name] = Service(selector, namespace, headless=True)

    def create_pod(
        self,
        *,
        owner: str,
        name: str,
        hostname: str,
        subdomain: str | None,
        namespace: str,
        template: dict[str, Any],
        labels: dict[str, str],
        annotations: dict[str, str],
        index: int | None,
        on_end: Callable[[Pod], None],
    ) -> Pod:
        """Create a pod; its container starts after ``pod_start_delay_s`` (a workload's call).

        Args:
            owner: The workload that owns it.
            name: The pod's name.
            hostname: Its hostname.
            subdomain: The headless Service that names it (None: none).
            namespace: Its namespace.
            template: The pod template (``spec.containers[0]`` is run).
            labels: Its labels.
            annotations: Its annotations.
            index: Its completion index (None: not an Indexed Job's).
            on_end: Called on the loop when its container ends.

        Returns:
            The pod, not started yet.
        """
        pod = Pod(
            name=name,
            hostname=hostname,
            subdomain=subdomain,
            namespace=namespace,
            labels=labels,
            annotations=annotations,
            owner=owner,
            index=index,
        )
        self.pods.append(pod)
        self._ends[pod.name] = on_end
        self._templates[pod.name] = template
        self.schedule(self.cfg.pod_start_delay_s, lambda: self._start(pod))
        return pod

    def terminate(self, pod: Pod, grace_s: float) -> None:
        """Delete a pod: SIGTERM, SIGKILL after ``grace_s``; one not started yet never starts.

        Args:
            pod: The pod.
            grace_s: Its termination grace period.
        """
        if pod.proc is None:
            pod.exit_code = pod.exit_code if pod.exit_code is not None else -1
            return
        pod.terminate(grace_s, time.monotonic())

    # --- the API for tests and benchmarks ------------------------------------------------------
    def apply(self, docs: list[dict[str, Any]]) -> None:
        """Create the objects (Services, claims, Deployments, Jobs, JobSets) and start them.

        Args:
            docs: The manifests' objects.

        Raises:
            ValueError: When a PersistentVolumeClaim has no host directory (``volumes``).
        """
        with self._lock:
            for doc in docs:
                kind, meta = doc.get("kind"), doc.get("metadata", {})
                ns = meta.get("namespace", "default")
                if kind == "Service":
                    spec = doc.get("spec", {})
                    self.dns.services[meta["name"]] = Service(
                        dict(spec.get("selector") or {}), ns, spec.get("clusterIP") == "None"
                    )
                elif kind == "PersistentVolumeClaim" and meta["name"] not in self.volumes:
                    raise ValueError(f"claim {meta['name']}: no host directory given (volumes=)")
            for doc in docs:
                kind, meta = doc.get("kind"), doc.get("metadata", {})
                if kind == "Deployment":
                    self.deployments.append(DeploymentRun(self, doc))
                elif kind == "Job":
                    self.workloads.append(
                        JobRun(
                            self,
                            name=meta["name"],
                            spec=doc["spec"],
                            hostname_prefix=meta["name"],
                            subdomain=None,
                            namespace=meta.get("namespace", "default"),
                        )
                    )
                elif kind == "JobSet":
                    self.workloads.append(JobSetRun(self, doc))
            for d in self.deployments:
                d.start()
            for w in self.workloads:
                w.start()
            self.record(
                "applied", objects=[f"{d.get('kind')}/{d['metadata']['name']}" for d in docs]
            )
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="unbroken-k8s-emulation", daemon=True
            )
            self._thread.start()

    def running(self, *, owner: str | None = None) -> list[Pod]:
        """The pods whose container runs.

        Args:
            owner: Only those of this workload (None: all).

        Returns:
            The running pods, in creation order.
        """
        with self._lock:
            return [p for p in self.pods if p.running and (owner is None or p.owner == owner)]

    def pod(self, hostname: str) -> Pod:
        """A running pod by its hostname.

        Args:
            hostname: The pod's hostname.

        Returns:
            The newest running pod with it.

        Raises:
            LookupError: When none runs.
        """
        with self._lock:
            found = [p for p in self.pods if p.hostname == hostname and p.running]
        if not found:
            raise LookupError(f"no running pod with hostname {hostname!r}")
        return found[-1]

    def lose(self, pod: Pod, *, evict_grace_s: float | None = None) -> float:
        """Lose the node of ``pod`` now (see ``Pod.lose``), or drain it: ``pod`` is evicted.

        Args:
            pod: The pod whose node is lost or drained.
            evict_grace_s: None: the node is lost. A number: the node is drained, so the pod
                gets ``DisruptionTarget``, SIGTERM, and SIGKILL after this long.

        Returns:
            When, as ``time.time()``.
        """
        with self._lock:
            ts = time.time()
            if evict_grace_s is None:
                pod.lose(self.network)
                event = "node_lost"
            else:
                pod.conditions.add(DISRUPTION)
                pod.terminate(evict_grace_s, time.monotonic())
                event = "pod_evicted"
            self.record(event, pod=pod.name, hostname=pod.hostname, index=pod.index, ip=pod.ip)
            return ts

    def degrade(
        self, pod: Pod, peers: list[Pod], *, delay_ms: float, loss: float, seconds: float, seed: int
    ) -> dict[str, float]:
        """Degrade the links between ``pod`` and each of ``peers`` for a while (``link``); returns
        at once. Recorded as ``link_degraded`` and, when it ends, ``link_restored`` (with the
        packets forwarded and dropped).

        Args:
            pod: One end.
            peers: The other ends.
            delay_ms: Added to every packet, each way.
            loss: Percent of the packets dropped.
            seconds: How long.
            seed: Of the drops' random sequence.

        Returns:
            ``ts`` (when it began) and ``until``.

        Raises:
            OSError: Where it cannot (loopback pods share the host's loopback: there is no
                link between them to degrade), or the cluster is closing.
        """
        if self.mode != "netns":
            raise OSError(f"links can be degraded between netns pods only, not in {self.mode} mode")
        ends = [
            link.End(netns=p.net.netns, ip=p.net.ip)
            for p in (pod, *peers)
            if p.net is not None and p.net.netns is not None
        ]
        if not peers or len(ends) != 1 + len(peers):
            raise OSError(f"pod {pod.name} or its peers have no network namespace")
        end, others = ends[0], ends[1:]
        proc, ready = link.start(
            end, others, delay_ms=delay_ms, loss=loss, seconds=seconds, seed=seed
        )
        what = {"pod": pod.name, "peers": [p.name for p in peers], "delay_ms": delay_ms}
        what.update(loss=loss, seconds=seconds)
        with self._lock:
            if self.closing:  # close() already ended the others: this one must not outlive it
                link.finish(proc)
                raise OSError("the emulated cluster is closing")
            self._links.append((proc, what))
            self.record("link_degraded", **what)
        return ready

    def _reap_links(self, *, end: bool = False) -> None:
        """Record the end of every forwarder that ended (all of them, ended now, with ``end``)."""
        for item in list(self._links):
            proc, what = item
            if end or proc.poll() is not None:
                self._links.remove(item)
                self.record("link_restored", **what, **link.finish(proc))

    def status(self) -> str | None:
        """The workloads' outcome so far.

        Returns:
            "Complete" when every Job/JobSet completed, "Failed" when one failed, else None.
        """
        with self._lock:
            states = [w.status for w in self.workloads]
        if "Failed" in states:
            return "Failed"
        return "Complete" if states and all(s == "Complete" for s in states) else None

    def wait(self, timeout_s: float) -> str:
        """Wait until every Job/JobSet is done and its pods are gone.

        Args:
            timeout_s: How long at most.

        Returns:
            Their ``status``.

        Raises:
            TimeoutError: When they are not done in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                done = self.workloads and all(w.settled for w in self.workloads)
            if done:
                return str(self.status())
            if time.monotonic() > deadline:
                raise TimeoutError(f"the emulated job did not finish in {timeout_s} s")
            time.sleep(0.05)

    def close(self) -> None:
        """Kill every pod, stop the loop, remove the network."""
        with self._lock:
            self.closing = True
            for p in self.pods:
                p.kill()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for p in self.pods:
            if p.proc is not None:
                with contextlib.suppress(Exception):
                    p.proc.wait(timeout=10)
        with self._lock:
            self._reap_links(end=True)
        self.network.close()

    # --- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                try:
                    self._step()
                except Exception:
                    logger.exception("emulated cluster: controller step failed")
            self._stop.wait(self.cfg.poll_s)

    def _step(self) -> None:
        now = time.monotonic()
        self._reap_links()
        ended = [p for p in self.pods if p.poll(now)]
        for pod in ended:
            if pod.exit_code and self.disrupted is not None and self.disrupted(pod):
                pod.conditions.add(DISRUPTION)  # its node went away (a node-loss fault)
            if pod.net is not None:
                self.network.detach(pod.net)
            self.record(
                "pod_ended",
                pod=pod.name,
                hostname=pod.hostname,
                index=pod.index,
                exit_code=pod.exit_code,
                conditions=sorted(pod.conditions),
                owner=pod.owner,
            )
        if ended:
            self.dns.publish(self.network, self.pods)
        for pod in ended:
            self._ends.pop(pod.name)(pod)
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            fn()
        for item in list(self._whens):
            if item[0]():
                self._whens.remove(item)
                item[1]()

    # --- pods ------------------------------------------------------------------------------
    def _start(self, pod: Pod) -> None:
        if pod.exit_code is not None or self.closing:
            return  # deleted before it started
        template = self._templates[pod.name]
        container = template["spec"]["containers"][0]
        pod.net = self.network.attach(pod.name)
        self.dns.publish(self.network, self.pods)
        env = pod.container_env(container)
        if pod.index is not None:
            env.setdefault("JOB_COMPLETION_INDEX", str(pod.index))
        argv = [
            expand(str(a), env)
            for a in (container.get("command") or []) + (container.get("args") or [])
        ]
        mounts = self._mounts(template)
        argv = [self._host_paths(a, mounts) for a in argv]
        env = {k: self._host_paths(v, mounts) for k, v in env.items()}
        if self.mode == "loopback":
            argv, env = self.localizer.rewrite(
                argv,
                env,
                answers=self.dns.answers(self.pods),
                templates=self._templates.values(),
                pod=pod,
            )
        head = self.commands.get(argv[0], [argv[0]])
        workdir = container.get("workingDir")
        pod.start(
            [*head, *argv[1:]],
            env={**self.env, **env},
            network=self.network,
            log=self.workdir / "pods" / f"{pod.name}.log",
            cwd=self._host_paths(str(workdir), mounts) if workdir else None,
        )
        self.record(
            "pod_started",
            pod=pod.name,
            hostname=pod.hostname,
            index=pod.index,
            ip=pod.ip,
            owner=pod.owner,
        )

    def _mounts(self, template: dict[str, Any]) -> dict[str, Path]:
        volumes = {v["name"]: v for v in template["spec"].get("volumes") or []}
        out = {}
        for m in template["spec"]["containers"][0].get("volumeMounts") or []:
            claim = (volumes.get(m["name"], {}).get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None:
                if claim not in self.volumes:
                    raise ValueError(f"claim {claim}: no host directory given (volumes=)")
                out[m["mountPath"].rstrip("/")] = self.volumes[claim]
        return out

    @staticmethod
    def _host_paths(text: str, mounts: dict[str, Path]) -> str:
        for mount, host in mounts.items():
            text = re.sub(rf"(?<![\w/.-]){re.escape(mount)}(?=/|$|[\s,:;])", str(host), text)
        return text
