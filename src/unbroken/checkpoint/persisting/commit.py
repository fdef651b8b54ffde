"""The coordinator's half of a save: merge every rank's done record into DCP's global
``.metadata``, write the manifest, and publish ``step-N`` atomically (runs in rank 0's writer).

A done record (``.rank-R.done``, pickled, written durably by rank R's writer after its data
file is fsynced) holds what ``dcp.save``'s coordinator would have gathered from that rank: the
write items it wrote (``SavePlan`` items), their ``WriteResult`` storage locations, the
flatten mapping, the replicated items it holds, its files' sizes and CRC-32s, and the run it
writes for (recorded in the manifest with every tensor's global shape).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
import uuid
from collections import ChainMap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import (
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from unbroken.checkpoint import layout

logger = logging.getLogger(__name__)

POLL_S = 0.005


class Abandoned(Exception):
    """This step will not be committed (a rank skipped or failed it); not an error."""


def wait_for_ranks(
    part: Path, *, world_size: int, deadline: float, at: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Wait for every rank's done record; raise Abandoned when a rank skipped or failed the
    step, TimeoutError past ``deadline`` (epoch seconds). Calls ``at("done")`` (a hook
    point, see ``hooks``) once every record is in."""
    wanted = {layout.done_record(r) for r in range(world_size)}
    while True:
        names = set(os.listdir(part))
        why = abandon_reason(part, names)
        if why:
            raise Abandoned(why)
        if wanted <= names:
            break
        if time.time() > deadline:
            missing = sorted(int(n.split("-")[1].split(".")[0]) for n in wanted - names)
            raise TimeoutError(f"ranks {missing} did not finish writing {part.name} in time")
        time.sleep(POLL_S)
    at("done")
    with layout.gc_paused():
        return [
            layout.parse_done_record((part / layout.done_record(r)).read_bytes())
            for r in range(world_size)
        ]


def abandon_reason(part: Path, names: set[str] | None = None) -> str | None:
    """Why ``part`` will never commit (a skip, failure or abandon marker), or None."""
    if names is None:
        try:
            names = set(os.listdir(part))
        except FileNotFoundError:
            return "the partial directory is gone"
    if layout.ABANDONED in names:
        return _read(part / layout.ABANDONED) or "abandoned"
    for name in sorted(names):
        if name.endswith(".skipped"):
            return f"{name[1:].split('.')[0]} skipped this step: its previous save was persisting"
        if name.endswith(".failed"):
            return f"{name[1:].split('.')[0]} failed: {_read(part / name)}"
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()[:500]
    except OSError:
        return ""


def build_metadata(records: list[dict[str, Any]], *, checkpoint_id: str) -> Metadata:
    """DCP's global metadata from the ranks' records, as ``dcp.save``'s coordinator makes it:
    duplicates (the same index written by several ranks) keep the lowest rank's copy."""
    kept: dict[MetadataIndex, Any] = {}
    plans = []
    for rec in sorted(records, key=lambda r: r["rank"]):
        items = []
        for wi, result in zip(rec["items"], rec["results"], strict=True):
            if wi.index in kept:
                continue
            kept[wi.index] = result.storage_data
            items.append(wi)
        plans.append(SavePlan(items=items))
    written = set(kept)
    missing = {idx for rec in records for idx in rec["assigned"]} - written
    if missing:
        names = sorted({i.fqn for i in missing})[:5]
        raise RuntimeError(
            f"replicated items held by some rank were written by none: {names}; the ranks' "
            "model or optimizer state differ in keys"
        )
    global_plan, md = create_default_global_save_plan(plans, rewrite_index_hints=False)
    planner_data = dict(ChainMap(*[rec["planner_data"] for rec in records]))
    md = dataclasses.replace(md, planner_data=planner_data)
    errors = _validate_global_plan(global_plan, md)
    if errors:
        raise RuntimeError(f"the merged checkpoint plan is inconsistent: {'; '.join(errors)[:500]}")
    md.storage_data = kept
    md.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=uuid.uuid4().hex)
    md.version = CURRENT_DCP_VERSION
    return md


def publish(
    root: Path,
    *,
    step: int,
    records: list[dict[str, Any]],
    keep: int,
    at: Callable[[str], None],
) -> list[str]:
    """Write ``.metadata`` and the manifest into ``step-N.partial``, rename it to ``step-N``,
    write ``COMMITTED``, fsync, and apply retention. Returns the names retention removed.
    Calls ``at("manifest")`` before the rename and ``at("renamed")`` before ``COMMITTED``."""
    part = layout.partial_dir(root, step)
    final = layout.step_dir(root, step)
    with layout.gc_paused():
        md = build_metadata(records, checkpoint_id=str(final))
        payload = pickle.dumps(md)
    files = {name: entry for rec in records for name, entry in rec["files"].items()}
    md_crc = layout.write_durable(part / layout.DCP_METADATA, payload)
    files[layout.DCP_METADATA] = layout.file_entry(len(payload), md_crc)
    tensors = {
        fqn: list(meta.size)
        for fqn, meta in md.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    runs = {rec.get("run") for rec in records}
    if len(runs) != 1:
        raise RuntimeError(f"the ranks' writers name different runs {sorted(map(str, runs))}")
    manifest = layout.manifest_bytes(
        step=step, world_size=len(records), files=files, run=runs.pop(), tensors=tensors
    )
    manifest_crc = layout.write_durable(part / layout.MANIFEST, manifest)
    for r in range(len(records)):  # merged into .metadata; not part of the DCP directory
        (part / layout.done_record(r)).unlink(missing_ok=True)
    layout.fsync_dir(part)
    at("manifest")
    layout.move_aside(final)
    os.rename(part, final)
    layout.fsync_dir(root)
    at("renamed")
    layout.write_durable(
        final / layout.COMMITTED,
        layout.committed_bytes(step=step, manifest_crc32=manifest_crc),
    )
    layout.fsync_dir(root)
    try:
        return layout.retain(root, keep=keep, newest=step)
    except OSError as e:  # step-N is committed: a failed clean-up is no failed save
        logger.warning(
            "retention after committing step %d failed (retried next commit): %s", step, e
        )
        return []
