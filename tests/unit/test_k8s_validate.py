"""``unbroken k8s validate``: schemas (strict, JobSet CRD) and the semantic checks, each able to fail."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from procs import capture
from unbroken.k8s import render, validate
from unbroken.k8s import spec as kspec


def _docs(kind: str = "job", **kw: Any) -> list[dict[str, Any]]:
    values: dict[str, Any] = {"name": "ft", "image": "img:1", "command": "-m train", "nodes": "3"}
    values.update(kw)
    return render.objects(kspec.build(**values), kind)


def _job(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Job")["spec"]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _job(docs)["template"]["spec"]


def _trainer(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _pod(docs)["containers"][0]


def _set_arg(docs: list[dict[str, Any]], prefix: str, value: str) -> None:
    args = _trainer(docs)["args"]
    args[next(i for i, a in enumerate(args) if a.startswith(prefix))] = value


def _service(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == name)


# (what is broken, how, a fragment of the message that must name it)
BREAKAGES: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("subdomain", lambda d: _pod(d).update(subdomain="elsewhere"), "not a headless Service"),
    (
        "not headless",
        lambda d: _service(d, "ft")["spec"].pop("clusterIP"),
        "is not headless",
    ),
    (
        "not-ready DNS",
        lambda d: _service(d, "ft")["spec"].update(publishNotReadyAddresses=False),
        "must publish not-ready addresses",
    ),
    (
        "exit codes",
        lambda d: _job(d)["podFailurePolicy"]["rules"][0]["onExitCodes"].update(values=[1, 3]),
        "unbroken-run gives up with [2, 3, 4, 6]",
    ),
    (
        "exit code container",
        lambda d: _job(d)["podFailurePolicy"]["rules"][0]["onExitCodes"].update(
            containerName="sidecar"
        ),
        "is not the container running unbroken-run",
    ),
    (
        "no disruption rule",
        lambda d: _job(d)["podFailurePolicy"]["rules"].pop(1),
        "DisruptionTarget",
    ),
    (
        "store on a node",
        lambda d: _set_arg(d, "--rdzv-endpoint", "--rdzv-endpoint=ft-0.ft:29400"),
        "not a Service of this file",
    ),
    (
        "store port",
        lambda d: _set_arg(d, "--rdzv-endpoint", "--rdzv-endpoint=ft-rdzv:1234"),
        "has no port 1234",
    ),
    (
        "store serves elsewhere",
        lambda d: next(x for x in d if x["kind"] == "Deployment")["spec"]["template"]["spec"][
            "containers"
        ][0].update(args=["--port=1"]),
        "the store serves on ['--port=1']",
    ),
    (
        "metrics port",
        lambda d: _set_arg(d, "--ft-metrics-port", "--ft-metrics-port=9999"),
        "--ft-metrics-port 9999 needs a port named metrics",
    ),
    ("too few pods", lambda d: _job(d).update(completions=2, parallelism=2), "can never form"),
    ("replacement", lambda d: _job(d).update(podReplacementPolicy="TerminatingOrFailed"), "Failed"),
    (
        "grace",
        lambda d: _pod(d).update(terminationGracePeriodSeconds=5),
        "does not exceed unbroken-run's stop grace",
    ),
    (
        "RWX",
        lambda d: next(x for x in d if x["kind"] == "PersistentVolumeClaim")["spec"].update(
            accessModes=["ReadWriteOnce"]
        ),
        "must include ReadWriteMany",
    ),
    ("shm", lambda d: _pod(d)["volumes"][0].update(emptyDir={}), "/dev/shm must be an emptyDir"),
    ("bad flag", lambda d: _set_arg(d, "--nnodes", "--nnodes=three"), "unbroken-run refuses"),
    (
        "gpus",
        lambda d: _trainer(d).update(resources={"limits": {"nvidia.com/gpu": 4}}),
        "one rank per GPU",
    ),
]


@pytest.mark.parametrize("what,breakage,message", BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_each_semantic_check_catches_its_breakage(
    what: str, breakage: Callable[[list[dict[str, Any]]], None], message: str
) -> None:
    docs = _docs()
    assert validate.validate_docs(docs) == []
    broken = copy.deepcopy(docs)
    breakage(broken)
    problems = [str(p) for p in validate.validate_docs(broken)]
    assert any(message in p for p in problems), problems


def test_strict_schema_rejects_an_unknown_field_of_a_core_kind() -> None:
    docs = _docs()
    _pod(docs)["restartPolicyy"] = "Never"
    [p] = validate.validate_docs(docs)
    assert p.obj == "Job/ft" and p.path == "spec.template.spec"
    assert "restartPolicyy" in p.message


def test_jobset_is_checked_against_its_crd_and_its_child_job() -> None:
    docs = _docs("jobset")
    assert validate.validate_docs(docs) == []
    js = copy.deepcopy(docs)
    js[-1]["spec"]["failurePolicy"]["maxRestart"] = 3  # a typo of maxRestarts
    assert ["'maxRestart' was unexpected" in p.message for p in validate.validate_docs(js)] == [
        True
    ]
    js = copy.deepcopy(docs)
    js[-1]["spec"]["failurePolicy"]["rules"] = []
    assert any("restart the whole JobSet in a loop" in str(p) for p in validate.validate_docs(js))
    js = copy.deepcopy(docs)
    js[-1]["spec"]["network"]["enableDNSHostnames"] = False
    assert any("find each other by name" in str(p) for p in validate.validate_docs(js))


@pytest.mark.slow
def test_validate_cli_exit_codes(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(render.to_yaml(_docs(), file="good.yaml"))
    broken = _docs()
    _pod(broken)["subdomain"] = "nope"
    bad.write_text(render.to_yaml(broken, file="bad.yaml"))
    cmd = [sys.executable, "-m", "unbroken.cli", "k8s", "validate"]
    ok = capture([*cmd, str(good)])
    assert ok.returncode == 0 and "ok (Kubernetes 1.33.0 schemas strict" in ok.stdout
    no = capture([*cmd, str(good), str(bad)])
    assert no.returncode == 1 and "'nope' is not a headless Service" in no.stdout
    missing = capture([*cmd, str(tmp_path / "x.yaml")])
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_spec_refuses_bad_values(tmp_path: Path) -> None:
    base = {"name": "ft", "image": "i", "command": "x.py"}
    with pytest.raises(ValueError, match="nodes must be N or MIN:MAX"):
        kspec.build(**base, nodes="3:2")
    with pytest.raises(ValueError, match="termination_grace_s .* must be larger than stop_grace_s"):
        kspec.build(**base, termination_grace_s=10, stop_grace_s=30)
    with pytest.raises(ValueError, match="rdzv_port and metrics_port are both"):
        kspec.build(**base, rdzv_port=9400)
    f = tmp_path / "spec.yaml"
    f.write_text("name: ft\nimage: i\ncommand: [x.py]\nnodez: 3\n")
    with pytest.raises(ValueError, match=r"unknown keys \['nodez'\]"):
        kspec.build(spec_path=f)
    f.write_text("name: ft\nimage: i\ncommand: [x.py, --a, 1]\nnodes: 2:3\n")
    s = kspec.build(spec_path=f, spares=1)
    assert s.command == ("x.py", "--a", "1") and s.node_range == (2, 3) and s.pods == 4
