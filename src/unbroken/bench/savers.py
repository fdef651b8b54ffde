"""The checkpointing modes ``unbroken bench checkpoint`` drives, one class each.

Every saver is driven by the benchmark's training loop (``checkpoint._loop``): ``save`` at due
steps and ``before_update`` before every optimizer step, each returning the seconds the
trainer was blocked; ``take`` hands over per-save stalls, persist times and skips. The modes:
``Saver`` (none), ``DcpSync`` (``dcp.save``), ``DcpAsync`` (``dcp.async_save`` with a reused
``DefaultStager``), ``UnbrokenSaver`` (our ``Checkpointer``, ``on_busy`` skip or wait). DCP's
writes can be throttled like ours (``throttle`` MB/s) to emulate slow shared storage.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any, Literal, Protocol

_SLICE = 4 << 20


class Trainee(Protocol):
    """What a saver needs of the benchmark's training process."""

    root: Path
    """Where this saver's checkpoints go (a folder per mode below it)."""
    throttle: float
    """Write-rate cap in MB/s (0: none)."""
    state: dict[str, Any]
    """The training state as ``Checkpointer`` takes it (modules and optimizers)."""

    def state_dict(self) -> dict[str, Any]:
        """The training state as DCP takes it (state dicts)."""
        ...


class _ThrottledStream(io.RawIOBase):
    """A file stream whose writes are capped at a rate (emulated slow storage)."""

    def __init__(self, raw: Any, bytes_per_s: float) -> None:
        super().__init__()
        self._raw = raw
        self._rate = bytes_per_s
        self._t0 = time.monotonic()
        self._n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        for start in range(0, len(view), _SLICE):
            chunk = view[start : start + _SLICE]
            self._raw.write(chunk)
            self._n += len(chunk)
            ahead = self._t0 + self._n / self._rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        return len(view)

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()


def _dcp_writer(path: Path, throttle_mbps: float) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    writer = FileSystemWriter(path)
    if throttle_mbps > 0:
        rate = throttle_mbps * 1e6

        class Throttled(FileSystem):
            @contextlib.contextmanager
            def create_stream(self, path: Any, mode: str) -> Any:
                with super().create_stream(path, mode) as raw:
                    yield _ThrottledStream(raw, rate) if "w" in mode else raw

        writer.fs = Throttled()
    return writer


class Saver:
    """One checkpointing mode, driven by the loop: ``save`` at due steps, ``before_update``
    before every optimizer step; both return the seconds the trainer was blocked."""

    mode = "none"

    def save(self, step: int) -> float:
        return 0.0

    def before_update(self) -> float:
        return 0.0

    def drain(self) -> None:
        pass

    def take(self) -> dict[str, Any]:
        """Per-save stalls, persist times and skips since the last take."""
        return {"stall_s": [], "persist_s": [], "skipped": 0, "staging_bytes": 0}

    def close(self) -> None:
        pass


class DcpSync(Saver):
    mode = "dcp-sync"

    def __init__(self, ctx: Trainee) -> None:
        self.ctx = ctx
        self.stalls: list[float] = []

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        writer = _dcp_writer(self.ctx.root / self.mode / f"step-{step}", self.ctx.throttle)
        dcp.save(self.ctx.state_dict(), storage_writer=writer)
        dt = time.perf_counter() - t0
        self.stalls.append(dt)
        return dt

    def take(self) -> dict[str, Any]:
        out = {"stall_s": self.stalls, "persist_s": list(self.stalls), "skipped": 0}
        self.stalls = []
        return {**out, "staging_bytes": 0}


class DcpAsync(Saver):
    mode = "dcp-async"

    def __init__(self, ctx: Trainee) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.ctx = ctx
        # CPU: no pinned or shared memory, no non-blocking copies; staging on a thread.
        self.stager = DefaultStager(StagingOptions(False, False, True, False))
        # The upload thread runs collectives: never on the training loop's group.
        self.pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.resp: Any = None
        self.started = 0.0
        self.stalls: list[float] = []
        self.persist: list[float] = []
        self._done_ts = 0.0

    def _finish_previous(self) -> None:
        if self.resp is not None:
            self.resp.upload_completion.result()
            self.persist.append(self._done_ts - self.started)
            self.resp = None

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self._finish_previous()  # at most one save in flight
        writer = _dcp_writer(self.ctx.root / self.mode / f"step-{step}", self.ctx.throttle)
        self.started = time.perf_counter()
        self.resp = dcp.async_save(
            self.ctx.state_dict(),
            storage_writer=writer,
            async_stager=self.stager,
            process_group=self.pg,
        )
        self.resp.upload_completion.add_done_callback(self._mark_done)
        dt = time.perf_counter() - t0
        self.stalls.append(dt)
        return dt

    def _mark_done(self, _fut: Any) -> None:
        self._done_ts = time.perf_counter()

    def before_update(self) -> float:
        if self.resp is None or self.resp.staging_completion.done():
            return 0.0
        t0 = time.perf_counter()
        self.resp.staging_completion.result()
        dt = time.perf_counter() - t0
        self.stalls[-1] += dt
        return dt

    def drain(self) -> None:
        self._finish_previous()

    def take(self) -> dict[str, Any]:
        out = {"stall_s": self.stalls, "persist_s": self.persist, "skipped": 0}
        self.stalls, self.persist = [], []
        return {**out, "staging_bytes": 0}

    def close(self) -> None:
        self.drain()
        self.stager.close()


class UnbrokenSaver(Saver):
    def __init__(self, ctx: Trainee, *, on_busy: Literal["skip", "wait"]) -> None:
        from unbroken.checkpoint import CheckpointConfig, Checkpointer

        self.mode = "unbroken" if on_busy == "skip" else "unbroken-wait"
        self.ctx = ctx
        self.ck = Checkpointer(
            ctx.root / self.mode,
            overlap=True,
            on_busy=on_busy,
            keep=2,
            config=CheckpointConfig(throttle_mbps=ctx.throttle),
        )
        self._seen = self.ck.stats()

    def save(self, step: int) -> float:
        before = self.ck.stats().blocking_s
        self.ck.save(step, self.ctx.state)
        return self.ck.stats().blocking_s - before

    def before_update(self) -> float:
        return 0.0  # the optimizer pre-hook waits; counted in the Checkpointer's stats

    def drain(self) -> None:
        self.ck.wait()

    def take(self) -> dict[str, Any]:
        now = self.ck.stats()
        old = self._seen
        self._seen = now
        persist = now.persist_s[len(old.persist_s) :]
        commits = now.commit_s[len(old.commit_s) :]
        if commits:  # rank 0: the writer is busy until the commit
            persist = [p + c for p, c in zip(persist, commits, strict=False)]
        return {
            "stall_s": now.stall_s[len(old.stall_s) :],
            "persist_s": persist,
            "skipped": now.skipped - old.skipped,
            "blocking_s": now.blocking_s - old.blocking_s,
            "staging_bytes": self.ck.staging_bytes,
        }

    def close(self) -> None:
        self.ck.close()
