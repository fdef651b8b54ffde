"""Property-based fuzzing of the fault-plan parser: whatever YAML a user writes, ``parse_plan``
and ``load_plan`` return a plan or raise ValueError (FileNotFoundError for a missing file), and
``unbroken faults show`` answers with exit 0 or a one-line usage error (2), never a
traceback."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken import cli
from unbroken.faults import KINDS, load_plan, parse_plan
from unbroken.faults.plan import PARAMS

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.integers(min_value=0, max_value=20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from([*KINDS, "all", "data", "manifest"]),
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(scalars, kids, max_size=3),
    max_leaves=8,
)
PARAM_NAMES = sorted({n for p in PARAMS.values() for n in p})
entries = st.fixed_dictionaries(
    {},
    optional={
        "step": values,
        "rank": values,
        "kind": st.sampled_from(list(KINDS)) | values,
        **{name: values for name in PARAM_NAMES},
    },
)
randoms = st.fixed_dictionaries(
    {},
    optional={
        "count": values | st.integers(0, 10**12),
        "kinds": st.lists(st.sampled_from(list(KINDS)), max_size=3) | values,
        "seed": values,
        "steps": st.lists(st.integers(-5, 10**12), min_size=2, max_size=2) | values,
        "ranks": st.lists(st.integers(-1, 4), max_size=3) | values,
    },
)
plans = st.one_of(
    values,
    st.fixed_dictionaries(
        {},
        optional={
            "faults": st.lists(entries | values, max_size=4) | values,
            "random": randoms | values,
        },
    ),
    st.dictionaries(scalars, values, max_size=3),
)


@FUZZ
@given(plans, st.none() | st.integers(0, 4))
@pytest.mark.slow
def test_parse_plan_raises_only_value_error(obj: object, world_size: int | None) -> None:
    try:
        plan = parse_plan(obj, world_size=world_size)
    except ValueError as e:
        assert str(e)
        return
    for f in plan.faults:
        assert f.kind in KINDS and f.step >= 0 and f.rank >= 0
        f.settings(), f.targets(), f.describe()
    if world_size is not None:
        with contextlib.suppress(ValueError):
            plan.check_world(world_size)


@settings(FUZZ, max_examples=100)
@given(st.text(max_size=80) | plans.map(lambda o: yaml.safe_dump(o, allow_unicode=True)))
@pytest.mark.slow
def test_faults_show_never_raises(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text(text)
    assert cli.main(["faults", "show", str(path), "--world-size", "2"]) in (0, 2)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("faults: []\n1: x\n", "unknown top-level keys"),
        ("faults: [{step: 1, rank: 0, kind: node-loss, 1: 2, a: 3}]\n", "unknown parameter"),
        ("random: {count: 3, kinds: [sigkill], seed: 1, steps: [0, 1e12]}", "steps"),
        (
            "random: {count: 100000000, kinds: [sigkill], seed: 1, steps: [0, 1000000000000]}",
            "count",
        ),
        ("random: {count: 1, kinds: [[sigkill]], seed: 1, steps: [0, 5]}", "random.kinds"),
        ("random: {count: 1, kinds: [sigkill], seed: 1, steps: [0, 5], ranks: [-1]}", "ranks"),
        ("random: {count: true, kinds: [sigkill], seed: 1, steps: [0, 5]}", "count"),
        ("faults: [{step: 1, rank: 0, kind: slow-storage, mbps: .nan}]", "mbps"),
        ("faults: [{step: 1, rank: 0, kind: slow-storage, seconds: .inf}]", "seconds"),
        ("faults: [{step: 1, rank: 0, kind: [exception]}]", "unknown kind"),
        ("\xff", None),
    ],
)
def test_bad_plans_get_a_clear_error_fast(tmp_path: Path, text: str, needle: str | None) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(text, encoding="utf-8" if needle else "latin-1")
    with pytest.raises(ValueError, match=needle):
        load_plan(path, world_size=2)
