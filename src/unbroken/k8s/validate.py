"""Validation of manifests without a cluster: schemas first, then ``checks`` (semantics).

- Core kinds (Service, Job, Deployment, PersistentVolumeClaim, ...) against Kubernetes'
  own schemas for ``K8S_VERSION``, strict (an unknown field is an error, as a typo would be),
  through ``kubernetes-validate`` (a pinned release: its schemas are part of the check).
- JobSet against the ``openAPIV3Schema`` of the JobSet CRD, release ``JOBSET_RELEASE``,
  committed under ``schemas/`` (kubernetes-sigs/jobset, config/components/crd/bases); made
  strict the same way. Its metadata and its child Job are also checked as core objects.
- TrainJob, TrainingRuntime and ClusterTrainingRuntime the same way, against the CRDs of
  Kubeflow Trainer release ``TRAINER_RELEASE`` (kubeflow/trainer, manifests/base/crds); a
  runtime's JobSet template's child Job is checked as a core object too.
- ``checks.problems``: what no schema says (the pods' subdomain is a headless Service, the
  give-up exit codes are unbroken-run's, the ports agree, the rendezvous store is a pod of its
  own, ...).

Everything runs offline.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

K8S_VERSION = "1.33.0"
"""Kubernetes version whose schemas the core kinds are checked against (EKS standard support)."""
JOBSET_RELEASE = "v0.12.0"
"""JobSet release whose CRD schema JobSets are checked against."""
TRAINER_RELEASE = "v2.3.0"
"""Kubeflow Trainer release whose CRD schemas TrainJobs and their runtimes are checked against."""
CRDS = {
    "JobSet": (f"jobset-{JOBSET_RELEASE}", ("spec",)),
    "TrainJob": (f"trainjob-{TRAINER_RELEASE}", None),
    "TrainingRuntime": (f"trainingruntime-{TRAINER_RELEASE}", ("spec", "template", "spec")),
    "ClusterTrainingRuntime": (
        f"clustertrainingruntime-{TRAINER_RELEASE}",
        ("spec", "template", "spec"),
    ),
}
"""Custom kinds: their schema file under ``schemas/``, and where their JobSet spec (whose
``replicatedJobs`` hold child Jobs) lies, if they have one."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one object."""

    obj: str
    """"Kind/name" of the object (or "document N" when it has none)."""
    path: str
    """Where in it ("spec.template.spec.containers[0].args"), "" for the whole object."""
    message: str
    """What is wrong and what to do."""

    def __str__(self) -> str:
        where = f"{self.obj}: {self.path}" if self.path else self.obj
        return f"{where}: {self.message}"


def name_of(doc: Any, index: int) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
        return f"{doc.get('kind', '?')}/{doc['metadata'].get('name', '?')}"
    return f"document {index}"


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _strict(schema: Any) -> Any:
    """A copy of an openAPI v3 schema where objects with listed properties admit no others."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crd(name: str) -> tuple[str, Any]:
    """(apiVersion, strict validator) of the pinned CRD schema ``schemas/<name>.json``."""
    import jsonschema

    raw = resources.files("unbroken.k8s").joinpath(f"schemas/{name}.json")
    crd = json.loads(raw.read_text())
    api = f"{crd['group']}/{crd['version']}"
    return api, jsonschema.Draft7Validator(_strict(crd["schema"]))


def _core(doc: dict[str, Any], obj: str, prefix: str = "") -> list[Problem]:
    try:
        import kubernetes_validate as kv
    except ImportError as e:
        raise ImportError(
            "validating manifests needs kubernetes-validate: pip install 'unbroken[k8s]'"
        ) from e
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        path = _path(e.path)
        return [Problem(obj, f"{prefix}{'.' if prefix and path else ''}{path}", e.message)]
    except kv.SchemaNotFoundError as e:
        return [Problem(obj, "", f"{e.message}: not a kind this file should contain")]
    return []


def schema_problems(doc: Any, index: int = 0) -> list[Problem]:
    """Schema errors of one object (core kinds strict; custom kinds against their CRDs)."""
    obj = name_of(doc, index)
    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return [Problem(obj, "", "not a Kubernetes object (needs apiVersion and kind)")]
    if doc["kind"] not in CRDS:
        return _core(doc, obj)
    name, jobset_at = CRDS[doc["kind"]]
    api, validator = _crd(name)
    if doc["apiVersion"] != api:
        return [
            Problem(obj, "apiVersion", f"{doc['apiVersion']!r}: the pinned CRD ({name}) is {api}")
        ]
    out = [
        Problem(obj, _path(e.path), e.message)
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    ]
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
    out += _core(meta, obj)
    jobset_spec: Any = doc if jobset_at else {}
    for key in jobset_at or ():
        jobset_spec = jobset_spec.get(key) if isinstance(jobset_spec, dict) else None
    rjobs = jobset_spec.get("replicatedJobs") if isinstance(jobset_spec, dict) else None
    for i, rjob in enumerate(rjobs if isinstance(rjobs, list) else []):
        template = rjob.get("template", {}) if isinstance(rjob, dict) else {}
        child = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": copy.deepcopy(template.get("metadata", {"name": "child"})),
            "spec": template.get("spec", {}),
        }
        at = ".".join((*(jobset_at or ()), f"replicatedJobs[{i}].template"))
        out += _core(child, obj, prefix=at)
    return out


def validate_docs(docs: list[Any]) -> list[Problem]:
    """Every problem of a set of objects meant to be applied together."""
    from unbroken.k8s import checks

    out: list[Problem] = []
    for i, doc in enumerate(docs):
        out += schema_problems(doc, i)
    if not out:  # semantics read fields the schemas vouched for
        out += checks.problems(docs)
    return list(dict.fromkeys(out))  # a JobSet's child Job is seen by two schemas


def load_docs(path: str | Path) -> list[Any]:
    """The non-empty YAML documents of a file; ValueError when it is not YAML."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist")
    try:
        return [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None


def validate_file(path: str | Path) -> list[Problem]:
    docs = load_docs(path)
    if not docs:
        return [Problem(str(path), "", "no objects in the file")]
    return validate_docs(docs)
