"""The faults that degrade without killing: slow-rank and network. Their plan parameters, the
CLI that lists them, the real CPU throttle (cgroup and emulated) leaving nothing behind, and
a network fault fired where no emulated cluster serves it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sinks import Sink
from unbroken import cli
from unbroken import env as envnames
from unbroken.faults import KINDS, FaultInjector, parse_plan, slowrank
from unbroken.faults import link as flink
from unbroken.faults.plan import NON_DISRUPTIVE, PARAMS
from unbroken.ledger import Ledger, read_events
from unbroken.ledger.busy import BusyClock


def one(kind: str, rank: int = 1, **params: Any) -> dict[str, Any]:
    return {"faults": [{"step": 4, "rank": rank, "kind": kind, **params}]}


def test_degrading_kinds_are_described_non_disruptive_and_have_defaults() -> None:
    for kind in ("slow-rank", "network"):
        assert kind in KINDS and kind in NON_DISRUPTIVE and kind in PARAMS
    (slow,) = parse_plan(one("slow-rank")).faults
    assert not slow.disruptive and slow.params == {}
    assert slow.settings() == {"cpu": 0.5, "seconds": 30.0}
    assert slow.targets() == [1]
    (net,) = parse_plan(one("network", rank=0, delay_ms=20, peers=[1, 2])).faults
    assert net.settings() == {"delay_ms": 20.0, "loss": 1.0, "seconds": 20.0, "peers": [1, 2]}
    assert net.targets() == [0, 1, 2]
    (everyone,) = parse_plan(one("network")).faults
    assert everyone.settings()["peers"] == "all" and everyone.targets() is None


@pytest.mark.parametrize(
    ("entry", "msg"),
    [
        (one("slow-rank", cpu=0), r"cpu must be a number in \(0, 1\].*got 0"),
        (one("slow-rank", cpu=1.5), r"cpu must be a number in \(0, 1\].*got 1.5"),
        (one("slow-rank", cpu="half"), "cpu must be a number.*'half'"),
        (one("slow-rank", cpu=True), "cpu must be a number"),
        (one("slow-rank", cpu=float("nan")), "cpu must be a number"),
        (one("slow-rank", seconds=0), r"seconds must be a number in \(0, 86400\]"),
        (one("slow-rank", seconds=1e9), r"seconds must be a number in \(0, 86400\]"),
        (one("slow-rank", quota=3), r"unknown parameter\(s\) \['quota'\].*takes cpu, seconds"),
        (one("network", delay_ms=-1), r"delay_ms must be a number in \[0, 10000\]"),
        (one("network", loss=100), r"loss must be a number in \[0, 100\)"),
        (one("network", loss=-0.5), r"loss must be a number in \[0, 100\)"),
        (one("network", seconds=-3), "seconds must be a number in"),
        (one("network", peers=[]), "peers must be 'all' or a non-empty list of ranks"),
        (one("network", peers="others"), "peers must be 'all' or a non-empty list"),
        (one("network", peers=[0, -1]), "peers must be 'all' or a non-empty list"),
        (one("network", peers=[1]), r"peers \[1\] include the fault's own rank 1"),
        (one("network", delay_ms=0, loss=0), "both 0: nothing would degrade"),
        (one("network", jitter_ms=5), r"unknown parameter\(s\) \['jitter_ms'\]"),
    ],
)
def test_bad_params_say_what_is_wrong_and_what_to_do(entry: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg) as info:
        parse_plan(entry, source="plan.yaml")
    assert str(info.value).startswith("plan.yaml: fault #0 (")


def test_check_world_covers_the_peers() -> None:
    plan = parse_plan(one("network", rank=0, peers=[3]))
    with pytest.raises(ValueError, match="targets rank 3, but the world has 2 ranks"):
        plan.check_world(2)
    parse_plan(one("network", rank=0)).check_world(2)


@pytest.fixture
def no_logging_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "init_logging", lambda: None)


@pytest.mark.usefixtures("no_logging_setup")
def test_faults_kinds_lists_every_kind_with_what_it_does(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["faults", "kinds"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert [h.split()[0] for h in heads] == list(KINDS)
    assert "slow-rank (non-disruptive: nothing restarts)" in heads
    assert "network (non-disruptive: nothing restarts)" in heads
    flat = " ".join(out.split())
    assert "a cpu cgroup quota" in flat and "by delay_ms ms (default 50) each way" in flat
    assert "cpu: a number in (0, 1] (the share of one CPU the rank keeps); default 0.5" in flat
    assert "peers: 'all' or a non-empty list of ranks" in flat


@pytest.mark.usefixtures("no_logging_setup")
def test_faults_show_lists_the_degrading_kinds(tmp_path: Path, capsys) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "faults:\n"
        "  - {step: 5, rank: 1, kind: slow-rank, cpu: 0.5, seconds: 30}\n"
        "  - {step: 9, rank: 0, kind: network, peers: [1]}\n"
    )
    assert cli.main(["faults", "show", str(plan), "--world-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "slow-rank" in lines[1] and KINDS["slow-rank"] in lines[1]
    assert "(cpu=0.5, seconds=30.0)" in lines[2]
    assert (
        "network" in lines[3] and "(delay_ms=50.0, loss=1.0, seconds=20.0, peers=[1])" in lines[4]
    )


def test_a_network_fault_outside_an_emulated_cluster_is_recorded_not_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(envnames.UNBROKEN_LINK_FAULTS, raising=False)
    sink = Sink()
    plan = parse_plan(one("network", rank=0))
    t = time.monotonic()
    FaultInjector(plan, run_dir=tmp_path, rank=0, sink=sink).on_step(4)
    assert time.monotonic() - t < 1.0  # at once: no orchestrator to wait for
    [(kind, data)] = sink.events
    assert kind == "fault_injected" and data["fault"] == "network"
    assert data["applied"] is False and data["disruptive"] is False
    assert envnames.UNBROKEN_LINK_FAULTS in data["reason"] and "window_s" not in data


def test_a_network_fault_nobody_answers_is_recorded_not_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(envnames.UNBROKEN_LINK_FAULTS, "1")
    (spec,) = parse_plan(one("network", rank=0, peers=[1])).faults
    fired = tmp_path / "faults" / "fired"
    fired.mkdir(parents=True)
    out = flink.request(spec, fired_dir=fired, timeout_s=0.2)
    assert out["applied"] is False and "no answer from the emulated cluster" in out["reason"]
    request = flink.requests_dir(tmp_path) / "0.json"
    assert request.is_file() and '"peers": [1]' in request.read_text()


def test_an_answered_network_fault_carries_its_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(envnames.UNBROKEN_LINK_FAULTS, "1")
    (spec,) = parse_plan(one("network", rank=0, seconds=5)).faults
    fired = tmp_path / "faults" / "fired"
    fired.mkdir(parents=True)
    request = flink.requests_dir(tmp_path) / "0.json"

    def answer() -> None:
        while not request.exists():
            time.sleep(0.005)
        now = time.time()
        flink.answer_path(request).write_text(
            f'{{"applied": true, "ts": {now}, "until": {now + 5}, "pods": ["p1"]}}'
        )

    t = threading.Thread(target=answer)
    t.start()
    out = flink.request(spec, fired_dir=fired, timeout_s=5.0)
    t.join()
    assert out["applied"] is True and out["pods"] == ["p1"]
    assert 4.5 < out["window_s"] <= 5.0


# --- the throttle ------------------------------------------------------------------------------
def _spinner() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 60: pass"]
    )


def _cpu_s(pid: int) -> float:
    """Seconds ``pid`` ran on a CPU (/proc schedstat)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def _share(pid: int, seconds: float) -> float:
    a, t = _cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (_cpu_s(pid) - a) / (time.monotonic() - t)


