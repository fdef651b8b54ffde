"""A fresh optimizer's state made from what a snapshot holds, without DCP's zero-grad step.

``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` first give an optimizer without
state its state by running ``step()`` on zero gradients (``_init_optim_state``), so that the
state dict has tensors to load into. In a new process (a launcher restart) that step is most
of a restore for a model under FSDP2, nearly all of it DTensor dispatch. The snapshot already names every state value
(``<key>.state.<fqn>.<name>``) with its dtype and shape, so ``template`` allocates those
tensors directly (each a DTensor laid out like its parameter where the parameter is one), the
memory tier copies the snapshot into them, and ``load`` hands them to the optimizer with
``Optimizer.load_state_dict``, the call DCP ends with too. Same bytes, same types, same
devices: ``load_state_dict`` puts each value where DCP's path puts it.

In a new process that memory is fresh: its first touch (a page fault for each 4 KiB page)
was most of the copy. ``Pool`` is fresh CPU memory faulted in ahead of the restore (on a
thread, while the new process builds its model: ``tiers``), that ``template`` carves the CPU
state tensors from: one storage per tensor all the same (``torch.save`` of one writes only
its bytes), private anonymous memory that lives as long as its tensors do (left out of a
child forked before the restore ends, such as the checkpoint writer). ``spare_bytes`` is the
size a pool needs for what a snapshot holds; ``Pool.fill`` copies a snapshot's state
ahead into the places its tensors will be carved from, each tagged with the slot it came
from, so that the restore's copy skips them (``memory.Pending.apply``).

Where this cannot be sure of the state's shape ``template`` returns None and DCP's path runs:
an optimizer that has state or gradients already, FSDP1 (its flat parameters rename the
state), a state value nested deeper than ``<fqn>.<name>`` or under a name that is no parameter
of the live model, and, for DTensor parameters, an optimizer outside ``torch.optim`` or a
state tensor that is neither a scalar nor shaped like its parameter's shard.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import logging
import math
import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as _sd
from torch.distributed.tensor import DTensor

from unbroken.checkpoint.state import naming

logger = logging.getLogger(__name__)

STATE, GROUPS, PARAMS = "state", "param_groups", "params"
_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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


def spare_bytes(saved: Saved) -> int:
    """Bytes of ``Pool`` the fresh optimizer state of ``saved`` (a snapshot) takes: every
    non-scalar tensor under an ``<key>.state.`` prefix (an upper bound: another key may hold
    such a name)."""
    return sum(
        _aligned(dtype.itemsize * math.prod(shape))
        for flat, (dtype, shape) in saved.tensors.items()
        if shape and f".{STATE}." in flat
    )


class Pool:
    """``size`` bytes of private anonymous memory that ``_allocate`` carves fresh CPU state
    tensors from (see the module docstring); ``fault_in`` touches its pages."""

    def __init__(self, size: int) -> None:
        self.size = size
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._mm: mmap.mmap | None = mmap.mmap(-1, max(size, mmap.PAGESIZE), flags=flags)
        # Not in a child forked meanwhile (the checkpoint writer, forked while this is filled):
        # it would share the pages copy-on-write, and each write here would copy one.
        self._mm.madvise(mmap.MADV_DONTFORK)
        self.used = 0
        self.carved = 0
        """Tensors carved so far."""
        self._base = torch.frombuffer(self._mm, dtype=torch.uint8).data_ptr()
        self._filled: dict[int, Any] = {}
        """Offset -> the tag of what ``fill`` copied there."""

    def fault_in(self) -> None:
        """Fault every page in (a write of one byte each; the GIL is released meanwhile)."""
        if self._mm is not None:
            torch.frombuffer(self._mm, dtype=torch.uint8)[:: mmap.PAGESIZE].fill_(0)

    def fill(self, sources: list[tuple[Any, torch.Tensor]]) -> None:
        """Copy each ``(tag, tensor)`` to where ``take`` will carve a tensor of its shape
        when asked in this order (the GIL is released while it copies); ``tag_of`` tells."""
        offset, dsts, srcs = 0, [], []
        assert self._mm is not None
        for tag, src in sources:
            nbytes = src.numel() * src.element_size()
            if not nbytes or offset + nbytes > self.size:
                break
            dst = torch.frombuffer(self._mm, dtype=src.dtype, count=src.numel(), offset=offset)
            dsts.append(dst.view(src.shape))
            srcs.append(src)
            self._filled[offset] = tag
            offset = _aligned(offset + nbytes)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def tag_of(self, t: torch.Tensor) -> Any:
        """The tag ``fill`` copied into the place ``t`` was carved from, or None."""
        return self._filled.get(t.data_ptr() - self._base)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized CPU tensor of ``shape`` in the pool (its own storage), or None
        when it does not fit what is left."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if self._mm is None or not nbytes or self.used + nbytes > self.size:
            return None
        t = torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=self.used).view(shape)
        self.used = _aligned(self.used + nbytes)
        self.carved += 1
        return t

    def close(self) -> None:
        """Give back the pages nothing was carved from; the mapping lives on while a tensor
        carved from it does. Idempotent."""
        if self._mm is None:
            return
        start = (self.used + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        if start < len(self._mm):
            self._mm.madvise(mmap.MADV_DONTNEED, start, len(self._mm) - start)
        self._mm.madvise(mmap.MADV_DOFORK)  # from now on the state forks like any memory
        self._mm = None  # unmapped once the last carved tensor is gone


_pool: contextvars.ContextVar[Pool | None] = contextvars.ContextVar("freshopt_pool", default=None)


@contextlib.contextmanager
def carving(pool: Pool | None) -> Iterator[None]:
    """Within this, ``template`` takes CPU state tensors from ``pool`` while they fit."""
    token = _pool.set(pool)
    try:
        yield
    finally:
        _pool.reset(token)


def _fqns(model: nn.Module, optim: torch.optim.Optimizer) -> list[str] | None:
    """The FQN of each of ``optim``'s parameters, in its order; None when one has none or
    several (a parameter outside ``model``, shared parameters)."""
    names: dict[int, str] = {}
    known = naming.names(model)  # without DCP's walk per name where the names are the FQNs
    for name, p in model.named_parameters(remove_duplicate=False):
        fqns = {known[name]} if known is not None else _sd._get_fqns(model, name)
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
    shard = _shard(p)
    return shard.device if tuple(shard.shape if local else p.shape) == shape else None


def _allocate(wants: list[tuple[torch.Tensor, torch.dtype, tuple[int, ...]]]) -> list[Any]:
    """Uninitialized tensors for ``(parameter, dtype, shape)`` (shapes checked by
    ``_device``), each a DTensor laid out like its parameter where that is one and the state
    is not a scalar."""
    out = []
    pool = _pool.get()
    for p, dtype, shape in wants:
        if isinstance(p, DTensor) and shape:
            shape = tuple(_shard(p).shape)
        device = _device(p, shape, True)
        t = None
        if pool is not None and shape and device is not None and device.type == "cpu":
            t = pool.take(shape, dtype)
        if t is None:
            t = torch.empty(shape, dtype=dtype, device=device)
        if isinstance(p, DTensor) and shape:
            t = _like(p, t)
        out.append(t)
    return out


def _shard(p: DTensor) -> torch.Tensor:
    """``p``'s local shard (without ``to_local``'s autograd function)."""
    local = getattr(p, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else p.to_local()


def _like(p: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor of ``local`` laid out like ``p``: ``p``'s spec where the dtypes match (what
    ``from_local`` would make, without its autograd function's cost per tensor), else
    ``from_local``."""
    spec = p._spec
    if spec.tensor_meta is not None and spec.tensor_meta.dtype == local.dtype:
        return DTensor(local, spec, requires_grad=False)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


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
    if not _load_as_is(optim, state, groups):
        optim.load_state_dict({STATE: state, GROUPS: groups})


