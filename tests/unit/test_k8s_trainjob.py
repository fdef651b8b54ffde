"""``--kind trainjob``: a Kubeflow Trainer TrainJob and its runtime, the runtime holding the
JobSet layout; strict validation against Trainer's pinned CRDs, and the checks of the JobSet
Trainer would make of the two."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from unbroken.k8s import render, trainer, validate
from unbroken.k8s import spec as kspec


def _spec(**kw: Any) -> kspec.DeploySpec:
    values: dict[str, Any] = {"name": "ft", "image": "img:1", "command": "-m train --steps 5"}
    values.update(nodes="2:3", spares=1, nproc_per_node=2, gpus_per_node=2)
    values.update(kw)
    return kspec.build(**values)


def _docs(**kw: Any) -> list[dict[str, Any]]:
    return render.objects(_spec(**kw), "trainjob")


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def _rjob(docs: list[dict[str, Any]]) -> dict[str, Any]:
    rt = next(d for d in docs if d["kind"] in trainer.RUNTIME_KINDS)
    return rt["spec"]["template"]["spec"]["replicatedJobs"][0]


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _rjob(docs)["template"]["spec"]["template"]["spec"]["containers"][0]


def test_the_trainjob_references_its_runtime_and_runs_unbroken_run_as_the_job_does() -> None:
    s = _spec()
    docs = render.objects(s, "trainjob")
    assert [d["kind"] for d in docs][-2:] == ["TrainingRuntime", "TrainJob"]  # runtime first
    tj, rt = _one(docs, "TrainJob"), _one(docs, "TrainingRuntime")
    assert tj["apiVersion"] == rt["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert tj["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": rt["metadata"]["name"],
    }
    job = next(d for d in render.objects(s, "job") if d["kind"] == "Job")
    job_container = job["spec"]["template"]["spec"]["containers"][0]
    t = tj["spec"]["trainer"]
    assert t["image"] == s.image and t["command"] == ["unbroken-run"]
    assert t["args"] == job_container["args"] and t["numNodes"] == s.pods == 4
    assert rt["spec"]["mlPolicy"] == {"numNodes": 4}  # no torch policy: unbroken-run launches


def test_the_runtime_holds_the_jobset_layout_with_trainers_names() -> None:
    docs = _docs()
    rt = _one(docs, "TrainingRuntime")
    js = rt["spec"]["template"]["spec"]
    jobset = _one(render.objects(_spec(), "jobset"), "JobSet")["spec"]
    assert js["failurePolicy"] == jobset["failurePolicy"]  # FailJobSet on the give-up rule
    assert js["network"] == jobset["network"]
    rjob = _rjob(docs)
    assert rjob["template"]["metadata"]["labels"][trainer.ANCESTOR_LABEL] == "trainer"
    job = rjob["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == 4
    assert job["podFailurePolicy"] == {
        **jobset["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"],
        "rules": [
            {**r, "onExitCodes": {**r["onExitCodes"], "containerName": "node"}}
            if "onExitCodes" in r
            else r
            for r in jobset["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
        ],
    }
    assert _container(docs)["name"] == trainer.NODE_CONTAINER


def test_a_cluster_training_runtime_is_cluster_scoped() -> None:
    docs = _docs(trainjob_runtime="ClusterTrainingRuntime", namespace="team")
    rt = _one(docs, "ClusterTrainingRuntime")
    assert "namespace" not in rt["metadata"] and rt["metadata"]["name"] == "team-ft"
    ref = _one(docs, "TrainJob")["spec"]["runtimeRef"]
    assert ref["kind"] == "ClusterTrainingRuntime" and ref["name"] == "team-ft"
    assert validate.validate_docs(docs) == []


@pytest.mark.parametrize("runtime", ["TrainingRuntime", "ClusterTrainingRuntime"])
def test_trainjob_passes_strict_validation(runtime: str) -> None:
    for extra in ({}, {"cpu": "4", "memory": "8Gi", "nodes": "3", "spares": 0}):
        assert validate.validate_docs(_docs(trainjob_runtime=runtime, **extra)) == []


def test_the_crds_are_strict() -> None:
    docs = _docs()
    broken = copy.deepcopy(docs)
    _one(broken, "TrainJob")["spec"]["trainer"]["numNode"] = 3  # a typo of numNodes
    [p] = validate.validate_docs(broken)
    assert p.obj == "TrainJob/ft" and "'numNode' was unexpected" in p.message
    broken = copy.deepcopy(docs)
    _rjob(broken)["template"]["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    problems = validate.validate_docs(broken)
    assert problems and all(p.obj == "TrainingRuntime/ft" for p in problems)
    assert any("restartPolicyy" in p.message for p in problems)
    broken = copy.deepcopy(docs)
    _one(broken, "TrainJob")["apiVersion"] = "trainer.kubeflow.org/v1"
    [p] = validate.validate_docs(broken)
    assert p.path == "apiVersion" and "trainer.kubeflow.org/v1alpha1" in p.message


def _tj(d: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(d, "TrainJob")["spec"]


def _rt(d: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(d, "TrainingRuntime")["spec"]


BREAKAGES: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("runtime elsewhere", lambda d: _tj(d)["runtimeRef"].update(name="x"), "is not in this file"),
    ("torch policy", lambda d: _rt(d)["mlPolicy"].update(torch={}), "Trainer's torch policy"),
    ("too few nodes", lambda d: _tj(d)["trainer"].update(numNodes=2), "can never form"),
    ("bad args", lambda d: _tj(d)["trainer"]["args"].__setitem__(0, "--nnodes=x"), "refuses"),
    (
        "no ancestor label",
        lambda d: _rjob(d)["template"]["metadata"]["labels"].pop(trainer.ANCESTOR_LABEL),
        "would reach no pod",
    ),
    ("container name", lambda d: _container(d).update(name="trainer"), "no container is named"),
    (
        "give-up restarts",
        lambda d: _rt(d)["template"]["spec"]["failurePolicy"].update(rules=[]),
        "restart the whole JobSet in a loop",
    ),
    (
        "restarts every give-up",
        lambda d: _rjob(d)["template"]["spec"]["podFailurePolicy"]["rules"].pop(0),
        "no FailJob rule",
    ),
]


@pytest.mark.parametrize("what,breakage,message", BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_each_trainjob_check_catches_its_breakage(
    what: str, breakage: Callable[[list[dict[str, Any]]], None], message: str
) -> None:
    docs = _docs()
    broken = copy.deepcopy(docs)
    breakage(broken)
    problems = [str(p) for p in validate.validate_docs(broken)]
    assert any(message in p for p in problems), problems


def test_jobset_of_applies_the_trainjobs_settings_as_trainer_does() -> None:
    docs = _docs()
    tj, rt = _one(docs, "TrainJob"), _one(docs, "TrainingRuntime")
    tj["spec"]["trainer"].update(image="other:2", numNodes=5)
    tj["spec"]["trainer"]["env"] = [
        {"name": "OMP_NUM_THREADS", "value": "4"},
        {"name": "A", "value": "b"},
    ]
    spec, issues = trainer.jobset_of(tj, rt)
    assert issues == []
    job = spec["replicatedJobs"][0]["template"]["spec"]
    c = job["template"]["spec"]["containers"][0]
    assert c["image"] == "other:2" and job["parallelism"] == job["completions"] == 5
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMP_NUM_THREADS"] == "4" and env["A"] == "b"
    assert [e["name"] for e in c["env"]].count("OMP_NUM_THREADS") == 1
    assert (
        rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] == 4
    )
