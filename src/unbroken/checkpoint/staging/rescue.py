"""The step a fault interrupted, snapshotted from the live state as the process unwinds.

A snapshot per step costs the training thread a walk over every state tensor and its checks,
and a GPU job a full device-to-host copy per step. A soft
fault does not need one: the process survives it, and the model and optimizers it holds are
still those of the last completed step unless an ``optimizer.step`` ran since. So between
snapshots ``Checkpointer.note`` records each completed step cheaply:

- every state value other than the model and its optimizers (data cursor, RNG, counters) by
  value: its state dict with tensors cloned and lists copied (the RNG capture a good part of
  it);
- the version counter of every model and optimizer tensor the reuse plan holds
  (``reuse.Plan``), and the optimizers' hyperparameters.

When the training function unwinds from a fault in the same process (an exception, the
in-process restart's interrupt, a watchdog's), ``Checkpointer.abort`` snapshots the noted step
from the live model and optimizers and the captured values (``rescue``), but only when nothing
that snapshot would hold changed since the note: the same objects and structure (the plan's
check), every version counter the same (an in-place update bumps it: ``optimizer.step``, an
EMA, a manual ``no_grad`` edit) and equal hyperparameters. Otherwise the last snapshot stays
the newest step. A hard fault (the process killed) restores the last snapshot: at most
``snapshot_every - 1`` steps back.

Never rescued (the last snapshot is used): a model with buffers in its state dict (BatchNorm
updates its running statistics in the forward pass without bumping their version counters),
a step before the state was first resolved (no plan yet: ``maybe_save`` resolves it at its
first step, ``note`` alone at the first save), a state without an ``nn.Module`` and its
optimizers given as such (nothing to plan), or a state value that is neither a tensor, a
mapping nor a Stateful whose state dict is made of tensors, containers and plain values.
Writes through ``.data`` bypass version counters: code doing that between ``optimizer.step``
and the next save must call ``wait_staged`` anyway (``checkpointer``), and should not rely on
a rescue.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from unbroken.checkpoint.state import reuse
from unbroken.checkpoint.state.resolve import PerRank, is_stateful

logger = logging.getLogger(__name__)

_VERSION = operator.attrgetter("_version")
_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None)})


class _Unfreezable(Exception):
    """A value a note cannot capture by value."""


def _freeze(obj: Any) -> Any:
    """``obj`` by value: tensors cloned, containers rebuilt, plain values as they are."""
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, DTensor):
            raise _Unfreezable("a DTensor")
        return obj.detach().clone()
    if kind is list or kind is tuple:
        if set(map(type, obj)) <= _PLAIN:
            return obj if kind is tuple else list(obj)
        return kind(map(_freeze, obj))
    if isinstance(obj, Mapping):
        return {k: _freeze(v) for k, v in obj.items()}
    raise _Unfreezable(f"a {kind.__name__}")


class _Frozen:
    """A Stateful whose state dict is the one captured at a note."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state

    def load_state_dict(self, state: Any) -> None:
        raise RuntimeError("a noted value is only saved, never loaded")


@dataclass
class Note:
    """A completed step that was not snapshotted, and what a rescue needs of it."""

    step: int
    plan: reuse.Plan
    args: tuple[Any, ...]
    state: dict[str, Any]
    """The state to snapshot: the live model and optimizers, the other values frozen."""
    versions: list[int]
    values: list[Any]


def _values(plan: reuse.Plan) -> list[Any]:
    return [v.container.get(v.key) for key in plan.values for v in plan.values[key]]


def _same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        if type(x) is not type(y) or isinstance(x, torch.Tensor) or x != y:
            return False
    return True


def _buffers(plan: reuse.Plan) -> bool:
    """True when a model leaf of ``plan`` is a buffer (not tracked by version counters)."""
    tables = {id(t) for t in plan._tables[1] if t}
    return any(id(leaf.container) in tables for leaf in plan.leaves)


class Notes:
    """One Checkpointer's newest note (``note``) and its rescue (``due``)."""

    def __init__(self) -> None:
        self.note: Note | None = None
        self.refused = ""
        """Why the last note was not taken ("" when it was)."""
        self._checked: tuple[reuse.Plan, bool] | None = None

    def take(
        self, step: int, state: Mapping[str, Any], plan: reuse.Plan | None, args: tuple[Any, ...]
    ) -> bool:
        """Note ``step`` (completed, not staged) of ``state``; False (and ``refused`` says
        why) when it cannot be rescued later."""
        self.note = None
        if plan is None:
            self.refused = "no save has been resolved yet"
            return False
        if self._checked is None or self._checked[0] is not plan:
            self._checked = (plan, _buffers(plan))
        if self._checked[1]:
            self.refused = "the model has buffers (not tracked by version counters)"
            return False
        frozen: dict[str, Any] = {}
        try:
            for key, value in state.items():
                if key in plan.objects:
                    frozen[key] = value
                    continue
                inner = value.obj if isinstance(value, PerRank) else value
                if hasattr(inner, "note_state"):  # its own copy for notes (the generators)
                    held = _Frozen(inner.note_state())
                elif is_stateful(inner):
                    held = _Frozen(_freeze(inner.state_dict()))
                else:
                    held = _freeze(inner)
                frozen[key] = PerRank(held) if isinstance(value, PerRank) else held
        except _Unfreezable as e:
            self.refused = f"state value {key!r} holds {e}"
            return False
        self.note = Note(
            step=step,
            plan=plan,
            args=args,
            state=frozen,
            versions=list(map(_VERSION, plan._locals)),
            values=_values(plan),
        )
        self.refused = ""
        return True

    def due(self, last_staged: int | None, plan: reuse.Plan | None) -> Note | None:
        """The note to snapshot now: newer than ``last_staged`` and nothing it holds changed
        since (same plan, structure, version counters and hyperparameters); else None."""
        note = self.note
        if note is None or (last_staged is not None and note.step <= last_staged):
            return None
        if plan is not note.plan or not plan.check(note.state, note.args):
            return None
        if list(map(_VERSION, plan._locals)) != note.versions:
            return None
        if not _same(_values(plan), note.values):
            return None
        return note

    def rescue(
        self,
        last_staged: int | None,
        plan: reuse.Plan | None,
        stage: Callable[..., Any],
        wait: Callable[[], None],
    ) -> int | None:
        """Snapshot the ``due`` note with ``stage(step, state, durable=False)`` and ``wait``
        for its copy; its step, or None (nothing due, or the snapshot failed: logged, since
        the caller is unwinding from a fault already and the last snapshot stays)."""
        try:
            note = self.due(last_staged, plan)
            if note is None:
                return None
            stage(note.step, note.state, durable=False)
            wait()
        except Exception:
            logger.exception("rescuing the noted step to memory")
            return None
        logger.info("step %d rescued to memory from the live state", note.step)
        return note.step
