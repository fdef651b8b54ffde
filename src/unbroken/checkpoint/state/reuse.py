"""The resolved items of a model and its optimizers, reused from one save to the next.

Resolving a state (``resolve.resolve_for_save``) walks every state dict, flattens it, looks up
each leaf's write items and balances the replicated ones over the ranks: for a small model,
most of a per-step snapshot's blocking time. Between two saves
of a training loop none of that changes for the model and its optimizers: the same parameter,
buffer and optimizer-state tensors are updated in place. A ``Plan`` records, once, where each
of their leaves lives in the live objects (a module's ``_parameters``/``_buffers`` table, an
optimizer's ``state[param]`` dict or a ``param_groups`` dict) and the items resolved for it;
a later save checks that every leaf is still the same tensor object with the same storage,
shape and dtype, and that no module, parameter, buffer, optimizer state or parameter group
was added, removed or replaced, and then reuses the items (a check costs a small fraction of
a resolve). Non-tensor leaves (a
learning rate) are read afresh and re-serialized when they changed. Any check that fails
makes the caller resolve from scratch and learn a new plan.

Nothing here imports the rest of ``unbroken.checkpoint``; items are opaque to it.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

_MISSING = object()
_TABLES = tuple(map(operator.attrgetter, ("_parameters", "_buffers", "_modules")))
_LOCAL = operator.attrgetter("_local_tensor")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def _same(containers: list[dict[Any, Any]], keys: list[Any], objs: list[Any]) -> bool:
    """Every ``containers[i][keys[i]]`` is still ``objs[i]`` (one C-level pass: the
    containers are dicts, or dict subclasses that keep ``dict.get``)."""
    found = map(dict.get, containers, keys, itertools.repeat(_MISSING))
    return all(map(operator.is_, found, objs))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (as ``resolve.local_shard``), else the tensor itself."""
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


_PLAIN = frozenset({int, float, bool, str, bytes, type(None)})


