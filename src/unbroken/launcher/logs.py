"""torchrun's ``--tee``: copy workers' redirected output files to the agent's console.

One thread (``unbroken-tee``) polls the files of the current round and writes each new complete
line to the agent's stdout or stderr, prefixed ``[<role><local_rank>]:`` as torchrun does.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)


@dataclass
class _Tail:
    path: Path
    prefix: str
    out: TextIO
    offset: int = 0
    partial: bytes = b""


class Tee:
    """Copies new lines of files to the console until ``close()``."""

    def __init__(self, *, interval_s: float = 0.1) -> None:
        self._interval_s = interval_s
        self._tails: list[_Tail] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, path: Path, *, prefix: str, stream: str) -> None:
        """Start copying ``path`` (``stream``: "stdout" or "stderr")."""
        out = sys.stdout if stream == "stdout" else sys.stderr
        with self._lock:
            self._tails.append(_Tail(path=path, prefix=prefix, out=out))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="unbroken-tee", daemon=True)
            self._thread.start()

    def reset(self) -> None:
        """Copy what is left of the current files, then forget them (a new round begins)."""
        self._poll()
        with self._lock:
            for t in self._tails:
                if t.partial:
                    self._emit(t, t.partial + b"\n")
            self._tails = []

    def _emit(self, t: _Tail, data: bytes) -> None:
        text = data.decode(errors="replace")
        t.out.write("".join(f"{t.prefix}{line}\n" for line in text.splitlines()))
        t.out.flush()

    def _poll(self) -> None:
        with self._lock:
            for t in self._tails:
                try:
                    with open(t.path, "rb") as f:
                        f.seek(t.offset)
                        data = f.read()
                except OSError:
                    continue
                if not data:
                    continue
                t.offset += len(data)
                data = t.partial + data
                head, sep, t.partial = data.rpartition(b"\n")
                if sep:
                    self._emit(t, head + sep)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._poll()
            except Exception:  # never let a console copy take the agent down
                logger.exception("tee failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        self.reset()
