"""Turn a user's state into DCP write items on the trainer, and back into live objects on load.

A state is a dict whose values are an ``nn.Module`` (FSDP2, DDP or plain), ``Optimizer``s of
that module, ``Stateful`` objects (``state_dict``/``load_state_dict``), tensors, dicts of those,
or ``PerRank(...)`` of any of these. Models and optimizers go through
``torch.distributed.checkpoint.state_dict`` with sharded state dicts, so a DTensor is saved as
this rank's shard and reshards on load.

Who writes what, decided without a collective: a DTensor shard, the rank that holds it; a
plain tensor of a model or optimizer (DDP, unsharded, an optimizer's ``step``), the same on
every rank, exactly one rank, chosen by a deterministic balance over the sorted item list
every rank computes alike; anything else (extra state, non-tensor values), every rank that
has it, the metadata pointing to the lowest rank's copy (DCP's rule: one key, one value).
Values that differ per rank go in ``PerRank``: saved under ``<key>.rank<R>`` and restored
into the same rank when the world size matches, skipped otherwise.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from unbroken.checkpoint.state import freshopt, naming, reuse
from unbroken.checkpoint.state.savecache import Later, ResolveCache, serialize

logger = logging.getLogger(__name__)


class PerRank:
    """Marks a state value that differs per rank (RNG state, a rank's data cursor).

    Saved under ``<key>.rank<R>``; restored into rank R when the checkpoint has that key.

    Args:
        obj: The value: a Stateful, a mapping or a tensor, as a state value may be.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` is a ``Stateful`` (DCP's protocol), by duck typing.

    Args:
        obj: any value of a state.

    Returns:
        True when it has callable ``state_dict`` and ``load_state_dict``.
    """
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


@dataclass
class StageItem:
    """One write item of this rank and where its data comes from."""

    write_item: WriteItem
    tensor: torch.Tensor | None = None
    """The local data to copy into staging (tensor items)."""
    payload: bytes | None = None
    """The serialized value (BYTE_IO items), made at ``save`` time."""
    background: bool = False
    """May be copied after ``save`` returns (only changed by ``optimizer.step``)."""
    persist: bool = True
    """Written by this rank's writer; False for a replicated tensor another rank writes,
    staged only for the memory tier (``stage_all``)."""
    pending: Later | None = None
    """Makes ``payload`` when called (``resolve_for_save(defer=True)``; see ``finish``)."""

    def finish(self) -> None:
        """Make the payload left for later, if any."""
        if self.pending is not None:
            self.payload, self.pending = self.pending(), None

    # Cached: an item is made anew whenever its tensor or payload changes (``reuse``).
    @functools.cached_property
    def nbytes(self) -> int:
        if self.tensor is not None:
            return self.tensor.numel() * self.tensor.element_size()
        if self.pending is not None:
            return self.pending.estimate
        return len(self.payload or b"")

    @functools.cached_property
    def layout(self) -> tuple[Any, ...]:
        """What a tensor item's place in the staging layout depends on."""
        assert self.tensor is not None
        index = self.write_item.index
        return (index.fqn, tuple(index.offset or ()), self.tensor.dtype, tuple(self.tensor.shape))


@dataclass
class ResolvedState:
    """What this rank writes for one save."""

    items: list[StageItem]
    assigned: list[MetadataIndex] = field(default_factory=list)
    """Replicated items this rank holds, whichever rank was chosen to write them."""
    planner_data: dict[str, Any] = field(default_factory=dict)
    """DCP's flatten mapping (flat key -> path in the nested state)."""

    @property
    def tensor_bytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.tensor is not None)


@dataclass
class _Parts:
    """The user's state split by kind (shared by save and load)."""

    model: tuple[str, nn.Module] | None = None
    optims: list[tuple[str, torch.optim.Optimizer]] = field(default_factory=list)
    per_rank: set[str] = field(default_factory=set)


def _split(state: Mapping[str, Any]) -> _Parts:
    if not isinstance(state, Mapping) or not state:
        raise ValueError(
            f"state must be a non-empty dict of name -> model/optimizer/Stateful/tensor, "
            f"got {type(state).__name__}"
        )
    parts = _Parts()
    modules = []
    for key, value in state.items():
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"state keys must be non-empty strings without '.', got {key!r}")
        inner = value.obj if isinstance(value, PerRank) else value
        if isinstance(value, PerRank):
            if isinstance(inner, (nn.Module, torch.optim.Optimizer)):
                raise ValueError(f"state[{key!r}]: a model or optimizer cannot be PerRank")
            parts.per_rank.add(key)
        if isinstance(inner, nn.Module):
            modules.append((key, inner))
        elif isinstance(inner, torch.optim.Optimizer):
            parts.optims.append((key, inner))
        elif not (is_stateful(inner) or isinstance(inner, (torch.Tensor, Mapping))):
            raise ValueError(
                f"state[{key!r}] is a {type(inner).__name__}; expected an nn.Module, an "
                "Optimizer, a Stateful (state_dict/load_state_dict), a tensor or a dict"
            )
    if len(modules) > 1 or (parts.optims and not modules):
        raise ValueError(
            f"state holds {len(modules)} nn.Module(s) ({[k for k, _ in modules]}) and "
            f"{len(parts.optims)} optimizer(s); optimizers need exactly one module to name "
            "their parameters. Wrap several models in one nn.Module (e.g. nn.ModuleDict)"
        )
    parts.model = modules[0] if modules else None
    return parts


def _nested(
    state: Mapping[str, Any], parts: _Parts, *, rank: int, cache: ResolveCache | None = None
) -> tuple[dict, dict[str, str]]:
    """{key: plain nested state} and {key: role} with role in model / optim / extra."""
    nested: dict[str, Any] = {}
    roles: dict[str, str] = {}
    optims = tuple(o for _, o in parts.optims)
    if cache is not None and parts.model is not None:
        cache.begin(parts.model[1], optims)
    for key, value in state.items():
        inner = value.obj if isinstance(value, PerRank) else value
        if isinstance(inner, nn.Module):
            sd: Any = cache.model_state(inner, optims) if cache else get_model_state_dict(inner)
            roles[key] = "model"
        elif isinstance(inner, torch.optim.Optimizer):
            assert parts.model is not None
            model = parts.model[1]
            if cache:
                sd = cache.optim_state(model, inner, optims)
            else:
                sd = get_optimizer_state_dict(model, inner)
            roles[key] = "optim"
        elif is_stateful(inner):
            sd = inner.state_dict()
            roles[key] = "extra"
        else:
            sd = inner
            roles[key] = "extra"
        nested[key] = {f"rank{rank}": sd} if key in parts.per_rank else sd
    return nested, roles


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage, without ``to_local``'s autograd overhead).

    Args:
        t: a tensor or a DTensor.

    Returns:
        The DTensor's local tensor, else ``t`` itself.
    """
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


def in_mesh(mesh: Any, seen: dict[int, bool]) -> bool:
    """Whether this rank is part of ``mesh`` (a DTensor outside it has no local shard here).

    Args:
        mesh: a DTensor's ``device_mesh``.
        seen: answers so far, by ``id(mesh)``; filled in (one call per save or load).

    Returns:
        True when this rank has a coordinate in ``mesh``.
    """
    if id(mesh) not in seen:
        seen[id(mesh)] = mesh.get_coordinate() is not None
    return seen[id(mesh)]


def _assign(items: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Deterministic balance of replicated items over ranks: largest first, to the least
    loaded rank (lowest on ties). Every rank computes the same answer from the same list."""
    loads = [0] * world_size
    owner = {}
    for fqn, nbytes in sorted(items, key=lambda x: (-x[1], x[0])):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        owner[fqn] = r
        loads[r] += nbytes
    return owner


def resolve_for_save(
    state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    overlap: bool,
    cache: ResolveCache | None = None,
    stage_all: bool = False,
    defer: bool = False,
) -> ResolvedState:
    """This rank's write items for ``state``, with BYTE_IO values serialized now.
    ``stage_all``: also the replicated tensors another rank writes (``persist=False``), so
    that this rank's staged copy alone restores it (the memory tier). With ``cache``, the
    model's and optimizers' items are reused while they check out (``reuse``); with
    ``defer`` too, the other keys' changed values are captured now and serialized when
    their item's ``finish`` is called (after this returns, before the payloads are read)."""
    parts = _split(state)
    args = plan_args(state, rank=rank, world_size=world_size, overlap=overlap, stage_all=stage_all)
    if cache is not None and cache.plan is not None and cache.plan.check(state, args):
        out = _reuse(state, parts, cache, cache.plan, rank=rank, defer=defer)
        if out is not None:
            return out
    nested, roles = _nested(state, parts, rank=rank, cache=cache)
    flat, mappings = flatten_state_dict(nested)
    param_ptrs: set[int] = set()
    if overlap and parts.model is not None:
        param_ptrs = {local_shard(p.data).data_ptr() for p in parts.model[1].parameters()}
    replicated = [
        (fqn, obj.numel() * obj.element_size())
        for fqn, obj in flat.items()
        if roles[str(mappings[fqn][0])] in ("model", "optim")
        and isinstance(obj, torch.Tensor)
        and not isinstance(obj, DTensor)
    ]
    owner = _assign(replicated, world_size)
    out = ResolvedState(items=[], planner_data=dict(mappings))
    items = _items(flat, mappings, roles, owner, param_ptrs, out, cache, rank, stage_all, overlap)
    for fqn_items in items.values():
        out.items.extend(fqn_items)
    if cache is not None:
        cache.plan = _learn(state, parts, cache, flat, mappings, roles, items, out, args)
    return out


def plan_args(
    state: Mapping[str, Any], *, rank: int, world_size: int, overlap: bool, stage_all: bool
) -> tuple[Any, ...]:
    """What a reuse plan of ``resolve_for_save`` was made for (``reuse.Plan.args``)."""
    return (rank, world_size, overlap, stage_all, _roles(state))


def _roles(state: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(
        (
            k,
            "model"
            if isinstance(v, nn.Module)
            else "optim"
            if isinstance(v, torch.optim.Optimizer)
            else "",
        )
        for k, v in state.items()
    )


def _items(
    flat: Mapping[str, Any],
    mappings: Mapping[str, Any],
    roles: Mapping[str, str],
    owner: Mapping[str, int],
    param_ptrs: set[int],
    out: ResolvedState,
    cache: ResolveCache | None,
    rank: int,
    stage_all: bool,
    overlap: bool,
    defer: bool = False,
) -> dict[str, list[StageItem]]:
    """The items of every flat leaf, by top-level key (``out.assigned`` gets the replicated
    ones this rank holds)."""
    by_key: dict[str, list[StageItem]] = {}
    meshes: dict[int, bool] = {}
    for fqn, obj in flat.items():
        key = str(mappings[fqn][0])
        role = roles[key]
        mine = by_key.setdefault(key, [])
        if isinstance(obj, DTensor) and not in_mesh(obj.device_mesh, meshes):
            continue  # not part of this DTensor's mesh
        for wi in cache.items_for(fqn, obj) if cache else _create_write_items(fqn, obj):
            if wi.type == WriteItemType.BYTE_IO:
                if cache is not None and defer:
                    payload, later = cache.serialize_later(fqn, obj)
                    mine.append(StageItem(wi, payload=payload, pending=later))
                    continue
                payload = cache.serialize(fqn, obj) if cache else serialize(obj)
                mine.append(StageItem(wi, payload=payload))
                continue
            persist = True
            if fqn in owner:
                out.assigned.append(wi.index)
                if owner[fqn] != rank:
                    if not stage_all:
                        continue
                    persist = False
            local = local_shard(obj).detach()
            background = overlap and (
                role == "optim" or (role == "model" and local.data_ptr() in param_ptrs)
            )
            mine.append(StageItem(wi, tensor=local, background=background, persist=persist))
    return by_key


def _learn(
    state: Mapping[str, Any],
    parts: _Parts,
    cache: ResolveCache,
    flat: Mapping[str, Any],
    mappings: Mapping[str, Any],
    roles: Mapping[str, str],
    items: Mapping[str, list[StageItem]],
    out: ResolvedState,
    args: tuple[Any, ...],
) -> reuse.Plan | None:
    """A plan reusing the model's and optimizers' items of this save, or None when the fast
    state dicts were not used (``ResolveCache``)."""
    if parts.model is None or not cache._valid() or cache._model_map is None:
        return None
    model = parts.model[1]
    plan = reuse.Plan(args=args, objects={}, assigned=list(out.assigned))
    for key, role in roles.items():
        if role not in ("model", "optim"):
            continue
        obj = state[key]
        plan.objects[key] = obj
        mine = {fqn: v for fqn, v in flat.items() if mappings[fqn][0] == key}
        optim_map = cache._optim_maps.get(id(obj)) if role == "optim" else None
        if role == "optim" and optim_map is None:
            return None
        ok = reuse.build(
            plan,
            key,
            mine,
            items.get(key, []),
            mappings,
            model=model if role == "model" else None,
            model_map=cache._model_map if role == "model" else None,
            optim=obj if role == "optim" else None,
            optim_map=optim_map,
        )
        if not ok:
            return None
    return plan


def _reuse(
    state: Mapping[str, Any],
    parts: _Parts,
    cache: ResolveCache,
    plan: reuse.Plan,
    *,
    rank: int,
    defer: bool,
) -> ResolvedState | None:
    """``resolve_for_save`` through ``plan`` (checked): the model's and optimizers' items as
    they were, the other keys resolved afresh; None when a value moved out of reach."""
    extra = {k: v for k, v in state.items() if k not in plan.objects}
    flat: dict[str, Any] = {}
    mappings: dict[str, Any] = {}
    if extra:
        nested, roles = _nested(extra, _Parts(per_rank=parts.per_rank), rank=rank)
        flat, mappings = reuse.flatten(nested)
    out = ResolvedState(items=[], assigned=list(plan.assigned))
    fresh = _items(
        flat, mappings, roles if extra else {}, {}, set(), out, cache, rank, False, False, defer
    )
    for key in state:
        segment = plan.items(key, cache.serialize) if key in plan.objects else fresh.get(key, [])
        if segment is None:
            return None
        out.items.extend(segment)
    out.planner_data = {**plan.mappings, **mappings}
    return out


# --- load ------------------------------------------------------------------------------------
@dataclass
class LoadPlan:
    """Templates for ``dcp.load`` and how to apply what it loaded."""

    template: dict[str, Any]
    parts: _Parts
    skipped: list[str]
    fresh: set[str] = field(default_factory=set)
    """Optimizers whose state ``freshopt`` made (loaded by ``freshopt.load``)."""
    live_model: bool = False
    """The model's entry holds its live tensors (``template_for_load(live_model=True)``)."""


def template_for_load(
    state: Mapping[str, Any],
    *,
    rank: int,
    saved_keys: set[str],
    saved: freshopt.Saved | None = None,
    live_model: bool = False,
) -> LoadPlan:
    """A nested state dict for ``dcp.load`` (DCP fills its tensors in place and replaces its
    other leaves). ``saved_keys`` are the flat keys in the checkpoint's metadata, to skip the
    PerRank values the checkpoint lacks for this rank; with ``saved`` (what a snapshot holds)
    an optimizer without state gets it from ``freshopt``, not from DCP's zero-grad step.
    ``live_model``: the model's entry holds its live parameters and buffers where
    ``naming.model_tensors`` can tell them (for a copy under ``no_grad``, not for ``dcp.load``)."""
    parts = _split(state)
    made = freshopt.templates(parts.model, parts.optims, saved)
    if live_model and parts.model is not None:
        tensors = naming.model_tensors(parts.model[1])
        if tensors is not None:
            made[parts.model[0]] = tensors
    rest, _ = _nested({k: v for k, v in state.items() if k not in made}, parts, rank=rank)
    nested = {k: made[k] if k in made else rest[k] for k in state}
    skipped = []
    for key in parts.per_rank:
        prefix = f"{key}.rank{rank}"
        if not any(k == prefix or k.startswith(prefix + ".") for k in saved_keys):
            skipped.append(key)
            del nested[key]
    live = parts.model is not None and parts.model[0] in made
    fresh = set(made) - {parts.model[0]} if live and parts.model is not None else set(made)
    return LoadPlan(
        template=nested, parts=parts, skipped=sorted(skipped), fresh=fresh, live_model=live
    )


def apply_loaded(state: Mapping[str, Any], plan: LoadPlan, *, rank: int) -> None:
    """Hand what ``dcp.load`` filled in back to the live objects."""
    model = plan.parts.model[1] if plan.parts.model else None
    for key, value in state.items():
        if key not in plan.template:
            continue
        loaded = plan.template[key]
        if key in plan.parts.per_rank:
            loaded = loaded[f"rank{rank}"]
        inner = value.obj if isinstance(value, PerRank) else value
        if isinstance(inner, nn.Module):
            set_model_state_dict(inner, loaded)
        elif isinstance(inner, torch.optim.Optimizer):
            assert model is not None
            if key in plan.fresh:
                freshopt.load(model, inner, loaded)
            else:
                set_optimizer_state_dict(model, inner, loaded)
        elif is_stateful(inner):
            inner.load_state_dict(loaded)
        elif isinstance(inner, Mapping) and inner is not loaded:
            inner.update(loaded)  # type: ignore[attr-defined]
        # a bare tensor was filled in place
