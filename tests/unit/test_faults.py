from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from sinks import Sink
from unbroken.faults import FaultInjector, InjectedFault, load_plan, parse_plan


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


def _run_fault(tmp_path: Path, kind: str, params: str = "") -> subprocess.Popen[bytes]:
    code = textwrap.dedent(
        f"""
        from unbroken.faults import FaultInjector, parse_plan
        plan = parse_plan({{"faults": [{{"step": 0, "rank": 0, "kind": {kind!r}{params}}}]}})
        FaultInjector(plan, run_dir={str(tmp_path)!r}, rank=0).on_step(0)
        print("survived")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)


def test_segfault_is_a_real_sigsegv(tmp_path: Path) -> None:
    proc = _run_fault(tmp_path, "segfault")
    assert proc.wait(timeout=60) == -signal.SIGSEGV


def test_oom_kill_grows_memory_then_dies_of_sigkill(tmp_path: Path) -> None:
    proc = _run_fault(tmp_path, "oom-kill", ', "limit_mb": 32')
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_hang_native_blocks_in_native_code(tmp_path: Path) -> None:
    import time

    proc = _run_fault(tmp_path, "hang-native")
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "faults" / "fired" / "0.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        time.sleep(0.2)
        assert proc.poll() is None  # still blocked
        # Sleeping in the kernel (S), not spinning: no Python runs on its main thread.
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "S"
        cpu_before = sum(
            int(v)
            for v in Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]
        )
        time.sleep(0.3)
        cpu_after = sum(
            int(v)
            for v in Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]
        )
        assert cpu_after - cpu_before <= 1  # clock ticks: it is not executing
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_random_schedule_is_deterministic_and_in_range() -> None:
    spec = {
        "random": {"count": 5, "kinds": ["exception", "sigkill"], "seed": 42, "steps": [10, 90]}
    }
    a = parse_plan(spec, world_size=4)
    b = parse_plan(spec, world_size=4)
    assert [(f.step, f.rank, f.kind) for f in a.faults] == [
        (f.step, f.rank, f.kind) for f in b.faults
    ]
    assert len(a) == 5 and len({f.step for f in a.faults}) == 5
    assert all(10 <= f.step <= 90 and 0 <= f.rank < 4 for f in a.faults)
    assert {f.kind for f in a.faults} <= {"exception", "sigkill"}
    c = parse_plan({"random": {**spec["random"], "seed": 43}}, world_size=4)
    assert [f.step for f in c.faults] != [f.step for f in a.faults]
    # Listed faults and a random schedule combine.
    both = parse_plan({"faults": [{"step": 1, "rank": 0, "kind": "hang"}], **spec}, world_size=4)
    assert len(both) == 6 and both.faults[0].kind == "hang"


@pytest.mark.parametrize(
    ("rnd", "msg"),
    [
        ({"count": 5, "kinds": ["sigkill"], "seed": 1, "steps": [0, 2]}, "do not fit"),
        ({"count": 1, "kinds": ["meteor"], "seed": 1, "steps": [0, 2]}, "random.kinds"),
        ({"count": 1, "kinds": ["sigkill"], "seed": 1, "steps": [5, 2]}, "random.steps"),
        ({"count": 1, "kinds": ["sigkill"], "steps": [0, 2]}, "lacks"),
        ({"count": 1, "kinds": ["sigkill"], "seed": 1, "steps": [0, 2], "x": 1}, "unknown"),
    ],
)
def test_bad_random_schedules(rnd: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse_plan({"random": rnd}, world_size=2)


def test_random_schedule_without_ranks_needs_the_world() -> None:
    with pytest.raises(ValueError, match="needs the world size"):
        parse_plan({"random": {"count": 1, "kinds": ["sigkill"], "seed": 1, "steps": [0, 2]}})


def test_oom_kill_is_the_kernels_where_a_cgroup_can_be_made(tmp_path: Path) -> None:
    from unbroken.faults import oom

    mech = oom.mechanism()
    own = oom._own_memory_cgroup()
    proc = _run_fault(tmp_path, "oom-kill", ', "limit_mb": 32')
    assert proc.wait(timeout=60) == -signal.SIGKILL
    if mech == "emulated":
        return  # no cgroup here: the emulation above is all there is (recorded as such)
    assert own is not None
    parent, version = own
    child = parent / f"unbroken-oom-{proc.pid}"
    if version == "v1":
        # The kernel's OOM killer acted (memory.oom_control counts kills in the child)...
        # ...and the watcher removes the cgroup once the process is gone.
        import time

        deadline = time.monotonic() + 10
        while child.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not child.exists(), f"{child} left behind"
    # Where the kernel log is readable, it names the kill: the kernel's OOM killer, not ours.
    log = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
    if log.returncode == 0:
        assert f"Killed process {proc.pid} " in log.stdout
