"""The reference training script, except that in the first round rank 1, right after sealing
the snapshot of step ``--corrupt-at``, flips one byte of every snapshot its arena holds and
SIGKILLs itself: the memory the agent keeps for it is corrupt, so the restart must notice (the
checksums) and restore from disk. Run with durable saves in sync mode, so that no save is
persisting (reading the arena) when the bytes flip."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from unbroken.checkpoint.staging import memory, ring_format
from unbroken.workload import train

_seal = memory.seal


def _corrupt_and_die(at: int):
    def seal(snapshot: memory.Snapshot, ring: ring_format.Ring, **kwargs: Any) -> None:
        _seal(snapshot, ring, **kwargs)
        if snapshot.step != at:
            return
        _, held = memory.read(snapshot.arena)
        for snap in held:
            _, slot = max(snap.tensors, key=lambda t: t[1].nbytes)
            byte = snap.arena.read(slot.offset + slot.nbytes // 2, 1)[0]
            snap.arena.write(slot.offset + slot.nbytes // 2, bytes([byte ^ 0x5A]))
        print(f"CORRUPTED steps {[s.step for s in held]}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    return seal


if __name__ == "__main__":
    argv = sys.argv[1:]
    at = int(argv[argv.index("--corrupt-at") + 1])
    del argv[argv.index("--corrupt-at") : argv.index("--corrupt-at") + 2]
    if os.environ.get("RANK") == "1" and os.environ.get("UNBROKEN_ROUND", "0") == "0":
        memory.seal = _corrupt_and_die(at)
    sys.exit(train.main(argv))
