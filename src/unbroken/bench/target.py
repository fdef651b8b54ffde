"""What ``unbroken bench recovery`` trains, and how each configuration runs it.

The target is the reference script (``python -m unbroken.workload.train`` with the workload's
flags) or a user's own command (``-- SCRIPT.py [ARGS]`` or ``-- -m MODULE [ARGS]``), run with
this interpreter. A configuration reaches it from outside only, through the environment the
library reads (``unbroken.env.Overrides``: ``UNBROKEN_INPROCESS``, ``UNBROKEN_CKPT_MODE``,
``UNBROKEN_MEMORY_TIER``, ``UNBROKEN_SNAPSHOT_EVERY``, the timeouts; ``UNBROKEN_FAULTS``;
``UNBROKEN_RUN_DIR``): the script is never edited.

A script that adopted unbroken (it calls ``unbroken.run``/``unbroken.main``) gets every
configuration. A plain torchrun script runs under ``python -m unbroken.observe`` (its optimizer
steps become ledger steps, heartbeats and fault points) and gets only the configurations that
apply to it: ``NEEDS_ADOPTION`` says why the others do not. Which one a script is, the first
run's ledger tells (``adopted``); a guess from its source picks how that run starts.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from unbroken import env as uenv
from unbroken.ledger import events as ev
from unbroken.ledger import read_run

REFERENCE_MODULE = "unbroken.workload.train"
OBSERVER_MODULE = "unbroken.observe"

NEEDS_ADOPTION = {
    "inprocess": "in-process restart is unbroken.run's, which the script does not call",
    "sync": "the checkpoint mode is a Checkpointer's; the script saves nothing through unbroken",
}
"""Why a plain script cannot run a configuration, by the configuration's trait."""

_CLEARED = (*uenv.OVERRIDE_NAMES, uenv.UNBROKEN_FAULTS, uenv.UNBROKEN_RUN_DIR)


@dataclass(frozen=True, kw_only=True)
class Target:
    """A command every configuration runs (with this interpreter)."""

    argv: tuple[str, ...]
    """After the interpreter: a script path or ``-m MODULE``, then its arguments."""
    reference: bool = False
    """The reference script (``REFERENCE_MODULE``): the workload's flags are given."""
    observed: bool = False
    """A plain script: run under ``python -m unbroken.observe``."""

    @classmethod
    def user(cls, command: Sequence[str]) -> Target:
        """The target of ``-- COMMAND``; ValueError saying what a command must be."""
        command = list(command)
        if not command:
            raise ValueError("give the command after --, e.g. -- examples/ddp.py")
        if command[0] == "-m":
            if len(command) < 2 or importlib.util.find_spec(command[1]) is None:
                name = command[1] if len(command) > 1 else ""
                raise ValueError(
                    f"-m {name}: no such module on this interpreter's path ({sys.executable}); "
                    "install the package or give a script path"
                )
            return cls(argv=tuple(command), reference=command[1] == REFERENCE_MODULE)
        if command[0] in ("python", "python3") or command[0] == sys.executable:
            return cls.user(command[1:])
        script = Path(command[0])
        if not script.is_file():
            raise ValueError(
                f"{command[0]}: no such file; the command is a Python script or -m MODULE "
                "(run with this interpreter), e.g. -- examples/ddp.py --lr 1e-2"
            )
        if script.suffix != ".py":
            raise ValueError(
                f"{command[0]}: not a Python script (.py); unbroken-run and the emulated pods "
                "run the command with this interpreter, so give the script (or -m MODULE)"
            )
        return cls(argv=(str(script.resolve()), *command[1:]))

    @property
    def name(self) -> str:
        """How the target reads in the output."""
        return " ".join(self.argv if not self.reference else ("-m", REFERENCE_MODULE))

    def source_mentions_unbroken(self) -> bool:
        """A guess whether the script adopted unbroken: its source imports ``unbroken``."""
        path: str | None = self.argv[0]
        if self.argv[0] == "-m":
            spec = importlib.util.find_spec(self.argv[1])
            path = spec.origin if spec is not None else None
        try:
            text = Path(path or "").read_text(errors="replace")
        except OSError:
            return True
        return "import unbroken" in text or "from unbroken" in text

    def plain(self) -> Target:
        """This target run as a plain script (under the observer)."""
        return replace(self, observed=True)

    def launcher_argv(self) -> list[str]:
        """What ``unbroken-run`` takes after its own flags."""
        return ["-m", OBSERVER_MODULE, *self.argv] if self.observed else list(self.argv)

    def python_argv(self) -> list[str]:
        """The command as a plain process (one rank of a pod)."""
        return [sys.executable, *self.launcher_argv()]


def adopted(run_dir: Path) -> bool | None:
    """Whether a run's training processes called ``unbroken.run`` (their ``process_start``
    says ``adopted``); None: the run left no training process's record."""
    starts = [
        e
        for e in read_run(run_dir).events
        if e.kind == ev.PROCESS_START and e.rank >= 0 and "adopted" in e.data
    ]
    if not starts:
        return None
    return all(bool(e.get("adopted")) for e in starts)


def configuration_env(
    *,
    run_dir: Path,
    plan: Path | None,
    inprocess: bool,
    ckpt_mode: str | None,
    memory_tier: bool,
    snapshot_every: int | None,
    soft_timeout_s: float | None,
    max_rank_faults: int | None,
    pg_timeout_s: float | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one configuration's run: ``base`` (default: this process's) with
    every override of ours it held removed, then the configuration's."""
    env = dict(os.environ) if base is None else dict(base)
    env = {k: v for k, v in env.items() if k not in _CLEARED}
    env[uenv.OMP_NUM_THREADS] = "1"
    env[uenv.UNBROKEN_RUN_DIR] = str(run_dir)
    env[uenv.UNBROKEN_INPROCESS] = "1" if inprocess else "0"
    env[uenv.UNBROKEN_FINAL_DIGEST] = "1"  # the final state, for scripts that print no hash
    if ckpt_mode is not None:
        env[uenv.UNBROKEN_CKPT_MODE] = ckpt_mode
    if not memory_tier:
        env[uenv.UNBROKEN_MEMORY_TIER] = "0"
    elif snapshot_every is not None:
        env[uenv.UNBROKEN_SNAPSHOT_EVERY] = str(snapshot_every)
    if plan is not None:
        env[uenv.UNBROKEN_FAULTS] = str(plan)
    # Each run works in a directory of its own: ``-m`` finds the modules it finds from here.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    if pg_timeout_s is not None:
        env[uenv.UNBROKEN_PG_TIMEOUT_S] = str(pg_timeout_s)
    if inprocess and soft_timeout_s is not None:
        env[uenv.UNBROKEN_SOFT_TIMEOUT_S] = str(soft_timeout_s)
        env[uenv.UNBROKEN_HARD_TIMEOUT_S] = str(soft_timeout_s * 3)
    if inprocess and max_rank_faults is not None:
        env[uenv.UNBROKEN_MAX_RANK_FAULTS] = str(max_rank_faults)
    return env
