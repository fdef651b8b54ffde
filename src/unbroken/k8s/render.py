"""A ``DeploySpec`` as Kubernetes objects (plain dicts), and as the YAML a user applies.

Two layouts, each one self-contained file for ``kubectl apply -f``:

- ``job``: the published layout. An Indexed Job (one pod per node index, hostnames
  ``<name>-<index>``) whose pods find each other through a headless Service of the same name
  (``subdomain``; DNS records published before the pods are ready);
- ``jobset``: the same pods as the single replicated Job of a JobSet (what Kubeflow Trainer v2
  runs), hostnames ``<name>-node-0-<index>``, restarted as a whole by its ``failurePolicy``.

Both add the rendezvous store, a one-replica Deployment with a Service in front
(``<name>-rdzv``): the nodes are the store's clients, so losing any node, index 0 included,
leaves the others running, and Kubernetes replaces the store's pod if it is lost. Plus the
checkpoint volume claim (ReadWriteMany) unless the spec names an existing one.

The training container runs ``unbroken-run`` with c10d rendezvous on the store's Service;
nodes take their rank in the rendezvous by hostname order, which is index order.
``podFailurePolicy`` fails the Job on unbroken-run's give-up exit codes (no restart loop on a
bad config, an exhausted budget, no progress) and ignores disruptions (a node drained, lost or
preempted does not use the per-index budget).
"""

from __future__ import annotations

from typing import Any

import yaml

from unbroken.k8s.spec import DeploySpec
from unbroken.launcher import errors as lerrors

KINDS = ("job", "jobset")
TRAINER = "trainer"
"""Name of the training container (podFailurePolicy rules name it)."""
STORE = "rdzv"
"""Name of the store's container and port."""
METRICS = "metrics"
"""Name of the metrics port."""
GIVE_UP_CODES = (
    lerrors.EXIT_USAGE,
    lerrors.EXIT_BUDGET_EXHAUSTED,
    lerrors.EXIT_NO_PROGRESS,
    lerrors.EXIT_STORAGE_FAILED,
)
"""unbroken-run's exit codes after which a new pod would fail the same way."""
INDEX_ENV = "JOB_COMPLETION_INDEX"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "node"
HEADER = (
    "# Rendered by `unbroken k8s render`{source}: edit the spec and render again.\n"
    "# Apply: kubectl apply -f {file}   Delete: kubectl delete -f {file}\n"
)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def labels(spec: DeploySpec, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "unbroken",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
    }


def _meta(spec: DeploySpec, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": labels(spec, component)}


def launcher_args(spec: DeploySpec) -> list[str]:
    """unbroken-run's arguments in a node pod (the container's ``args``)."""
    conf = f"keep_alive_interval={_num(spec.keep_alive_s)},keep_alive_max_attempt={spec.keep_alive_attempts}"
    return [
        f"--nnodes={spec.nodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--node-rank=$({INDEX_ENV})",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={spec.store_name}:{spec.rdzv_port}",
        f"--rdzv-id={spec.name}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={spec.max_restarts}",
        f"--ft-run-dir={spec.run_dir}",
        f"--ft-rdzv-timeout-s={spec.join_timeout_s}",
        f"--ft-rdzv-poll-s={_num(spec.rdzv_poll_s)}",
        f"--ft-membership-check-s={_num(spec.membership_check_s)}",
        f"--ft-stop-grace-s={_num(spec.stop_grace_s)}",
        f"--ft-metrics-port={spec.metrics_port}",
        *spec.command,
    ]


def _resources(spec: DeploySpec) -> dict[str, Any]:
    requests = {k: str(v) for k, v in (("cpu", spec.cpu), ("memory", spec.memory)) if v}
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if spec.gpus_per_node:
        out["limits"] = {"nvidia.com/gpu": spec.gpus_per_node}
    return out


def node_pod_template(spec: DeploySpec, *, subdomain: str | None) -> dict[str, Any]:
    """The node pods' template; ``subdomain``: the headless Service (None: JobSet sets it)."""
    env: list[dict[str, Any]] = [
        {
            "name": INDEX_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}},
        },
        {"name": "OMP_NUM_THREADS", "value": "1"},
        *({"name": k, "value": v} for k, v in sorted(spec.env.items())),
    ]
    container: dict[str, Any] = {
        "name": TRAINER,
        "image": spec.image,
        "command": ["unbroken-run"],
        "args": launcher_args(spec),
        "env": env,
        "ports": [{"name": METRICS, "containerPort": spec.metrics_port}],
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "checkpoints", "mountPath": spec.checkpoint_mount},
        ],
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.termination_grace_s,
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.claim}},
        ],
    }
    if subdomain is not None:
        pod = {"subdomain": subdomain, **pod}
    return {"metadata": {"labels": labels(spec, "node")}, "spec": pod}


