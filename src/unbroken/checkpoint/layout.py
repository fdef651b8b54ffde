"""The on-disk layout of a checkpoint directory, its durability helpers, checks and retention.

``<root>/step-N/`` is a torch.distributed.checkpoint (DCP) directory: one ``__<rank>_0.distcp``
per rank and the global ``.metadata``, so ``torch.distributed.checkpoint.load`` reads it as is.
Beside them: ``MANIFEST.json`` (size and CRC-32 of every file) and ``COMMITTED`` (the CRC-32 of
the manifest). A checkpoint exists only once ``COMMITTED`` does.

Life of a save: every rank's writer fills ``step-N.partial/`` and drops a done record
``.rank-R.done``; the coordinator (rank 0's writer) merges them into ``.metadata``, writes the
manifest, fsyncs, renames the directory to ``step-N/``, writes ``COMMITTED`` and fsyncs the
root. A crash at any point leaves either no ``step-N/`` or one without ``COMMITTED``; both are
invisible to ``committed_steps`` and removed by ``retain`` after a later commit.

Recycled data files: ``retain`` moves each rank's data file of a checkpoint it retires into
``<root>/.recycle/`` (after its ``COMMITTED`` is gone, durably), and that rank's writer renames
it into its next save and writes over it in place (``claim_recycled``), as databases recycle
their log segments: overwriting blocks a file holds costs no block allocation, which on a
thin-provisioned virtual disk (the cloud's, this project's CI machine's: ext4 with ``discard``)
is most of a write into a new file. It holds no more disk than before: the retired file
stands for the one the next save writes.

Checksum: zlib.crc32, the fastest whole-file check in the standard library (ahead of adler32,
sha1, sha256, blake2b and md5); it guards against torn and flipped bytes, not against an
adversary.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import io
import json
import logging
import os
import pickle
import re
import shutil
import sys
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from unbroken.ledger.durable import fsync_dir as fsync_dir  # commit, faults, writer use it
from unbroken.ledger.durable import write_atomic

logger = logging.getLogger(__name__)

FORMAT = "unbroken-ckpt/1"
COMMITTED = "COMMITTED"
MANIFEST = "MANIFEST.json"
DCP_METADATA = ".metadata"
ABANDONED = ".abandoned"
PARTIAL_SUFFIX = ".partial"
_STEP_RE = re.compile(r"^step-(\d+)$")
_PARTIAL_RE = re.compile(r"^step-(\d+)\.partial$")
_ASIDE_RE = re.compile(r"^step-(\d+)\.old-[0-9a-f]+$")
_REJECTED_RE = re.compile(r"^step-(\d+)\.rejected-[0-9a-f]+$")
_CHUNK = 8 << 20
RECYCLE = ".recycle"
_DATA_RE = re.compile(r"^__\d+_0\.distcp$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint directory's (``step-N``), committed or not yet."""
    return _STEP_RE.match(name) is not None


def partial_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}{PARTIAL_SUFFIX}"


def data_file(rank: int) -> str:
    """DCP's file name for a rank's single data file."""
    return f"__{rank}_0.distcp"


def done_record(rank: int) -> str:
    return f".rank-{rank}.done"


def skip_marker(rank: int) -> str:
    return f".rank-{rank}.skipped"


def fail_marker(rank: int) -> str:
    return f".rank-{rank}.failed"


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (restored after, as it was).

    Unpickling n ranks' done records, or DCP's global metadata of an n-rank checkpoint,
    allocates millions of small objects and no cycles; the collector's passes over them made
    the commit merge and the restore's metadata read quadratic in the ranks (``unbroken bench
    scale`` measures both)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# --- durability ------------------------------------------------------------------------------
def write_durable(path: Path, payload: bytes) -> int:
    """Write ``payload`` to ``path`` atomically (tmp, fsync, rename, fsync dir); returns CRC-32."""
    write_atomic(path, payload)
    return zlib.crc32(payload)


def write_marker(path: Path, info: dict[str, Any]) -> None:
    """A small signal file between processes (not fsynced: it only has to be seen)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(info), durable=False)


def file_crc32(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC-32) of a file, read in 8 MiB chunks."""
    crc = 0
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


