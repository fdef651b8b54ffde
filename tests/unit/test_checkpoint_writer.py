"""The writer process: background work (``writer.lower_priority``: a session of its own, whose
autogroup gets the lowest share where the kernel has autogroups, SCHED_IDLE, its niceness),
and the stream it persists through (``ChecksumWriter``: small writes gathered, CRC-32 summed
on another thread for large ones)."""

from __future__ import annotations

import errno
import io
import os
import threading
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch

from unbroken.checkpoint import CheckpointConfig, Checkpointer
from unbroken.checkpoint.persisting import writer as writer_mod
from unbroken.checkpoint.persisting.writer import ChecksumWriter


def _autogroup(pid: int) -> tuple[str, int] | None:
    """(autogroup name, its niceness) of ``pid``, or None where the kernel has none: no file,
    or an empty one (autogroups off, or the task in a cgroup of its own, as on some CI hosts)."""
    try:
        fields = Path(f"/proc/{pid or 'self'}/autogroup").read_text().split()
    except OSError:
        return None
    if len(fields) != 3:
        return None
    name, _, nice = fields
    return name, int(nice)


def _served(ck: Checkpointer) -> int:
    """The writer's pid once it has served a save (it lowers its priority before serving)."""
    pid = ck.writer_pid
    assert pid is not None and pid != os.getpid()
    ck.save(0, {"w": torch.arange(10.0)})
    ck.wait()
    return pid


def test_the_writer_leaves_the_trainers_session_and_runs_on_what_training_leaves(tmp_path):
    with Checkpointer(tmp_path / "ckpt", config=CheckpointConfig(writer_start="fork")) as ck:
        pid = _served(ck)
        assert os.getsid(pid) == pid != os.getsid(0)
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(
            19, os.getpriority(os.PRIO_PROCESS, 0) + ck.config.writer_nice
        )
        mine, theirs = _autogroup(0), _autogroup(pid)
        if mine is not None:  # where the kernel has autogroups, the writer's is its own
            assert theirs is not None and theirs[0] != mine[0] and theirs[1] == 19


def test_a_writer_at_the_trainers_priority_stays_in_its_session(tmp_path):
    with Checkpointer(
        tmp_path / "ckpt",
        config=CheckpointConfig(writer_start="fork", writer_nice=0, writer_idle=False),
    ) as ck:
        pid = _served(ck)
        assert os.getsid(pid) == os.getsid(0)
        assert os.sched_getscheduler(pid) == os.sched_getscheduler(0)
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)
        assert _autogroup(pid) == _autogroup(0)


def test_the_stream_gathers_small_writes_and_checksums_the_file_it_wrote(tmp_path):
    path = tmp_path / "data"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        stream = ChecksumWriter(fd, bytes_per_s=0)
        tensors = [torch.arange(n, dtype=torch.float32) for n in (1, 10, 300, 70_000, 2)]
        offsets = []
        for t in tensors:  # torch.save writes each archive in many small pieces
            offsets.append(stream.tell())
            torch.save(t, stream)
        big = os.urandom(3 << 20)  # more than the buffer: written through
        stream.write(big)
        stream.write(b"tail")
        assert stream.tell() > path.stat().st_size  # the tail is still buffered
        stream.flush()
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == stream.tell() == stream.pos
    assert stream.crc == zlib.crc32(data)
    assert data.endswith(big + b"tail")
    ends = [*offsets[1:], len(data) - len(big) - 4]
    for t, begin, end in zip(tensors, offsets, ends, strict=True):  # DCP reads each slice
        assert torch.equal(torch.load(io.BytesIO(data[begin:end]), weights_only=True), t)


def test_a_large_write_is_summed_on_another_thread_before_the_call_returns(tmp_path):
    """Slices of a write larger than one are summed on the CRC thread while the next is
    written; the sum is over the bytes as they were during the call (the caller may reuse its
    buffer once ``write`` returns: torch.save does), in order, whatever came between."""
    path = tmp_path / "data"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    summed_on = set()
    crc32 = zlib.crc32

    def spy(data, value=0):
        summed_on.add(threading.current_thread().name)
        return crc32(data, value)

    parts = [b"head", bytearray(os.urandom((17 << 20) + 5)), b"mid", os.urandom(9 << 20)]
    expected = zlib.crc32(b"".join(parts))
    try:
        stream = ChecksumWriter(fd, bytes_per_s=0)
        with mock.patch.object(zlib, "crc32", spy):
            for part in parts:
                stream.write(part)
                if isinstance(part, bytearray):
                    part[:] = bytes(len(part))  # reused by the caller: must not be read now
            stream.flush()
    finally:
        os.close(fd)
    assert stream.crc == expected == zlib.crc32(path.read_bytes())
    assert any(name.startswith("unbroken-writer-crc") for name in summed_on), summed_on
    writer_mod._crc_thread().shutdown()  # a writer process's thread, here in the test's
    writer_mod._crc_thread.cache_clear()


def test_a_storage_error_is_raised_and_kept_when_the_buffer_is_written(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # writes fail with EBADF, as a broken storage would
    try:
        stream = ChecksumWriter(fd, bytes_per_s=0)
        stream.write(b"x" * 100)  # buffered: nothing written yet
        with pytest.raises(OSError) as raised:
            stream.flush()
    finally:
        os.close(fd)
    assert raised.value.errno == errno.EBADF
    assert stream.os_error is raised.value


def test_closing_the_stream_drops_what_is_buffered(tmp_path):
    """A save that failed leaves bytes in the buffer; closing the stream (as ``IOBase`` does
    when it is collected, possibly after its descriptor number was reused) writes none."""
    path = tmp_path / "data"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        stream = ChecksumWriter(fd, bytes_per_s=0)
        stream.write(b"x" * 100)
        stream.close()
    finally:
        os.close(fd)
    assert path.read_bytes() == b""
    assert stream.closed
