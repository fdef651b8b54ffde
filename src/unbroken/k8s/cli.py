"""``unbroken k8s``: render manifests, validate them, serve the rendezvous store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from unbroken.k8s import spec as kspec

KINDS = ("job", "jobset", "trainjob")
"""``render.KINDS``, without importing the renderer to build the parser."""
_PAIRS = {"env": "NAME=VALUE", "node_selector": "KEY=VALUE"}
"""Mapping fields: their flags repeat, one pair each."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="k8s_command", required=True)
    r = sub.add_parser(
        "render",
        help="write the manifests of a training job (Indexed Job, JobSet or Kubeflow TrainJob)",
        description="Render the manifests a user applies with kubectl apply -f: the rendezvous "
        "store (Deployment + Service), the checkpoint claim (on FSx for Lustre with the fsx "
        "fields), and an Indexed Job + headless Service (--kind job), a JobSet (--kind jobset) "
        "or a Kubeflow Trainer TrainJob + its runtime (--kind trainjob). Fields come from "
        "--spec FILE.yaml (keys = the flag names with underscores) and the flags below (which "
        "override it). The output is validated before it is written.",
    )
    r.add_argument("--spec", metavar="YAML", help="a YAML mapping of the fields below")
    r.add_argument(
        "--kind",
        choices=list(KINDS),
        default="job",
        help="layout: job (Indexed Job), jobset (JobSet) or trainjob (Kubeflow Trainer "
        "TrainJob + runtime); default job",
    )
    r.add_argument("--out", "-o", metavar="PATH", default="-", help="output file ('-': stdout)")
    r.add_argument("--no-validate", action="store_true", help="write without validating")
    docs = kspec.field_docs()
    for name in kspec.FIELDS:
        flag = "--" + name.replace("_", "-")
        if name == "command":
            r.add_argument(
                flag, dest=name, default=None, help=docs[name] + " (one shell-quoted string)"
            )
        elif name in _PAIRS:
            r.add_argument(
                flag,
                dest=name,
                action="append",
                metavar=_PAIRS[name],
                default=None,
                help=docs[name] + " (repeat the flag for more)",
            )
        else:
            r.add_argument(flag, dest=name, default=None, help=docs[name])
    r.set_defaults(k8s_func=_render)

    v = sub.add_parser(
        "validate",
        help="check manifests: Kubernetes schemas (strict), the JobSet and Trainer CRDs, "
        "unbroken's semantics",
    )
    v.add_argument("files", nargs="+", metavar="FILE", help="YAML files (each applied on its own)")
    v.set_defaults(k8s_func=_validate)

    from unbroken.k8s import store

    s = sub.add_parser("store", help="serve the job's rendezvous store (the store pod runs it)")
    store.add_arguments(s)
    s.set_defaults(k8s_func=store.main)


def _pairs(name: str, pairs: list[str] | None) -> dict[str, str] | None:
    if pairs is None:
        return None
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be {_PAIRS[name]}, got {pair!r}")
        out[key] = value
    return out


def _render(args: argparse.Namespace) -> int:
    from unbroken.k8s import render, validate

    overrides = {name: getattr(args, name) for name in kspec.FIELDS}
    for name in _PAIRS:
        overrides[name] = _pairs(name, getattr(args, name))
    spec = kspec.build(spec_path=args.spec, **overrides)
    docs = render.objects(spec, args.kind)
    if not args.no_validate:
        problems = validate.validate_docs(docs)
        if problems:
            for p in problems:
                print(f"error: {p}", file=sys.stderr)
            return 1
    source = f" from {args.spec} (--kind {args.kind})" if args.spec else f" (--kind {args.kind})"
    file = "-" if args.out == "-" else Path(args.out).name
    text = render.to_yaml(docs, file=file if file != "-" else "FILE.yaml", source=source)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: {', '.join(validate.name_of(d, i) for i, d in enumerate(docs))}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from unbroken.k8s import validate

    bad = 0
    for f in args.files:
        problems = validate.validate_file(f)
        for p in problems:
            print(f"{f}: {p}")
        if problems:
            bad += 1
        else:
            print(
                f"{f}: ok (Kubernetes {validate.K8S_VERSION} schemas strict, JobSet "
                f"{validate.JOBSET_RELEASE} and Kubeflow Trainer {validate.TRAINER_RELEASE} "
                "CRDs, unbroken's checks)"
            )
    return 1 if bad else 0


def main(args: argparse.Namespace) -> int:
    try:
        return int(args.k8s_func(args))
    except ImportError as e:  # the k8s extra is not installed
        print(f"error: {e}", file=sys.stderr)
        return 2
