"""``DeploySpec``: what a user says about a training job on Kubernetes; the renderer does the rest.

Every field is a flag of ``unbroken k8s render`` (``--field-with-dashes``) and a key of the
``--spec FILE.yaml`` mapping (flags override the file). ``__post_init__`` refuses bad values
with a message that names the field, the value seen and what is expected.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import shlex
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from unbroken.k8s import eks

RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")
"""Kubeflow Trainer runtimes a TrainJob can reference."""
# A DNS-1123 label, short enough that "<name>-<index>" and "<name>-node-0-<index>" stay labels.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without base-60 integers: ``nodes: 2:3`` is "2:3", not 123."""


_INT = "tag:yaml.org,2002:int"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _INT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)


@dataclass(frozen=True, kw_only=True)
class DeploySpec:
    """One training job on Kubernetes: its shape, image, command, volumes and budgets."""

    name: str
    """Job name: the Job (or JobSet), its headless Service and the pods' hostname prefix."""
    image: str
    """Container image with unbroken and the training code installed (every pod runs it)."""
    command: tuple[str, ...]
    """What each worker runs, as unbroken-run's target: "-m module args..." or "script.py args..."."""
    namespace: str = "default"
    """Namespace of every object."""
    nodes: str = "1"
    """Nodes as N or MIN:MAX (unbroken-run's --nnodes): the job trains on MIN to MAX nodes."""
    spares: int = 0
    """Pods beyond MAX that wait as hot spares and take a lost node's place at once."""
    nproc_per_node: int = 1
    """Workers (ranks) per node."""
    gpus_per_node: int = 0
    """GPUs each node pod requests (nvidia.com/gpu); 0: CPU only."""
    cpu: str | None = None
    """CPU request of a node pod (a Kubernetes quantity such as "8" or "500m"); None: none."""
    memory: str | None = None
    """Memory request of a node pod (such as "64Gi"); None: none."""
    shm_size: str = "8Gi"
    """Size limit of /dev/shm, a memory emptyDir (data loaders and NCCL use it; the checkpoint
    staging is a memfd, not in it, and counts toward ``memory``)."""
    checkpoint_claim: str | None = None
    """An existing ReadWriteMany PersistentVolumeClaim for checkpoints and the ledger; None: a
    claim "<name>-ckpt" is rendered too."""
    checkpoint_size: str = "100Gi"
    """Size of the rendered claim."""
    checkpoint_storage_class: str | None = None
    """Storage class of the rendered claim (one that offers ReadWriteMany, e.g. EFS's); None:
    the cluster's default."""
    checkpoint_mount: str = "/checkpoints"
    """Where the checkpoint volume is mounted; the run directory is <mount>/<name>."""
    max_restarts: int = 20
    """unbroken-run's restart budget on each node (--max-restarts)."""
    backoff_limit_per_index: int = 3
    """Times Kubernetes replaces the pod of one index after failures it counts."""
    jobset_max_restarts: int = 3
    """JobSet variant: times the whole JobSet is recreated after a child Job failed."""
    rdzv_port: int = 29400
    """Port of the rendezvous store (its pod and Service)."""
    metrics_port: int = 9400
    """Port of each node's Prometheus /metrics endpoint (unbroken-run --ft-metrics-port)."""
    keep_alive_s: float = 1.0
    """Seconds between a node's rendezvous keep-alives."""
    keep_alive_attempts: int = 3
    """Keep-alives a node may miss before the others drop it (node loss detection)."""
    rdzv_poll_s: float = 0.2
    """Seconds between two looks at the rendezvous state while nodes are gathering."""
    membership_check_s: float = 0.5
    """Seconds between two checks, while training, for a lost node or a node waiting to join."""
    join_timeout_s: int = 600
    """Seconds a rendezvous round may wait for enough nodes (a replacement pod included)."""
    stop_grace_s: float = 30.0
    """Seconds unbroken-run gives its workers between SIGTERM and SIGKILL (the last save)."""
    termination_grace_s: int = 60
    """The pods' terminationGracePeriodSeconds: stop grace plus the agent's own flush."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables of the training container (they win over the EFA ones)."""
    efa: int = 0
    """EFA interfaces each node pod requests (vpc.amazonaws.com/efa: as many as its instance type
    has), with the environment NCCL needs on EFA (aws-ofi-nccl); needs zone; 0: no EFA."""
    hugepages_2mi: str | None = None
    """2 MiB huge pages each node pod requests (such as "5120Mi") for libfabric's buffers; needs
    memory or cpu; None: none (and libfabric is told not to use them)."""
    zone: str | None = None
    """Availability zone of every pod (node label topology.kubernetes.io/zone, such as
    "us-east-1a"); None: any zone."""
    instance_type: str | None = None
    """Instance type of the node pods' nodes (node.kubernetes.io/instance-type, such as
    "p5.48xlarge"); None: any."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """More node labels the node pods require (such as the label of a node group launched in one
    cluster placement group)."""
    fsx_file_system_id: str | None = None
    """Checkpoints on an existing FSx for Lustre file system (static provisioning): its id
    ("fs-..."); with fsx_dns_name and fsx_mount_name."""
    fsx_dns_name: str | None = None
    """The existing FSx file system's DNSName."""
    fsx_mount_name: str | None = None
    """The existing FSx file system's MountName."""
    fsx_subnet_id: str | None = None
    """Checkpoints on a new FSx for Lustre file system (dynamic provisioning, checkpoint_size of
    it) created in this subnet ("subnet-..."); with fsx_security_group_ids."""
    fsx_security_group_ids: tuple[str, ...] = ()
    """Security groups of the new FSx file system ("sg-...", comma-separated or a list)."""
    fsx_deployment_type: str | None = None
    """Deployment type of the new FSx file system (SCRATCH_1, SCRATCH_2, PERSISTENT_1,
    PERSISTENT_2); None: PERSISTENT_2."""
    fsx_throughput: int | None = None
    """perUnitStorageThroughput of a new PERSISTENT FSx file system, MB/s per TiB (PERSISTENT_2:
    125, 250, 500 or 1000)."""
    trainjob_runtime: str = "TrainingRuntime"
    """TrainJob layout: the kind of runtime rendered with it, TrainingRuntime (in the namespace)
    or ClusterTrainingRuntime (cluster-wide)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"name must be a lowercase DNS label of at most 40 characters (a-z, 0-9, '-', "
                f"starting with a letter), got {self.name!r}"
            )
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"image must be a container image reference, got {self.image!r}")
        if not self.command:
            raise ValueError("command is empty: give the training script or '-m module' and args")
        if not isinstance(self.namespace, str) or not _NAME.match(self.namespace):
            raise ValueError(f"namespace must be a DNS label, got {self.namespace!r}")
        lo, hi = self.node_range
        for name in ("spares", "gpus_per_node"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("nproc_per_node", "keep_alive_attempts", "join_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_restarts", "backoff_limit_per_index", "jobset_max_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("rdzv_port", "metrics_port"):
            if not 1 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a port in 1-65535, got {getattr(self, name)}")
        if self.rdzv_port == self.metrics_port:
            raise ValueError(f"rdzv_port and metrics_port are both {self.rdzv_port}")
        for name in ("cpu", "memory", "shm_size", "checkpoint_size"):
            value = getattr(self, name)
            if value is not None and not _QUANTITY.match(str(value)):
                raise ValueError(
                    f"{name} must be a Kubernetes quantity like 8, 500m or 64Gi, got {value!r}"
                )
        for name in ("keep_alive_s", "rdzv_poll_s", "membership_check_s", "stop_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.rdzv_poll_s < self.keep_alive_s * self.keep_alive_attempts:
            raise ValueError(
                f"rdzv_poll_s ({self.rdzv_poll_s}) must be smaller than keep_alive_s x "
                f"keep_alive_attempts ({self.keep_alive_s * self.keep_alive_attempts}): a lost "
                "node must be noticed before it is dropped"
            )
        if not self.termination_grace_s > self.stop_grace_s:
            raise ValueError(
                f"termination_grace_s ({self.termination_grace_s}) must be larger than "
                f"stop_grace_s ({self.stop_grace_s}): Kubernetes would SIGKILL the agent while "
                "its workers still flush their last checkpoint"
            )
        if not self.checkpoint_mount.startswith("/") or self.checkpoint_mount in ("/", "/dev/shm"):
            raise ValueError(
                f"checkpoint_mount must be an absolute path, got {self.checkpoint_mount!r}"
            )
        if self.checkpoint_claim is not None and not _NAME.match(self.checkpoint_claim):
            raise ValueError(
                f"checkpoint_claim must be a claim name, got {self.checkpoint_claim!r}"
            )
        for key in self.env:
            if not _ENV_NAME.match(key):
                raise ValueError(f"env: {key!r} is not a valid environment variable name")
        if hi + self.spares > 1000:
            raise ValueError(
                f"nodes + spares must be at most 1000, got {hi + self.spares} ({lo}:{hi})"
            )
        if self.trainjob_runtime not in RUNTIME_KINDS:
            raise ValueError(
                f"trainjob_runtime must be one of {list(RUNTIME_KINDS)}, got "
                f"{self.trainjob_runtime!r}"
            )
        eks.check(self)

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) of ``nodes``."""
        parts = str(self.nodes).split(":")
        try:
            lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
        except ValueError:
            lo, hi = 0, -1
        if not 0 < lo <= hi:
            raise ValueError(f"nodes must be N or MIN:MAX with 0 < MIN <= MAX, got {self.nodes!r}")
        return lo, hi

    @property
    def pods(self) -> int:
        """Node pods the Job runs at once: MAX nodes plus the spares."""
        return self.node_range[1] + self.spares

    @property
    def claim(self) -> str:
        """The checkpoint claim's name."""
        return self.checkpoint_claim or f"{self.name}-ckpt"

    @property
    def run_dir(self) -> str:
        """The job's run directory on the checkpoint volume (ledger, checkpoints, errors)."""
        return f"{self.checkpoint_mount.rstrip('/')}/{self.name}"

    @property
    def store_name(self) -> str:
        """Name of the rendezvous store's Deployment and Service."""
        return f"{self.name}-rdzv"

    @property
    def runtime_name(self) -> str:
        """Name of the TrainJob's runtime (a cluster-wide one has the namespace in it)."""
        if self.trainjob_runtime == "ClusterTrainingRuntime":
            return f"{self.namespace}-{self.name}"
        return self.name


