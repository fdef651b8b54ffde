"""The writer is forked from a multi-threaded trainer: no lock another thread held as it forked
may stop it. Each case runs in a fresh interpreter (its import state is part of the case)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_PRELUDE = """
import importlib.abc, importlib.util, logging, os, sys, threading, time
import torch
from unbroken.checkpoint.checkpointer import Checkpointer
logging.basicConfig(level=logging.WARNING)
release = threading.Event()

class LogHooks:
    # A slow-storage cap: the writer logs a warning at the start of the save.
    def save_rate(self, *, root, rank, step):
        return 1e12
    def at(self, point, *, root, step):
        return None

def save(root):
    from unbroken.checkpoint import CheckpointConfig
    config = CheckpointConfig(writer_start="fork", writer_start_timeout_s=10.0)
    ckpt = Checkpointer(root, hooks=LogHooks(), memory_tier=False, persist_timeout_s=10.0,
                        config=config)
    ckpt.save(0, {"w": torch.arange(64, dtype=torch.float32)})
    ckpt.close()
    return ckpt.latest()
"""

_IMPORTING = """
TARGET = "unbroken.checkpoint.persisting.commit"  # the writer needs it; the trainer has not imported it
assert TARGET not in sys.modules
importing = threading.Event()

class Slow(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real
    def create_module(self, spec):
        return self.real.create_module(spec)
    def exec_module(self, module):
        importing.set()
        release.wait()
        self.real.exec_module(module)

class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        spec.loader = Slow(spec.loader)
        return spec

sys.meta_path.insert(0, Finder())
threading.Thread(target=lambda: __import__(TARGET), daemon=True).start()
importing.wait()  # another thread is inside that import, holding its module lock
threading.Timer(1.0, release.set).start()
print("latest", save(sys.argv[1]), flush=True)
"""

_LOGGING = """
r, w = os.pipe()
os.dup2(w, 2)  # stderr: a pipe that is full until the drain below starts
handler = logging.root.handlers[0]
holding = threading.Barrier(3)

def hold_handler():
    with handler.lock:  # a thread inside a logging call
        holding.wait()
        release.wait()

def hog_stderr():
    holding.wait()
    sys.stderr.buffer.write(b"x" * (1 << 20))  # blocks on the full pipe, holding its lock
    sys.stderr.buffer.flush()

out = bytearray()
def drain():
    release.wait()
    while chunk := os.read(r, 1 << 16):
        out.extend(chunk)

for fn in (hold_handler, hog_stderr, drain):
    threading.Thread(target=fn, daemon=True).start()
holding.wait()
time.sleep(0.2)  # the hog is blocked in write(2)
threading.Timer(1.0, release.set).start()
latest = save(sys.argv[1])
time.sleep(0.5)
print("latest", latest, "child logged", b"storage slowed" in out, flush=True)
"""


def _run(tmp_path: Path, body: str) -> str:
    script = textwrap.dedent(_PRELUDE) + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_a_writer_forked_while_another_thread_imports_what_it_needs_works(
    tmp_path: Path,
) -> None:
    assert "latest 0" in _run(tmp_path, _IMPORTING)


@pytest.mark.slow
def test_a_writer_forked_while_threads_hold_the_logging_and_stderr_locks_logs(
    tmp_path: Path,
) -> None:
    assert "latest 0 child logged True" in _run(tmp_path, _LOGGING)