def node_job_spec(spec: DeploySpec, *, subdomain: str | None) -> dict[str, Any]:
    """The Indexed Job's spec (also the JobSet's replicated Job)."""
    lo, _ = spec.node_range
    return {
        "completionMode": "Indexed",
        "completions": spec.pods,
        "parallelism": spec.pods,
        "backoffLimitPerIndex": spec.backoff_limit_per_index,
        # Indexes that may fail for good while the rendezvous still finds MIN nodes.
        "maxFailedIndexes": spec.pods - lo,
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": TRAINER,
                        "operator": "In",
                        "values": list(GIVE_UP_CODES),
                    },
                },
                {
                    "action": "Ignore",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
            ]
        },
        "template": node_pod_template(spec, subdomain=subdomain),
    }


def headless_service(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, spec.name, "node"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(spec, "node"),
            "ports": [{"name": METRICS, "port": spec.metrics_port, "targetPort": METRICS}],
        },
    }


def job(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(spec, spec.name, "node"),
        "spec": node_job_spec(spec, subdomain=spec.name),
    }


def jobset(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _meta(spec, spec.name, "node"),
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {
                "maxRestarts": spec.jobset_max_restarts,
                "rules": [
                    # A give-up exit code failed the child Job: restarting would fail again.
                    {
                        "name": "GiveUp",
                        "action": "FailJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    }
                ],
            },
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": labels(spec, "node")},
                        "spec": node_job_spec(spec, subdomain=None),
                    },
                }
            ],
        },
    }


def store_deployment(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec, spec.store_name, STORE),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels(spec, STORE)},
            "template": {
                "metadata": {"labels": labels(spec, STORE)},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": STORE,
                            "image": spec.image,
                            "command": ["unbroken", "k8s", "store"],
                            "args": [f"--port={spec.rdzv_port}"],
                            "ports": [{"name": STORE, "containerPort": spec.rdzv_port}],
                            "readinessProbe": {
                                "tcpSocket": {"port": STORE},
                                "periodSeconds": 2,
                            },
                            "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
                        }
                    ],
                },
            },
        },
    }


def store_service(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, spec.store_name, STORE),
        "spec": {
            "selector": labels(spec, STORE),
            "ports": [{"name": STORE, "port": spec.rdzv_port, "targetPort": STORE}],
        },
    }


def claim(spec: DeploySpec) -> dict[str, Any]:
    pvc_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": spec.checkpoint_size}},
    }
    if spec.checkpoint_storage_class:
        pvc_spec["storageClassName"] = spec.checkpoint_storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(spec, spec.claim, "checkpoints"),
        "spec": pvc_spec,
    }


def objects(spec: DeploySpec, kind: str) -> list[dict[str, Any]]:
    """Every object of layout ``kind`` ("job" or "jobset"), in apply order."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = [] if spec.checkpoint_claim else [claim(spec)]
    out += [store_deployment(spec), store_service(spec)]
    out += [headless_service(spec), job(spec)] if kind == "job" else [jobset(spec)]
    return out


def to_yaml(docs: list[dict[str, Any]], *, file: str, source: str = "") -> str:
    """The objects as one multi-document YAML file with a header saying how it was made."""
    body = "---\n".join(yaml.safe_dump(d, sort_keys=False, width=100) for d in docs)
    return HEADER.format(source=source, file=file) + body
