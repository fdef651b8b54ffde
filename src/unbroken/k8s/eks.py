"""The EKS pieces of a ``DeploySpec``, each opt-in: EFA, placement in one zone, FSx for Lustre.

- EFA: the node pods request ``vpc.amazonaws.com/efa`` (the EFA device plugin's resource) and,
  optionally, ``hugepages-2Mi``; the trainer gets the environment NCCL needs on EFA through the
  aws-ofi-nccl plugin (``efa_env``);
- placement: a ``nodeSelector`` on the availability zone (node pods and the store pod), the
  instance type and any other node labels (node pods);
- FSx for Lustre for checkpoints: an existing file system (a PersistentVolume of the FSx CSI
  driver and a claim bound to it by name) or a new one (a StorageClass that provisions it, and a
  claim of that class).

``check`` refuses bad values (called by ``DeploySpec.__post_init__``); the other functions are
what ``render`` puts in the manifests.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.k8s.spec import DeploySpec

EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
ZONE_LABEL = "topology.kubernetes.io/zone"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
FSX_DRIVER = "fsx.csi.aws.com"
FSX_MOUNT_OPTIONS = ["flock"]
"""Lustre clients mount without flock unless told; the run directory's owner record needs it."""
FSX_DEFAULT_DEPLOYMENT = "PERSISTENT_2"
FSX_THROUGHPUT = {
    "SCRATCH_1": (),
    "SCRATCH_2": (),
    "PERSISTENT_1": (50, 100, 200),
    "PERSISTENT_2": (125, 250, 500, 1000),
}
"""FSx for Lustre deployment types (SSD storage) and their perUnitStorageThroughput values, in
MB/s per TiB (FSx API, CreateFileSystemLustreConfiguration); scratch ones take none."""

# The environment NCCL needs on EFA through the aws-ofi-nccl plugin. What this relies on:
# aws-samples/awsome-distributed-training, 1.architectures/efa-cheatsheet.md: with
# libfabric >= 1.18 and aws-ofi-nccl >= 1.7 (any current image) FI_EFA_USE_DEVICE_RDMA=1 need not
# be set (the plugin turns device RDMA on where the instance has it; set it by hand it breaks
# instances without it), NCCL_PROTO=simple and FI_PROVIDER=efa were for aws-ofi-nccl <= 1.5
# (NCCL_PROTO=simple would keep NCCL off its LL/LL128 protocols, so it is not set); and
# FI_EFA_USE_HUGE_PAGE=0 keeps fork() (data-loader workers, the checkpoint writer) from failing
# with "Cannot allocate memory" when libfabric holds huge pages the pod did not request.
# FI_PROVIDER=efa stays: it pins libfabric to EFA, so a pod without working EFA fails at NCCL's
# start instead of training over libfabric's TCP provider. The aws-ofi-nccl wiki ("Environment
# Variables") says its own socket interfaces exclude "lo,docker0"; NCCL's bootstrap sockets get
# the same exclusion (a pod's eth0 remains). spec.env overrides any of these.
EFA_ENV = {
    "FI_PROVIDER": "efa",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}
NO_HUGE_PAGES_ENV = {"FI_EFA_USE_HUGE_PAGE": "0"}
"""Added to ``EFA_ENV`` when the pod requests no huge pages."""

_ZONE = re.compile(r"^[a-z]{2}(-[a-z0-9]+)+-[0-9]+[a-z]$")
_INSTANCE_TYPE = re.compile(r"^[a-z0-9-]+(\.[a-z0-9-]+)+$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_FS_ID = re.compile(r"^fs-[0-9a-f]{8,17}$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_SG = re.compile(r"^sg-[0-9a-f]{8,17}$")
_MOUNT_NAME = re.compile(r"^[a-z0-9]{1,8}$")
_HUGEPAGES = re.compile(r"^([0-9]+)(Mi|Gi)$")

STATIC_FIELDS = ("fsx_file_system_id", "fsx_dns_name", "fsx_mount_name")
DYNAMIC_FIELDS = (
    "fsx_subnet_id",
    "fsx_security_group_ids",
    "fsx_deployment_type",
    "fsx_throughput",
)


def _given(spec: DeploySpec, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(spec, n) not in (None, (), "")]


def fsx_mode(spec: DeploySpec) -> str | None:
    """ "static" (an existing file system), "dynamic" (a new one) or None (no FSx)."""
    if _given(spec, STATIC_FIELDS):
        return "static"
    return "dynamic" if _given(spec, DYNAMIC_FIELDS) else None


def _label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    ok_prefix = not prefix or (len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.match(prefix)))
    return ok_prefix and bool(_LABEL_NAME.match(name))


def check(spec: DeploySpec) -> None:
    """ValueError naming the field, the value seen and what to do, for a bad EKS value."""
    _check_efa(spec)
    _check_placement(spec)
    _check_fsx(spec)


