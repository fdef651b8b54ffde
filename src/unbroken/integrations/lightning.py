"""Lightning: one Callback gives a ``Trainer`` every layer of a hand-written unbroken loop.

``Trainer(..., callbacks=[Unbroken(ctx)])`` inside a function run by ``unbroken.main``:

- each optimizer step is a step of the ledger and a heartbeat (``ctx.step_done``, with the
  loss ``training_step`` returned), so the launcher's and the in-process watchdogs see progress;
  validation is the named phase ``validation`` (its own timeouts, badput and fault target);
- after each step the Checkpointer's ``maybe_save`` takes the model, the optimizers and the
  Trainer's own state (``TrainerState``: the loops' progress, and with it the position of a
  resumable data loader, the LR schedulers, the other callbacks', the precision plugin's and
  the datamodule's state): async, atomic, verified, with the memory tier's snapshots between
  durable saves;
- on ``fit`` the newest checkpoint (memory, peer, disk) is restored into the live objects
  once the strategy has built them (``on_fit_start``), and the Trainer's state is handed to
  Lightning's own restore steps, so the loop goes on from the step after the checkpoint, as
  ``fit(ckpt_path=...)`` would, and the Checkpointer's random generators with it.

An in-process restart calls the training function again: it builds a new ``Trainer`` (and
``Unbroken``), whose ``fit`` resumes from the memory tier. Lightning takes its ranks from the
environment (``TorchElasticEnvironment``): a restart that reassigns ranks (a rank excluded, a
spare's) needs the launcher's path. Lightning's ``Trainer`` resumes mid-epoch exactly only when
its data loader is resumable (``state_dict``/``load_state_dict``, as torchdata's
``StatefulDataLoader``); with a plain ``DataLoader`` it starts the epoch over.

Uses two members of Lightning's checkpoint connector that ``Trainer.save_checkpoint`` and
``fit(ckpt_path=...)`` use (``_get_loops_state_dict`` and the ``restore_*`` steps); tested with
the ``lightning`` version the ``lightning`` extra pins.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer import call

from unbroken.checkpoint import Checkpointer
from unbroken.integrations import blob
from unbroken.restart import RestartContext

__all__ = ["TrainerState", "Unbroken"]


def _count_the_epoch_in_progress(loops: dict[str, Any]) -> None:
    """Correct the fit loop's epoch count in a state taken inside an epoch (after a batch).

    Lightning (2.6) does not count an epoch as started when it began in a run that resumed
    from the previous epoch's last batch: its state then says the epoch is not in progress,
    so a second resume from inside it starts the epoch over (``fit(ckpt_path=...)`` does the
    same from Lightning's own checkpoints). Inside an epoch, one more epoch is ready and
    started than completed; this sets it so."""
    progress = loops.get("fit_loop", {}).get("epoch_progress", {})
    for part in ("total", "current"):
        counts = progress.get(part)
        if counts and counts["ready"] == counts["completed"]:
            counts["ready"] = counts["started"] = counts["completed"] + 1


class TrainerState:
    """The ``Trainer``'s state beside the model and optimizers, as a ``Stateful``: what
    Lightning's own checkpoint holds of it (loops, schedulers, callbacks, precision plugin,
    datamodule). Its shape (which loops, loaders, callbacks) is known only once ``fit`` runs, so
    it is one serialized value (``torch.save``; loaded ``weights_only``: tensors, containers,
    numbers, strings), not a tree a restore would need a template of. ``load_state_dict`` only
    keeps it: ``apply`` hands it to the Trainer."""

    def __init__(self, trainer: pl.Trainer, owner: pl.Callback) -> None:
        self.trainer = trainer
        self.owner = owner
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"serialized": blob.dumps(self._collect())}

    def _collect(self) -> dict[str, Any]:
        t = self.trainer
        loops = t._checkpoint_connector._get_loops_state_dict()
        _count_the_epoch_in_progress(loops)
        state: dict[str, Any] = {
            "epoch": t.current_epoch,
            "global_step": t.global_step,
            "pytorch-lightning_version": pl.__version__,
            "loops": loops,
            "callbacks": {
                k: v
                for k, v in call._call_callbacks_state_dict(t).items()
                if k != self.owner.state_key
            },
            "lr_schedulers": [c.scheduler.state_dict() for c in t.lr_scheduler_configs],
        }
        precision = t.precision_plugin.state_dict()
        if precision:
            state[type(t.precision_plugin).__qualname__] = precision
        datamodule = getattr(t, "datamodule", None)  # a property mypy does not see
        if datamodule is not None:
            data = datamodule.state_dict()
            if data:
                state[type(datamodule).__qualname__] = data
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = blob.loads(state["serialized"])

    def apply(self) -> None:
        """Hand the loaded state to Lightning's restore steps, in ``fit``'s order."""
        assert self.loaded is not None
        connector = self.trainer._checkpoint_connector
        connector._loaded_checkpoint = self.loaded
        try:
            connector.restore_datamodule()
            connector.restore_callbacks()
            connector.restore_precision_plugin_state()
            connector.restore_loops()
            connector.restore_lr_schedulers()
        finally:
            connector._loaded_checkpoint = {}  # fit's own restore then has nothing to do


class Unbroken(pl.Callback):
    """Ledger, heartbeats, phases and unbroken's checkpoints for a Lightning ``Trainer``.

    Args:
        ctx: The ``RestartContext`` the training function was called with.
        directory: Where checkpoints go; default ``<run dir>/ckpt``.
        **checkpointer: ``Checkpointer`` keywords (``every_steps``, ``keep``, ``mode`` ...).

    Raises:
        ValueError: No ``directory`` and the run has no run directory.
    """

    def __init__(
        self,
        ctx: RestartContext,
        directory: str | os.PathLike[str] | None = None,
        **checkpointer: Any,
    ) -> None:
        if directory is None:
            if ctx.run_dir is None:
                raise ValueError(
                    "Unbroken(ctx): this run has no run directory; pass directory= "
                    "(where the checkpoints go)"
                )
            directory = ctx.run_dir / "ckpt"
        self.ctx = ctx
        self.directory = Path(directory)
        self.options = checkpointer
        self.ckpt: Checkpointer | None = None
        self.state: dict[str, Any] = {}
        self.resumed_step: int | None = None
        """The step the last ``fit`` resumed after (None: it started afresh)."""
        self._last_step = -1
        self._validation: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ckpt = Checkpointer(self.directory, **self.options)
        lightning = TrainerState(trainer, self)
        self.state = {"model": trainer.strategy.model, "trainer": lightning}
        for i, optimizer in enumerate(trainer.optimizers):
            self.state[f"optim{i}"] = optimizer
        self.resumed_step = self.ckpt.restore(self.state)
        if self.resumed_step is not None:
            lightning.apply()
        self._last_step = trainer.global_step - 1

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step - 1
        if step <= self._last_step:
            return  # gradient accumulation: no optimizer step in this batch
        self._last_step = step
        data = {}
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is not None and hasattr(loss, "item"):
            data["loss"] = float(loss.item())
        assert self.ckpt is not None
        self.ckpt.maybe_save(step, self.state)  # before step_done: see unbroken.restart.context
        self.ctx.step_done(step, **data)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._validation = self.ctx.phase("validation")
            self._validation.__enter__()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation is not None:
            phase, self._validation = self._validation, None
            phase.__exit__(None, None, None)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ckpt is not None:
            self.ckpt.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        phase, self._validation = self._validation, None
        if phase is not None:  # leave it as the ledger and the watchdog entered it
            with contextlib.suppress(BaseException):
                phase.__exit__(type(exception), exception, exception.__traceback__)
        # unbroken.run aborts the Checkpointer; the next call of fn restores from memory
