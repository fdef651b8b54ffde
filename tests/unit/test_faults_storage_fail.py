"""storage-fail: plan parameters, the writer hooks that fail saves (which error, where, on which
ranks, how many times, across a restarted writer), their combination with slow-storage, and
one injected failure through a real Checkpointer into the ledger."""

from __future__ import annotations

import errno
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

from sinks import Sink
from unbroken import cli
from unbroken.checkpoint import layout
from unbroken.faults import KINDS, FaultInjector, parse_plan, storagefail, throttle
from unbroken.faults.params import STORAGE_ERRORS
from unbroken.faults.plan import NON_DISRUPTIVE, PARAMS

ERRNOS = {
    "full": errno.ENOSPC,
    "readonly": errno.EROFS,
    "eio": errno.EIO,
    "vanish": errno.ENOENT,
    "flock": errno.ENOLCK,
    "stall": errno.ETIMEDOUT,
}


def one(**params: Any) -> dict[str, Any]:
    return {"faults": [{"step": 4, "rank": 1, "kind": "storage-fail", **params}]}


def _control(root: Path, *, index: int = 0, **kw: Any) -> Path:
    args: dict[str, Any] = {"ranks": None, "error": "full", "saves": 1, "stall_s": None, **kw}
    return storagefail.write_control(root, index=index, **args)


def _save(hooks: Any, root: Path, *, rank: int, step: int) -> OSError | None:
    """One save as the writer calls its hooks; the error that failed it, or None."""
    try:
        hooks.save_rate(root=root, rank=rank, step=step)
        for point in ("data", "done", "manifest", "renamed"):
            hooks.at(point, root=root, step=step)
    except OSError as e:
        return e
    return None


# --- the plan ----------------------------------------------------------------------------------
def test_storage_fail_is_a_non_disruptive_kind_with_defaults() -> None:
    assert "storage-fail" in KINDS and "storage-fail" in NON_DISRUPTIVE
    assert tuple(ERRNOS) == STORAGE_ERRORS
    (f,) = parse_plan(one()).faults
    assert not f.disruptive and f.params == {}
    assert f.settings() == {"error": "full", "saves": 1, "ranks": "all", "stall_s": None}
    assert f.targets() is None
    (stall,) = parse_plan(one(error="stall", ranks=[2, 0, 2])).faults
    assert stall.settings() == {"error": "stall", "saves": 1, "ranks": [2, 0, 2], "stall_s": 3600.0}
    assert stall.targets() == [0, 2]
    (short,) = parse_plan(one(error="stall", stall_s=2, saves=3)).faults
    assert short.settings()["stall_s"] == 2.0 and short.settings()["saves"] == 3
    for error in STORAGE_ERRORS:
        assert parse_plan(one(error=error)).faults[0].settings()["error"] == error


@pytest.mark.parametrize(
    ("params", "msg"),
    [
        (
            {"error": "disk"},
            r"error must be one of full, readonly, eio, vanish, flock, stall, got 'disk'",
        ),
        ({"error": ["full"]}, "error must be one of full, readonly"),
        ({"error": None}, "error must be one of full, readonly"),
        ({"saves": 0}, r"saves must be an integer >= 1 \(saves of each rank that fail\), got 0"),
        ({"saves": 1.5}, "saves must be an integer >= 1"),
        ({"saves": True}, "saves must be an integer >= 1"),
        ({"ranks": "some"}, "ranks must be 'all' or a non-empty list of ranks"),
        ({"ranks": []}, "ranks must be 'all' or a non-empty list"),
        ({"ranks": [0, -1]}, "ranks must be 'all' or a non-empty list"),
        ({"error": "stall", "stall_s": 0}, "stall_s must be a number in"),
        ({"error": "stall", "stall_s": float("nan")}, "stall_s must be a number in"),
        ({"error": "stall", "stall_s": 1e9}, "stall_s must be a number in"),
        ({"stall_s": 5}, "stall_s applies only to error: stall .*set error: stall"),
        ({"errno": 28}, r"unknown parameter\(s\) \['errno'\] for storage-fail; it takes error"),
    ],
)
def test_bad_params_say_what_is_wrong(params: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg) as info:
        parse_plan(one(**params), source="plan.yaml")
    assert str(info.value).startswith("plan.yaml: fault #0 (storage-fail)")


