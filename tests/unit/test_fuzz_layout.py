"""Property-based fuzzing of a checkpoint's manifest and commit marker: whatever bytes they
hold, ``layout.verify`` answers with a reason (never raises), ``parse_manifest`` and
``parse_marker`` raise only ValueError, and a manifest never makes verify open a file outside
the checkpoint directory."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.checkpoint import layout

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 2**65), st.floats(), st.text(max_size=10)
)
json_values = st.recursive(
    leaves,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=8,
)
entries = st.fixed_dictionaries(
    {},
    optional={"bytes": json_values | st.integers(0, 10), "crc32": json_values | st.just("0" * 8)},
)
manifests = st.one_of(
    st.binary(max_size=40),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(
        st.sampled_from(["data", "../outside", "/etc/hostname", "", "a/b", "x"])
        | st.text(max_size=4),
        entries | json_values,
        max_size=3,
    ).map(lambda files: json.dumps({"files": files}).encode()),
)


@FUZZ
@given(manifests, st.booleans() | json_values | st.binary(max_size=20))
@pytest.mark.slow
def test_verify_never_raises(
    tmp_path_factory: pytest.TempPathFactory, manifest: bytes, marker: object
) -> None:
    ckpt = tmp_path_factory.mktemp("step-1")
    (ckpt / "data").write_bytes(b"0123456789")
    (ckpt / layout.MANIFEST).write_bytes(manifest)
    if marker is True:  # a marker that matches: the manifest itself is what is checked
        raw = layout.committed_bytes(step=1, manifest_crc32=zlib.crc32(manifest))
    else:
        raw = marker if isinstance(marker, bytes) else json.dumps(marker).encode()
    (ckpt / layout.COMMITTED).write_bytes(raw)
    why = layout.verify(ckpt)
    assert why is None or isinstance(why, str)
    try:
        names = layout.manifest_files(ckpt)
    except ValueError:
        return
    assert all("/" not in n and n not in ("", ".", "..") for n in names)


@pytest.mark.parametrize(
    "files",
    [
        {"../outside": {"bytes": 3, "crc32": "00000000"}},
        {"data": [1]},
        {"data": {"bytes": "10", "crc32": "x"}},
    ],
)
def test_malformed_manifests_are_refused_not_followed(tmp_path: Path, files: dict) -> None:
    ckpt = tmp_path / "ckpt" / "step-1"
    ckpt.mkdir(parents=True)
    (tmp_path / "ckpt" / "outside").write_bytes(b"abc")
    raw = json.dumps({"files": files}).encode()
    (ckpt / layout.MANIFEST).write_bytes(raw)
    (ckpt / layout.COMMITTED).write_bytes(
        layout.committed_bytes(step=1, manifest_crc32=zlib.crc32(raw))
    )
    assert "malformed manifest" in (layout.verify(ckpt) or "")
    with pytest.raises(ValueError):
        layout.manifest_files(ckpt)
