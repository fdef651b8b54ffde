"""Run a plain training script unchanged while firing a fault plan from its optimizer steps.

    optim_faults.py PLAN SCRIPT [ARGS...]

A global optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``)
numbers this process's optimizer steps from 0 and fires the plan's faults for this rank through
unbroken's FaultInjector (once per run, recorded in the ledger of ``UNBROKEN_RUN_DIR``); then
SCRIPT runs as ``__main__``, as ``python SCRIPT`` would run it. Step numbers are this process's:
meant for a plain script, which starts again from step 0 after every restart.
"""

from __future__ import annotations

import itertools
import runpy
import sys
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

from unbroken.env import WorkerEnv
from unbroken.faults import FaultInjector, load_plan
from unbroken.ledger import Ledger

if __name__ == "__main__":
    plan, script, *args = sys.argv[1:]
    env = WorkerEnv.from_environ()
    assert env.run_dir is not None, "run under unbroken-run"
    ledger = Ledger(env.run_dir, run=env.run_dir.name, rank=env.rank, attempt=env.restart_count)
    injector = FaultInjector(load_plan(plan), run_dir=env.run_dir, rank=env.rank, sink=ledger)
    steps = itertools.count()
    register_optimizer_step_post_hook(lambda optim, a, kw: injector.on_step(next(steps)))
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")
