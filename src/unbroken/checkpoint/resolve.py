"""Turn a user's state into DCP write items on the trainer, and back into live objects on load.

A state is a dict whose values are an ``nn.Module`` (FSDP2, DDP or plain), ``Optimizer``s of
that module, ``Stateful`` objects (``state_dict``/``load_state_dict``), tensors, dicts of those,
or ``PerRank(...)`` of any of these. Models and optimizers go through
``torch.distributed.checkpoint.state_dict`` with sharded state dicts, so a DTensor is saved as
this rank's shard and reshards on load.

Who writes what, decided without a collective:
- a DTensor shard: the rank that holds it;
- a plain tensor of a model or optimizer (DDP, unsharded, an optimizer's ``step``): it is the
  same on every rank, so exactly one rank writes it, chosen by a deterministic balance over
  the sorted item list every rank computes alike;
- anything else (extra state, non-tensor values): every rank that has it writes it, and the
  checkpoint's metadata points to the lowest rank's copy (DCP's rule: one key, one value).
  Values that differ per rank go in ``PerRank``: saved under ``<key>.rank<R>`` and restored
  into the same rank when the world size matches, skipped otherwise.
"""

from __future__ import annotations

import copy
import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as _sd
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

from unbroken.checkpoint import freshopt

logger = logging.getLogger(__name__)