def _load_as_is(
    optim: torch.optim.Optimizer, state: dict[int, Any], groups: list[dict[str, Any]]
) -> bool:
    """What ``Optimizer.load_state_dict`` does when its casts change nothing (every state
    tensor already of its parameter's dtype and device, as ``template`` makes them), without
    their per-tensor dispatch (most of the load for DTensors); False, doing nothing, where
    it could differ: load hooks, a value that is no tensor of that kind, fused or
    capturable groups (their ``step`` is moved)."""
    if optim._optimizer_load_state_dict_pre_hooks or optim._optimizer_load_state_dict_post_hooks:
        return False
    if any(g.get("fused") or g.get("capturable") for g in groups):
        return False
    params = [p for g in optim.param_groups for p in g[PARAMS]]
    if len(params) != sum(len(g[PARAMS]) for g in groups):
        return False
    live: dict[Any, dict[str, Any]] = {}
    for i, values in state.items():
        p = params[i] if isinstance(i, int) and 0 <= i < len(params) else None
        if p is None or not isinstance(values, dict):
            return False
        for name, v in values.items():
            if name == "step":
                continue
            if not isinstance(v, torch.Tensor) or v.device != p.device:
                return False
            if p.is_floating_point() and v.dtype != p.dtype:
                return False
        live[p] = dict(values)
    new_groups = []
    for g, ng in zip(optim.param_groups, copy.deepcopy(groups), strict=True):
        ng[PARAMS] = g[PARAMS]
        if "param_names" in g and "param_names" not in ng:
            ng["param_names"] = g["param_names"]
        new_groups.append(ng)
    optim.__setstate__({STATE: collections.defaultdict(dict, live), GROUPS: new_groups})
    return True
