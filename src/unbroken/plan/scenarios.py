"""The stored runs the planner is validated against (``data/``), and the scenarios of the README.

- ``demo``: the figures of ``make demo``'s runs of 500 and 2000 steps (aggregates only: goodput,
  infrastructure goodput, steps lost). Each configuration's 500-step run calibrates a plan
  (start-up, stall and per-fault costs, in units of the step time), which then predicts the
  same job at 2000 steps.
- ``run200``: report summaries of one real 200-step run here (clean and in-process), with its
  per-fault costs; ``--from`` on them predicts the demo's 500- and 2000-step runs.
- ``published``: the published 16-H100 run; what it does not publish is assumed (``data/
  published.json`` lists it) and the plan reproduces its training goodput.
- ``scale``: 16, 64, 1k and 16k GPUs at Llama 3's interruption rate (466 in 54 days on 16,384
  H100s), 1 s steps.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from unbroken.plan import measured
from unbroken.plan.config import PlanConfig, failures_per_gpu_hour
from unbroken.plan.model import predict

_HANG = {
    "inprocess": "hang_timeout_s",
    "launcher": "heartbeat_timeout_s",
    "kubernetes": "collective_timeout_s",
}
LLAMA3_RATE = failures_per_gpu_hour(466, days=54, gpus=16_384)
"""Llama 3 pre-training's interruptions per GPU-hour (all causes)."""
# Llama 3's 419 unexpected interruptions by cause (Table 5 of the paper), grouped by the layer
# that can recover them: software and NCCL errors raise; watchdog timeouts hang; GPU, memory
# and host failures take the node; the rest (47 planned) restart the job's processes.
LLAMA3_SHARES = {"exception": 0.12, "hang": 0.05, "process": 0.13, "node": 0.70}


def data(name: str) -> dict[str, Any]:
    """A stored document of ``data/`` by name (without ``.json``)."""
    text = resources.files("unbroken.plan").joinpath("data", f"{name}.json").read_text()
    doc: dict[str, Any] = json.loads(text)
    return doc


@dataclass(frozen=True, kw_only=True)
class Check:
    """One prediction next to what was measured or published."""

    scenario: str
    layering: str
    figure: str
    expected: float
    predicted: float

    @property
    def delta_points(self) -> float:
        return (self.predicted - self.expected) * 100


# --- demo: calibrate at 500 steps, predict 2000 --------------------------------------------
def demo_config(layering: str, *, steps: int) -> PlanConfig:
    """A plan of the demo's job under ``layering`` (or "clean"), from its 500-step figures;
    durations in units of one step (step_time_s = 1)."""
    doc = data("demo")
    runs = doc["runs"]["500"]
    n = 500
    stall = 1 / doc["checkpoint_efficiency"] - 1
    clean = runs["clean"]["training_goodput"]
    startup = n * (1 / clean - 1 - stall)
    base = dict(steps=steps, step_time_s=1.0, measured_stall=stall, startup_s=startup)
    if layering == "clean":
        return PlanConfig(**base)
    run = runs[layering]
    faults = doc["faults"]
    count = sum(faults.values())
    extra = n * (1 / run["training_goodput"] - 1 / clean)  # every fault's cost together
    infra = (1 - run["infra_goodput"]) * n / run["training_goodput"]
    redo = run["steps_lost"] * (1 + stall)
    detect = max(0.0, extra - infra - redo)
    layer = "kubernetes" if layering == "kubernetes" else layering
    return PlanConfig(
        **base,
        injected=faults,
        exception_detection_s=0.0,  # the rank raises at once; the hangs wait out a timeout
        **{_HANG[layering]: detect / faults["hang"]},
        restart_s={"inprocess": 0, "launcher": 0, "spare": 0, "kubernetes": 0}
        | {layer: infra / count},
        restore_s={"memory": 0.0, "durable": 0.0},
        steps_lost={layer: run["steps_lost"] / count},
    )


def demo_checks() -> list[Check]:
    doc = data("demo")["runs"]["2000"]
    out = []
    for layering in ("clean", "inprocess", "launcher", "kubernetes"):
        cfg = demo_config(layering, steps=2000)
        pred = predict(cfg, "kubernetes" if layering == "clean" else layering)
        for figure in ("training_goodput", "infra_goodput"):
            out.append(
                Check(
                    scenario="demo 500 -> 2000 steps",
                    layering=layering,
                    figure=figure,
                    expected=doc[layering][figure],
                    predicted=getattr(pred, figure),
                )
            )
    return out