# --- manifest and commit marker --------------------------------------------------------------
def manifest_bytes(
    *,
    step: int,
    world_size: int,
    files: dict[str, dict[str, Any]],
    run: str | None = None,
    tensors: dict[str, list[int]] | None = None,
) -> bytes:
    """The manifest: every file of the checkpoint with its size and CRC-32 (hex), the run that
    wrote it (None: unnamed) and the global shape of every tensor in it (the model it fits)."""
    doc = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "created": time.time(),
        "run": run,
        "tensors": dict(sorted((tensors or {}).items())),
        "files": dict(sorted(files.items())),
    }
    return json.dumps(doc, indent=1).encode()


def manifest_run(ckpt: Path) -> tuple[bool, str | None]:
    """(whether the manifest records its run, that run): checkpoints of older versions of
    unbroken do not; raises OSError/ValueError for an unreadable manifest."""
    doc = json.loads((ckpt / MANIFEST).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{ckpt / MANIFEST}: not a JSON object")
    run = doc.get("run")
    return "run" in doc, None if run is None else str(run)


def committed_bytes(*, step: int, manifest_crc32: int) -> bytes:
    doc = {"format": FORMAT, "step": step, "manifest_crc32": f"{manifest_crc32:08x}"}
    return json.dumps(doc).encode()


def file_entry(size: int, crc: int) -> dict[str, Any]:
    return {"bytes": size, "crc32": f"{crc:08x}"}


_CRC_RE = re.compile(r"^[0-9a-f]{8}$")


def _json_object(raw: bytes | str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: JSON and UTF-8 errors
        raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what} is not a JSON object")
    return doc


def parse_marker(raw: bytes | str) -> dict[str, Any]:
    """A ``COMMITTED`` marker's fields; ValueError unless it names a manifest CRC-32."""
    doc = _json_object(raw, "commit marker")
    if not (isinstance(doc.get("manifest_crc32"), str) and _CRC_RE.match(doc["manifest_crc32"])):
        raise ValueError(
            f"commit marker has no manifest_crc32, got {doc.get('manifest_crc32')!r:.40}"
        )
    return doc


def parse_manifest(raw: bytes | str) -> dict[str, dict[str, Any]]:
    """A manifest's ``files``: name -> {"bytes": int >= 0, "crc32": 8 hex digits}.

    ValueError for anything else, and for a name that is not a plain file name of the
    checkpoint directory (a path: ``a/b``, ``..``), which verify must never open.
    """
    files = _json_object(raw, "manifest").get("files")
    if not isinstance(files, dict):
        raise ValueError("manifest has no files mapping")
    for name, entry in files.items():
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"manifest names {name!r:.80}, not a file of the checkpoint")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and not isinstance(entry["bytes"], bool)
            and entry["bytes"] >= 0
            and isinstance(entry.get("crc32"), str)
            and _CRC_RE.match(entry["crc32"])
        ):
            raise ValueError(f"manifest entry of {name!r:.80} is malformed: {entry!r:.80}")
    return files