def _check_efa(spec: DeploySpec) -> None:
    if spec.efa < 0:
        raise ValueError(
            f"efa must be >= 0 (EFA interfaces each node pod requests; 0: no EFA), got {spec.efa}"
        )
    if spec.hugepages_2mi is not None:
        m = _HUGEPAGES.match(str(spec.hugepages_2mi))
        mib = int(m.group(1)) * (1024 if m.group(2) == "Gi" else 1) if m else 0
        if not mib or mib % 2:
            raise ValueError(
                "hugepages_2mi must be a whole number of 2 MiB pages written in Mi or Gi, such as "
                f"5120Mi, got {spec.hugepages_2mi!r}"
            )
        if spec.cpu is None and spec.memory is None:
            raise ValueError(
                f"hugepages_2mi is {spec.hugepages_2mi} but neither memory nor cpu is set: "
                "Kubernetes refuses a container that requests huge pages without a cpu or memory "
                "request; give memory (such as 1600Gi)"
            )
    if spec.efa and spec.zone is None:
        raise ValueError(
            f"efa is {spec.efa} but zone is not set: the nodes of an EFA job must share one "
            "availability zone (as a cluster placement group does); give zone, such as "
            "us-east-1a, or set efa to 0"
        )


def _check_placement(spec: DeploySpec) -> None:
    if spec.zone is not None and not _ZONE.match(spec.zone):
        raise ValueError(
            f"zone must be an availability zone name such as us-east-1a (the node label "
            f"{ZONE_LABEL}; not a zone ID such as use1-az1), got {spec.zone!r}"
        )
    if spec.instance_type is not None and not _INSTANCE_TYPE.match(spec.instance_type):
        raise ValueError(
            f"instance_type must be an EC2 instance type such as p5.48xlarge, got "
            f"{spec.instance_type!r}"
        )
    for key, value in spec.node_selector.items():
        if not _label_key(key):
            raise ValueError(
                f"node_selector: {key!r} is not a label key ([prefix/]name, the name at most 63 "
                "characters of a-z, A-Z, 0-9, '-', '_', '.')"
            )
        if value and not _LABEL_NAME.match(value):
            raise ValueError(
                f"node_selector: the value of {key} must be a label value (at most 63 characters "
                f"of a-z, A-Z, 0-9, '-', '_', '.', starting and ending alphanumeric), got {value!r}"
            )
    for key, name in ((ZONE_LABEL, "zone"), (INSTANCE_TYPE_LABEL, "instance_type")):
        if key in spec.node_selector:
            raise ValueError(
                f"node_selector has {key} ({spec.node_selector[key]!r}): give it as {name} "
                "instead (the store pod follows the zone too)"
            )


def _check_fsx(spec: DeploySpec) -> None:
    static, dynamic = _given(spec, STATIC_FIELDS), _given(spec, DYNAMIC_FIELDS)
    if not static and not dynamic:
        return
    if static and dynamic:
        raise ValueError(
            f"FSx: both an existing file system ({static}) and a new one ({dynamic}) are given: "
            f"keep {list(STATIC_FIELDS)} to mount an existing one, or {list(DYNAMIC_FIELDS)} to "
            "have the FSx CSI driver create one"
        )
    for name in ("checkpoint_claim", "checkpoint_storage_class"):
        if getattr(spec, name) is not None:
            raise ValueError(
                f"{name} ({getattr(spec, name)!r}) and FSx fields ({static or dynamic}) are both "
                "given: the FSx fields render the checkpoint claim; drop one of them"
            )
    if static:
        missing = [n for n in STATIC_FIELDS if n not in static]
        if missing:
            raise ValueError(
                f"FSx (existing file system): {missing} missing; `aws fsx describe-file-systems` "
                "shows FileSystemId, DNSName and LustreConfiguration.MountName"
            )
        _match(spec, "fsx_file_system_id", _FS_ID, "a file system id such as fs-xxxxxxxxxxxxxxxxx")
        _match(
            spec,
            "fsx_dns_name",
            _DNS_SUBDOMAIN,
            "the DNSName, such as fs-xxxxxxxxxxxxxxxxx.fsx.us-east-1.amazonaws.com",
        )
        _match(
            spec,
            "fsx_mount_name",
            _MOUNT_NAME,
            "the file system's MountName (8 letters and digits)",
        )
        return
    if spec.fsx_subnet_id is None or not spec.fsx_security_group_ids:
        raise ValueError(
            "FSx (new file system): give both fsx_subnet_id and fsx_security_group_ids (the "
            f"subnet to create it in and the groups its clients reach it through), got "
            f"fsx_subnet_id={spec.fsx_subnet_id!r}, "
            f"fsx_security_group_ids={list(spec.fsx_security_group_ids)}"
        )
    _match(spec, "fsx_subnet_id", _SUBNET, "a subnet id such as subnet-xxxxxxxxxxxxxxxxx")
    for sg in spec.fsx_security_group_ids:
        if not _SG.match(sg):
            raise ValueError(
                f"fsx_security_group_ids: {sg!r} is not a security group id such as "
                "sg-xxxxxxxxxxxxxxxxx"
            )
    kind = fsx_deployment_type(spec)
    if kind not in FSX_THROUGHPUT:
        raise ValueError(
            f"fsx_deployment_type must be one of {sorted(FSX_THROUGHPUT)}, got {kind!r}"
        )
    allowed = FSX_THROUGHPUT[kind]
    if not allowed and spec.fsx_throughput is not None:
        raise ValueError(
            f"fsx_throughput ({spec.fsx_throughput}) is for PERSISTENT file systems; a {kind} one "
            "takes none: drop it"
        )
    if allowed and spec.fsx_throughput not in allowed:
        raise ValueError(
            f"fsx_throughput must be one of {list(allowed)} (MB/s per TiB) for a {kind} file "
            f"system, got {spec.fsx_throughput}"
        )