def flatten(nested: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's ``flatten_state_dict`` (mappings walked, a list only when it holds a tensor, a
    mapping or such a list; other values are leaves), faster on a long list of plain values
    such as a loss curve: DCP tests each entry in Python."""
    if _version._derived_version == "2_3":  # DCP's older traversal: its own code
        return flatten_state_dict(dict(nested))
    flat: dict[str, Any] = {}
    mappings: dict[str, Any] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list) or set(map(type, value)) <= _PLAIN:
            return True
        for entry in value:
            if isinstance(entry, (Mapping, list)) and not terminal(entry):
                return False
            if isinstance(entry, torch.Tensor):
                return False
        return True

    def visit(path: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif terminal(value):
            fqn = ".".join(map(str, path))
            if fqn in flat:
                raise ValueError(f"duplicated flatten key {fqn}")
            flat[fqn] = value
            mappings[fqn] = path
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit((*path, i), v)

    for key, value in nested.items():
        visit((str(key),), value)
    return flat, mappings


@dataclass
class Leaf:
    """One tensor leaf: where it lives (``container[key]``) and what it was."""

    container: Any
    """A dict (a module's tables, a param group), or ``(optimizer, param)`` for its state."""
    key: Any
    obj: torch.Tensor
    local: torch.Tensor
    ptr: int
    shape: torch.Size
    dtype: torch.dtype


@dataclass
class Value:
    """One non-tensor leaf, read afresh every save."""

    container: Any
    key: Any
    fqn: str
    position: int
    """Index of its item in the plan's item list."""


@dataclass
class Plan:
    """The items of the model and optimizer keys of one state, and how to check them."""

    args: tuple[Any, ...]
    """(rank, world size, overlap, stage_all, the state's keys and their roles)."""
    objects: dict[str, Any]
    """key -> the model or optimizer object it held."""
    segments: dict[str, list[Any]] = field(default_factory=dict)
    """key -> its items, in flat order."""
    mappings: dict[str, Any] = field(default_factory=dict)
    """The flatten mapping of these keys' leaves."""
    assigned: list[Any] = field(default_factory=list)
    optims: list[tuple[Any, ...]] = field(default_factory=list)
    """Every optimizer: its state, the state's size, its param groups (dict, ids, size)."""
    states: tuple[list[Any], ...] = field(default_factory=lambda: ([], [], [], []))
    """Columns: an optimizer's state, a parameter, its state dict, the dict's size."""
    leaves: list[Leaf] = field(default_factory=list)
    # The checks, column by column: each one C-level ``map`` over a list.
    _containers: list[dict[Any, Any]] = field(default_factory=list)
    _keys: list[Any] = field(default_factory=list)
    _objs: list[torch.Tensor] = field(default_factory=list)
    _locals: list[torch.Tensor] = field(default_factory=list)
    _ptrs: list[int] = field(default_factory=list)
    _shapes: list[torch.Size] = field(default_factory=list)
    _dtypes: list[torch.dtype] = field(default_factory=list)
    """Storage address, shape and dtype of every leaf's local tensor."""
    _dtensors: tuple[list[torch.Tensor], list[torch.Tensor]] = field(
        default_factory=lambda: ([], [])
    )
    _modules: list[nn.Module] = field(default_factory=list)
    _tables: tuple[list[Any], list[Any], list[Any]] = field(default_factory=lambda: ([], [], []))
    """Every module's ``_parameters``, ``_buffers`` and ``_modules``."""
    _sizes: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))
    _children: tuple[list[Any], list[Any], list[Any]] = field(default_factory=lambda: ([], [], []))
    """Every child: the ``_modules`` table it is in, its name, the child."""
    values: dict[str, list[Value]] = field(default_factory=dict)
    """key -> its non-tensor leaves."""

    def check(self, state: Mapping[str, Any], args: tuple[Any, ...]) -> bool:
        """True when every recorded leaf and structure is unchanged."""
        if args != self.args:
            return False
        for key, obj in self.objects.items():
            if state[key] is not obj:
                return False
        mods, tables, sizes = self._modules, self._tables, self._sizes
        for table, get in zip(tables, _TABLES, strict=True):
            if not all(map(operator.is_, map(get, mods), table)):
                return False
        if [list(map(len, table)) for table in tables] != list(sizes):
            return False
        if not _same(*self._children):
            return False
        for optim, opt_state, n, groups in self.optims:
            if optim.state is not opt_state or len(opt_state) != n:
                return False
            if len(optim.param_groups) != len(groups):
                return False
            for live, (group, ids, size) in zip(optim.param_groups, groups, strict=True):
                if live is not group or len(group) != size or list(map(id, group["params"])) != ids:
                    return False
        where, params, dicts, lengths = self.states
        if not _same(where, params, dicts) or list(map(len, dicts)) != lengths:
            return False
        if not _same(self._containers, self._keys, self._objs):
            return False
        dtensors = self._dtensors
        try:
            if not all(map(operator.is_, map(_LOCAL, dtensors[0]), dtensors[1])):
                return False
        except AttributeError:  # no longer a DTensor with a local shard
            return False
        live = self._locals
        return (
            list(map(torch.Tensor.data_ptr, live)) == self._ptrs
            and list(map(_SHAPE, live)) == self._shapes
            and list(map(_DTYPE, live)) == self._dtypes
        )

    def add(self, leaf: Leaf) -> None:
        """Check ``leaf`` from now on."""
        self.leaves.append(leaf)
        self._containers.append(leaf.container)
        self._keys.append(leaf.key)
        self._objs.append(leaf.obj)
        self._locals.append(leaf.local)
        self._ptrs.append(leaf.ptr)
        self._shapes.append(leaf.shape)
        self._dtypes.append(leaf.dtype)
        if leaf.local is not leaf.obj:
            self._dtensors[0].append(leaf.obj)
            self._dtensors[1].append(leaf.local)

    def add_module(self, module: nn.Module) -> None:
        """Check from now on that ``module``'s parameters, buffers and children stay."""
        self._modules.append(module)
        for table, sizes, get in zip(self._tables, self._sizes, _TABLES, strict=True):
            table.append(get(module))
            sizes.append(len(get(module)))
        for name, child in module._modules.items():
            self._children[0].append(module._modules)
            self._children[1].append(name)
            self._children[2].append(child)

    def items(self, key: str, serialize: Callable[[str, Any], bytes]) -> list[Any] | None:
        """The items of ``key`` with its non-tensor values read afresh (after ``check``);
        None when one of them is no longer a plain value."""
        items = self.segments[key]
        values = self.values.get(key)
        if not values:
            return items
        items = list(items)
        for v in values:
            obj = v.container.get(v.key, _MISSING)
            if obj is _MISSING or isinstance(obj, torch.Tensor):
                return None
            item = items[v.position]
            payload = serialize(v.fqn, obj)
            if payload is not item.payload:
                items[v.position] = type(item)(item.write_item, payload=payload)
        return items