class PerRank:
    """Marks a state value that differs per rank (RNG state, a rank's data cursor).

    Saved under ``<key>.rank<R>``; restored into rank R when the checkpoint has that key
    (same world size), and left as it is otherwise.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def _is_stateful(obj: Any) -> bool:
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

    @property
    def nbytes(self) -> int:
        if self.tensor is not None:
            return self.tensor.numel() * self.tensor.element_size()
        return len(self.payload or b"")


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


class ResolveCache:
    """What stays the same from one save to the next, kept by a Checkpointer.

    - A fast path for ``get_model_state_dict`` / ``get_optimizer_state_dict``: both are
      ``state_dict()`` with keys renamed to FQNs, but recompute every FQN on every call (5 ms
      per save for the 22M-parameter reference model on this machine). The first save calls
      them, learns the renaming, and checks that ``state_dict()`` plus the renaming gives the
      same keys, the same tensors (storage, shape, dtype, type) and equal other values. Later
      saves rename directly (0.3 ms) while the model's and optimizers' parameters are the same
      objects; anything else (FSDP1, a mismatch) keeps the public calls.
    - The write items of each tensor, keyed by name, shape, dtype and placement.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._model_map: dict[str, tuple[dict[str, Any], str]] | None = None
        self._optim_maps: dict[int, dict[int, str]] = {}
        self._broken = False
        self._same = False
        self.write_items: dict[tuple[Any, ...], list[WriteItem]] = {}
        self.param_ptrs: tuple[tuple[Any, ...], set[int]] | None = None
        self._payloads: dict[str, tuple[Any, bytes]] = {}

    def serialize(self, fqn: str, obj: Any) -> bytes:
        """``torch.save`` bytes of a non-tensor value, reused while the value is unchanged
        (torch.save costs ~0.2 ms even for a float; an optimizer has a dozen such values)."""
        hit = self._payloads.get(fqn)
        try:
            if hit is not None and type(hit[0]) is type(obj) and bool(hit[0] == obj):
                return hit[1]
        except Exception:  # a value without a plain == (arrays): serialize it afresh
            pass
        payload = _serialize(obj)
        self._payloads[fqn] = (copy.deepcopy(obj), payload)
        return payload

    @staticmethod
    def _identity(model: nn.Module, optims: tuple[torch.optim.Optimizer, ...]) -> tuple:
        return (
            id(model),
            tuple(map(id, model.parameters())),
            tuple(tuple(id(p) for g in o.param_groups for p in g["params"]) for o in optims),
        )

    def begin(self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...]) -> None:
        """Once per save: forget the learned renaming if any parameter object changed."""
        key = self._identity(model, optims)
        self._same = key == self._key
        if not self._same:
            self._key, self._model_map, self._optim_maps = key, None, {}

    def _valid(self) -> bool:
        return self._same and not self._broken

    def _fqn(self, model: nn.Module, name: str) -> str:
        fqns = _sd._get_fqns(model, name)
        if len(fqns) != 1:
            raise KeyError(name)
        return next(iter(fqns))

    def _give_up(self, what: str, why: object) -> None:
        logger.info("no fast %s state dict (%s); using the public call every save", what, why)
        self._broken = True

    def model_state(self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...]) -> Any:
        if self._valid() and self._model_map is not None:
            # The live parameter and buffer objects themselves: no state_dict() walk and no
            # per-tensor detach (a DTensor detach costs ~40 us in DTensor's dispatcher).
            out = {}
            for fqn, (table, name) in self._model_map.items():
                value = table.get(name)
                if value is None:
                    break
                out[fqn] = value
            else:
                return out
        ref = get_model_state_dict(model)
        if not self._broken:
            try:
                mapping = self._learn_model(model, ref)
                if mapping is None:
                    self._give_up("model", "state_dict() renamed differs from DCP's")
                self._model_map = mapping
            except (AttributeError, KeyError, TypeError) as e:
                self._give_up("model", e)
        return ref

    def _learn_model(
        self, model: nn.Module, ref: dict[str, Any]
    ) -> dict[str, tuple[dict[str, Any], str]] | None:
        """fqn -> (the module's _parameters or _buffers dict, name) for every key of
        ``ref``, if each resolves to a tensor on the same storage."""
        mapping: dict[str, Any] = {}
        for key in model.state_dict():
            fqn = self._fqn(model, key)
            owner, _, name = key.rpartition(".")
            module = model.get_submodule(owner)
            table = module._parameters if name in module._parameters else module._buffers
            mapping[fqn] = (table, name)
        mine = {fqn: table[name] for fqn, (table, name) in mapping.items()}
        return mapping if _same_state(mine, ref) else None

    def optim_state(
        self, model: nn.Module, optim: torch.optim.Optimizer, optims: tuple[Any, ...]
    ) -> Any:
        fresh = not optim.state  # DCP initializes a fresh optimizer's state: keep its path
        mapping = self._optim_maps.get(id(optim))
        if not fresh and self._valid() and mapping is not None:
            return _rename_optim(optim.state_dict(), mapping)
        ref = get_optimizer_state_dict(model, optim)
        if not self._broken and not fresh:
            try:
                params = [p for g in optim.param_groups for p in g["params"]]
                pid = {id(p): i for i, p in enumerate(params)}
                mapping = {
                    pid[id(p)]: self._fqn(model, n)
                    for n, p in model.named_parameters()
                    if id(p) in pid
                }
                if _same_state(_rename_optim(optim.state_dict(), mapping), ref):
                    self._optim_maps[id(optim)] = mapping
                else:
                    self._give_up("optimizer", "state_dict() renamed differs from DCP's")
            except (AttributeError, KeyError, TypeError) as e:
                self._give_up("optimizer", e)
        return ref

    def items_for(self, fqn: str, obj: Any) -> list[WriteItem]:
        if isinstance(obj, DTensor):
            key: tuple[Any, ...] = (
                fqn, "d", tuple(obj.shape), obj.dtype, id(obj.device_mesh), obj.placements
            )  # fmt: skip
        elif isinstance(obj, torch.Tensor):
            key = (fqn, "t", tuple(obj.shape), obj.dtype)
        else:
            return _create_write_items(fqn, obj)
        items = self.write_items.get(key)
        if items is None:
            items = self.write_items[key] = _create_write_items(fqn, obj)
        return items


def _rename_optim(osd: dict[str, Any], mapping: dict[int, str]) -> dict[str, Any]:
    return {
        "state": {mapping[pid]: v for pid, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [mapping[pid] for pid in g["params"]]} for g in osd["param_groups"]
        ],
    }


def _same_state(a: Any, b: Any) -> bool:
    """Same nested structure, tensors on the same storage with the same shape, dtype and
    type, other values equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, DTensor) == isinstance(b, DTensor)
            and _local(a).data_ptr() == _local(b).data_ptr()
            and a.shape == b.shape
            and a.dtype == b.dtype
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


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
        elif not (_is_stateful(inner) or isinstance(inner, (torch.Tensor, Mapping))):
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
        elif _is_stateful(inner):
            sd = inner.state_dict()
            roles[key] = "extra"
        else:
            sd = inner
            roles[key] = "extra"
        nested[key] = {f"rank{rank}": sd} if key in parts.per_rank else sd
    return nested, roles


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage, without ``to_local``'s autograd overhead)."""
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


