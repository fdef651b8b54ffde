from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from unbroken.faults import FaultInjector, InjectedFault, load_plan, parse_plan


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.flushes = 0

    def emit(self, kind: str, *, ts: float | None = None, **data: Any) -> None:
        self.events.append((kind, data))

    def flush(self, timeout_s: float = 5.0) -> bool:
        self.flushes += 1
        return True


def test_parse_orders_by_step_and_keeps_params(tmp_path: Path) -> None:
    p = tmp_path / "plan.yaml"
    p.write_text(
        "faults:\n"
        "  - {step: 30, rank: 0, kind: exception}\n"
        "  - {step: 12, rank: 1, kind: sigkill}\n"
        "  - {step: 12, rank: 0, kind: hang, seconds: 3}\n"
    )
    plan = load_plan(p)
    assert [(f.step, f.rank, f.kind, f.index) for f in plan.faults] == [
        (12, 0, "hang", 2),
        (12, 1, "sigkill", 1),
        (30, 0, "exception", 0),
    ]
    assert plan.faults[0].params == {"seconds": 3}
    assert [f.index for f in plan.at(12, 1)] == [1]
    assert plan.at(13, 1) == []


@pytest.mark.parametrize(
    ("obj", "msg"),
    [
        ({"faults": [{"step": 1, "rank": 0, "kind": "meteor"}]}, "unknown kind 'meteor'"),
        ({"faults": [{"step": 1, "kind": "sigkill"}]}, r"lacks \['rank'\]"),
        ({"faults": [{"step": "1", "rank": 0, "kind": "sigkill"}]}, "step must be an integer"),
        ({"faults": [{"step": -1, "rank": 0, "kind": "sigkill"}]}, "step must be >= 0"),
        ({"faults": "x"}, "must be a list"),
        ({"fault": []}, "'faults' list"),
        ({"faults": [], "extra": 1}, "unknown top-level keys"),
        ([1, 2], "'faults' list"),
    ],
)
def test_bad_plans_say_what_is_wrong(obj: Any, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse_plan(obj)


def test_empty_and_missing_plans(tmp_path: Path) -> None:
    assert len(parse_plan(None)) == 0
    assert len(parse_plan({"faults": []})) == 0
    with pytest.raises(FileNotFoundError):
        load_plan(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("faults: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_plan(bad)


def test_check_world_rejects_ranks_outside() -> None:
    plan = parse_plan({"faults": [{"step": 1, "rank": 2, "kind": "sigkill"}]})
    plan.check_world(3)
    with pytest.raises(ValueError, match="world has 2 ranks"):
        plan.check_world(2)


def test_exception_fires_once_per_run_across_restarts(tmp_path: Path) -> None:
    plan = parse_plan({"faults": [{"step": 3, "rank": 1, "kind": "exception"}]})
    sink = Sink()
    inj = FaultInjector(plan, run_dir=tmp_path, rank=1, sink=sink)
    inj.on_step(2)
    with pytest.raises(InjectedFault):
        inj.on_step(3)
    assert sink.events == [("fault_injected", {"fault": "exception", "step": 3, "index": 0})]
    assert sink.flushes == 1
    # A restarted worker (a new injector over the same run dir) does not fire it again.
    again = FaultInjector(plan, run_dir=tmp_path, rank=1, sink=sink)
    again.on_step(3)
    assert again.fired() == [0]
    # Other ranks never fire it.
    FaultInjector(plan, run_dir=tmp_path / "other", rank=0).on_step(3)


def test_sigkill_really_kills_and_is_recorded_first(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        from unbroken.faults import FaultInjector, parse_plan
        plan = parse_plan({{"faults": [{{"step": 0, "rank": 0, "kind": "sigkill"}}]}})
        FaultInjector(plan, run_dir={str(tmp_path)!r}, rank=0).on_step(0)
        print("survived")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert b"survived" not in proc.stdout
    assert (tmp_path / "faults" / "fired" / "0.json").is_file()
    # Re-running the same plan in the same run dir does not fire again.
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0 and b"survived" in proc.stdout
