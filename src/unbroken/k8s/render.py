"""A ``DeploySpec`` as Kubernetes objects (plain dicts), and as the YAML a user applies.

Three layouts, each one self-contained file for ``kubectl apply -f``:

- ``job``: the published layout. An Indexed Job (one pod per node index, hostnames
  ``<name>-<index>``) whose pods find each other through a headless Service of the same name
  (``subdomain``; DNS records published before the pods are ready);
- ``jobset``: the same pods as the single replicated Job of a JobSet (what Kubeflow Trainer v2
  runs), hostnames ``<name>-node-0-<index>``, restarted as a whole by its ``failurePolicy``;
- ``trainjob``: a Kubeflow Trainer ``TrainJob`` and its runtime (``TrainingRuntime`` or
  ``ClusterTrainingRuntime``) holding that JobSet as its template; Trainer makes the JobSet,
  named after the TrainJob, with the TrainJob's image, command, args and node count.

Both add the rendezvous store, a one-replica Deployment with a Service in front
(``<name>-rdzv``): the nodes are the store's clients, so losing any node, index 0 included,
leaves the others running, and Kubernetes replaces the store's pod if it is lost. Plus the
checkpoint volume claim (ReadWriteMany) unless the spec names an existing one, on FSx for
Lustre when the spec says so (``eks``), with EFA and the placement in one zone (``eks`` too).

The training container runs ``unbroken-run`` with c10d rendezvous on the store's Service;
nodes take their rank in the rendezvous by hostname order, which is index order.
``podFailurePolicy`` fails the Job on unbroken-run's give-up exit codes (no restart loop on a
bad config, an exhausted budget, no progress) and ignores disruptions (a node drained, lost or
preempted does not use the per-index budget).
"""

from __future__ import annotations

from typing import Any

import yaml

from unbroken.k8s import eks
from unbroken.k8s.spec import DeploySpec
from unbroken.launcher import errors as lerrors

KINDS = ("job", "jobset", "trainjob")
TRAINER = "trainer"
"""Name of the training container (podFailurePolicy rules name it)."""
TRAINJOB_CONTAINER = "node"
"""Name of the training container in a Trainer runtime: Trainer sets the image, command, args
and environment of the container of this name only."""
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
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINER_ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
"""The label by which Trainer finds the replicated Job its TrainJob's trainer settings go to."""
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
    extra = eks.extra_resources(spec)  # huge pages and EFA: requests equal limits
    requests |= extra
    limits = {"nvidia.com/gpu": spec.gpus_per_node} if spec.gpus_per_node else {}
    limits |= extra
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def node_pod_template(
    spec: DeploySpec, *, subdomain: str | None, container_name: str = TRAINER
) -> dict[str, Any]:
    """The node pods' template; ``subdomain``: the headless Service (None: JobSet sets it)."""
    efa = {k: v for k, v in eks.efa_env(spec).items() if k not in spec.env}
    env: list[dict[str, Any]] = [
        {
            "name": INDEX_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}},
        },
        {"name": "OMP_NUM_THREADS", "value": "1"},
        *({"name": k, "value": v} for k, v in efa.items()),
        *({"name": k, "value": v} for k, v in sorted(spec.env.items())),
    ]
    container: dict[str, Any] = {
        "name": container_name,
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
        **({"nodeSelector": sel} if (sel := eks.node_selector(spec)) else {}),
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.claim}},
        ],
    }
    if subdomain is not None:
        pod = {"subdomain": subdomain, **pod}
    return {"metadata": {"labels": labels(spec, "node")}, "spec": pod}


def node_job_spec(
    spec: DeploySpec, *, subdomain: str | None, container_name: str = TRAINER
) -> dict[str, Any]:
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
                        "containerName": container_name,
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
        "template": node_pod_template(spec, subdomain=subdomain, container_name=container_name),
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
        "spec": jobset_spec(spec, container_name=TRAINER, job_labels=labels(spec, "node")),
    }


def jobset_spec(
    spec: DeploySpec, *, container_name: str, job_labels: dict[str, str]
) -> dict[str, Any]:
    """The JobSet's spec (also the template of a Trainer runtime)."""
    return {
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
                    "metadata": {"labels": job_labels},
                    "spec": node_job_spec(spec, subdomain=None, container_name=container_name),
                },
            }
        ],
    }


def training_runtime(spec: DeploySpec) -> dict[str, Any]:
    """The TrainJob's runtime: the JobSet as its template, no framework policy (unbroken-run is
    the launcher: Trainer's torch policy would hand torchrun's settings to the container)."""
    meta = _meta(spec, spec.runtime_name, "node")
    if spec.trainjob_runtime == "ClusterTrainingRuntime":
        del meta["namespace"]
    job_labels = {**labels(spec, "node"), TRAINER_ANCESTOR: "trainer"}
    return {
        "apiVersion": TRAINER_API,
        "kind": spec.trainjob_runtime,
        "metadata": meta,
        "spec": {
            "mlPolicy": {"numNodes": spec.pods},
            "template": {
                "metadata": {"labels": labels(spec, "node")},
                "spec": jobset_spec(spec, container_name=TRAINJOB_CONTAINER, job_labels=job_labels),
            },
        },
    }


def trainjob(spec: DeploySpec) -> dict[str, Any]:
    """The TrainJob: its runtime, and what Trainer sets in the runtime's trainer container."""
    return {
        "apiVersion": TRAINER_API,
        "kind": "TrainJob",
        "metadata": _meta(spec, spec.name, "node"),
        "spec": {
            "runtimeRef": {
                "apiGroup": TRAINER_API.split("/")[0],
                "kind": spec.trainjob_runtime,
                "name": spec.runtime_name,
            },
            "trainer": {
                "image": spec.image,
                "command": ["unbroken-run"],
                "args": launcher_args(spec),
                "numNodes": spec.pods,
            },
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
                    **({"nodeSelector": sel} if (sel := eks.store_selector(spec)) else {}),
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
    """Every object of layout ``kind`` (one of ``KINDS``), in apply order."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = eks.fsx_objects(spec, labels=labels(spec, "checkpoints"))
    if not out and not spec.checkpoint_claim:
        out = [claim(spec)]
    out += [store_deployment(spec), store_service(spec)]
    if kind == "job":
        out += [headless_service(spec), job(spec)]
    elif kind == "jobset":
        out += [jobset(spec)]
    else:
        out += [training_runtime(spec), trainjob(spec)]
    return out


def to_yaml(docs: list[dict[str, Any]], *, file: str, source: str = "") -> str:
    """The objects as one multi-document YAML file with a header saying how it was made."""
    body = "---\n".join(yaml.safe_dump(d, sort_keys=False, width=100) for d in docs)
    return HEADER.format(source=source, file=file) + body
