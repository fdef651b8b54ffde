"""torchtitan: its ``Trainer`` with unbroken's checkpoints, ledger, heartbeats and restarts.

torchtitan takes its checkpoint manager from its config (``config.checkpoint``, a
``BaseCheckpointManager``'s ``Config``); ``Checkpoint`` is one. Inside a function run by
``unbroken.main``, ``config.checkpoint = Checkpoint.adopt(config.checkpoint, ctx)`` before
``config.build()`` is the whole change (``train`` here does torchtitan's ``train.main``'s steps
so; ``python -m unbroken.integrations.torchtitan`` runs it, under ``unbroken-run`` in place of
``torchrun -m torchtitan.train``, with the same arguments):

- each step (torchtitan's ``save`` after ``train_step``) is a step of the ledger and a
  heartbeat (``ctx.step_done``), for the launcher's and the in-process watchdogs; the ledger
  counts steps from 0 (torchtitan's step 1 is the ledger's step 0);
- the Checkpointer's ``maybe_save`` (just before ``step_done``) takes the model, each
  optimizer, the LR schedulers, each rank's data loader position and the Trainer's own state
  (step, tokens seen): async, atomic, verified, with the memory tier's snapshots between
  durable saves, every ``interval`` steps and after the last step when ``enable`` (the
  memory tier's snapshots also when not);
- ``train()`` first restores the newest checkpoint (memory, peer, disk) into the live objects
  (torchtitan's ``load``), so it goes on from the step after it;
- torchtitan's wait before the optimizer step (``maybe_wait_for_staging``) waits for a save's
  copy still overlapping the step (``Checkpointer.wait_staged``);
- from the last step to ``close`` is the phase ``shutdown`` (torchtitan's end: its rank 0
  sleeps 2 s), which the hang watchdog times as a phase, not as a gap between steps; the ranks
  leave ``close`` together (a barrier), so a collective the script runs next does not wait
  out that end outside the phase.

An in-process restart calls the training function again: it builds a new Trainer, whose
``train()`` resumes from the memory tier. ``unbroken.run`` forms the process group; torchtitan
finds it formed and uses it (its ``comm`` timeouts then do not apply: unbroken's do).
torchtitan's own checkpoint features beyond resuming (a seed checkpoint, an initial load from
another path, exported or Hugging Face final checkpoints, loading a given step, excluding
state from loading) are refused with what to do, and so is pipeline parallelism (several model
parts); ``folder``, ``interval``, ``keep_latest_k`` and ``enable`` are honoured, and the last
save holds the whole state in its training dtypes whatever ``last_save_model_only`` and
``export_dtype`` say (export the model after ``train()`` returns). Tested with
the ``torchtitan`` version the ``torchtitan`` extra pins.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torchtitan.components.checkpointer.base import BaseCheckpointManager, ModelWrapper

from unbroken.checkpoint import Checkpointer, PerRank
from unbroken.restart import RestartContext

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer

__all__ = ["Checkpoint", "train"]

_REFUSED = {
    "initial_load_path": "restore another run's weights into the model before train()",
    "initial_load_in_hf": "restore another run's weights into the model before train()",
    "last_save_in_hf": "export the trained model after train() returns",
    "create_seed_checkpoint": "create it with torchtitan's own CheckpointManager",
    "exclude_from_loading": "unbroken restores the whole state, or nothing",
    "load_only": "disable saves with enable=False (the memory tier still snapshots)",
}
"""torchtitan checkpoint settings that ``Checkpoint`` does not do, and what to do instead."""


class _Stateful:
    """``obj``'s ``state_dict``/``load_state_dict`` only: torchtitan's optimizers container is
    an ``Optimizer`` too, which the Checkpointer would name through the model."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)


