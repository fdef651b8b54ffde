"""The goodput planner: config validation, the model against the Monte Carlo, and the stored
validations (the demo's measured runs, a real run's summary, the published figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken import cli
from unbroken.plan import PlanConfig, predict, scenarios, simulate
from unbroken.plan import measured as pmeasured
from unbroken.plan.cli import TOLERANCE


def _checks(prefix: str) -> list[scenarios.Check]:
    return [c for c in scenarios.checks() if c.scenario.startswith(prefix)]


def test_the_demo_at_2000_steps_is_predicted_from_its_500_step_runs() -> None:
    checks = _checks("demo")
    assert {c.layering for c in checks} == {"clean", "inprocess", "launcher", "kubernetes"}
    for c in checks:
        assert abs(c.delta_points) <= TOLERANCE["demo"], c


def test_a_real_run_summary_predicts_the_demo_within_the_stated_tolerance() -> None:
    checks = _checks("run200")
    assert len(checks) == 8
    for c in checks:
        assert abs(c.delta_points) <= TOLERANCE["run200"], c
    at_2000 = [c for c in checks if "2000" in c.scenario]
    assert all(abs(c.delta_points) <= 2.0 for c in at_2000)


def test_the_published_training_goodput_is_reproduced() -> None:
    got = {c.layering: c for c in _checks("published") if c.figure == "training_goodput"}
    assert {k: c.expected for k, c in got.items()} == {
        "inprocess": 0.31,
        "launcher": 0.255,
        "kubernetes": 0.115,
    }
    for c in got.values():
        assert abs(c.delta_points) <= TOLERANCE["published"], c


def test_the_published_checkpoint_efficiencies_fall_in_their_ranges() -> None:
    doc = scenarios.data("published")["checkpoint_efficiency"]
    got = {c.layering: c.predicted for c in scenarios.published_efficiency_checks()}
    assert doc["sync"][0] <= got["sync saves"] <= doc["sync"][1]
    assert doc["async"][0] <= got["async saves"] <= doc["async"][1]


def test_from_a_summary_reproduces_its_own_run() -> None:
    doc = scenarios.data("run200-inprocess")
    m = pmeasured.from_report(doc)
    assert m.fields["injected"] == {"hang": 3, "exception": 2}
    pred = predict(PlanConfig(**m.fields), "inprocess")
    assert pred.training_goodput == pytest.approx(doc["training_goodput"], abs=0.005)
    assert pred.infra_goodput == pytest.approx(doc["infra_goodput"], abs=0.005)


@pytest.mark.parametrize("layering", ["inprocess", "launcher", "kubernetes"])
def test_the_monte_carlo_mean_agrees_with_the_model(layering: str) -> None:
    cfg = scenarios.scale_config(16_384, days=2)
    pred = predict(cfg, layering)
    spread = simulate(cfg, layering, trials=200, seed=1)
    tg = spread.training_goodput
    assert tg["p5"] <= tg["p50"] <= tg["p95"]
    assert tg["p95"] - tg["p5"] > 0  # faults at random times: a spread
    assert tg["mean"] == pytest.approx(pred.training_goodput, abs=0.005)  # ~5 std errors
    assert spread.infra_goodput["mean"] == pytest.approx(pred.infra_goodput, abs=0.005)
    assert simulate(cfg, layering, trials=200, seed=1) == spread  # seeded


def test_layers_rank_as_designed_at_scale() -> None:
    cfg = scenarios.scale_config(16_384)
    full, launcher, k8s = (predict(cfg, x) for x in ("inprocess", "launcher", "kubernetes"))
    assert full.training_goodput >= launcher.training_goodput > k8s.training_goodput
    assert full.hot_spares >= 1 and k8s.hot_spares == 0
    assert k8s.memory_every_steps is None and full.memory_tier_bytes_per_node > 0


def test_the_best_interval_follows_young() -> None:
    # no memory tier, sync saves: the durable interval is Young's sqrt(2 * cost * MTBF)
    base = dict(
        nodes=4,
        gpus_per_node=8,
        steps=10**6,
        failures_per_gpu_hour={"process": 1e-3},
        state_bytes=32e9,
        storage_bytes_per_s=10e9,
        memory_tier=False,
        async_checkpoint=False,
    )
    cfg = PlanConfig(**base)
    mtbf = 3600 / (1e-3 * 32)
    young = (2 * cfg.persist_s * mtbf) ** 0.5
    k = predict(cfg, "launcher").ckpt_every_steps
    assert k == pytest.approx(young, rel=0.05)
    faster = PlanConfig(**(base | {"failures_per_gpu_hour": {"process": 4e-3}}))
    assert predict(faster, "launcher").ckpt_every_steps == pytest.approx(k / 2, rel=0.05)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"nodes": 0}, "nodes must be a whole number >= 1, got 0"),
        ({"step_time_s": -1.0}, "step_time_s must be a number > 0"),
        ({"failures_per_gpu_hour": {"gpu": 1.0}}, "unknown key 'gpu'"),
        ({"injected": {"hang": 1.5}}, "injected['hang'] must be a whole number"),
        ({"restart_s": {"inprocess": 1.0}}, "restart_s has no value for"),
        (
            {"injected": {"hang": 1}, "failures_per_gpu_hour": {"hang": 1.0}},
            "not both",
        ),
    ],
)
def test_bad_configs_are_refused_with_a_reason(fields: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        PlanConfig(**fields)


def test_a_job_that_never_finishes_is_refused() -> None:
    cfg = PlanConfig(failures_per_gpu_hour={"process": 50.0}, memory_tier=False)
    with pytest.raises(ValueError, match="never finishes"):
        predict(cfg, "kubernetes")


def test_cli_plan_prints_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--llama3", "--nodes", "128", "--trials", "20", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "inprocess" in text and "kubernetes" in text
    doc = json.loads(out.read_text())
    assert [r["prediction"]["layering"] for r in doc["layerings"]] == [
        "inprocess",
        "launcher",
        "kubernetes",
    ]
    assert cli.main(["plan", "--validate"]) == 0


def test_cli_plan_from_a_report_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "run.json"
    src.write_text(json.dumps(scenarios.data("run200-inprocess")))
    assert cli.main(["plan", "--from", str(src), "--steps", "2000", "--trials", "10"]) == 0
    assert "measured (--from)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--nodes", "0"],
        ["plan", "--restart-s", "launcher"],
        ["plan", "--injected", "hang=x"],
        ["plan", "--from", "/nonexistent/run"],
    ],
)
def test_cli_plan_exits_2_on_bad_input(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert cli.main(argv) == 2
    assert "error:" in capsys.readouterr().err


def test_the_stop_grace_covers_two_steps_and_one_durable_save_doubled(capsys) -> None:
    cfg = PlanConfig(
        nodes=2, gpus_per_node=8, step_time_s=1.5, state_bytes=160e9, storage_bytes_per_s=10e9
    )
    assert cfg.persist_s == 16.0
    assert cfg.stop_grace_s == pytest.approx(2 * (2 * 1.5 + cfg.stage_s + 16.0))
    assert cli.main(["plan", "--steps", "100", "--trials", "1", "--state-bytes", "160e9"]) == 0
    assert "a stop grace of at least" in capsys.readouterr().out


def test_the_memory_tier_per_node_is_what_the_checkpointer_and_the_peer_replica_hold() -> None:
    from unbroken.checkpoint import CheckpointConfig
    from unbroken.checkpoint.tiers import peers

    cfg = PlanConfig()
    assert cfg.memory_slots == CheckpointConfig().memory_slots
    assert cfg.replica_slots == peers._REPLICA_REGIONS
    shard_node = cfg.shard_bytes * cfg.gpus_per_node
    assert cfg.nodes > 1 and cfg.memory_tier_bytes_per_node == 4 * shard_node
    one = PlanConfig(nodes=1)  # no peer replica on one node
    assert one.memory_tier_bytes_per_node == 1 * one.shard_bytes * one.gpus_per_node
    with pytest.raises(ValueError, match="memory_slots must be >= 1"):
        PlanConfig(memory_slots=0)
