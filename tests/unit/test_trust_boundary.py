"""Guards of the trust boundary the README states: our code unpickles only what the README names
(the trainer-writer socket pair, the in-process memory snapshot, the writers' done records in a
private checkpoint directory), and the checkpoint writer reads no environment variable (test
hooks are injected objects, never variables a production process could inherit)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "unbroken"
UNPICKLE = re.compile(r"pickle\.loads?\(|weights_only=False|allow_pickle=True|Unpickler\(")
# file -> why it may unpickle (each is named in the README's trust-boundary paragraph)
ALLOWED = {
    "checkpoint/protocol.py": "messages over the trainer-writer socketpair",
    "checkpoint/memory.py": "values of this process's own memory snapshot",
    "checkpoint/commit.py": "done records of the private checkpoint directory (as DCP's .metadata)",
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