def _match(spec: DeploySpec, name: str, rx: re.Pattern[str], what: str) -> None:
    value = getattr(spec, name)
    if not rx.match(str(value)):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def fsx_deployment_type(spec: DeploySpec) -> str:
    return spec.fsx_deployment_type or FSX_DEFAULT_DEPLOYMENT


def efa_env(spec: DeploySpec) -> dict[str, str]:
    """The trainer's EFA environment (empty without EFA), before ``spec.env``."""
    if not spec.efa:
        return {}
    return {**EFA_ENV, **({} if spec.hugepages_2mi else NO_HUGE_PAGES_ENV)}


def node_selector(spec: DeploySpec) -> dict[str, str]:
    """The node pods' nodeSelector (empty: none)."""
    out = store_selector(spec)
    if spec.instance_type:
        out[INSTANCE_TYPE_LABEL] = spec.instance_type
    return out | dict(sorted(spec.node_selector.items()))


def store_selector(spec: DeploySpec) -> dict[str, str]:
    """The store pod's nodeSelector: the job's zone, nothing more (it needs no GPU node)."""
    return {ZONE_LABEL: spec.zone} if spec.zone else {}


def extra_resources(spec: DeploySpec) -> dict[str, Any]:
    """Resources the trainer requests and limits alike (extended resources, huge pages)."""
    out: dict[str, Any] = {}
    if spec.hugepages_2mi:
        out[HUGEPAGES_RESOURCE] = spec.hugepages_2mi
    if spec.efa:
        out[EFA_RESOURCE] = spec.efa
    return out


def volume_name(spec: DeploySpec) -> str:
    """The static PersistentVolume's name (cluster-wide, so the namespace is in it)."""
    return f"{spec.namespace}-{spec.claim}"


def storage_class_name(spec: DeploySpec) -> str:
    """The dynamic StorageClass's name (cluster-wide, so the namespace is in it)."""
    return f"{spec.namespace}-{spec.name}-fsx"


def fsx_objects(spec: DeploySpec, *, labels: dict[str, str]) -> list[dict[str, Any]]:
    """The checkpoint claim on FSx for Lustre and what backs it, in apply order ([] without FSx).

    Both keep the file system when the claim is deleted (``Retain``): checkpoints outlive
    ``kubectl delete -f``.
    """
    mode = fsx_mode(spec)
    if mode is None:
        return []
    pvc: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": spec.checkpoint_size}},
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": spec.claim, "namespace": spec.namespace, "labels": labels},
        "spec": pvc,
    }
    if mode == "static":
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume_name(spec), "labels": labels},
            "spec": {
                "capacity": {"storage": spec.checkpoint_size},
                "volumeMode": "Filesystem",
                "accessModes": ["ReadWriteMany"],
                "mountOptions": list(FSX_MOUNT_OPTIONS),
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                # Reserved for this job's claim: no other claim binds it first.
                "claimRef": {"namespace": spec.namespace, "name": spec.claim},
                "csi": {
                    "driver": FSX_DRIVER,
                    "volumeHandle": spec.fsx_file_system_id,
                    "volumeAttributes": {
                        "dnsname": spec.fsx_dns_name,
                        "mountname": spec.fsx_mount_name,
                    },
                },
            },
        }
        # "": no class, so the cluster's default class is not filled in and binding by name holds.
        pvc.update(storageClassName="", volumeName=volume_name(spec))
        return [pv, claim]
    parameters = {
        "subnetId": spec.fsx_subnet_id,
        "securityGroupIds": ",".join(spec.fsx_security_group_ids),
        "deploymentType": fsx_deployment_type(spec),
    }
    if spec.fsx_throughput is not None:
        parameters["perUnitStorageThroughput"] = str(spec.fsx_throughput)
    sc = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": storage_class_name(spec), "labels": labels},
        "provisioner": FSX_DRIVER,
        "parameters": parameters,
        "reclaimPolicy": "Retain",
        "mountOptions": list(FSX_MOUNT_OPTIONS),
    }
    pvc["storageClassName"] = storage_class_name(spec)
    return [sc, claim]
