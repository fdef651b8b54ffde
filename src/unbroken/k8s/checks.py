"""The semantic checks of a set of manifests: what a schema cannot see.

Each Job (and each JobSet's replicated Job) whose pods run ``unbroken-run`` is checked against
the objects beside it and against unbroken-run itself (its arguments are parsed by the
launcher's own parser, so a flag it would refuse is caught here):

- an Indexed Job of ``--nnodes`` MAX or more pods, restartPolicy Never, pods replaced only
  once gone (``podReplacementPolicy: Failed``), a per-index budget;
- ``podFailurePolicy``: FailJob on exactly unbroken-run's give-up exit codes, for the container
  that runs it; Ignore on ``DisruptionTarget``;
- the rendezvous endpoint is a Service of this file in front of a one-replica store
  Deployment that serves on the port the Service targets (no node hosts it);
- the pods' DNS: the Job's ``subdomain`` is a headless Service selecting them that publishes
  not-ready addresses; a JobSet enables DNS hostnames;
- ports agree (``--ft-metrics-port``, the container's ``metrics`` port, the Service's);
- /dev/shm is a memory emptyDir; ``--ft-run-dir`` lies on a ReadWriteMany claim, and a claim
  of this file binds: to a PersistentVolume of the file by name (both of class ""), or through
  a StorageClass of the file (``binding``);
- ``terminationGracePeriodSeconds`` exceeds the launcher's stop grace; GPUs match ranks;
- EFA pods are placed in one availability zone; huge pages come with a cpu or memory request;
- a JobSet fails (instead of restarting) when a give-up exit code failed its child Job;
- a TrainJob's runtime is in the file and takes its settings: the JobSet Trainer would make of
  the two (``trainer.jobset_of``) is checked as a JobSet.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Any

from unbroken.k8s import binding, eks, trainer
from unbroken.k8s.render import GIVE_UP_CODES
from unbroken.k8s.validate import Problem, name_of
from unbroken.launcher import args as largs

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _get(d: Any, *keys: Any, default: Any = None) -> Any:
    for k in keys:
        in_dict = isinstance(d, dict) and k in d
        in_list = isinstance(d, list) and isinstance(k, int) and 0 <= k < len(d)
        if not (in_dict or in_list):
            return default
        d = d[k]
    return d


def _selects(selector: Any, labels: Any) -> bool:
    return bool(selector) and all(_get(labels, k) == v for k, v in selector.items())


class _Workload:
    """One Job spec running unbroken-run, with what it needs from the other objects."""

    def __init__(self, docs: list[Any], obj: str, job: dict[str, Any], path: str) -> None:
        self.docs, self.obj, self.job, self.path = docs, obj, job, path
        self.out: list[Problem] = []

    def bad(self, path: str, message: str) -> None:
        self.out.append(Problem(self.obj, f"{self.path}.{path}" if path else self.path, message))

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if isinstance(d, dict) and d.get("kind") == kind]

    def service(self, name: str) -> dict[str, Any] | None:
        return next(
            (s for s in self.of_kind("Service") if _get(s, "metadata", "name") == name), None
        )

    def check(self, *, jobset: dict[str, Any] | None) -> list[Problem]:
        pod = _get(self.job, "template", "spec", default={})
        containers = pod.get("containers") or []
        index = next(
            (
                i
                for i, c in enumerate(containers)
                if os.path.basename(str(_get(c, "command", 0, default=""))) == "unbroken-run"
            ),
            None,
        )
        if index is None:
            self.bad("template.spec.containers", "no container runs unbroken-run (command)")
            return self.out
        trainer = containers[index]
        cpath = f"template.spec.containers[{index}]"
        args = [_VAR.sub("0", str(a)) for a in trainer.get("args") or []]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                spec, cfg, _ = largs.parse(args)
        except (ValueError, FileNotFoundError, SystemExit) as e:
            why = err.getvalue().strip().splitlines()[-1:] or [str(e)]
            self.bad(f"{cpath}.args", f"unbroken-run refuses these arguments: {why[0]}")
            return self.out
        self._job_shape(spec, pod)
        self._failure_policy(trainer["name"])
        self._rendezvous(spec)
        self._dns(pod, jobset)
        self._ports(cfg, trainer, cpath, jobset)
        self._volumes(cfg, pod, trainer, cpath)
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if not grace > cfg.stop_grace_s:
            self.bad(
                "template.spec.terminationGracePeriodSeconds",
                f"{grace} s does not exceed unbroken-run's stop grace ({cfg.stop_grace_s} s, "
                "--ft-stop-grace-s): the last checkpoint and the ledger would be cut off",
            )
        gpus = _get(trainer, "resources", "limits", "nvidia.com/gpu")
        if gpus and int(gpus) != spec.nproc_per_node:
            self.bad(
                f"{cpath}.resources.limits",
                f"{gpus} GPUs but --nproc-per-node {spec.nproc_per_node}: one rank per GPU",
            )
        self._eks(pod, trainer, cpath)
        return self.out

    def _eks(self, pod: dict[str, Any], trainer: dict[str, Any], cpath: str) -> None:
        res = trainer.get("resources") or {}
        efa = _get(res, "limits", eks.EFA_RESOURCE) or _get(res, "requests", eks.EFA_RESOURCE)
        zone = _get(pod, "nodeSelector", eks.ZONE_LABEL) or _get(
            pod, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution"
        )
        if efa and not zone:
            self.bad(
                "template.spec.nodeSelector",
                f"{efa} EFA interfaces but no {eks.ZONE_LABEL}: the nodes of an EFA job must "
                "share one availability zone",
            )
        huge = any(str(k).startswith("hugepages-") for part in res.values() for k in part or {})
        if huge and not any(k in part for part in res.values() for k in ("cpu", "memory")):
            self.bad(
                f"{cpath}.resources",
                "huge pages without a cpu or memory request: Kubernetes refuses the pod",
            )

    def _job_shape(self, spec: largs.JobSpec, pod: dict[str, Any]) -> None:
        job = self.job
        if job.get("completionMode") != "Indexed":
            self.bad("completionMode", "must be Indexed (node identity from the index)")
        completions, parallelism = job.get("completions"), job.get("parallelism")
        if completions != parallelism:
            self.bad(
                "parallelism", f"{parallelism} != completions {completions}: every pod runs at once"
            )
        if not isinstance(completions, int) or completions < spec.max_nodes:
            self.bad(
                "completions",
                f"{completions} pods can never form --nnodes {spec.min_nodes}:{spec.max_nodes}",
            )
        if pod.get("restartPolicy") != "Never":
            self.bad("template.spec.restartPolicy", "must be Never (podFailurePolicy needs it)")
        if job.get("podReplacementPolicy") != "Failed":
            self.bad(
                "podReplacementPolicy",
                "must be Failed: a replacement must not start while the old pod still runs",
            )
        if job.get("backoffLimitPerIndex") is None:
            self.bad("backoffLimitPerIndex", "missing: a lost node's index must be replaced alone")
        failed = job.get("maxFailedIndexes")
        if isinstance(failed, int) and isinstance(completions, int) and failed > completions:
            self.bad(
                "maxFailedIndexes",
                f"{failed} exceeds completions {completions}: Kubernetes refuses the Job",
            )

    def _failure_policy(self, trainer: str) -> None:
        rules = _get(self.job, "podFailurePolicy", "rules", default=[]) or []
        fail = [r for r in rules if r.get("action") == "FailJob" and r.get("onExitCodes")]
        want = sorted(GIVE_UP_CODES)
        if not fail:
            self.bad(
                "podFailurePolicy",
                f"no FailJob rule on unbroken-run's give-up exit codes {want}: a bad config "
                "or an exhausted budget would be retried in a loop",
            )
        for rule in fail:
            at = f"podFailurePolicy.rules[{rules.index(rule)}].onExitCodes"
            codes = rule["onExitCodes"]
            got = sorted(int(v) for v in codes.get("values") or [])
            if codes.get("operator") != "In" or got != want:
                self.bad(
                    at,
                    f"FailJob on {codes.get('operator')} {got}; unbroken-run gives up with "
                    f"{want} (2 bad flags, 3 restart budget exhausted, 4 no progress, 6 storage failed)",
                )
            if codes.get("containerName") not in (None, trainer):
                self.bad(
                    f"{at}.containerName",
                    f"{codes.get('containerName')!r} is not the container running unbroken-run "
                    f"({trainer!r})",
                )
        ignores = [
            r
            for r in rules
            if r.get("action") == "Ignore"
            and any(c.get("type") == "DisruptionTarget" for c in r.get("onPodConditions") or [])
        ]
        if not ignores:
            self.bad(
                "podFailurePolicy",
                "no Ignore rule on the DisruptionTarget condition: a drained or lost node "
                "would use up the index's backoff budget",
            )

    def _rendezvous(self, spec: largs.JobSpec) -> None:
        host, _, port = spec.rdzv_endpoint.rpartition(":")
        svc_name = host.split(".")[0]
        svc = self.service(svc_name)
        if svc is None:
            self.bad(
                "template.spec.containers",
                f"the rendezvous endpoint {spec.rdzv_endpoint} is not a Service of this file: "
                "a node would host the store, and losing it would end the job",
            )
            return
        sport = next(
            (p for p in _get(svc, "spec", "ports", default=[]) if str(p.get("port")) == port), None
        )
        if sport is None:
            self.bad("", f"Service {svc_name} has no port {port} (the rendezvous endpoint's)")
            return
        selector = _get(svc, "spec", "selector", default={})
        stores = [
            d
            for d in self.of_kind("Deployment")
            if _selects(selector, _get(d, "spec", "template", "metadata", "labels"))
        ]
        if len(stores) != 1:
            self.bad(
                "",
                f"Service {svc_name} must select exactly one store Deployment, got {len(stores)}",
            )
            return
        store = stores[0]
        if _get(store, "spec", "replicas", default=1) != 1:
            self.bad("", f"Deployment/{store['metadata']['name']}: the store has one replica")
        target = sport.get("targetPort", sport.get("port"))
        for c in _get(store, "spec", "template", "spec", "containers", default=[]):
            ports = {str(p.get("name")): p.get("containerPort") for p in c.get("ports") or []}
            number = ports.get(str(target), target)
            cmd = [str(x) for x in (c.get("command") or []) + (c.get("args") or [])]
            if cmd[1:3] == ["k8s", "store"] and f"--port={number}" not in cmd:
                self.bad(
                    "",
                    f"Deployment/{store['metadata']['name']}: the store serves on "
                    f"{[a for a in cmd if a.startswith('--port')]}, the Service targets {number}",
                )

    def _dns(self, pod: dict[str, Any], jobset: dict[str, Any] | None) -> None:
        if jobset is not None:
            net = _get(jobset, "spec", "network", default={})
            if not net.get("enableDNSHostnames"):
                self.out.append(
                    Problem(
                        self.obj,
                        "spec.network.enableDNSHostnames",
                        "must be true: nodes find each other by name",
                    )
                )
            if net.get("publishNotReadyAddresses") is False:
                self.out.append(
                    Problem(
                        self.obj,
                        "spec.network.publishNotReadyAddresses",
                        "must not be false: pods resolve before they are ready",
                    )
                )
            return
        sub = pod.get("subdomain")
        svc = self.service(sub) if sub else None
        if svc is None:
            self.bad("template.spec.subdomain", f"{sub!r} is not a headless Service of this file")
            return
        spec = svc.get("spec", {})
        if spec.get("clusterIP") != "None":
            self.bad("template.spec.subdomain", f"Service {sub} is not headless (clusterIP: None)")
        if spec.get("publishNotReadyAddresses") is not True:
            self.bad("template.spec.subdomain", f"Service {sub} must publish not-ready addresses")
        if not _selects(spec.get("selector"), _get(self.job, "template", "metadata", "labels")):
            self.bad(
                "template.metadata.labels", f"Service {sub}'s selector does not select these pods"
            )

    def _ports(self, cfg: Any, trainer: dict[str, Any], cpath: str, jobset: Any) -> None:
        if not cfg.metrics_port:
            return
        ports = {p.get("name"): p.get("containerPort") for p in trainer.get("ports") or []}
        if ports.get("metrics") != cfg.metrics_port:
            self.bad(
                f"{cpath}.ports",
                f"--ft-metrics-port {cfg.metrics_port} needs a port named metrics with that "
                f"containerPort, got {ports.get('metrics')}",
            )
        sub = _get(self.job, "template", "spec", "subdomain")
        svc = self.service(sub) if sub and jobset is None else None
        for p in _get(svc, "spec", "ports", default=[]) or []:
            if p.get("name") == "metrics" and p.get("targetPort") not in (
                "metrics",
                cfg.metrics_port,
            ):
                self.bad(
                    "template.spec.subdomain",
                    f"Service {sub}'s metrics port targets {p.get('targetPort')}",
                )

    def _volumes(self, cfg: Any, pod: dict[str, Any], trainer: dict[str, Any], cpath: str) -> None:
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        mounts = {m.get("mountPath"): m.get("name") for m in trainer.get("volumeMounts") or []}
        shm = volumes.get(mounts.get("/dev/shm"), {})
        if _get(shm, "emptyDir", "medium") != "Memory":
            self.bad(f"{cpath}.volumeMounts", "/dev/shm must be an emptyDir with medium Memory")
        if cfg.run_dir is None:
            self.bad(
                f"{cpath}.args",
                "no --ft-run-dir: the ledger and checkpoints need the shared volume",
            )
            return
        run_dir = str(cfg.run_dir)
        mount = max(
            (m for m in mounts if m and (run_dir == m or run_dir.startswith(m.rstrip("/") + "/"))),
            key=len,
            default=None,
        )
        claim = _get(volumes.get(mounts.get(mount)), "persistentVolumeClaim", "claimName")
        if claim is None:
            self.bad(
                f"{cpath}.volumeMounts",
                f"--ft-run-dir {run_dir} is not on a PersistentVolumeClaim mount",
            )
            return
        pvc = next(
            (
                d
                for d in self.of_kind("PersistentVolumeClaim")
                if _get(d, "metadata", "name") == claim
            ),
            None,
        )
        if pvc is not None and "ReadWriteMany" not in (_get(pvc, "spec", "accessModes") or []):
            self.out.append(
                Problem(
                    f"PersistentVolumeClaim/{claim}",
                    "spec.accessModes",
                    f"must include ReadWriteMany: every node of {self.obj} writes it",
                )
            )
        if pvc is not None:
            self.out.extend(binding.problems(self.docs, pvc))


def problems(docs: list[Any]) -> list[Problem]:
    """Semantic problems of objects that passed their schemas."""
    out: list[Problem] = []
    found = 0
    for i, doc in enumerate(docs):
        obj = name_of(doc, i)
        if doc.get("kind") == "Job":
            found += 1
            out += _Workload(docs, obj, doc.get("spec", {}), "spec").check(jobset=None)
        elif doc.get("kind") == "JobSet":
            found += 1
            out += _jobset(doc, obj)
            for j, rjob in enumerate(_get(doc, "spec", "replicatedJobs", default=[]) or []):
                path = f"spec.replicatedJobs[{j}].template.spec"
                job = _get(rjob, "template", "spec", default={})
                out += _Workload(docs, obj, job, path).check(jobset=doc)
        elif doc.get("kind") == "TrainJob":
            found += 1
            out += _trainjob(docs, doc, obj)
    if not found:
        out.append(Problem("file", "", "no Job, JobSet or TrainJob in it"))
    return out


def _trainjob(docs: list[Any], doc: dict[str, Any], obj: str) -> list[Problem]:
    """A TrainJob: its runtime is in the file, and the JobSet Trainer makes of them passes."""
    runtime = trainer.find_runtime(docs, doc)
    if runtime is None:
        ref = _get(doc, "spec", "runtimeRef", default={})
        kind = ref.get("kind", trainer.DEFAULT_RUNTIME_KIND)
        return [
            Problem(
                obj,
                "spec.runtimeRef",
                f"{kind}/{ref.get('name')} is not in this file: its pods cannot be checked "
                "(render the TrainJob with its runtime: unbroken k8s render --kind trainjob)",
            )
        ]
    robj = name_of(runtime, 0)
    spec, issues = trainer.jobset_of(doc, runtime)
    out = [Problem(robj, path, message) for path, message in issues]
    effective = {"spec": spec}
    where = f"{obj} with {robj}"
    out += _jobset(effective, where)
    for j, rjob in enumerate(spec.get("replicatedJobs") or []):
        if _get(rjob, "template", "metadata", "labels", trainer.ANCESTOR_LABEL) != "trainer":
            continue
        path = f"spec.template.spec.replicatedJobs[{j}].template.spec"
        job = _get(rjob, "template", "spec", default={})
        out += _Workload(docs, where, job, path).check(jobset=effective)
    return out


def _jobset(doc: dict[str, Any], obj: str) -> list[Problem]:
    rules = _get(doc, "spec", "failurePolicy", "rules", default=[]) or []
    if not any(
        r.get("action") == "FailJobSet"
        and "PodFailurePolicy" in (r.get("onJobFailureReasons") or [])
        for r in rules
    ):
        return [
            Problem(
                obj,
                "spec.failurePolicy.rules",
                "no FailJobSet rule on the PodFailurePolicy reason: a give-up exit code would "
                "restart the whole JobSet in a loop",
            )
        ]
    return []