def _where(pid: int) -> dict[str, str]:
    """A process's scheduler state and cpu cgroup, for a failure's message."""
    return {
        "state": Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0],
        "cgroup": Path(f"/proc/{pid}/cgroup").read_text(),
    }


def _leftovers() -> list[str]:
    out = []
    for base in (slowrank.ROOT / "cpu", slowrank.ROOT / "cpu,cpuacct", slowrank.ROOT):
        if base.is_dir():
            out += [str(p) for p in base.glob(f"{slowrank.PREFIX}*")]
    return out


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "emulated"])
@pytest.mark.slow
@pytest.mark.serial
def test_slow_caps_the_cpu_for_the_window_then_leaves_nothing(cgroup: bool) -> None:
    if cgroup and slowrank.mechanism() == "emulated":
        pytest.skip("no cpu cgroup can be made here")
    before = set(_leftovers())
    spin = _spinner()
    try:
        time.sleep(0.2)
        done = slowrank.slow(spin.pid, cpu=0.1, seconds=1.5, cgroup=cgroup)
        assert done["mechanism"] == ("emulated" if not cgroup else slowrank.mechanism())
        throttled = _share(spin.pid, 1.0)
        assert throttled < 0.2, throttled  # 0.1 of a CPU (less on a busy machine)
        _gone(int(str(done["watcher_pid"])))  # the window is over, the watcher cleaned up
        after = _share(spin.pid, 0.5)
        assert after > 2 * throttled, (after, _where(spin.pid))
        assert set(_leftovers()) == before
        if cgroup:
            assert not Path(str(done["cgroup"])).exists()
    finally:
        spin.kill()
        spin.wait()


