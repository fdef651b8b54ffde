"""Hugging Face Accelerate: what ``Accelerator.save_state`` saves, as a Checkpointer's state.

An Accelerate script keeps its own loop, so it adopts unbroken as any loop does
(``unbroken.main``, ``ctx.step_done``, a ``Checkpointer``); ``state_of(accelerator)`` is the
state to hand the Checkpointer, in place of ``save_state``/``load_state``: every model,
optimizer and LR scheduler the accelerator prepared, the objects registered with
``register_for_checkpointing``, its gradient-accumulation step and mixed-precision scaler, and
each prepared data loader that can say where it is (``state_dict``, as Accelerate's
``use_stateful_dataloader`` loaders), per rank. The Checkpointer adds the random generators, as
``save_state`` does. Saves are asynchronous and go to the memory tier; ``resume`` restores from
memory after an in-process restart.

Call it after ``prepare`` (it reads what was prepared) and before ``resume``. Under
``unbroken.main`` the process group exists before ``Accelerator()``: Accelerate finds it formed
and uses it, and after an in-process restart the training function builds a new
``Accelerator`` whose ``prepare`` wraps the new model for the new group. Accelerate keeps its
ranks in a process-wide singleton (``PartialState``): a restart that reassigns ranks needs the
launcher's path. DeepSpeed and Megatron-LM engines save themselves; they are not supported.

Reads the accelerator's lists of prepared objects, as ``save_state`` does.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from unbroken.checkpoint import PerRank

__all__ = ["AcceleratorCounters", "state_of"]


class AcceleratorCounters:
    """The accelerator's own counters as a ``Stateful``: its gradient-accumulation step and
    its mixed-precision scaler's state."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        scaler = acc.scaler.state_dict() if acc.scaler is not None else {}
        return {"step": acc.step, "scaler": scaler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        acc = self.accelerator
        acc.step = int(state["step"])
        if acc.scaler is not None and state.get("scaler"):
            acc.scaler.load_state_dict(state["scaler"])


def state_of(accelerator: Accelerator) -> dict[str, Any]:
    """The state of a prepared ``Accelerator``, for ``Checkpointer.resume``/``maybe_save``.

    Args:
        accelerator: The script's accelerator, after ``prepare``.

    Returns:
        Name -> object: ``model``, ``optim<i>``, ``scheduler<i>``, ``custom<i>``,
        ``loader<i>`` (per rank) and ``accelerator`` (its counters).

    Raises:
        ValueError: No model or several were prepared (the Checkpointer names optimizer state
            by one module's parameters), or the accelerator runs DeepSpeed or Megatron-LM
            (their engines checkpoint themselves).
    """
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"state_of: {accelerator.distributed_type} engines save their own state; use "
            "accelerator.save_state/load_state there"
        )
    models = list(accelerator._models)
    if len(models) != 1:
        raise ValueError(
            f"state_of: the accelerator prepared {len(models)} models; it takes one (call "
            "accelerator.prepare(model, optimizer, ...) first; several models: one nn.Module "
            "holding them, e.g. nn.ModuleDict, prepared once)"
        )
    state: dict[str, Any] = {"model": models[0]}
    for i, optimizer in enumerate(accelerator._optimizers):
        state[f"optim{i}"] = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer
    for i, scheduler in enumerate(accelerator._schedulers):
        state[f"scheduler{i}"] = scheduler
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom{i}"] = obj
    for i, loader in enumerate(accelerator._dataloaders):
        if callable(getattr(loader, "state_dict", None)) and hasattr(loader, "load_state_dict"):
            state[f"loader{i}"] = PerRank(loader)
    state["accelerator"] = AcceleratorCounters(accelerator)
    return state
