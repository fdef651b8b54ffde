"""``python -m unbroken.observe SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``): a plain script,
unchanged, watched from inside its process.

What a script that has not adopted unbroken (it never calls ``unbroken.run``) can still give
a benchmark: a global optimizer step post-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) numbers the steps of the first
optimizer that steps, from 0 in every process (a restarted plain script starts over), and after
each one writes the ledger's ``step`` record (without a loss: the hook cannot see it; the first
step's interval holds the script's set-up), sends the launcher heartbeat, and fires the fault
plan of ``UNBROKEN_FAULTS`` (step targets only: a plain script announces no phases). Then the
script runs as ``__main__``, as ``python SCRIPT`` would run it. The ledger goes to
``UNBROKEN_RUN_DIR`` (``unbroken-run`` sets it); without one nothing is recorded.

While ``unbroken.run`` runs (the script did adopt it), the hook does nothing: its ledger and
faults are ``unbroken.run``'s. ``unbroken bench recovery -- SCRIPT`` runs plain scripts so.

Imports of ours: ``unbroken.errors``, ``unbroken.env``, ``unbroken.ledger``,
``unbroken.faults``, ``unbroken.launcher.client``.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import Any

from unbroken.env import WorkerEnv, standby_start
from unbroken.faults import FaultInjector, load_plan
from unbroken.launcher.client import heartbeat
from unbroken.ledger import Ledger, process_start_time
from unbroken.ledger import events as ev
from unbroken.ledger.active import current as active_ledger
from unbroken.ledger.process import open_for_process, record_failure


def build_parser() -> argparse.ArgumentParser:
    """The command line, for ``--help`` and the docs test.

    Returns:
        The parser. ``main`` reads its arguments by hand: everything after ``SCRIPT`` (or
        ``-m MODULE``) is the script's own and must reach it untouched, options included.
    """
    parser = argparse.ArgumentParser(
        prog="python -m unbroken.observe",
        usage="python -m unbroken.observe SCRIPT [ARGS...] | -m MODULE [ARGS...]",
        description="Run a plain (not adopted) training script unchanged, with its optimizer "
        "steps recorded in the ledger of UNBROKEN_RUN_DIR, launcher heartbeats sent and the "
        "step faults of UNBROKEN_FAULTS fired. `unbroken bench recovery -- SCRIPT` runs plain "
        "scripts so.",
    )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module as __main__")
    parser.add_argument("script", nargs="?", metavar="SCRIPT", help="the script's path")
    parser.add_argument("args", nargs="*", metavar="ARGS", help="the script's own arguments")
    return parser


class StepWatch:
    """The optimizer step post-hook (see the module docstring)."""

    def __init__(self, ledger: Ledger | None, injector: FaultInjector | None) -> None:
        self.ledger = ledger
        self.injector = injector
        self.optimizer: int | None = None
        self.step = -1

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if active_ledger() is not None:  # unbroken.run records this process itself
            return
        if self.optimizer is None:
            self.optimizer = id(optimizer)
        elif id(optimizer) != self.optimizer:
            return
        self.step += 1
        if self.ledger is not None:
            self.ledger.step(self.step)
        heartbeat(self.step)
        if self.injector is not None:
            self.injector.on_step(self.step)


def _ledger(env: WorkerEnv, target: list[str]) -> Ledger | None:
    if env.run_dir is None:
        return None
    return open_for_process(
        env.run_dir,
        run=env.run_id if env.run_id and env.run_id != "none" else env.run_dir.name,
        rank=env.rank,
        attempt=env.restart_count,
        started=standby_start() or process_start_time(),
        local_rank=env.local_rank,
        world_size=env.world_size,
        argv=target,
        adopted=False,
        observed=True,
    )


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        build_parser().print_help()
        return 0
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        build_parser().print_usage(sys.stderr)
        print("error: name the script to run (SCRIPT or -m MODULE)", file=sys.stderr)
        return 2
    env = WorkerEnv.from_environ()
    ledger = _ledger(env, argv)
    injector = None
    if env.fault_plan is not None and env.run_dir is not None:
        plan = load_plan(env.fault_plan, world_size=env.world_size)
        plan.check_world(env.world_size)
        sink = ledger if ledger is not None else None
        injector = FaultInjector(
            plan, run_dir=env.run_dir, rank=env.rank, agent_pid=env.agent_pid, **_sink(sink)
        )
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(StepWatch(ledger, injector))
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = Path(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path[0] = str(script.resolve().parent)
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        _end(ledger, env, ok=code == 0)
        raise
    except BaseException as e:
        if ledger is not None:
            record_failure(ledger, e, fault_rank=env.rank)
        _end(ledger, env, ok=False)
        raise
    finally:
        handle.remove()
    _end(ledger, env, ok=True)
    return 0


def _sink(ledger: Ledger | None) -> dict[str, Any]:
    return {} if ledger is None else {"sink": ledger}


def _end(ledger: Ledger | None, env: WorkerEnv, *, ok: bool) -> None:
    if ledger is None:
        return
    if ok and env.rank == 0:
        ledger.emit(ev.JOB_END, status="ok")
    ledger.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
