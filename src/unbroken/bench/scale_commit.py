"""Checkpoint commit at scale: n ranks' done records merged into one committed checkpoint by
the real coordinator code, then the listing and checks ``restore()`` runs on a rank.

Stood in: the ranks' writers. Each rank's done record is written as ``checkpoint.persisting.writer``
writes it (``items``, ``results``, ``assigned``, ``planner_data``, ``files``, pickled), for a
model of ``tensors`` parameters each sharded along dim 0 over the n ranks (FSDP's layout)
plus one replicated value written by rank 0 (an optimizer step counter), beside a tiny data
file per rank (the bytes do not matter to the merge; their sizes and CRCs do).

Measured with the real code, time, then in a second save peak Python memory (tracemalloc):

- merge: ``commit.wait_for_ranks`` (read every record) + ``commit.publish`` (DCP metadata,
  manifest, rename, COMMITTED, fsyncs): what rank 0's writer does per checkpoint;
- restore listing: ``layout.sweep_incomplete``, ``layout.committed_steps``,
  ``layout.manifest_files``, ``layout.verify`` of rank 0's share of the files (file i on rank
  i mod n) and DCP's ``read_metadata``: what each rank does in ``restore()`` before loading.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from unbroken.checkpoint import layout
from unbroken.checkpoint.persisting import commit

STEP = 100
ROWS, COLS = 4, 8  # each rank's chunk of each parameter


def _record(rank: int, n: int, tensors: int) -> tuple[dict[str, Any], bytes]:
    """Rank ``rank``'s done record and data file, shaped as the writer makes them."""
    name = layout.data_file(rank)
    items, results = [], []
    props = TensorProperties(dtype=torch.float32)
    offset = 0
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        chunk_offsets = torch.Size([rank * ROWS, 0])
        wi = WriteItem(
            index=MetadataIndex(fqn, chunk_offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=chunk_offsets, sizes=torch.Size([ROWS, COLS])),
                properties=props,
                size=torch.Size([n * ROWS, COLS]),
            ),
        )
        items.append(wi)
        results.append(WriteResult(wi.index, 16, _StorageInfo(name, offset, 16)))
        offset += 16
    step_item = WriteItem(
        index=MetadataIndex("optim.state.step"),
        type=WriteItemType.BYTE_IO,
        bytes_io_data=BytesIOWriteData(nbytes=8),
    )
    if rank == 0:
        items.append(step_item)
        results.append(WriteResult(step_item.index, 8, _StorageInfo(name, offset, 8)))
        offset += 8
    data = bytes(offset)
    planner = {f"model.layers.{t}.weight": (f"model.layers.{t}.weight",) for t in range(tensors)}
    planner["optim.state.step"] = ("optim.state.step",)
    record = {
        "rank": rank,
        "step": STEP,
        "items": items,
        "results": results,
        "assigned": [step_item.index],
        "planner_data": planner,
        "files": {name: layout.file_entry(len(data), zlib.crc32(data))},
    }
    return record, data


def _timed(fn: Any, *, traced: bool) -> tuple[Any, float]:
    """(result, seconds), or (result, peak traced bytes): tracemalloc slows allocation-heavy
    code several times, so time and memory come from separate runs."""
    if not traced:
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t
    tracemalloc.start()
    try:
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, float(peak)


def _prepare(root: Path, step: int, n: int, tensors: int) -> Path:
    part = layout.partial_dir(root, step)
    part.mkdir(parents=True)
    for r in range(n):
        rec, data = _record(r, n, tensors)
        rec["step"] = step
        (part / layout.data_file(r)).write_bytes(data)
        (part / layout.done_record(r)).write_bytes(pickle.dumps(rec))
    return part


def measure(n: int, *, tensors: int = 32) -> dict[str, Any]:
    """Merge ``n`` ranks' records of a ``tensors``-parameter model; then list and check it.
    Timed once, then again under tracemalloc for the peak (a second step, same records)."""
    out: dict[str, Any] = {"ranks": n, "tensors": tensors}
    with tempfile.TemporaryDirectory(prefix="unbroken-scale-ckpt-") as tmp:
        root = Path(tmp)
        for step, traced in ((STEP, False), (STEP + 1, True)):
            part = _prepare(root, step, n, tensors)

            def merge(part: Path = part, step: int = step) -> list[str]:
                records = commit.wait_for_ranks(
                    part, world_size=n, deadline=time.time() + 600, at=lambda _: None
                )
                return commit.publish(root, step=step, records=records, keep=2, at=lambda _: None)

            _, merged = _timed(merge, traced=traced)
            ckpt = layout.step_dir(root, step)
            if not (ckpt / layout.COMMITTED).exists():
                raise RuntimeError(f"the merge of {n} ranks did not commit")

            def listing(ckpt: Path = ckpt, step: int = step) -> str | None:
                layout.sweep_incomplete(root)
                assert layout.committed_steps(root)[0] == step
                names = layout.manifest_files(ckpt)
                why = layout.verify(ckpt, files=names[0::n])
                with layout.gc_paused():  # as restore() reads it
                    md = FileSystemReader(ckpt).read_metadata()
                assert len(md.state_dict_metadata) == tensors + 1
                return why

            why, listed = _timed(listing, traced=traced)
            if why is not None:
                raise RuntimeError(f"the committed checkpoint of {n} ranks fails its check: {why}")
            if traced:
                out["merge_peak_bytes"] = merged
                out["restore_listing_peak_bytes"] = listed
            else:
                out["merge_s"] = merged
                out["restore_listing_s"] = listed
                out["metadata_bytes"] = os.path.getsize(ckpt / layout.DCP_METADATA)
    return out
