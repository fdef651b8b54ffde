"""One rank under ``unbroken.restart.run`` that hangs where no interrupt reaches it.

``native``: ``time.sleep`` in C (GIL released): the watchdog requests a restart, the interrupt
stays pending, and after ``exit_timeout_s`` the watchdog kills the process (SIGKILL).
``gil``: a C call that holds the GIL: no Python thread runs at all, so faulthandler's C timer
(the backstop) exits the process (code 1) ``backstop_margin_s`` after the last hard deadline
the watchdog saw (here the initial one: the GIL is taken right after the first step).
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

from unbroken.env import WorkerEnv
from unbroken.ledger import Ledger
from unbroken.restart import RestartConfig, RestartContext, run


def main() -> int:
    mode, run_dir = sys.argv[1], Path(sys.argv[2])
    env = WorkerEnv.from_environ()
    ledger = Ledger(run_dir, run="hang", rank=env.rank)
    config = RestartConfig(
        monitor_interval_s=0.01,
        soft_timeout_s=0.3,
        hard_timeout_s=1.0,
        initial_soft_timeout_s=1.5,
        initial_hard_timeout_s=2.0,
        exit_timeout_s=0.5,
        barrier_timeout_s=10.0,
        backstop_margin_s=0.5,
        health_checks=(),
    )

    def fn(ctx: RestartContext) -> None:
        ctx.step_done(0)
        print("hanging", flush=True)
        if mode == "native":
            time.sleep(60)
        else:
            ctypes.PyDLL(None).sleep(60)  # PyDLL: the GIL stays held during the call

    run(fn, config=config, ledger=ledger, env=env)
    print("run returned", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
