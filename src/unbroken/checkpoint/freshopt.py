"""A fresh optimizer's state made from what a snapshot holds, without DCP's zero-grad step.

``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` first give an optimizer without
state its state by running ``step()`` on zero gradients (``_init_optim_state``), so that the
state dict has tensors to load into. In a new process (a launcher restart) that step is most
of a restore: 0.3 s of the ~0.4 s for the 22M-parameter reference model under FSDP2, nearly
all of it DTensor dispatch. The snapshot already names every state value
(``<key>.state.<fqn>.<name>``) with its dtype and shape, so ``template`` allocates those
tensors directly (each a DTensor laid out like its parameter where the parameter is one), the
memory tier copies the snapshot into them, and ``load`` hands them to the optimizer with
``Optimizer.load_state_dict``, the call DCP ends with too. Same bytes, same types, same
devices: ``load_state_dict`` puts each value where DCP's path puts it.

Where this cannot be sure of the state's shape ``template`` returns None and DCP's path runs:
an optimizer that has state or gradients already, FSDP1 (its flat parameters rename the
state), a state value nested deeper than ``<fqn>.<name>`` or under a name that is no parameter
of the live model, and, for DTensor parameters, an optimizer outside ``torch.optim`` or a
state tensor that is neither a scalar nor shaped like its parameter's shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as _sd
from torch.distributed.tensor import DTensor

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


@dataclass(frozen=True)
class Saved:
    """What a snapshot holds, by flat key."""

    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    """Tensor items: dtype and shape (see ``local``)."""
    values: tuple[str, ...]
    """Non-tensor items (both in the order they were saved)."""
    local: bool = True
    """The shapes are this rank's (a DTensor's local shard's: a snapshot), else the global
    ones (a checkpoint on disk)."""


def _fqns(model: nn.Module, optim: torch.optim.Optimizer) -> list[str] | None:
    """The FQN of each of ``optim``'s parameters, in its order; None when one has none or
    several (a parameter outside ``model``, shared parameters)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqns = _sd._get_fqns(model, name)
        if len(fqns) != 1 or id(p) in names:
            return None
        names[id(p)] = next(iter(fqns))
    try:
        return [names[id(p)] for g in optim.param_groups for p in g[PARAMS]]
    except KeyError:
        return None


def _fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _device(p: torch.Tensor, shape: tuple[int, ...], local: bool) -> torch.device | None:
    """Where the state tensor of ``shape`` for parameter ``p`` goes: a scalar (``step``) on
    CPU as torch.optim makes it, others with the parameter (its shard); None when the layout
    cannot be told from the shape (a DTensor's state not shaped like it)."""
    if not shape:
        return torch.device("cpu")
    if not isinstance(p, DTensor):
        return p.device
    shard = p.to_local()
    return shard.device if tuple(shard.shape if local else p.shape) == shape else None


def _allocate(wants: list[tuple[torch.Tensor, torch.dtype, tuple[int, ...]]]) -> list[Any]:
    """Uninitialized tensors for ``(parameter, dtype, shape)`` (shapes checked by
    ``_device``), each a DTensor laid out like its parameter where that is one and the state
    is not a scalar."""
    out = []
    for p, dtype, shape in wants:
        if isinstance(p, DTensor) and shape:
            shape = tuple(p.to_local().shape)
        t = torch.empty(shape, dtype=dtype, device=_device(p, shape, True))
        if isinstance(p, DTensor) and shape:
            t = DTensor.from_local(
                t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        out.append(t)
    return out


def template(
    model: nn.Module, optim: torch.optim.Optimizer, *, key: str, saved: Saved
) -> dict[str, Any] | None:
    """``optim``'s state dict as ``get_optimizer_state_dict`` would give it after creating
    the state (FQN keys), with fresh uninitialized tensors for what ``saved`` holds under
    ``key``; None where DCP's path must run (see the module's docstring)."""
    params = [p for g in optim.param_groups for p in g[PARAMS]]
    if optim.state or any(p.grad is not None for p in params) or _fsdp1(model):
        return None
    fqns = _fqns(model, optim)
    if fqns is None:
        return None
    sharded = any(isinstance(p, DTensor) for p in params)
    if sharded and not type(optim).__module__.startswith("torch.optim."):
        return None
    by_fqn = dict(zip(fqns, params, strict=True))
    prefix = f"{key}.{STATE}."
    state: dict[str, dict[str, Any]] = {}
    wants, where = [], []
    for flat in (k for k in (*saved.tensors, *saved.values) if k.startswith(prefix)):
        fqn, _, name = flat[len(prefix) :].rpartition(".")
        p = by_fqn.get(fqn)
        if p is None:  # nested deeper, or a parameter this optimizer does not hold
            return None
        state.setdefault(fqn, {})[name] = None  # a non-tensor value: the snapshot's replaces it
        if flat in saved.tensors:
            dtype, shape = saved.tensors[flat]
            if _device(p, shape, saved.local) is None:
                return None
            wants.append((p, dtype, shape))
            where.append((fqn, name))
    for (fqn, name), t in zip(where, _allocate(wants), strict=True):
        state[fqn][name] = t
    ordered = {f: state[f] for f in fqns if f in state}
    groups = []
    it = iter(fqns)
    for g in optim.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != PARAMS}, PARAMS: []})
        groups[-1][PARAMS] = [next(it) for _ in g[PARAMS]]
    return {STATE: ordered, GROUPS: groups}


def templates(
    model: tuple[str, nn.Module] | None,
    optims: list[tuple[str, torch.optim.Optimizer]],
    saved: Saved | None,
) -> dict[str, Any]:
    """``template`` of each optimizer where it applies, by key."""
    made = {}
    for key, optim in optims if model is not None and saved is not None else ():
        assert model is not None and saved is not None
        sd = template(model[1], optim, key=key, saved=saved)
        if sd is not None:
            made[key] = sd
    return made


def load(model: nn.Module, optim: torch.optim.Optimizer, loaded: Mapping[str, Any]) -> None:
    """Give ``optim`` the state of a ``template`` filled in. Loaded groups that list the
    parameters in another order go through DCP's ``set_optimizer_state_dict``, which maps
    them by name."""
    fqns = _fqns(model, optim)
    assert fqns is not None  # template checked it
    index = {f: i for i, f in enumerate(fqns)}
    groups = []
    it = iter(fqns)
    for g, live in zip(loaded[GROUPS], optim.param_groups, strict=True):
        want = [next(it) for _ in live[PARAMS]]
        if list(g[PARAMS]) != want:
            _sd.set_optimizer_state_dict(model, optim, dict(loaded))
            return
        groups.append({**g, PARAMS: [index[f] for f in want]})
    state = {index[f]: v for f, v in loaded[STATE].items()}
    optim.load_state_dict({STATE: state, GROUPS: groups})
