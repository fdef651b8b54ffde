"""The state and the limits of ``unbroken bench size``: a synthetic per-rank state of flat
shards, and what the machine itself does with its bytes (a plain copy, a write+fsync, a read),
at the start and again next to each measured operation (``Floors``)."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20


# --- the state -------------------------------------------------------------------------------
class Shards(torch.nn.Module):
    """A rank's flat shards, as parameters of a module (loaded in place, as FSDP's are)."""

    def __init__(self, nbytes: int, shard_mib: int, device: str = "cpu") -> None:
        super().__init__()
        per = shard_mib * MIB // 4
        n = max(1, nbytes // 4)
        for i in range(-(-n // per)):
            t = _filled(i, min(per, n - i * per)).to(device)
            self.register_parameter(f"shard{i:04d}", torch.nn.Parameter(t, requires_grad=False))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.parameters()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def scramble(self) -> None:
        """Overwrite every shard, so a restore has something to prove."""
        for t in self.tensors:
            t.fill_(-1.0)

    def intact(self) -> bool:
        """Whether every shard holds the values its seed gives."""
        return all(torch.equal(t.cpu(), _filled(i, t.numel())) for i, t in enumerate(self.tensors))


def _filled(seed: int, n: int) -> torch.Tensor:
    return torch.empty(n).uniform_(generator=torch.Generator().manual_seed(seed))


# --- the limits ------------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache (root only); whether it was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def limits(state: Shards, root: Path) -> dict[str, Any]:
    """Copy, write+fsync and read bandwidths (bytes/s) of this state on this machine. On a
    GPU the copy is device to pinned host memory: the floor of staging there."""
    tensors = state.tensors
    cuda = tensors[0].is_cuda
    fresh = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    copy = functools.partial(_copy, fresh, tensors)
    first_touch, _ = timed(copy)
    copies = [timed(copy)[0] for _ in range(3)]
    host = fresh if cuda else tensors
    root.mkdir(parents=True, exist_ok=True)
    writes, reads, dropped = [], [], True
    for _ in range(2):  # the disk's best of two: a limit, not an average
        w, r, cold = _disk(host, root / "limits.bin")
        writes.append(w)
        reads.append(r)
        dropped = dropped and cold
    del copy, fresh, host
    n = state.nbytes
    return {
        "memcpy_Bps": n / min(copies),
        "first_touch_Bps": n / first_touch,
        "write_fsync_Bps": n / min(writes),
        "read_Bps": n / min(reads),
        "read_cold": dropped,
    }


class Floors:
    """The limits again, next to each measured operation: on a shared host the memory and
    disk bandwidth move by half from one second to the next, so each stall and restore from
    memory is set against a plain copy timed just before it, not against the best one of the
    start; a persist is set against the plain write+fsyncs timed on either side of it (which
    also join the disk's best of the run)."""

    def __init__(self, state: Shards, root: Path) -> None:
        self._state = state
        cuda = state.tensors[0].is_cuda
        self._scratch = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in state.tensors
        ]
        _copy(self._scratch, state.tensors)  # faulted in: a floor, not a first touch
        self._file = root / "floor.bin"
        root.mkdir(parents=True, exist_ok=True)

    def copy_s(self) -> float:
        """Seconds for one plain copy of the state (device to pinned host memory on a GPU)."""
        return timed(functools.partial(_copy, self._scratch, self._state.tensors))[0]

    def disk_s(self) -> float:
        """Seconds to write the state to a file and fsync it."""
        host = self._scratch if self._state.tensors[0].is_cuda else self._state.tensors
        t0 = time.perf_counter()
        _write_fsync(host, self._file)
        took = time.perf_counter() - t0
        self._file.unlink()
        return took

    def close(self) -> None:
        self._scratch = []


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dsts, srcs)
    if srcs[0].is_cuda:
        torch.cuda.synchronize()


def _disk(tensors: list[torch.Tensor], path: Path) -> tuple[float, float, bool]:
    """Seconds to write ``tensors`` to ``path`` and fsync, then to read it back (page cache
    dropped if it may be: the third value)."""
    t0 = time.perf_counter()
    _write_fsync(tensors, path)
    write_s = time.perf_counter() - t0
    dropped = drop_page_cache()
    buf = bytearray(8 * MIB)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return write_s, read_s, dropped


def _write_fsync(tensors: list[torch.Tensor], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for t in tensors:
            view = memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
            for at in range(0, len(view), 8 * MIB):
                os.write(fd, view[at : at + 8 * MIB])
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out
