"""Checkpoint commit at scale: n ranks' done records merged into one committed checkpoint by
the real coordinator code, then the listing and checks ``restore()`` runs on a rank.

Stood in: the ranks' writers. Each rank's done record is written as ``checkpoint.writer``
writes it (``items``, ``results``, ``assigned``, ``planner_data``, ``files``, pickled), for a
model of ``tensors`` parameters each sharded along dim 0 over the n ranks (FSDP's layout)
plus one replicated value written by rank 0 (an optimizer step counter), beside a tiny data
file per rank (the bytes do not matter to the merge; their sizes and CRCs do).

Measured with the real code, time and peak Python memory (tracemalloc):

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

from unbroken.checkpoint import commit, layout

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


def _timed(fn: Any) -> tuple[Any, float, int]:
    tracemalloc.start()
    t = time.perf_counter()
    try:
        out = fn()
        dt = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, dt, peak


def measure(n: int, *, tensors: int = 32) -> dict[str, Any]:
    """Merge ``n`` ranks' records of a ``tensors``-parameter model; then list and check it."""
    with tempfile.TemporaryDirectory(prefix="unbroken-scale-ckpt-") as tmp:
        root = Path(tmp)
        part = layout.partial_dir(root, STEP)
        part.mkdir(parents=True)
        for r in range(n):
            rec, data = _record(r, n, tensors)
            (part / layout.data_file(r)).write_bytes(data)
            (part / layout.done_record(r)).write_bytes(pickle.dumps(rec))

        def merge() -> list[str]:
            records = commit.wait_for_ranks(
                part, world_size=n, deadline=time.time() + 600, at=lambda _: None
            )
            return commit.publish(root, step=STEP, records=records, keep=2, at=lambda _: None)

        _, merge_s, merge_peak = _timed(merge)
        ckpt = layout.step_dir(root, STEP)
        if not (ckpt / layout.COMMITTED).exists():
            raise RuntimeError(f"the merge of {n} ranks did not commit")
        md_bytes = os.path.getsize(ckpt / layout.DCP_METADATA)

        def listing() -> str | None:
            layout.sweep_incomplete(root)
            steps = layout.committed_steps(root)
            assert steps == [STEP], steps
            names = layout.manifest_files(ckpt)
            why = layout.verify(ckpt, files=names[0::n])
            with layout.gc_paused():  # as restore() reads it
                md = FileSystemReader(ckpt).read_metadata()
            assert len(md.state_dict_metadata) == tensors + 1
            return why

        why, list_s, list_peak = _timed(listing)
        if why is not None:
            raise RuntimeError(f"the committed checkpoint of {n} ranks fails its check: {why}")
    return {
        "ranks": n,
        "tensors": tensors,
        "merge_s": merge_s,
        "merge_peak_bytes": merge_peak,
        "metadata_bytes": md_bytes,
        "restore_listing_s": list_s,
        "restore_listing_peak_bytes": list_peak,
    }