def _gone(pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                return  # ended; its parent (this process) has not reaped it yet
        except (ProcessLookupError, FileNotFoundError):
            return
        assert time.monotonic() < deadline, f"process {pid} still there"
        time.sleep(0.02)


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "emulated"])
@pytest.mark.serial
def test_the_watcher_cleans_up_at_once_when_the_rank_dies(cgroup: bool) -> None:
    if cgroup and slowrank.mechanism() == "emulated":
        pytest.skip("no cpu cgroup can be made here")
    before = set(_leftovers())
    spin = _spinner()
    done = slowrank.slow(spin.pid, cpu=0.3, seconds=60, cgroup=cgroup)
    time.sleep(0.3)
    spin.kill()
    spin.wait()
    _gone(int(str(done["watcher_pid"])), timeout_s=2.0)  # not 60 s later
    assert set(_leftovers()) == before


def test_slow_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="cpu must be in"):
        slowrank.slow(os.getpid(), cpu=0, seconds=1)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        slowrank.slow(os.getpid(), cpu=0.5, seconds=0)


# --- busy_s ------------------------------------------------------------------------------------
def test_busy_counts_computing_not_sleeping() -> None:
    clock = BusyClock()
    clock.reset()
    t = time.monotonic()
    while time.monotonic() - t < 0.2:
        pass
    busy = clock.lap()
    assert busy is not None and busy > 0.15  # ran, or waited to run: all of the 0.2 s
    time.sleep(0.2)
    slept = clock.lap()
    assert slept is not None and slept < 0.05


def test_a_lap_on_another_thread_is_not_known() -> None:
    clock = BusyClock()
    clock.reset()
    got: list[float | None] = []
    t = threading.Thread(target=lambda: got.append(clock.lap()))
    t.start()
    t.join()
    assert got == [None]
    clock.close()


def test_step_records_carry_busy_s(tmp_path: Path) -> None:
    led = Ledger(tmp_path, run="r", rank=0)
    try:
        led.mark()
        t = time.monotonic()
        while time.monotonic() - t < 0.1:
            pass
        led.step(0, loss=1.0)
        time.sleep(0.1)
        led.step(1, loss=1.0)
        led.step(2, busy_s=0.5)  # given: kept
    finally:
        led.close()
    steps = [e for e in read_events(tmp_path) if e.kind == "step"]
    assert steps[0].get("busy_s") > 0.07
    assert steps[1].get("busy_s") < 0.05 and steps[1].dur_s > 0.09
    assert steps[2].get("busy_s") == 0.5