# --- run200: a real run's ledger summary, predicting the demo's lengths ----------------------
def run200_checks() -> list[Check]:
    demo = data("demo")["runs"]
    out = []
    for name, layering in (("clean", "clean"), ("inprocess", "inprocess")):
        m = measured.from_report(data(f"run200-{name}"))
        for steps in (500, 2000):
            cfg = PlanConfig(**(m.fields | {"steps": steps}))
            pred = predict(cfg, "inprocess" if layering == "clean" else layering)
            for figure in ("training_goodput", "infra_goodput"):
                out.append(
                    Check(
                        scenario=f"run200 --from -> {steps} steps",
                        layering=layering,
                        figure=figure,
                        expected=demo[str(steps)][layering][figure],
                        predicted=getattr(pred, figure),
                    )
                )
    return out


# --- the published run ------------------------------------------------------------------------
def published_config() -> PlanConfig:
    doc = data("published")
    a = doc["assumed"]
    recovery = {k: v["recovery_s"] for k, v in doc["published"].items()}
    detect = a["exception_detection_s"]
    return PlanConfig(
        nodes=2,
        gpus_per_node=8,
        steps=a["steps"],
        step_time_s=a["step_time_s"],
        injected={"exception": 5},
        state_bytes=a["state_bytes"],
        storage_bytes_per_s=a["storage_bytes_per_s"],
        stage_bytes_per_s=a["stage_bytes_per_s"],
        ckpt_every_steps=a["ckpt_every_steps"],
        memory_tier=False,
        startup_s=a["startup_s"],
        exception_detection_s=detect,
        restart_s={k: v - detect for k, v in recovery.items()} | {"spare": 30.0},
        restore_s={"memory": 0.0, "durable": 0.0},
        steps_lost={"inprocess": 0.0},
    )


def published_checks() -> list[Check]:
    doc = data("published")["published"]
    cfg = published_config()
    out = []
    for layering in ("inprocess", "launcher", "kubernetes"):
        pred = predict(cfg, layering)
        for figure in ("training_goodput", "infra_goodput"):
            out.append(
                Check(
                    scenario="published 16 H100",
                    layering=layering,
                    figure=figure,
                    expected=doc[layering][figure],
                    predicted=getattr(pred, figure),
                )
            )
    return out


def published_efficiency_checks() -> list[Check]:
    """Checkpoint efficiency (1 / (1 + stall)) with the assumed storage, synchronous and
    asynchronous saves, against the middle of the published ranges."""
    doc = data("published")["checkpoint_efficiency"]
    out = []
    for mode, is_async in (("sync", False), ("async", True)):
        cfg = dataclasses.replace(published_config(), async_checkpoint=is_async)
        pred = predict(cfg, "launcher")
        out.append(
            Check(
                scenario="published 16 H100",
                layering=f"{mode} saves",
                figure="checkpoint_efficiency",
                expected=sum(doc[mode]) / 2,
                predicted=1 / (1 + pred.stall),
            )
        )
    return out


def checks() -> list[Check]:
    """Every validation: the demo, the real run, the published run."""
    return demo_checks() + run200_checks() + published_checks() + published_efficiency_checks()


# --- the README's scale table ---------------------------------------------------------------
MODELS = ((64, 8e9), (1024, 70e9), (16_384, 405e9))
"""Llama 3 sizes by job size: up to 64 GPUs 8B, up to 1k 70B, beyond 405B parameters."""


def scale_config(gpus: int, *, days: float = 7.0) -> PlanConfig:
    """A Llama-3-like job of ``gpus`` H100s for ``days`` at Llama 3's interruption rate and
    causes, 1 s steps; the model by size (``MODELS``), 16 bytes of checkpoint per parameter;
    storage 100 GB/s per 1k GPUs (at least 10 GB/s); 25 GB/s per GPU into host memory."""
    params = next((p for limit, p in MODELS if gpus <= limit), MODELS[-1][1])
    rate = {kind: LLAMA3_RATE * share for kind, share in LLAMA3_SHARES.items()}
    return PlanConfig(
        nodes=max(1, gpus // 8),
        gpus_per_node=8,
        steps=int(days * 86400),
        step_time_s=1.0,
        failures_per_gpu_hour=rate,
        state_bytes=16 * params,
        storage_bytes_per_s=max(10e9, 100e9 * gpus / 1024),
        stage_bytes_per_s=25e9,
        startup_s=300.0,
    )