def test_check_world_covers_the_failed_ranks() -> None:
    with pytest.raises(ValueError, match="targets rank 2, but the world has 2 ranks"):
        parse_plan(one(ranks=[0, 2])).check_world(2)
    parse_plan(one()).check_world(2)


def test_a_random_schedule_may_draw_it() -> None:
    spec = {"random": {"count": 3, "kinds": ["storage-fail"], "seed": 1, "steps": [1, 9]}}
    plan = parse_plan(spec, world_size=2)
    assert [f.kind for f in plan.faults] == ["storage-fail"] * 3
    assert all(f.settings()["error"] == "full" for f in plan.faults)


@pytest.fixture
def no_logging_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "init_logging", lambda: None)  # leave the test process's logging


@pytest.mark.usefixtures("no_logging_setup")
def test_the_cli_shows_and_checks_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {step: 5, rank: 0, kind: storage-fail, error: eio, saves: 2}\n")
    assert cli.main(["faults", "show", str(plan), "--world-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "step     5 on rank   0: storage-fail " in lines[1]
    assert "(error=eio, saves=2, ranks=all)" in lines[2]
    plan.write_text("faults: [{step: 1, rank: 0, kind: storage-fail, error: enospc}]\n")
    assert cli.main(["faults", "show", str(plan)]) != 0
    err = capsys.readouterr().err
    assert "error must be one of full, readonly, eio, vanish, flock, stall, got 'enospc'" in err
    assert cli.main(["faults", "kinds"]) == 0
    out = capsys.readouterr().out
    assert "storage-fail (non-disruptive: nothing restarts)" in out
    assert f"    error: {PARAMS['storage-fail']['error'][1]}; default full" in out


# --- firing ------------------------------------------------------------------------------------
def test_the_fault_writes_its_control_file_and_ends_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    plan = parse_plan(one(error="readonly", saves=2, ranks=[0]))
    sink = Sink()
    FaultInjector(plan, run_dir=tmp_path, rank=1, sink=sink).on_step(4)  # returns
    ((kind, data),) = sink.events
    assert kind == "fault_injected" and sink.flushes == 1
    assert data["fault"] == "storage-fail" and data["disruptive"] is False
    assert (data["error"], data["saves"], data["ranks"], data["emulated"]) == (
        "readonly",
        2,
        [0],
        True,
    )
    assert "stall_s" not in data
    assert Path(data["control"]).parent == throttle.control_dir(ckpt)
    hooks = storagefail.FailingStorage()
    assert _save(hooks, ckpt, rank=1, step=5) is None  # not its rank
    for step in (5, 6):
        e = _save(hooks, ckpt, rank=0, step=step)
        assert e is not None and e.errno == errno.EROFS
    assert _save(hooks, ckpt, rank=0, step=7) is None  # its two saves are used up


def test_without_a_checkpoint_directory_it_says_so(tmp_path: Path) -> None:
    plan = parse_plan({"faults": [{"step": 0, "rank": 0, "kind": "storage-fail"}]})
    sink = Sink()
    FaultInjector(plan, run_dir=tmp_path, rank=0, sink=sink).on_step(0)
    data = sink.events[0][1]
    assert data["control"] is None and "no checkpoint directory" in data["reason"]
    assert not (tmp_path / "ckpt").exists()


# --- the hooks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [e for e in STORAGE_ERRORS if e != "stall"])
def test_each_error_is_the_real_errno_named_as_injected(tmp_path: Path, error: str) -> None:
    _control(tmp_path, error=error)
    hooks = storagefail.FailingStorage()
    start = error in ("readonly", "flock")  # opening fails; the others fail half-way through
    if start:
        with pytest.raises(OSError) as info:
            hooks.save_rate(root=tmp_path, rank=0, step=3)
    else:
        assert hooks.save_rate(root=tmp_path, rank=0, step=3) is None
        with pytest.raises(OSError) as info:
            hooks.at("data", root=tmp_path, step=3)
    e = info.value
    assert e.errno == ERRNOS[error]
    assert (
        e.strerror
        == f"{os.strerror(ERRNOS[error])} (injected by the fault plan: storage-fail {error})"
    )
    part = layout.partial_dir(tmp_path, 3)
    if error == "vanish":
        assert isinstance(e, FileNotFoundError) and e.filename == str(part)
    else:
        assert e.filename == str(part / layout.data_file(0))
    if error == "full":
        assert str(e).startswith(
            "[Errno 28] No space left on device (injected by the fault plan: storage-fail full)"
        )


def test_only_the_data_point_fails_a_write_error(tmp_path: Path) -> None:
    _control(tmp_path, error="eio", saves=5)
    hooks = storagefail.FailingStorage()
    hooks.at("data", root=tmp_path, step=1)  # no save started yet: its rank is unknown
    assert hooks.save_rate(root=tmp_path, rank=0, step=1) is None
    for point in ("done", "manifest", "renamed"):
        hooks.at(point, root=tmp_path, step=1)
    with pytest.raises(OSError, match="Input/output error"):
        hooks.at("data", root=tmp_path, step=1)
    used = throttle.used_path(throttle.control_dir(tmp_path) / "fail-0.json", 0)
    assert used.read_text() == "1"  # counted when it failed, not when asked


def test_saves_are_counted_per_rank_across_a_restarted_writer(tmp_path: Path) -> None:
    _control(tmp_path, error="full", saves=2, ranks=[1, 2])
    first = storagefail.FailingStorage()
    assert _save(first, tmp_path, rank=0, step=1) is None  # not a target
    assert _save(first, tmp_path, rank=1, step=1) is not None
    restarted = pickle.loads(pickle.dumps(storagefail.FailingStorage()))  # a new writer
    e = _save(restarted, tmp_path, rank=1, step=2)
    assert e is not None and e.errno == errno.ENOSPC
    assert _save(restarted, tmp_path, rank=1, step=3) is None  # two saves of rank 1 failed
    assert _save(first, tmp_path, rank=2, step=3) is not None  # rank 2 counts its own
    assert _save(restarted, tmp_path, rank=2, step=4) is not None
    assert _save(restarted, tmp_path, rank=2, step=5) is None


def test_two_faults_fail_in_plan_order_and_bad_control_files_are_ignored(tmp_path: Path) -> None:
    _control(tmp_path, index=0, error="vanish")
    _control(tmp_path, index=1, error="eio")
    (throttle.control_dir(tmp_path) / "fail-9.json").write_text("{")
    (throttle.control_dir(tmp_path) / "fail-8.json").write_text(
        '{"ranks": null, "error": "melt", "saves": 1}'
    )
    hooks = storagefail.FailingStorage()
    errnos = [getattr(_save(hooks, tmp_path, rank=0, step=s), "errno", None) for s in (1, 2, 3)]
    assert errnos == [errno.ENOENT, errno.EIO, None]


def test_a_stall_blocks_then_fails(tmp_path: Path) -> None:
    _control(tmp_path, error="stall", stall_s=0.2)
    hooks = storagefail.FailingStorage()
    assert hooks.save_rate(root=tmp_path, rank=0, step=1) is None  # a stall is mid-write
    used = throttle.used_path(throttle.control_dir(tmp_path) / "fail-0.json", 0)
    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        hooks.at("data", root=tmp_path, step=1)
    assert time.monotonic() - t0 >= 0.2
    assert info.value.errno == errno.ETIMEDOUT
    assert "(injected by the fault plan: storage-fail stall, no progress for 0.2 s)" in str(
        info.value
    )
    assert used.read_text() == "1"  # counted before it blocked: a killed writer's save counts
    assert _save(hooks, tmp_path, rank=0, step=2) is None


# --- with slow-storage -------------------------------------------------------------------------
def _hooks(tmp_path: Path, *kinds: str) -> Any:
    plan = parse_plan({"faults": [{"step": 1, "rank": 0, "kind": k} for k in kinds]})
    return FaultInjector(plan, run_dir=tmp_path, rank=0).hooks_for(tmp_path / "ckpt")


def test_the_injector_offers_the_hooks_its_plan_needs(tmp_path: Path) -> None:
    assert _hooks(tmp_path, "exception") is None
    assert isinstance(_hooks(tmp_path, "slow-storage"), throttle.SlowStorage)
    assert isinstance(_hooks(tmp_path, "storage-fail"), storagefail.FailingStorage)
    both = _hooks(tmp_path, "slow-storage", "storage-fail")
    assert isinstance(both, storagefail.Combined)
    assert [type(h) for h in both.hooks] == [storagefail.FailingStorage, throttle.SlowStorage]
    assert isinstance(pickle.loads(pickle.dumps(both)), storagefail.Combined)


def test_a_plan_with_both_kinds_slows_and_fails(tmp_path: Path) -> None:
    throttle.write_control(tmp_path, index=0, ranks=None, bytes_per_s=2e6, saves=2, seconds=None)
    _control(tmp_path, index=1, error="full", saves=1)
    _control(tmp_path, index=2, error="readonly", saves=1, ranks=[1])
    hooks = pickle.loads(pickle.dumps(_hooks(tmp_path, "slow-storage", "storage-fail")))
    slow_used = throttle.used_path(throttle.control_dir(tmp_path) / "slow-0.json", 0)
    # Rank 0's first save is slowed, then fails half-way through.
    assert hooks.save_rate(root=tmp_path, rank=0, step=1) == 2e6
    with pytest.raises(OSError, match="No space left on device"):
        hooks.at("data", root=tmp_path, step=1)
    # Its second is slowed and commits; its third is neither.
    assert hooks.save_rate(root=tmp_path, rank=0, step=2) == 2e6
    hooks.at("data", root=tmp_path, step=2)
    assert hooks.save_rate(root=tmp_path, rank=0, step=3) is None
    assert slow_used.read_text() == "2"
    # Rank 1's first save fails as it opens its file: not slowed, so not counted as slowed.
    e = _save(hooks, tmp_path, rank=1, step=1)
    assert e is not None and e.errno == errno.EROFS
    slow_used_1 = throttle.used_path(throttle.control_dir(tmp_path) / "slow-0.json", 1)
    assert not slow_used_1.exists()
    assert hooks.save_rate(root=tmp_path, rank=1, step=2) == 2e6
    with pytest.raises(OSError, match="No space left on device"):  # fault #1 is on every rank
        hooks.at("data", root=tmp_path, step=2)


# --- through a real Checkpointer ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("error", ["full", "readonly"])
def test_an_injected_failure_reaches_the_ledger(tmp_path: Path, error: str) -> None:
    import torch

    from unbroken.checkpoint import Checkpointer, CheckpointError
    from unbroken.ledger import Ledger, read_events

    root = tmp_path / "ckpt"
    led = Ledger(tmp_path / "run", run="r", rank=0)
    w = torch.arange(4096.0)
    try:
        with Checkpointer(
            root, run="r", ledger=led, keep=2, hooks=storagefail.FailingStorage()
        ) as ck:
            ck.save(0, {"w": w})
            ck.wait()
            _control(root, error=error, saves=1)  # the fault fires after step 0
            w.add_(1.0)
            ck.save(1, {"w": w})
            try:  # today the failed save is raised once; a Checkpointer that goes on does not
                ck.wait()
            except CheckpointError as e:
                assert f"storage-fail {error}" in str(e)
    finally:
        led.close()
    fails = [e for e in read_events(tmp_path / "run") if e.kind == "ckpt_fail"]
    assert [e.get("step") for e in fails] == [1]
    message = fails[0].get("error")
    assert os.strerror(ERRNOS[error]) in message
    assert f"(injected by the fault plan: storage-fail {error})" in message
    assert 0 in layout.committed_steps(root)
    assert layout.verify(layout.step_dir(root, 0)) is None  # the previous checkpoint is intact
