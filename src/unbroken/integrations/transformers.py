"""Hugging Face ``transformers``: a ``Trainer`` that checkpoints through unbroken and resumes
from its newest checkpoint, memory first.

``Trainer(..., ctx=ctx)`` from here in place of ``transformers.Trainer`` (or ``with_unbroken``
of a subclass of it, e.g. TRL's ``SFTTrainer``), inside a function run by ``unbroken.main``:

- every optimizer step is a step of the ledger and a heartbeat (``ctx.step_done``), for the
  launcher's and the in-process watchdogs;
- after each step (once the Trainer has logged it) the Checkpointer's ``maybe_save`` takes the model, the optimizer, the
  Trainer's state (``TrainerState``: global step, epoch, log history, stateful callbacks), the
  LR scheduler's and the AMP scaler's state, and each rank's random generators as the Trainer
  saves them: async, atomic, verified, with the memory tier's snapshots between saves;
- ``train()`` restores the newest checkpoint (memory, peer, disk) into the model and an
  optimizer made early (``create_optimizer``: the Trainer keeps it), then resumes through the
  Trainer's own path (``resume_from_checkpoint``) with a directory holding only what that path
  reads besides the weights (``trainer_state.json``, the generators): the Trainer skips the
  batches the resumed epoch has seen, as from its own checkpoints, and loads the scheduler's
  and scaler's state from the restored ones.

An in-process restart calls the training function again: it builds a new Trainer, whose
``train()`` resumes from memory. Turn the Trainer's own saving off (``save_strategy="no"``):
its checkpoints are full copies on storage. DeepSpeed, FSDP and SageMaker model parallelism
restore their models their own way: not supported. The Trainer's private ``_load_*`` steps
are overridden (the ones ``resume_from_checkpoint`` runs); tested with the ``transformers``
versions the ``transformers`` extra allows.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import transformers
from transformers.trainer_callback import ExportableState, TrainerCallback

from unbroken.checkpoint import Checkpointer, PerRank
from unbroken.integrations import blob
from unbroken.restart import RestartContext

__all__ = ["Trainer", "UnbrokenMixin", "with_unbroken"]

RESUME_DIR = "hf-resume"
"""Under the checkpoint directory: the directory ``resume_from_checkpoint`` names, per rank."""


class _Shared:
    """The Trainer's state, scheduler and scaler, the same on every rank, as one serialized
    value (a ``Stateful``; ``torch.save``, loaded ``weights_only``). ``load_state_dict`` keeps
    it for the Trainer's resume steps."""

    def __init__(self, trainer: UnbrokenMixin) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        exported: dict[str, Any] = {}  # as the Trainer's own save exports them
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, ExportableState):
                name, cb_state = cb.__class__.__name__, cb.state()
                if name in exported:  # several of one class: a list
                    held = exported[name]
                    exported[name] = [*(held if isinstance(held, list) else [held]), cb_state]
                else:
                    exported[name] = cb_state
        state = dataclasses.asdict(t.state)
        state["stateful_callbacks"] = {**(state.get("stateful_callbacks") or {}), **exported}
        shared = {
            "trainer_state": json.dumps(state, sort_keys=True),
            "scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler is not None else None,
            "scaler": t.accelerator.scaler.state_dict() if t.accelerator.scaler else None,
        }
        return {"serialized": blob.dumps(shared)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = blob.loads(state["serialized"])


class _Generators:
    """This rank's random generators, in the form the Trainer saves them (``rng_state.pth``)."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        rng: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(np.asarray(keys).copy()), pos, has_gauss, gauss),
            "cpu": torch.random.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.random.get_rng_state_all()
        return {"serialized": blob.dumps(rng)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rng = blob.loads(state["serialized"])
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        rng["numpy"] = (kind, keys.numpy(), pos, has_gauss, gauss)  # as the Trainer saves it
        self.loaded = rng


class _Steps(TrainerCallback):
    """Each optimizer step: the Checkpointer's turn, then the heartbeat and the ledger's step at
    its end; unless the Trainer is about to log, evaluate or save this step: then the
    Checkpointer's turn comes at the next step's beginning (or the end of training), so the
    state saved holds what the Trainer adds for the step (its log entry)."""

    def __init__(self, trainer: UnbrokenMixin) -> None:
        self.trainer = trainer
        self.pending: int | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step - 1
        if control.should_log or control.should_evaluate or control.should_save:
            self.pending = step
        else:
            self.trainer._unbroken_save(step)  # before step_done: see unbroken.restart.context
        self.trainer.unbroken_ctx.step_done(step)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush()
        if self.trainer.unbroken_checkpointer is not None:
            self.trainer.unbroken_checkpointer.close()

    def _flush(self) -> None:
        if self.pending is not None:
            step, self.pending = self.pending, None
            self.trainer._unbroken_save(step)


if TYPE_CHECKING:  # the mixin comes before a Trainer class: type-check it as one
    _Base = transformers.Trainer
else:
    _Base = object


class UnbrokenMixin(_Base):
    """The unbroken part of ``Trainer``; ``with_unbroken`` puts it before a Trainer class.

    Args:
        *args: The Trainer's.
        ctx: The ``RestartContext`` the training function was called with.
        checkpoint: ``Checkpointer`` keywords (``every_steps``, ``keep``, ``mode`` ...), and
            ``directory`` (default ``<run dir>/ckpt``).
        **kwargs: The Trainer's.

    Raises:
        ValueError: No ``directory`` and the run has no run directory.
    """

    def __init__(
        self,
        *args: Any,
        ctx: RestartContext,
        checkpoint: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        options = dict(checkpoint or {})
        directory = options.pop("directory", None)
        if directory is None:
            if ctx.run_dir is None:
                raise ValueError(
                    "Trainer(ctx=...): this run has no run directory; pass "
                    "checkpoint={'directory': ...} (where the checkpoints go)"
                )
            directory = ctx.run_dir / "ckpt"
        self.unbroken_ctx = ctx
        self.unbroken_directory = Path(directory)
        self.unbroken_options = options
        self.unbroken_checkpointer: Checkpointer | None = None
        self.unbroken_resumed_step: int | None = None
        """The step the last ``train()`` resumed after (None: it started afresh)."""
        self._unbroken_state: dict[str, Any] | None = None
        self._unbroken_shared: dict[str, Any] | None = None
        self.add_callback(_Steps(self))

    # --- the Trainer's resume path ------------------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """The Trainer's ``train``, resumed from unbroken's newest checkpoint when there is one
        and no ``resume_from_checkpoint`` was given."""
        self.unbroken_checkpointer = Checkpointer(self.unbroken_directory, **self.unbroken_options)
        self._unbroken_state = None
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self._unbroken_restore()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _unbroken_restore(self) -> str | None:
        assert self.unbroken_checkpointer is not None
        self.create_optimizer()  # the Trainer keeps an optimizer made before train()
        shared, generators = _Shared(self), _Generators()
        state = {
            "model": self.model,
            "optim": self.optimizer,
            "trainer": shared,
            "rng": PerRank(generators),
        }
        step = self.unbroken_checkpointer.restore(state)
        self.unbroken_resumed_step = step
        if step is None:
            return None
        assert shared.loaded is not None and generators.loaded is not None
        self._unbroken_shared = shared.loaded
        where = self.unbroken_directory / RESUME_DIR / f"rank{self.args.process_index}"
        where.mkdir(parents=True, exist_ok=True)
        (where / transformers.trainer.TRAINER_STATE_NAME).write_text(shared.loaded["trainer_state"])
        name = (
            f"rng_state_{self.args.process_index}.pth"
            if self.args.world_size > 1
            else "rng_state.pth"
        )
        torch.save(generators.loaded, where / name)
        return str(where)

    def _resuming(self, checkpoint: Any) -> bool:
        return (
            self._unbroken_shared is not None
            and checkpoint is not None
            and Path(checkpoint).parent == self.unbroken_directory / RESUME_DIR
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._resuming(resume_from_checkpoint):  # else: restored already
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._resuming(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        assert self._unbroken_shared is not None
        if self.lr_scheduler is not None and self._unbroken_shared["scheduler"] is not None:
            self.lr_scheduler.load_state_dict(self._unbroken_shared["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._resuming(checkpoint):
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        assert self._unbroken_shared is not None
        scaler = self.accelerator.scaler
        if scaler is not None and self._unbroken_shared["scaler"] is not None:
            scaler.load_state_dict(self._unbroken_shared["scaler"])

    # --- each step ----------------------------------------------------------------------------
    def _unbroken_save(self, step: int) -> None:
        ckpt = self.unbroken_checkpointer
        if ckpt is None:
            return
        if self._unbroken_state is None:
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrap
            self._unbroken_state = {
                "model": self.model_wrapped,
                "optim": optimizer,
                "trainer": _Shared(self),
                "rng": PerRank(_Generators()),
            }
        ckpt.maybe_save(step, self._unbroken_state)


def with_unbroken(trainer_class: type) -> type:
    """``trainer_class`` (``transformers.Trainer`` or a subclass) with ``UnbrokenMixin`` before
    it: its ``__init__`` takes ``ctx=`` and ``checkpoint=`` besides its own arguments.

    Args:
        trainer_class: The Trainer class to extend.

    Returns:
        The extended class.

    Raises:
        TypeError: ``trainer_class`` is not a ``transformers.Trainer``.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"with_unbroken: {trainer_class!r} is not a transformers.Trainer class")
    return type(trainer_class.__name__, (UnbrokenMixin, trainer_class), {})


Trainer = with_unbroken(transformers.Trainer)
"""``transformers.Trainer`` with unbroken's checkpoints and resume (``UnbrokenMixin``)."""
