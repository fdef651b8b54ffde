"""``unbroken plan --from RUN --recommend`` on hand-built ledgers: what it measures, and that
each recommendation moves the way its measured cost says it must."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from timelines import fault, rec, write
from unbroken import cli
from unbroken.ledger import events as ev
from unbroken.plan import PlanConfig, predict
from unbroken.plan.observed import observe
from unbroken.plan.tune import (
    ENV_CKPT_EVERY,
    ENV_PHASE_TIMEOUTS,
    ENV_SNAPSHOT_EVERY,
    ENV_SOFT_TIMEOUT,
    TIMEOUT_FACTOR,
    TIMEOUT_FLOOR_S,
    Recommendation,
    TuneConfig,
    effective,
    job_config,
    recommend,
)
from unbroken.restart.config import RestartConfig

# 60 process faults per GPU-hour: Young's interval for a 2 ms save is ~5 steps of 100 ms.
FAST_FAULTS = {"failures_per_gpu_hour": {"process": 60.0}}


def training(
    run_dir: Path,
    *,
    steps: int = 60,
    step_s: float = 0.1,
    first_step_s: float | None = None,
    slow_step: tuple[int, float] | None = None,
    ckpt_every: int = 10,
    save_s: float = 0.002,
    snapshot_every: int = 1,
    snapshot_s: float = 0.001,
    note_s: float | None = None,
    persist_s: float = 0.05,
    phases: dict[str, list[float]] | None = None,
    validate_every: int = 20,
    validation_s: list[float] = (0.3,),
    extra: list[ev.Event] = (),
) -> Path:
    """A one-rank run as the library records it: start-up phases, steps, each followed by a
    durable save, a snapshot or a note (a save due while one persists is skipped and staged as
    a snapshot), validation phases, then shutdown."""
    t = 100.0
    events = [rec(ev.PROCESS_START, t, rank=0, world_size=1, host="h")]
    for name, dur in (phases or {"import": [2.0], "pg_init": [0.01], "model_build": [0.5]}).items():
        for d in dur:
            t += d
            events.append(rec(ev.PHASE, t, name=name, dur_s=d))
    t += 0.004
    events.append(rec(ev.CKPT_LOAD, t, dur_s=0.004, step=None, tier="none"))
    persisting_until = -1.0
    validations = iter(validation_s)
    for n in range(steps):
        begin = t
        compute = step_s
        if n == 0 and first_step_s is not None:
            compute = first_step_s
        if slow_step and slow_step[0] == n:
            compute = slow_step[1]
        t += compute
        done = n + 1
        if done % ckpt_every == 0 and t >= persisting_until:
            t += save_s
            events.append(rec(ev.CKPT_STAGE, t, dur_s=save_s, step=n, bytes=1e6, durable=True))
            persisting_until = t + persist_s
            events.append(rec(ev.CKPT_PERSIST, persisting_until, dur_s=persist_s, step=n))
            events.append(rec(ev.CKPT_COMMIT, persisting_until + 0.001, step=n))
        else:
            if done % ckpt_every == 0:
                events.append(rec(ev.CKPT_SKIP, t, step=n, reason="still persisting"))
            if snapshot_every and done % snapshot_every == 0 or done % ckpt_every == 0:
                t += snapshot_s
                events.append(
                    rec(ev.CKPT_STAGE, t, dur_s=snapshot_s, step=n, bytes=1e6, durable=False)
                )
            elif note_s is not None:
                t += note_s
                events.append(rec(ev.CKPT_STAGE, t, dur_s=note_s, step=n, part="note"))
        events.append(rec(ev.STEP, t, step=n, dur_s=t - begin, loss=1.0))
        if validate_every and done % validate_every == 0:
            d = next(validations, validation_s[-1])
            t += d
            events.append(rec(ev.PHASE, t, name="validation", dur_s=d))
    t += 0.05
    events.append(rec(ev.PHASE, t, name="shutdown", dur_s=0.05))
    events += list(extra)
    events.append(rec(ev.JOB_END, t + 0.01, status="ok"))
    write(run_dir, events)
    return run_dir


def tuned(run_dir: Path, given: dict | None = None, **tune: float) -> Recommendation:
    obs = observe(run_dir)
    return recommend(obs, job_config(obs, given), TuneConfig(**tune))


# --- what a run measures ---------------------------------------------------------------------
def test_a_save_held_back_a_step_does_not_halve_the_interval_seen(tmp_path: Path) -> None:
    # One copy: the save due after step 29 waits for the writer, is skipped with
    # ``retried`` and staged after step 30; the interval is still the run's 10.
    held = [
        rec(ev.CKPT_SKIP, 103.0, step=29, reason="the writer reads the copy", retried=True),
        rec(ev.CKPT_STAGE, 103.2, dur_s=0.002, step=30, bytes=1e6, durable=True),
    ]
    assert observe(training(tmp_path / "r", extra=held)).ckpt_every == 10
    busy = [rec(ev.CKPT_SKIP, 103.0, step=29, reason="still persisting")]  # dropped, not held
    assert observe(training(tmp_path / "b", extra=[*busy, held[1]])).ckpt_every == 1


def test_a_save_skipped_at_every_step_while_one_persists_fell_due_once(tmp_path: Path) -> None:
    # A slow writer: the save due after step 19 is skipped at steps 19-26, each time for the
    # same save still persisting; one save that fell due, not eight a step apart.
    busy = [
        rec(ev.CKPT_SKIP, 102.0 + 0.1 * s, step=s, reason="the save of step 9 is still persisting")
        for s in range(19, 27)
    ]
    run = training(tmp_path / "r", persist_s=0.0, extra=busy)
    obs = observe(run)
    assert obs.ckpt_every == 10 and obs.skipped_saves == 8


def test_the_run_figures_come_from_their_records(tmp_path: Path) -> None:
    run = training(
        tmp_path / "r", snapshot_every=2, note_s=0.0005, first_step_s=3.0, slow_step=(30, 0.4)
    )
    obs = observe(run)
    assert obs.steps_completed == 60 and obs.world_size == 1 and obs.nodes == 1
    assert obs.step_s.median == pytest.approx(0.1)  # the stage inside a step is not compute
    assert obs.step_s.max == pytest.approx(0.4)
    assert obs.first_step_s.max == pytest.approx(3.0, abs=1e-3) and obs.gap_s.max < 0.5
    assert (obs.save_s.count, obs.save_s.median) == (6, pytest.approx(0.002))
    assert obs.snapshot_s.median == pytest.approx(0.001)
    assert obs.note_s.median == pytest.approx(0.0005)
    assert obs.durable_lag_s.max == pytest.approx(0.051)
    assert (obs.ckpt_every, obs.snapshot_every, obs.skipped_saves) == (10, 2, 0)
    assert obs.phases["validation"].count == 3 and obs.phases["save"].count > 6
    assert obs.phases["restore"].max == pytest.approx(0.004)
    assert obs.faults == ()


def test_no_fault_in_the_run_uses_the_published_rate_and_says_so(tmp_path: Path) -> None:
    obs = observe(training(tmp_path / "r"))
    job = job_config(obs)
    assert "Llama 3" in job.rate_source
    assert sum(job.config.failures_per_gpu_hour.values()) == pytest.approx(2.19e-5, rel=0.01)
    assert job_config(obs, FAST_FAULTS).config.failures_per_gpu_hour == {"process": 60.0}


def test_the_runs_faults_give_the_rate_and_the_recovery_cost(tmp_path: Path) -> None:
    extra = [
        *fault(105.0, rank=0, kind="exception"),
        rec(ev.RESTART_END, 105.3, rank=0, layer="inprocess"),
        *fault(107.0, rank=0, kind="sigkill", layer="launcher"),
    ]
    obs = observe(training(tmp_path / "r", extra=extra))
    assert [f.kind for f in obs.faults] == ["exception", "sigkill"]
    job = job_config(obs)
    assert job.layering == "inprocess" and "the run's: 2 fault(s)" in job.rate_source
    hours = obs.train_s / 3600
    assert dict(job.config.failures_per_gpu_hour) == pytest.approx(
        {"exception": 1 / hours, "process": 1 / hours}
    )
    r = recommend(obs, job)
    assert "recovery" in [t.name for t in r.timeouts]
    assert "the run's mean recovery" in r.timeouts_why


# --- the durable interval ------------------------------------------------------------------
def test_a_slow_persist_raises_the_durable_interval(tmp_path: Path) -> None:
    fast = tuned(training(tmp_path / "fast", persist_s=0.05), FAST_FAULTS)
    slow = tuned(training(tmp_path / "slow", persist_s=3.0), FAST_FAULTS)
    assert fast.ckpt_every < 10
    lag = math.ceil(3.001 / 0.1)  # staging end to commit, in steps
    assert slow.ckpt_every >= lag > fast.ckpt_every
    row = next(c for c in slow.ckpt_choices if c.every == 10)  # the run's own interval
    assert row.effective == effective(10, slow.ckpt_every) == 40  # a due save was skipped
    assert "skips saves" in slow.ckpt_why and "skipped" in slow.ckpt_why


def test_a_costlier_save_or_rarer_faults_lengthen_the_durable_interval(tmp_path: Path) -> None:
    cheap = tuned(training(tmp_path / "cheap", save_s=0.002), FAST_FAULTS)
    costly = tuned(training(tmp_path / "costly", save_s=0.05), FAST_FAULTS)
    rare = tuned(tmp_path / "cheap", {"failures_per_gpu_hour": {"process": 0.6}})
    assert cheap.ckpt_every < costly.ckpt_every
    assert cheap.ckpt_every < rare.ckpt_every
    best = next(c for c in cheap.ckpt_choices if c.every == cheap.ckpt_every)
    others = [c.goodput for c in cheap.ckpt_choices if c.every != cheap.ckpt_every]
    assert all(g is None or g <= best.goodput + 1e-9 for g in others)  # type: ignore[operator]


# --- the snapshot interval ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("snapshot_s", "note_s", "every"),
    [
        (0.0005, None, 1),  # within 1% of a 100 ms step: every step
        (0.003, None, 3),  # 3 ms: every third step blocks 1 ms per step
        (0.003, 0.0005, 5),  # notes on the other steps cost too: (3 + 4 x 0.5) / 5 = 1 ms
    ],
)
def test_a_costly_snapshot_lowers_the_snapshot_frequency(
    tmp_path: Path, snapshot_s: float, note_s: float | None, every: int
) -> None:
    r = tuned(training(tmp_path / "r", snapshot_s=snapshot_s, note_s=note_s, snapshot_every=2))
    assert r.snapshot_every == every
    rows = {c.every: c for c in r.snapshot_choices}
    assert rows[every].blocking_s_per_step <= 0.001 + 1e-9
    if every > 1:
        blocked = (snapshot_s + (every - 2) * (note_s or 0.0)) / (every - 1)
        assert blocked > 0.001
    assert rows[1].lost_steps < rows[every].lost_steps or every == 1
    assert r.env[ENV_SNAPSHOT_EVERY] == str(every)


def test_notes_over_the_budget_fall_back_to_the_best_goodput(tmp_path: Path) -> None:
    r = tuned(training(tmp_path / "r", snapshot_s=0.004, note_s=0.002, snapshot_every=2))
    assert "notes alone exceed" in r.snapshot_why
    best = max(c.goodput or 0.0 for c in r.snapshot_choices)
    chosen = next(c for c in r.snapshot_choices if c.every == r.snapshot_every)
    assert chosen.goodput == pytest.approx(best)


def test_a_larger_budget_allows_more_frequent_snapshots(tmp_path: Path) -> None:
    run = training(tmp_path / "r", snapshot_s=0.003)
    assert tuned(run, snapshot_budget=0.03).snapshot_every == 1
    assert tuned(run).snapshot_every == 3


# --- hang timeouts ---------------------------------------------------------------------------
def test_each_phase_timeout_follows_its_longest_duration(tmp_path: Path) -> None:
    run = training(
        tmp_path / "r",
        first_step_s=5.0,  # the initial timeout's, not the steady one's
        slow_step=(30, 0.4),
        validation_s=[0.3, 2.5, 0.2],
        phases={"import": [2.0], "model_build": [0.05], "eval_bleu": [0.7, 1.1]},
    )
    r = tuned(run)
    got = {t.name: t for t in r.timeouts}
    assert got["step"].timeout_s == 3.3  # 8 x 401 ms (a step and its snapshot), up to 0.1 s
    assert got["validation"].timeout_s == 20.0 and got["validation"].count == 3
    assert got["import"].timeout_s == 16.0
    assert got["model_build"].timeout_s == 1.0  # the floor
    assert got["eval_bleu"].timeout_s == pytest.approx(8.8)
    assert got["persist"].longest_s == pytest.approx(0.05)
    for t in r.timeouts:
        assert t.hang_cost_s > t.timeout_s
    assert r.env[ENV_SOFT_TIMEOUT] == "3.3"
    phases = dict(p.split("=") for p in r.env[ENV_PHASE_TIMEOUTS].split(","))
    assert phases["validation"] == "20" and phases["eval_bleu"] == "8.8"
    assert "step" not in phases
    half = tuned(run, timeout_factor=4.0, timeout_floor_s=2.0)
    got = {t.name: t.timeout_s for t in half.timeouts}
    assert got["validation"] == 10.0 and got["model_build"] == 2.0


def test_the_timeout_defaults_are_the_calibrators() -> None:
    cfg = RestartConfig()
    assert (cfg.timeout_factor, cfg.timeout_floor_s) == (TIMEOUT_FACTOR, TIMEOUT_FLOOR_S)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"timeout_factor": 1.0}, "timeout_factor must be > 1"),
        ({"timeout_floor_s": 0.0}, "timeout_floor_s must be > 0"),
        ({"snapshot_budget": 1.5}, "snapshot_budget must lie in"),
    ],
)
def test_bad_tune_configs_are_refused(fields: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        TuneConfig(**fields)


# --- the planner's measured save costs -------------------------------------------------------
def test_a_measured_save_and_note_cost_enter_the_stall() -> None:
    cfg = PlanConfig(failures_per_gpu_hour={"process": 1e-3}, state_bytes=16e9)
    base = predict(cfg, "inprocess")
    costly = predict(replace(cfg, save_stage_s=10 * cfg.stage_s), "inprocess")
    assert costly.ckpt_every_steps > base.ckpt_every_steps
    fixed = replace(cfg, ckpt_every_steps=100, memory_every_steps=4)
    noted = predict(replace(fixed, note_s=0.01), "inprocess")
    assert noted.stall == pytest.approx(predict(fixed, "inprocess").stall + 0.01 * 0.75)
    with pytest.raises(ValueError, match="note_s must be a number >= 0"):
        PlanConfig(note_s=-1.0)


# --- the CLI ---------------------------------------------------------------------------------
def test_cli_recommend_prints_the_tables_and_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = training(tmp_path / "r", snapshot_s=0.003)
    argv = ["plan", "--from", str(run), "--recommend", "--failures-per-gpu-hour", "process=60"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    for words in ("durable checkpoint: every", "memory snapshot: every 3", "hang timeouts:"):
        assert words in text
    line = next(x.strip() for x in text.splitlines() if x.strip().startswith("export "))
    assert f"{ENV_SNAPSHOT_EVERY}=3" in line and f"{ENV_CKPT_EVERY}=" in line
    assert cli.main([*argv, "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommendation"]["snapshot_every"] == 3
    assert doc["recommendation"]["env_line"] == line
    assert doc["observed"]["ckpt_every"] == 10
    assert doc["job"]["failures_per_gpu_hour"] == {"process": 60.0}


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["plan", "--recommend"], "--recommend needs --from RUN_DIR"),
        (["plan", "--recommend", "--from", "/nonexistent/run"], "no such run directory"),
        (["plan", "--recommend", "--from", "{empty}"], "no ledger in"),
        (["plan", "--recommend", "--from", "{no_steps}"], "no completed step"),
        (["plan", "--recommend", "--from", "{report}"], "not a report JSON"),
        (["plan", "--recommend", "--from", "{run}", "--snapshot-budget", "2"], "snapshot_budget"),
    ],
)
def test_cli_recommend_exits_2_on_bad_input(
    tmp_path: Path, argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    write(tmp_path / "no_steps", [rec(ev.PHASE, 1.0, name="import", dur_s=1.0)])
    (tmp_path / "report.json").write_text("{}")
    training(tmp_path / "run", steps=5)
    argv = [a.format(**{n: tmp_path / n for n in ("empty", "no_steps", "run")},
                     report=tmp_path / "report.json") for a in argv]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and words in err