# Modules whose dataclasses and enums a done record holds (DCP's write items and results, the
# staging arena's slots); nothing else may be constructed while reading one.
_RECORD_MODULES = frozenset(
    {
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.planner",
        "torch.distributed.checkpoint.storage",
        "torch.distributed.checkpoint.filesystem",
        "unbroken.checkpoint.staging.arena",
    }
)
_RECORD_NAMES = frozenset(
    {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout")}
)


class _RecordUnpickler(pickle.Unpickler):
    """Builds only the types a done record holds: no arbitrary callable, so a record planted in
    the directory cannot run code (DCP's own ``.metadata`` has no such guard: see README)."""

    def find_class(self, module: str, name: str) -> Any:
        # Checked before the import: importing a module named by the bytes could run code.
        if (
            module not in _RECORD_MODULES
            and module != "torch"
            and (module, name) not in _RECORD_NAMES
        ):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a done record")
        obj = super().find_class(module, name)
        torch = sys.modules.get("torch")
        dtype = module == "torch" and torch is not None and isinstance(obj, torch.dtype)
        record_type = (
            module in _RECORD_MODULES
            and isinstance(obj, type)
            and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        )
        if (module, name) in _RECORD_NAMES or dtype or record_type:
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a done record")


def safe_loads(raw: bytes) -> Any:
    """Unpickle ``raw`` building only the types of a done record or a snapshot's metadata
    (DCP's indexes and items, arena slots, dtypes, sizes, plain values); UnpicklingError for
    anything else, before it is constructed."""
    return _RecordUnpickler(io.BytesIO(raw)).load()


def parse_done_record(raw: bytes) -> dict[str, Any]:
    """A writer's done record (``.rank-R.done``); ValueError for anything else."""
    try:
        record = _RecordUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - whatever the bytes, one documented error
        raise ValueError(f"not a done record: {type(e).__name__}: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(f"not a done record: a {type(record).__name__}")
    return record


# --- listing ---------------------------------------------------------------------------------
def _own_entries(root: Path) -> list[os.DirEntry[str]]:
    """The entries of ``root`` that are its own: a symlink (to a checkpoint elsewhere, to
    anything) is never listed, checked, moved or deleted through, only logged."""
    out = []
    for entry in os.scandir(root):
        if entry.is_symlink():
            if entry.name.startswith("step-") and entry.path not in _warned_links:
                _warned_links.add(entry.path)
                logger.warning(
                    "ignoring %s: a symlink, not a checkpoint of this directory", entry.path
                )
            continue
        out.append(entry)
    return out


_warned_links: set[str] = set()


def committed_steps(root: Path) -> list[int]:
    """Steps with a ``COMMITTED`` marker, newest first (their contents are not checked).
    Symlinks are not checkpoints of ``root`` and are ignored."""
    if not root.is_dir():
        return []
    steps = []
    for entry in _own_entries(root):
        m = _STEP_RE.match(entry.name)
        if m and os.path.exists(os.path.join(entry.path, COMMITTED)):
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def manifest_files(ckpt: Path) -> list[str]:
    """The file names a committed checkpoint's manifest lists, sorted."""
    return sorted(parse_manifest((ckpt / MANIFEST).read_bytes()))


def verify(ckpt: Path, *, files: Iterable[str] | None = None, checksums: bool = True) -> str | None:
    """Check a committed checkpoint; returns None if sound, else why not.

    Always checks the marker against the manifest and every listed file's presence and size;
    with ``checksums``, also the CRC-32 of ``files`` (default: all listed files). An I/O error
    other than a missing file (EIO, ESTALE, ...) is raised as OSError, not returned: it says
    nothing about the checkpoint, and the caller retries rather than rejects.
    """
    try:
        marker = parse_marker((ckpt / COMMITTED).read_bytes())
        raw = (ckpt / MANIFEST).read_bytes()
    except (FileNotFoundError, ValueError) as e:
        return f"unreadable commit marker or manifest: {e}"
    if not isinstance(marker, dict):
        return f"malformed commit marker: {str(marker)[:100]}"
    if marker.get("manifest_crc32") != f"{zlib.crc32(raw):08x}":
        return f"manifest checksum mismatch (marker says {marker.get('manifest_crc32')})"
    try:
        listed = parse_manifest(raw)
    except ValueError as e:
        return f"malformed manifest: {e}"
    for name, entry in sorted(listed.items()):
        try:
            size = os.stat(ckpt / name).st_size
        except FileNotFoundError as e:
            return f"{name}: missing ({e.strerror})"
        if size != entry["bytes"]:
            return f"{name}: size {size} != {entry['bytes']} in the manifest"
    if not checksums:
        return None
    for name in sorted(listed if files is None else files):
        if name not in listed:
            return f"{name}: not in the manifest"
        size, crc = file_crc32(ckpt / name)
        if f"{crc:08x}" != listed[name]["crc32"] or size != listed[name]["bytes"]:
            return f"{name}: checksum mismatch (crc32 {crc:08x}, manifest {listed[name]['crc32']})"
    return None


# --- removal and retention -------------------------------------------------------------------
def remove_checkpoint(path: Path, *, recycle: Path | None = None) -> None:
    """Delete a checkpoint so that no crash leaves it half-deleted yet committed: the marker
    goes first (and is made durable), then the rest; with ``recycle``, its data files move
    there first (see the module docstring). A symlink is left alone (what it points to is not
    ours)."""
    if path.is_symlink():
        logger.warning("not removing %s: a symlink, not a checkpoint of this directory", path)
        return
    marker = path / COMMITTED
    if marker.exists():
        marker.unlink()
        fsync_dir(path)
    if recycle is not None:
        with contextlib.suppress(OSError):  # recycling is an optimisation: never a failure
            recycle.mkdir(exist_ok=True)
            for entry in os.scandir(path):
                if _DATA_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                    os.replace(entry.path, recycle / entry.name)
    shutil.rmtree(path, ignore_errors=True)


def claim_recycled(root: Path, name: str, dest: Path) -> bool:
    """Move the recycled data file ``name`` to ``dest`` (a save's own, to be written over in
    place and truncated to its new size); False when there is none."""
    try:
        os.rename(root / RECYCLE / name, dest)
    except OSError:
        return False
    return True


def _prune_recycled(root: Path, newest: int) -> None:
    """Drop recycled files no rank of the newest checkpoint would claim (a smaller world)."""
    try:
        wanted = set(os.listdir(step_dir(root, newest)))
        for entry in os.scandir(root / RECYCLE):
            if entry.name not in wanted:
                os.unlink(entry.path)
    except OSError:
        return


def retain(root: Path, *, keep: int, newest: int) -> list[str]:
    """After committing step ``newest``: keep the ``keep`` highest committed steps and
    ``newest`` itself (the one checkpoint just written and known sound), and remove partial,
    uncommitted or rejected directories of older steps. Returns the names removed."""
    assert keep >= 1, keep
    removed = []
    committed = committed_steps(root)
    assert newest in committed, (committed[:3], newest)
    for step in committed[keep:]:
        if step != newest:
            remove_checkpoint(step_dir(root, step), recycle=root / RECYCLE)
            removed.append(f"step-{step}")
    _prune_recycled(root, newest)
    for entry in _own_entries(root):
        if _ASIDE_RE.match(entry.name):  # a replaced checkpoint whose removal was cut short
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
            continue
        m = _PARTIAL_RE.match(entry.name) or _STEP_RE.match(entry.name)
        m = m or _REJECTED_RE.match(entry.name)
        if not m or int(m.group(1)) >= newest:
            continue
        if _STEP_RE.match(entry.name) is None or not os.path.exists(
            os.path.join(entry.path, COMMITTED)
        ):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def sweep_incomplete(root: Path) -> list[str]:
    """Remove every partial, uncommitted or replaced directory, whatever its step: leftovers
    of saves a crash interrupted, whose markers would otherwise confuse a new save of the same
    step. Only when no writer of this job is saving (``restore`` at start)."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for entry in _own_entries(root):
        m = _PARTIAL_RE.match(entry.name) or _ASIDE_RE.match(entry.name)
        uncommitted = _STEP_RE.match(entry.name) and not os.path.exists(
            os.path.join(entry.path, COMMITTED)
        )
        if m or uncommitted:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return sorted(removed)


def quarantine(path: Path) -> Path:
    """Rename a checkpoint that failed its checks out of sight (``step-N.rejected-<id>``),
    kept for inspection until a later commit's retention passes its step."""
    target = path.with_name(f"{path.name}.rejected-{uuid.uuid4().hex[:8]}")
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def move_aside(path: Path) -> None:
    """Remove an existing directory that a new commit replaces (an uncommitted leftover, or a
    checkpoint of the same step that failed its checks)."""
    if path.is_symlink():  # a link in our directory: drop the link, never what it points to
        path.unlink()
        return
    with contextlib.suppress(FileNotFoundError):
        aside = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(path, aside)
        remove_checkpoint(aside)
