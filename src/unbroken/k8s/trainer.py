"""What Kubeflow Trainer makes of a TrainJob and its runtime: the JobSet it creates, so that the
checks can look at the pods that would run.

As Trainer release ``validate.TRAINER_RELEASE`` does it (``pkg/runtime/framework/plugins/jobset/
builder.go`` and ``plugins/plainml/plainml.go``): the runtime's ``spec.template.spec`` is the
JobSet's spec; in each replicated Job labelled ``trainer.kubeflow.org/trainjob-ancestor-step:
trainer`` the container named ``node`` takes the TrainJob's ``trainer.image``, ``command`` and
``args``, its ``env`` entries are added or replaced, the Job runs one replica, and its
``parallelism`` and ``completions`` become ``trainer.numNodes`` (else the runtime's
``mlPolicy.numNodes``). A framework policy (``mlPolicy.torch`` and the like) makes Trainer set
up its own launcher's environment; unbroken's runtimes have none.
"""

from __future__ import annotations

import copy
from typing import Any

ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_STEP = "trainer"
NODE_CONTAINER = "node"
FRAMEWORKS = ("torch", "mpi", "jax", "xgboost", "flux")
RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")
DEFAULT_RUNTIME_KIND = "ClusterTrainingRuntime"
"""What ``runtimeRef.kind`` defaults to (the CRD's default)."""


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def find_runtime(docs: list[Any], trainjob: dict[str, Any]) -> dict[str, Any] | None:
    """The runtime ``trainjob`` references, among ``docs`` (a TrainingRuntime in its namespace)."""
    ref = _get(trainjob, "spec", "runtimeRef") or {}
    kind = ref.get("kind", DEFAULT_RUNTIME_KIND)
    namespace = _get(trainjob, "metadata", "namespace") or "default"
    for d in docs:
        if not isinstance(d, dict) or d.get("kind") != kind or kind not in RUNTIME_KINDS:
            continue
        if _get(d, "metadata", "name") != ref.get("name"):
            continue
        if kind == "TrainingRuntime" and (_get(d, "metadata", "namespace") or "default") != (
            namespace
        ):
            continue
        return d
    return None


def jobset_of(
    trainjob: dict[str, Any], runtime: dict[str, Any]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(the JobSet spec Trainer creates, [(path in the runtime, why the TrainJob's settings do
    not reach the pods as meant)])."""
    spec = copy.deepcopy(_get(runtime, "spec", "template", "spec") or {})
    trainer = _get(trainjob, "spec", "trainer") or {}
    policy = _get(runtime, "spec", "mlPolicy") or {}
    issues = [
        (
            f"spec.mlPolicy.{fw}",
            f"Trainer's {fw} policy would set up its own launcher in the pods; unbroken-run is "
            "the launcher here: leave mlPolicy with numNodes only",
        )
        for fw in FRAMEWORKS
        if fw in policy
    ]
    count = trainer.get("numNodes", policy.get("numNodes"))
    rjobs = spec.get("replicatedJobs") or []
    targets = [
        (i, r)
        for i, r in enumerate(rjobs)
        if _get(r, "template", "metadata", "labels", ANCESTOR_LABEL) == TRAINER_STEP
    ]
    if not targets:
        issues.append(
            (
                "spec.template.spec.replicatedJobs",
                f"no replicated Job is labelled {ANCESTOR_LABEL}: {TRAINER_STEP}: the TrainJob's "
                "image, command, args and numNodes would reach no pod",
            )
        )
    for i, rjob in targets:
        rjob["replicas"] = 1
        job = _get(rjob, "template", "spec") or {}
        containers = _get(job, "template", "spec", "containers") or []
        node = next((c for c in containers if c.get("name") == NODE_CONTAINER), None)
        if node is None:
            issues.append(
                (
                    f"spec.template.spec.replicatedJobs[{i}].template.spec.template.spec.containers",
                    f"no container is named {NODE_CONTAINER!r}: Trainer sets the TrainJob's image, "
                    "command, args and env in that one only",
                )
            )
        else:
            for key in ("image", "command", "args"):
                if key in trainer:
                    node[key] = copy.deepcopy(trainer[key])
            env = node.setdefault("env", [])
            for var in trainer.get("env") or []:
                at = next((j for j, e in enumerate(env) if e.get("name") == var.get("name")), None)
                if at is None:
                    env.append(copy.deepcopy(var))
                else:
                    env[at] = copy.deepcopy(var)
        if count is not None and isinstance(job, dict):
            job["parallelism"] = job["completions"] = count
    return spec, issues
