"""The working directory of ``unbroken bench k8s``: one per configuration, fresh for each run."""

from __future__ import annotations

import shutil
from pathlib import Path


def not_ours(workdir: Path) -> str | None:
    """Why ``workdir`` cannot take a run (a file, or non-empty with no earlier run of ours),
    or None."""
    if workdir.exists() and not workdir.is_dir():
        return f"{workdir} is a file, not a directory: pass a new --out"
    if workdir.is_dir() and any(workdir.iterdir()) and not (workdir / "volume").is_dir():
        return f"{workdir} is not empty and holds no earlier bench k8s run: pass a new --out"
    return None


def fresh_workdir(workdir: Path) -> None:
    """Empty ``workdir`` for a new run: an earlier run there (its ``volume``) is removed, since
    its ledger would read as this run's progress (its steps, its connected nodes); ValueError
    for a non-empty directory that holds no earlier run (not ours to delete)."""
    why = not_ours(workdir)
    if why is not None:
        raise ValueError(why)
    if workdir.is_dir():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
