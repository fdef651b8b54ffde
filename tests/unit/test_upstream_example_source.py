"""``examples/upstream/fsdp2`` is pytorch/examples' FSDP2 example as published: each file is a
header naming its source and license, then the upstream file, except the changes listed here
(``CHANGES``: what a CPU-only gloo run needs). Undoing them gives back the exact upstream bytes
(their git blob ids at ``COMMIT``). ``example.py`` is ``plain_example.py`` adopting unbroken;
tests/unit/test_docs.py counts that diff and tests/e2e/test_upstream_example.py runs it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "upstream" / "fsdp2"
REPO = "https://github.com/pytorch/examples"
COMMIT = "77f55b912142e11fcfdf5b530231fb9c52f181e8"
BLOBS = {  # file here: (its path upstream, `git rev-parse COMMIT:<path>`)
    "plain_example.py": (
        "distributed/FSDP2/example.py",
        "abe0120a1d349757835071ed7323adc5990885b4",
    ),
    "model.py": ("distributed/FSDP2/model.py", "21b609615aaf79ba70b0e33f3cbc88e026e4d3ef"),
    "utils.py": ("distributed/FSDP2/utils.py", "402d2bf33dd4f7ff9f788757f761c76ceb8df174"),
    "checkpoint.py": (
        "distributed/FSDP2/checkpoint.py",
        "aede91782338c75d402565a980a58a589a47b3d1",
    ),
    "LICENSE": ("LICENSE", "1ba2484d4697a92afd0bf6be291eca930315534c"),
}


@dataclass(frozen=True)
class Change:
    file: str
    """The file here."""
    published: str
    """The upstream text (occurs once)."""
    here: str
    """What replaces it here (occurs once)."""
    why: str
    """What goes wrong on CPU without it."""


_RESET = "        self.pos_embeddings.reset_parameters()\n"
CHANGES = [
    Change(
        file="plain_example.py",
        published=(
            "    _min_gpu_count = 2\n"
            "    if not verify_min_gpu_count(min_gpus=_min_gpu_count):\n"
            '        print(f"Unable to locate sufficient {_min_gpu_count} gpus to run this '
            'example. Exiting.")\n'
            "        exit()\n"
        ),
        here="    _min_gpu_count = 2\n",
        why="without 2 GPUs the example prints a message and exits",
    ),
    Change(
        file="plain_example.py",
        published="    torch.distributed.init_process_group(backend=backend, device_id=device)\n",
        here="    torch.distributed.init_process_group(backend=backend)\n",
        why="ValueError: init_process_group device_id parameter must be an accelerator with an "
        "index (device is cpu)",
    ),
    Change(
        file="model.py",
        published=_RESET,
        here=_RESET + "        for layer in self.layers:\n            layer.reset_parameters()\n",
        why="Transformer.reset_parameters never reaches the blocks, so after model.to_empty "
        "their weights are whatever memory held: on CPU (reused heap) thousands of non-finite "
        "values, a NaN loss from step 0 and all-NaN final weights (TransformerBlock's own "
        "reset_parameters is there, never called)",
    ),
]


def _blob_id(data: bytes) -> str:
    """git's id of a blob with these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _published(name: str) -> str:
    """The file here with its header removed and ``CHANGES`` undone."""
    text = (HERE / name).read_text()
    if name != "LICENSE":
        header, sep, text = text.partition("\n\n")
        assert sep and all(line.startswith("# ") for line in header.splitlines()), name
        assert f"{REPO}, {BLOBS[name][0]} at commit {COMMIT}" in header, header
        assert "BSD 3-Clause License" in header, header
    for change in (c for c in CHANGES if c.file == name):
        assert text.count(change.here) == 1, f"{name}: {change.here!r} is not there once"
        text = text.replace(change.here, change.published)
    return text


@pytest.mark.parametrize("name", sorted(BLOBS))
def test_each_file_is_the_published_one_but_for_the_listed_changes(name: str) -> None:
    upstream_path, blob = BLOBS[name]
    got = _blob_id(_published(name).encode())
    assert got == blob, (
        f"examples/upstream/fsdp2/{name} differs from {upstream_path} at {COMMIT} by more than "
        f"the changes listed in {Path(__file__).name}; list the change with its reason or undo it"
    )


def test_the_changes_are_few_and_each_has_a_reason() -> None:
    assert len(CHANGES) <= 3
    assert all(c.why for c in CHANGES)
    published = sum(c.published.count("\n") for c in CHANGES)
    here = sum(c.here.count("\n") for c in CHANGES)
    # 3 lines removed, 1 changed, 2 added; the README lists them.
    assert (published, here) == (6, 5), "the changes moved: keep them few, update the README"


def test_the_adopted_copy_keeps_the_header_and_siblings() -> None:
    plain = (HERE / "plain_example.py").read_text().partition("\n\n")[0]
    adopted = (HERE / "example.py").read_text().partition("\n\n")[0]
    assert adopted == plain
    assert {p.name for p in HERE.iterdir() if p.suffix == ".py"} == {
        "plain_example.py",
        "example.py",
        "model.py",
        "utils.py",
        "checkpoint.py",
    }