FIELDS = {f.name: f for f in fields(DeploySpec)}
REQUIRED = tuple(
    name for name, f in FIELDS.items() if f.default is MISSING and f.default_factory is MISSING
)


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's one-line docstring (the flag's help text)."""
    tree = ast.parse(inspect.getsource(DeploySpec))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


_MAPPINGS = ("env", "node_selector")
_LISTS = ("fsx_security_group_ids",)
_OPTIONAL_INTS = ("fsx_throughput",)


def _coerce(name: str, value: Any, *, source: str) -> Any:
    default = FIELDS[name].default
    if name == "command":
        if isinstance(value, str):
            return tuple(shlex.split(value))
        if isinstance(value, (list, tuple)) and all(
            isinstance(v, (str, int, float)) for v in value
        ):
            return tuple(str(v) for v in value)
        raise ValueError(f"{source}: command must be a string or a list of strings, got {value!r}")
    if name in _MAPPINGS:
        if not isinstance(value, Mapping):
            raise ValueError(f"{source}: {name} must be a mapping of KEY: value, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    if name in _LISTS:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ValueError(
                f"{source}: {name} must be a list of strings or one comma-separated string, "
                f"got {value!r}"
            )
        return tuple(v.strip() for v in items if v.strip())
    if value is None:
        return None
    if isinstance(default, bool) or isinstance(value, bool):
        raise ValueError(f"{source}: {name} must not be true/false, got {value!r}")
    try:
        if isinstance(default, int) or name in _OPTIONAL_INTS:
            return int(value)
        if isinstance(default, float):
            return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {name} must be a number, got {value!r}") from None
    return str(value)


def load(path: str | Path) -> dict[str, Any]:
    """Field values from a YAML spec file; ValueError names unknown keys and bad values."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"spec file {p} does not exist")
    try:
        obj = yaml.load(p.read_text(), Loader=_Loader)  # a SafeLoader
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise ValueError(f"{p}: expected a mapping of spec fields, got {obj!r:.80}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ValueError(f"{p}: unknown keys {unknown}; valid keys: {sorted(FIELDS)}")
    return {k: _coerce(k, v, source=str(p)) for k, v in obj.items()}


def build(*, spec_path: str | Path | None = None, **overrides: Any) -> DeploySpec:
    """The file's values (if any), then ``overrides`` (None: not given); checks required keys."""
    values = load(spec_path) if spec_path is not None else {}
    for k, v in overrides.items():
        if v is not None:
            values[k] = _coerce(k, v, source=f"--{k.replace('_', '-')}")
    missing = [k for k in REQUIRED if k not in values]
    if missing:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in missing)
        raise ValueError(f"missing {missing}: give {flags} or put them in the --spec file")
    return DeploySpec(**values)
