"""Guards of the trust boundary the README states: our code unpickles only what the README names
(the trainer-writer socket pair, the in-process memory snapshot; the writers' done records only
through an unpickler that builds nothing but their types), and the checkpoint writer reads no environment variable (test
hooks are injected objects, never variables a production process could inherit)."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.checkpoint import layout

SRC = Path(__file__).resolve().parents[2] / "src" / "unbroken"
UNPICKLE = re.compile(r"pickle\.loads?\(|weights_only=False|allow_pickle=True|Unpickler\(")
# file -> why it may unpickle (each is named in the README's trust-boundary paragraph)
ALLOWED = {
    "checkpoint/persisting/protocol.py": "messages over the trainer-writer socketpair",
    "checkpoint/staging/memory.py": "values of a memory snapshot (a peer's: only once they load "
    "weights_only)",
    "checkpoint/state/savecache.py": "a snapshot's values, pickled and unpickled in the trainer "
    "process (serialized off the training thread)",
    "checkpoint/layout.py": "done records, through an unpickler that builds only their types",
    "checkpoint/staging/journal.py": "a noted step's values, through an unpickler that builds "
    "only plain values, tensors and arrays",
}


def test_only_the_documented_places_unpickle() -> None:
    found = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if UNPICKLE.search(p.read_text())}
    assert found <= set(ALLOWED), sorted(found - set(ALLOWED))


def test_the_checkpoint_package_reads_no_environment_variable() -> None:
    readers = re.compile(r"os\.environ|os\.getenv|\blookup\(|from_environ\(")
    offenders = [
        str(p.relative_to(SRC))
        for p in (SRC / "checkpoint").rglob("*.py")
        if readers.search(p.read_text().replace("dict(os.environ)", ""))  # a child's env
    ]
    assert offenders == []


def test_env_names_no_test_only_variable() -> None:
    names = re.findall(r'^([A-Z_]+) = "', (SRC / "env.py").read_text(), re.M)
    assert names and not [n for n in names if re.search(r"TEST|PAUSE|SLOW|SLEEP|DELAY", n)]


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_planted_done_record_runs_no_code(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for raw in (pickle.dumps(_Boom()), pickle.dumps({"x": _Boom()}), b"\x80\x05junk", b""):
        with pytest.raises(ValueError, match="not a done record"):
            layout.parse_done_record(raw)
    assert not (tmp_path / "PWNED").exists()
    assert layout.parse_done_record(pickle.dumps({"rank": 0, "size": torch.Size([2])}))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(max_size=64))
def test_parse_done_record_raises_only_value_error(raw: bytes) -> None:
    with contextlib.suppress(ValueError):
        assert isinstance(layout.parse_done_record(raw), dict)