def build(
    plan: Plan,
    key: str,
    flat: Mapping[str, Any],
    items: list[Any],
    mappings: Mapping[str, Any],
    *,
    model: nn.Module | None = None,
    model_map: Mapping[str, tuple[dict[str, Any], str]] | None = None,
    optim: torch.optim.Optimizer | None = None,
    optim_map: Mapping[int, str] | None = None,
) -> bool:
    """Add the segment of ``key`` (a model with its learned ``model_map``, or an optimizer
    with its ``optim_map``) to ``plan``: ``flat`` holds its leaves, ``items`` what was resolved
    for them. False when a leaf lies where no plan can find it."""
    by_param: dict[str, Any] = {}
    if model is not None:
        for module in model.modules():
            plan.add_module(module)
    if optim is not None:
        assert optim_map is not None
        if not isinstance(optim.state, dict) or type(optim.state).get is not dict.get:
            return False  # the checks read it with dict.get
        groups = [(g, list(map(id, g["params"])), len(g)) for g in optim.param_groups]
        plan.optims.append((optim, optim.state, len(optim.state), groups))
        params = [p for g in optim.param_groups for p in g["params"]]
        by_param = {fqn: params[i] for i, fqn in optim_map.items()}
    where: dict[str, tuple[Any, Any]] = {}
    seen: set[int] = set()
    for fqn, obj in flat.items():
        path = mappings[fqn]
        if model_map is not None and len(path) == 2 and path[1] in model_map:
            where[fqn] = model_map[path[1]]
        elif optim is not None and len(path) == 4 and path[1] == "state" and path[2] in by_param:
            param = by_param[path[2]]
            container = optim.state.get(param)
            if container is None:
                return False
            if id(container) not in seen:  # one check per parameter, not per state value
                seen.add(id(container))
                for column, value in zip(
                    plan.states, (optim.state, param, container, len(container)), strict=True
                ):
                    column.append(value)
            where[fqn] = (container, path[3])
        elif optim is not None and len(path) == 4 and path[1] == "param_groups":
            where[fqn] = (optim.param_groups[path[2]], path[3])
        else:
            return False
        if isinstance(obj, torch.Tensor):
            found = leaf(*where[fqn])
            if found is None or found.ptr != _local(obj).data_ptr():
                return False
            plan.add(found)
            where[fqn] = (found, None)
    values: list[Value] = []
    segment = []
    for position, item in enumerate(items):
        fqn = item.write_item.index.fqn
        container, name = where[fqn]
        if item.tensor is not None:
            local = container.local
            item = type(item)(
                item.write_item, tensor=local, background=item.background, persist=item.persist
            )
        elif name != "params":  # a group's params are fixed while the checks hold
            values.append(Value(container, name, fqn, position))
        segment.append(item)
    plan.segments[key] = segment
    plan.values[key] = values
    plan.mappings.update({fqn: mappings[fqn] for fqn in flat})
    return True


def leaf(container: Any, key: Any) -> Leaf | None:
    """A ``Leaf`` for the tensor at ``container[key]``, or None when it is no tensor."""
    if not isinstance(container, dict) or type(container).get is not dict.get:
        return None  # the checks read it with dict.get
    obj = container.get(key, _MISSING)
    if not isinstance(obj, torch.Tensor):
        return None
    local = _local(obj)
    return Leaf(container, key, obj, local, local.data_ptr(), local.shape, local.dtype)