class Checkpoint(BaseCheckpointManager):
    """torchtitan's checkpoint manager, through unbroken's ``Checkpointer``.

    Built by torchtitan's ``Trainer`` from ``config.checkpoint``; make that with ``adopt``.

    Args:
        config: torchtitan's checkpoint settings, and the run's context (``adopt``).
        dataloader: The Trainer's data loader (its position differs per rank).
        model_parts: The model; one part (no pipeline parallelism).
        optimizers: torchtitan's optimizers container.
        lr_schedulers: torchtitan's LR schedulers container.
        states: More state by name; the Trainer passes itself as ``train_state``.
        sd_adapter: Unused (Hugging Face export is refused).
        base_folder: torchtitan's dump folder; checkpoints go to its ``config.folder``.

    Raises:
        ValueError: No context (the Trainer built outside ``unbroken.main``, or the config not
            made by ``adopt``), a refused setting, or more than one model part.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        enable: bool = True
        """Durable checkpoints every ``interval`` steps (False: the memory tier's only)."""

        _ctx: RestartContext | None = dataclasses.field(default=None, repr=False)
        """The run's context (``adopt`` sets it; not a setting: ``to_dict`` leaves it out)."""

    @classmethod
    def adopt(cls, titan: BaseCheckpointManager.Config, ctx: RestartContext) -> Checkpoint.Config:
        """The config of a ``Checkpoint`` with torchtitan's checkpoint settings ``titan``.

        Args:
            titan: ``config.checkpoint`` as torchtitan parsed it (its flags applied).
            ctx: The ``RestartContext`` the training function was called with.

        Returns:
            What to set ``config.checkpoint`` to.
        """
        fields = {f.name for f in dataclasses.fields(cls.Config)}
        same = {
            f.name: getattr(titan, f.name)
            for f in dataclasses.fields(titan)
            if f.name in fields and f.init and f.name != "_ctx"
        }
        return cls.Config(**same, _ctx=ctx)

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: Sequence[Any],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        if config._ctx is None:
            raise ValueError(
                "unbroken's torchtitan Checkpoint has no RestartContext: in the function "
                "unbroken.main runs, set config.checkpoint = Checkpoint.adopt("
                "config.checkpoint, ctx) before config.build() (or run "
                "python -m unbroken.integrations.torchtitan)"
            )
        for name, instead in _REFUSED.items():
            if getattr(config, name):
                raise ValueError(
                    f"checkpoint.{name} is a torchtitan checkpoint feature unbroken's "
                    f"Checkpoint does not do: {instead}"
                )
        if config.load_step != -1:
            raise ValueError(
                f"checkpoint.load_step={config.load_step}: unbroken restores the newest "
                "checkpoint every rank holds; leave load_step at -1"
            )
        if len(model_parts) != 1:
            raise ValueError(
                f"{len(model_parts)} model parts (pipeline parallelism): unbroken's torchtitan "
                "Checkpoint takes one; use torchtitan's CheckpointManager for pipelines"
            )
        self.enable = True  # torchtitan calls the hooks only when enabled: the steps need them
        self.save_future = None
        self.ctx = config._ctx
        # As torchtitan's own manager has them: its model's state dict hooks name the fused
        # parameters by their parts (not what DCP's get_model_state_dict expects), and its
        # optimizers name their state the same way.
        self.state: dict[str, Any] = {
            "model": ModelWrapper(list(model_parts)),
            "optimizer": _Stateful(optimizers),
            "lr_schedulers": lr_schedulers,
            "dataloader": PerRank(dataloader),
            **states,
        }
        self.durable = config.enable
        self.ckpt = Checkpointer(
            Path(base_folder) / config.folder,
            every_steps=config.interval if config.enable else 0,
            keep=config.keep_latest_k or None,
        )
        self.resumed_step: int | None = None
        """The ledger step ``load`` resumed after (None: it started afresh)."""
        self._shutdown: AbstractContextManager[None] | None = None

    def _load(self, step: int = -1) -> bool:
        self.resumed_step = self.ckpt.restore(self.state)
        return self.resumed_step is not None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        step = curr_step - 1
        staged = self.ckpt.maybe_save(step, self.state)  # before step_done (a fault plan's)
        self.ctx.step_done(step)
        if last_step and self.durable:
            # torchtitan saves its last step whatever the interval: so here, once the save in
            # flight (this step's, or one that kept this step's from starting) is committed.
            self.ckpt.wait()
            if self.ckpt.latest() != step:  # every rank sees the same directory
                staged = self.ckpt.save(step, self.state)
        if last_step:
            # From here to close() (torchtitan's end: its rank 0 sleeps 2 s) is the job's
            # shutdown, not a step gap for the hang watchdog to time.
            self._shutdown = self.ctx.phase("shutdown")
            self._shutdown.__enter__()
        return staged

    def _maybe_wait_for_staging(self) -> None:
        self.ckpt.wait_staged()

    def _wait_for_saving(self) -> None:
        self.ckpt.wait()

    def _close(self) -> None:
        error = sys.exc_info()
        phase, self._shutdown = self._shutdown, None
        try:
            if error[1] is not None:
                # An error unwinds through torchtitan's ``finally: trainer.close()``: the
                # restart that follows restores from the newest snapshot, which abort keeps
                # (close frees it).
                self.ckpt.abort()
            else:
                self.ckpt.close()
                if phase is not None and dist.is_initialized():
                    # Leave together: what the script does next on one rank (a collective)
                    # would wait out torchtitan's end on another outside any phase, where
                    # the hang watchdog times it as a gap between steps.
                    dist.barrier()
        finally:
            if phase is not None:
                phase.__exit__(*error)


def train(ctx: RestartContext, argv: Sequence[str] | None = None) -> Trainer:
    """torchtitan's ``train.main`` with ``Checkpoint``: parse the config from ``argv`` (default:
    the command line), build the Trainer, train, close it; the process group stays unbroken's.

    Args:
        ctx: The ``RestartContext`` (``unbroken.main(train)``).
        argv: torchtitan's arguments (``--module llama3 --config llama3_debugmodel ...``).

    Returns:
        The Trainer, trained and closed.
    """
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args(list(sys.argv[1:] if argv is None else argv))
    config.checkpoint = Checkpoint.adopt(config.checkpoint, ctx)
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer
