"""Files that must survive a crash: written atomically and made durable, directory included.

``write_atomic`` is the one way unbroken writes such a file (the launcher's error file, the
reference script's ``final.json``, launcher state, checkpoint metadata): the bytes go to a
temporary file beside the target (``O_EXCL``, so two writers never share one), which is
fsynced, renamed over the target, and the directory fsynced, so that after a crash the target
holds either its old contents or the new ones, never a torn mix, and the rename itself is not
lost. A failed write (a full or read-only disk) removes its temporary file and leaves the
target as it was.

Lives in ``ledger`` because every package of ours may import it. Imports of ours: none.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644, durable: bool = True
) -> None:
    """Replace ``path`` with ``data`` atomically: tmp, fsync, rename, fsync of the directory.

    ``durable=False`` skips both fsyncs (a signal file that only has to be seen, never torn).
    On any error the temporary file is removed and ``path`` is left as it was."""
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    # The directory is fsynced through a descriptor opened before the rename: another process
    # may rename the directory once the target is in it (a checkpoint's coordinator commits
    # ``step-N.partial`` as ``step-N`` the moment the last rank's done record is there).
    dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY) if durable else None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        if dfd is not None:
            os.fsync(dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        if dfd is not None:
            os.close(dfd)
