"""EKS, opt-in through the spec: EFA, placement in one zone, FSx for Lustre checkpoints; each
rendered, validated for every layout, and refused with a clear message when a value is bad."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from procs import capture
from unbroken.k8s import eks, render, validate
from unbroken.k8s import spec as kspec

BASE: dict[str, Any] = {
    "name": "ft",
    "image": "img:1",
    "command": "-m train",
    "nodes": "2",
    "nproc_per_node": 8,
    "gpus_per_node": 8,
    "memory": "64Gi",
}
EFA: dict[str, Any] = {"efa": 32, "zone": "us-east-1a", "instance_type": "p5.48xlarge"}
STATIC: dict[str, Any] = {
    "fsx_file_system_id": "fs-0123456789abcdef0",
    "fsx_dns_name": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com",
    "fsx_mount_name": "abcdef12",
}
DYNAMIC: dict[str, Any] = {
    "fsx_subnet_id": "subnet-0123456789abcdef0",
    "fsx_security_group_ids": "sg-0123456789abcdef0,sg-0fedcba9876543210",
    "fsx_throughput": 250,
}


def _spec(**kw: Any) -> kspec.DeploySpec:
    return kspec.build(**{**BASE, **kw})


def _of(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [job] = _of(docs, "Job")
    return job["spec"]["template"]["spec"]


def _env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in _pod(docs)["containers"][0]["env"]}


def test_efa_requests_the_interfaces_and_sets_nccls_environment() -> None:
    docs = render.objects(_spec(**EFA), "job")
    pod = _pod(docs)
    res = pod["containers"][0]["resources"]
    assert res["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    assert res["requests"] == {"memory": "64Gi", "vpc.amazonaws.com/efa": 32}
    env = _env(docs)
    assert env["FI_PROVIDER"] == "efa"
    assert env["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert env["FI_EFA_USE_HUGE_PAGE"] == "0"  # no huge pages requested: fork() must not fail
    assert "NCCL_PROTO" not in env and "FI_EFA_USE_DEVICE_RDMA" not in env  # old guidance
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_huge_pages_are_requested_and_limited_and_libfabric_may_use_them() -> None:
    docs = render.objects(_spec(**EFA, hugepages_2mi="5120Mi"), "job")
    res = _pod(docs)["containers"][0]["resources"]
    assert res["requests"]["hugepages-2Mi"] == res["limits"]["hugepages-2Mi"] == "5120Mi"
    assert "FI_EFA_USE_HUGE_PAGE" not in _env(docs)


def test_the_specs_env_wins_over_the_efa_environment_without_duplicates() -> None:
    docs = render.objects(_spec(**EFA, env={"NCCL_SOCKET_IFNAME": "eth0", "X": "1"}), "job")
    names = [e["name"] for e in _pod(docs)["containers"][0]["env"]]
    assert len(names) == len(set(names))
    assert _env(docs)["NCCL_SOCKET_IFNAME"] == "eth0" and _env(docs)["X"] == "1"


def test_without_eks_fields_nothing_eks_is_rendered() -> None:
    docs = render.objects(_spec(), "job")
    pod = _pod(docs)
    assert "nodeSelector" not in pod
    assert not set(_env(docs)) & {"FI_PROVIDER", "NCCL_SOCKET_IFNAME", "FI_EFA_USE_HUGE_PAGE"}
    assert [d["kind"] for d in docs][0] == "PersistentVolumeClaim"
    assert not _of(docs, "PersistentVolume") and not _of(docs, "StorageClass")


def test_placement_selects_the_zone_for_every_pod_and_the_nodes_for_the_trainers() -> None:
    s = _spec(**EFA, node_selector={"eks.amazonaws.com/nodegroup": "p5-pg"})
    docs = render.objects(s, "job")
    assert _pod(docs)["nodeSelector"] == {
        "topology.kubernetes.io/zone": "us-east-1a",
        "node.kubernetes.io/instance-type": "p5.48xlarge",
        "eks.amazonaws.com/nodegroup": "p5-pg",
    }
    [store] = _of(docs, "Deployment")
    assert store["spec"]["template"]["spec"]["nodeSelector"] == {
        "topology.kubernetes.io/zone": "us-east-1a"
    }


def test_fsx_static_provisioning_binds_the_claim_to_the_file_system_by_name() -> None:
    docs = render.objects(_spec(**STATIC, checkpoint_size="1200Gi"), "job")
    [pv], [pvc] = _of(docs, "PersistentVolume"), _of(docs, "PersistentVolumeClaim")
    assert [d["kind"] for d in docs][:2] == ["PersistentVolume", "PersistentVolumeClaim"]
    assert "namespace" not in pv["metadata"]  # cluster-scoped
    csi = pv["spec"]["csi"]
    assert (
        csi["driver"] == "fsx.csi.aws.com" and csi["volumeHandle"] == STATIC["fsx_file_system_id"]
    )
    assert csi["volumeAttributes"] == {
        "dnsname": STATIC["fsx_dns_name"],
        "mountname": STATIC["fsx_mount_name"],
    }
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"] and "flock" in pv["spec"]["mountOptions"]
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert pv["spec"]["claimRef"] == {"namespace": "default", "name": "ft-ckpt"}
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["spec"]["storageClassName"] == "" == pv["spec"]["storageClassName"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    claims = [v for v in _pod(docs)["volumes"] if "persistentVolumeClaim" in v]
    assert claims[0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_fsx_dynamic_provisioning_renders_a_storage_class_and_a_claim_of_it() -> None:
    docs = render.objects(_spec(**DYNAMIC), "job")
    [sc], [pvc] = _of(docs, "StorageClass"), _of(docs, "PersistentVolumeClaim")
    assert sc["provisioner"] == "fsx.csi.aws.com" and "namespace" not in sc["metadata"]
    assert sc["parameters"] == {
        "subnetId": "subnet-0123456789abcdef0",
        "securityGroupIds": "sg-0123456789abcdef0,sg-0fedcba9876543210",
        "deploymentType": "PERSISTENT_2",
        "perUnitStorageThroughput": "250",
    }
    assert sc["reclaimPolicy"] == "Retain" and sc["mountOptions"] == ["flock"]
    assert pvc["spec"]["storageClassName"] == sc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not _of(docs, "PersistentVolume")
    scratch = render.objects(
        _spec(**{**DYNAMIC, "fsx_throughput": None}, fsx_deployment_type="SCRATCH_2"), "job"
    )
    assert "perUnitStorageThroughput" not in _of(scratch, "StorageClass")[0]["parameters"]


@pytest.mark.parametrize("kind", render.KINDS)
@pytest.mark.parametrize("fsx", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_every_layout_with_every_eks_feature_passes_strict_validation(
    kind: str, fsx: dict[str, Any]
) -> None:
    s = _spec(**EFA, **fsx, hugepages_2mi="5120Mi", node_selector={"pool": "a"}, spares=1)
    assert validate.validate_docs(render.objects(s, kind)) == []


# (a bad value, a fragment of the message that must explain it)
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"efa": -1}, "efa must be >= 0"),
    ({"efa": 4}, "efa is 4 but zone is not set"),
    ({**EFA, "zone": "use1-az1"}, "not a zone ID such as use1-az1"),
    ({"instance_type": "p5"}, "instance_type must be an EC2 instance type"),
    ({"hugepages_2mi": "5Mi"}, "whole number of 2 MiB pages"),
    ({"hugepages_2mi": "5120Mi", "memory": None}, "neither memory nor cpu is set"),
    ({"node_selector": {"bad key!": "x"}}, "is not a label key"),
    ({"node_selector": {"pool": "no spaces"}}, "must be a label value"),
    ({"node_selector": {"topology.kubernetes.io/zone": "us-east-1a"}}, "give it as zone"),
    ({**STATIC, **DYNAMIC}, "both an existing file system"),
    ({"fsx_file_system_id": "fs-0123456789abcdef0"}, "['fsx_dns_name', 'fsx_mount_name'] missing"),
    ({**STATIC, "fsx_file_system_id": "fs-xyz"}, "fsx_file_system_id must be a file system id"),
    ({**STATIC, "checkpoint_claim": "shared"}, "checkpoint_claim ('shared') and FSx fields"),
    ({**DYNAMIC, "checkpoint_storage_class": "efs"}, "checkpoint_storage_class ('efs') and FSx"),
    ({"fsx_subnet_id": "subnet-0123456789abcdef0"}, "give both fsx_subnet_id and"),
    ({**DYNAMIC, "fsx_security_group_ids": "sg-nope"}, "'sg-nope' is not a security group id"),
    ({**DYNAMIC, "fsx_throughput": 200}, "must be one of [125, 250, 500, 1000]"),
    ({**DYNAMIC, "fsx_throughput": None}, "must be one of [125, 250, 500, 1000]"),
    ({**DYNAMIC, "fsx_deployment_type": "SCRATCH_2"}, "a SCRATCH_2 one takes none"),
    ({**DYNAMIC, "fsx_deployment_type": "PERSISTENT_3"}, "fsx_deployment_type must be one of"),
    ({"trainjob_runtime": "Runtime"}, "trainjob_runtime must be one of"),
]


@pytest.mark.parametrize("values,message", REFUSED, ids=[m for _, m in REFUSED])
def test_bad_eks_values_are_refused_with_what_to_do(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as e:
        _spec(**values)
    assert message in str(e.value)


def test_eks_fields_load_from_a_spec_file_and_from_flags(tmp_path: Path) -> None:
    f = tmp_path / "spec.yaml"
    body = {**BASE, **EFA, **DYNAMIC, "node_selector": {"pool": "a"}}
    body["fsx_security_group_ids"] = ["sg-0123456789abcdef0"]
    f.write_text(yaml.safe_dump(body))
    s = kspec.build(spec_path=f)
    assert s.fsx_security_group_ids == ("sg-0123456789abcdef0",) and s.fsx_throughput == 250
    assert s.node_selector == {"pool": "a"} and s.efa == 32
    out = tmp_path / "job.yaml"
    cmd = [sys.executable, "-m", "unbroken.cli", "k8s", "render", "--spec", str(f), "-o", str(out)]
    cmd += [
        "--node-selector",
        "pool=b",
        "--fsx-security-group-ids",
        "sg-0123456789abcdef0,sg-0fedcba9876543210",
    ]
    done = capture(cmd)
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(out.read_text()))
    assert _pod(docs)["nodeSelector"]["pool"] == "b"
    [sc] = _of(docs, "StorageClass")
    assert sc["parameters"]["securityGroupIds"].count("sg-") == 2
    bad = capture([*cmd, "--efa", "-3"])
    assert bad.returncode == 2 and "efa must be >= 0" in bad.stderr


def _claim(d: list[dict[str, Any]]) -> dict[str, Any]:
    return _of(d, "PersistentVolumeClaim")[0]


BREAKAGES: list[tuple[dict[str, Any], Callable[[list[dict[str, Any]]], None], str]] = [
    (STATIC, lambda d: _claim(d)["spec"].pop("storageClassName"), "the claim never binds"),
    (
        STATIC,
        lambda d: _of(d, "PersistentVolume")[0]["spec"].update(claimRef={"name": "other"}),
        "reserved for",
    ),
    (
        STATIC,
        lambda d: _of(d, "PersistentVolume")[0]["spec"]["csi"]["volumeAttributes"].pop("mountname"),
        "needs dnsname and mountname",
    ),
    (DYNAMIC, lambda d: _of(d, "StorageClass")[0]["parameters"].pop("subnetId"), "['subnetId']"),
    (EFA, lambda d: _pod(d).pop("nodeSelector"), "must share one availability zone"),
    (
        {"hugepages_2mi": "4Mi"},
        lambda d: _pod(d)["containers"][0]["resources"]["requests"].pop("memory"),
        "huge pages without a cpu or memory request",
    ),
]


@pytest.mark.parametrize("values,breakage,message", BREAKAGES, ids=[b[2] for b in BREAKAGES])
def test_each_eks_check_catches_its_breakage(
    values: dict[str, Any], breakage: Callable[[list[dict[str, Any]]], None], message: str
) -> None:
    docs = render.objects(_spec(**values), "job")
    assert validate.validate_docs(docs) == []
    broken = copy.deepcopy(docs)
    breakage(broken)
    problems = [str(p) for p in validate.validate_docs(broken)]
    assert any(message in p for p in problems), problems


def test_the_efa_environment_follows_current_guidance() -> None:
    """The pinned choice: no NCCL_PROTO=simple, no FI_EFA_USE_DEVICE_RDMA (see eks.py)."""
    assert eks.EFA_ENV == {"FI_PROVIDER": "efa", "NCCL_SOCKET_IFNAME": "^lo,docker"}
    assert eks.NO_HUGE_PAGES_ENV == {"FI_EFA_USE_HUGE_PAGE": "0"}
