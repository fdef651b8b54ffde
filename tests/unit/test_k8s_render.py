"""``unbroken k8s render``: the published layout, the JobSet variant, the committed examples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from procs import capture
from unbroken.k8s import render, validate
from unbroken.k8s import spec as kspec
from unbroken.launcher import args as largs
from unbroken.launcher import errors as lerrors

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "k8s"


def _spec(**kw: object) -> kspec.DeploySpec:
    values: dict[str, object] = {"name": "ft", "image": "img:1", "command": "-m train --steps 5"}
    values.update(kw)
    return kspec.build(**values)


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_indexed_job_and_headless_service_follow_the_published_layout() -> None:
    s = _spec(nodes="3", spares=1, nproc_per_node=8, gpus_per_node=8, backoff_limit_per_index=2)
    kinds = _by_kind(render.objects(s, "job"))
    [job] = kinds["Job"]
    headless = next(x for x in kinds["Service"] if x["spec"].get("clusterIP") == "None")
    js = job["spec"]
    assert js["completionMode"] == "Indexed"
    assert js["completions"] == js["parallelism"] == 4  # 3 nodes + 1 spare
    assert js["backoffLimitPerIndex"] == 2 and js["podReplacementPolicy"] == "Failed"
    assert js["maxFailedIndexes"] == 1  # the rendezvous still finds 3 nodes
    pod = js["template"]["spec"]
    assert pod["subdomain"] == headless["metadata"]["name"] == "ft"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert pod["restartPolicy"] == "Never"
    [c] = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    index_ref = env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert "batch.kubernetes.io/job-completion-index" in index_ref
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in c["args"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8}
    rules = js["podFailurePolicy"]["rules"]
    fail = next(r for r in rules if r["action"] == "FailJob")["onExitCodes"]
    assert fail["containerName"] == c["name"]
    assert fail["values"] == [
        lerrors.EXIT_USAGE,
        lerrors.EXIT_BUDGET_EXHAUSTED,
        lerrors.EXIT_NO_PROGRESS,
        lerrors.EXIT_STORAGE_FAILED,
    ]
    ignore = next(r for r in rules if r["action"] == "Ignore")
    assert ignore["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/checkpoints"]]["persistentVolumeClaim"]["claimName"]
    [pvc] = kinds["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pod["terminationGracePeriodSeconds"] > s.stop_grace_s
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400}]


def test_the_container_runs_unbroken_run_on_the_store_service() -> None:
    s = _spec(nodes="2:3", nproc_per_node=2, metrics_port=9500, rdzv_port=29500)
    kinds = _by_kind(render.objects(s, "job"))
    c = kinds["Job"][0]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["unbroken-run"]
    spec, cfg, ignored = largs.parse([a.replace("$(JOB_COMPLETION_INDEX)", "1") for a in c["args"]])
    assert (spec.min_nodes, spec.max_nodes, spec.nproc_per_node) == (2, 3, 2)
    assert spec.rdzv_endpoint == "ft-rdzv:29500" and spec.rdzv_id == "ft" and not ignored
    assert spec.is_host is None and not spec.standalone  # a client of the store pod
    assert spec.entry.kind == "module" and spec.entry.args == ("--steps", "5")
    assert cfg.metrics_port == 9500 and str(cfg.run_dir) == "/checkpoints/ft"
    assert spec.rdzv_conf == {"keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
    [deploy] = kinds["Deployment"]
    store = next(x for x in kinds["Service"] if x["metadata"]["name"] == "ft-rdzv")
    assert deploy["spec"]["replicas"] == 1
    assert store["spec"]["ports"] == [{"name": "rdzv", "port": 29500, "targetPort": "rdzv"}]
    [sc] = deploy["spec"]["template"]["spec"]["containers"]
    assert sc["command"] + sc["args"] == ["unbroken", "k8s", "store", "--port=29500"]


def test_jobset_variant() -> None:
    s = _spec(nodes="4", jobset_max_restarts=5)
    kinds = _by_kind(render.objects(s, "jobset"))
    assert "Job" not in kinds and {x["metadata"]["name"] for x in kinds["Service"]} == {"ft-rdzv"}
    [js] = kinds["JobSet"]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 5
    assert policy["rules"][0]["action"] == "FailJobSet"
    assert policy["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    [rjob] = js["spec"]["replicatedJobs"]
    assert rjob["template"]["spec"]["completionMode"] == "Indexed"
    assert "subdomain" not in rjob["template"]["spec"]["template"]["spec"]  # JobSet sets it


def test_an_existing_claim_is_used_not_rendered() -> None:
    kinds = _by_kind(render.objects(_spec(checkpoint_claim="shared-efs"), "job"))
    assert "PersistentVolumeClaim" not in kinds
    pod = kinds["Job"][0]["spec"]["template"]["spec"]
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == "shared-efs"


@pytest.mark.parametrize("kind", render.KINDS)
def test_rendered_output_passes_every_validation(kind: str) -> None:
    for s in (_spec(), _spec(nodes="2:4", spares=2, gpus_per_node=1, cpu="4", memory="8Gi")):
        assert validate.validate_docs(render.objects(s, kind)) == []


EXAMPLES = [
    ("spec.yaml", "job", "job.yaml"),
    ("spec.yaml", "jobset", "jobset.yaml"),
    ("eks-spec.yaml", "job", "eks-job.yaml"),
    ("eks-spec.yaml", "jobset", "eks-jobset.yaml"),
    ("eks-spec.yaml", "trainjob", "eks-trainjob.yaml"),
]
"""The committed examples under deploy/k8s/: (spec, --kind, rendered file)."""


@pytest.mark.parametrize("spec,kind,name", EXAMPLES, ids=[e[2] for e in EXAMPLES])
def test_committed_examples_equal_what_render_produces(
    tmp_path: Path, spec: str, kind: str, name: str
) -> None:
    out = tmp_path / name
    cmd = [sys.executable, "-m", "unbroken.cli", "k8s", "render"]
    cmd += ["--spec", f"deploy/k8s/{spec}", "--kind", kind, "-o", str(out)]
    done = capture(cmd, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    committed = (DEPLOY / name).read_text()
    assert out.read_text() == committed, (
        f"deploy/k8s/{name} is stale: run unbroken k8s render --spec deploy/k8s/{spec} "
        f"--kind {kind} -o deploy/k8s/{name}"
    )
    assert list(yaml.safe_load_all(committed))  # parses


def test_every_layout_has_a_committed_eks_example() -> None:
    assert {kind for spec, kind, _ in EXAMPLES if spec == "eks-spec.yaml"} == set(render.KINDS)


def test_committed_examples_pass_kubernetes_validate_strict() -> None:
    exe = Path(sys.executable).parent / "kubernetes-validate"
    files = [str(DEPLOY / name) for _, _, name in EXAMPLES]
    done = subprocess.run(
        [str(exe), "--strict", "-k", validate.K8S_VERSION, *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ERROR" not in done.stdout
    core = sum(
        1
        for _, _, name in EXAMPLES
        for d in yaml.safe_load_all((DEPLOY / name).read_text())
        if d["kind"] not in validate.CRDS
    )
    assert core == 8 + 6 + 4 + 4  # all but the JobSets, TrainJob and runtime (not core kinds)
    assert done.stdout.count("passed for resource") == core


def test_render_help_lists_every_layout() -> None:
    from unbroken.k8s import cli as kcli

    assert kcli.KINDS == render.KINDS  # the parser's choices, without importing the renderer
    cmd = [sys.executable, "-m", "unbroken.cli", "k8s", "render", "--help"]
    done = capture(cmd)
    assert done.returncode == 0
    assert "{job,jobset,trainjob}" in done.stdout and "TrainJob" in done.stdout
    for flag in ("--efa", "--zone", "--node-selector", "--fsx-file-system-id", "--fsx-subnet-id"):
        assert flag in done.stdout


def test_render_cli_refuses_bad_input_with_a_clear_error() -> None:
    cmd = [sys.executable, "-m", "unbroken.cli", "k8s", "render", "--name", "Bad_Name"]
    cmd += ["--image", "i", "--command", "x.py"]
    done = capture(cmd)
    assert done.returncode == 2 and "name must be a lowercase DNS label" in done.stderr
    cmd = [sys.executable, "-m", "unbroken.cli", "k8s", "render", "--name", "ok"]
    done = capture(cmd)
    assert done.returncode == 2 and "missing ['image', 'command']" in done.stderr