def _in_mesh(mesh: Any, seen: dict[int, bool]) -> bool:
    if id(mesh) not in seen:
        seen[id(mesh)] = mesh.get_coordinate() is not None
    return seen[id(mesh)]


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


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
) -> ResolvedState:
    """This rank's write items for ``state``, with BYTE_IO values serialized now.
    ``stage_all``: also the replicated tensors another rank writes (``persist=False``), so
    that this rank's staged copy alone restores it (the memory tier)."""
    parts = _split(state)
    nested, roles = _nested(state, parts, rank=rank, cache=cache)
    flat, mappings = flatten_state_dict(nested)
    param_ptrs: set[int] = set()
    if overlap and parts.model is not None:
        key = cache._key if cache else None
        if cache and key is not None and cache.param_ptrs and cache.param_ptrs[0] == key:
            param_ptrs = cache.param_ptrs[1]
        else:
            param_ptrs = {_local(p.data).data_ptr() for p in parts.model[1].parameters()}
            if cache and key is not None:
                cache.param_ptrs = (key, param_ptrs)
    replicated = [
        (fqn, obj.numel() * obj.element_size())
        for fqn, obj in flat.items()
        if roles[str(mappings[fqn][0])] in ("model", "optim")
        and isinstance(obj, torch.Tensor)
        and not isinstance(obj, DTensor)
    ]
    owner = _assign(replicated, world_size)
    out = ResolvedState(items=[], planner_data=dict(mappings))
    meshes: dict[int, bool] = {}
    for fqn, obj in flat.items():
        role = roles[str(mappings[fqn][0])]
        if isinstance(obj, DTensor) and not _in_mesh(obj.device_mesh, meshes):
            continue  # not part of this DTensor's mesh
        for wi in cache.items_for(fqn, obj) if cache else _create_write_items(fqn, obj):
            if wi.type == WriteItemType.BYTE_IO:
                payload = cache.serialize(fqn, obj) if cache else _serialize(obj)
                out.items.append(StageItem(wi, payload=payload))
                continue
            persist = True
            if fqn in owner:
                out.assigned.append(wi.index)
                if owner[fqn] != rank:
                    if not stage_all:
                        continue
                    persist = False
            local = _local(obj).detach()
            background = overlap and (
                role == "optim" or (role == "model" and local.data_ptr() in param_ptrs)
            )
            out.items.append(StageItem(wi, tensor=local, background=background, persist=persist))
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


def template_for_load(
    state: Mapping[str, Any],
    *,
    rank: int,
    saved_keys: set[str],
    saved: freshopt.Saved | None = None,
) -> LoadPlan:
    """A nested state dict for ``dcp.load`` (DCP fills its tensors in place and replaces its
    other leaves). ``saved_keys`` are the flat keys in the checkpoint's metadata, to skip the
    PerRank values the checkpoint lacks for this rank; with ``saved`` (what a snapshot holds)
    an optimizer without state gets it from ``freshopt``, not from DCP's zero-grad step."""
    parts = _split(state)
    made = freshopt.templates(parts.model, parts.optims, saved)
    rest, _ = _nested({k: v for k, v in state.items() if k not in made}, parts, rank=rank)
    nested = {k: made[k] if k in made else rest[k] for k in state}
    skipped = []
    for key in parts.per_rank:
        prefix = f"{key}.rank{rank}"
        if not any(k == prefix or k.startswith(prefix + ".") for k in saved_keys):
            skipped.append(key)
            del nested[key]
    return LoadPlan(template=nested, parts=parts, skipped=sorted(skipped), fresh=set(made))


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
        elif _is_stateful(inner):
            inner.load_state_dict(loaded)
        elif isinstance(inner, Mapping) and inner is not loaded:
            inner.update(loaded)  # type: ignore[attr-defined]
        # a bare tensor was filled in place
