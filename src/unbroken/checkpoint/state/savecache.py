"""What stays the same from one save to the next: ``ResolveCache``, kept by a Checkpointer.

The learned renaming of the model's and optimizers' state dicts, the write items of each
tensor, the serialized non-tensor values, and the ``reuse.Plan`` that reuses the model's and
optimizers' resolved items while they check out.
"""

from __future__ import annotations

import io
import logging
import pickle
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as _sd
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from unbroken.checkpoint.state.reuse import Plan

logger = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (as ``resolve.local_shard``), else the tensor itself."""
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


class ResolveCache:
    """What stays the same from one save to the next, kept by a Checkpointer.

    - A fast path for ``get_model_state_dict`` / ``get_optimizer_state_dict``: both are
      ``state_dict()`` with keys renamed to FQNs, but recompute every FQN on every call (a walk
      from the root per key). The first save calls
      them, learns the renaming, and checks that ``state_dict()`` plus the renaming gives the
      same keys, the same tensors (storage, shape, dtype, type) and equal other values. Later
      saves rename directly (a dictionary lookup per key) while the model's and optimizers' parameters are the same
      objects; anything else (FSDP1, a mismatch) keeps the public calls.
    - The write items of each tensor, keyed by name, shape, dtype and placement.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._model_map: dict[str, tuple[dict[str, Any], str]] | None = None
        self._optim_maps: dict[int, dict[int, str]] = {}
        self._broken = False
        self._meshes: dict[int, tuple[Any, tuple[Any, ...]]] = {}
        """id -> (a DTensor's mesh, what its items depend on): held, so no id is reused."""
        self.plan: Plan | None = None
        """The model's and optimizers' items of the last save, reused while they check out."""
        self._payloads: dict[str, tuple[bytes | None, bytes]] = {}

    def serialize(self, fqn: str, obj: Any) -> bytes:
        """``torch.save`` bytes of a non-tensor value, reused while the value pickles to the
        same bytes (a pickle costs a fraction of torch.save, and unlike ``==`` it keeps no copy
        of the value)."""
        try:
            key: bytes | None = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # not picklable: torch.save decides
            key = None
        hit = self._payloads.get(fqn)
        if key is not None and hit is not None and hit[0] == key:
            return hit[1]
        plain = False
        if key is not None:
            try:
                plain_loads(key)
                plain = True
            except pickle.UnpicklingError:
                pass
        payload = serialize(obj, plain=plain)
        self._payloads[fqn] = (key, payload)
        return payload

    def serialize_later(self, fqn: str, obj: Any) -> tuple[bytes | None, Later | None]:
        """``serialize``, except that a changed value is only captured now (its pickle: 20
        times cheaper than torch.save) and serialized by the returned ``Later`` when it is
        called, on the stager thread; (the reused bytes, None) while the value is unchanged."""
        try:
            key = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return self.serialize(fqn, obj), None
        hit = self._payloads.get(fqn)
        if hit is not None and hit[0] == key:
            return hit[1], None
        return None, Later(self, fqn, key)

    @staticmethod
    def _identity(model: nn.Module, optims: tuple[torch.optim.Optimizer, ...]) -> tuple:
        # Names too, and buffers: a module removed or added renames or adds state dict keys.
        return (
            id(model),
            tuple((n, id(t)) for n, t in model.named_parameters(remove_duplicate=False)),
            tuple((n, id(t)) for n, t in model.named_buffers(remove_duplicate=False)),
            tuple(tuple(id(p) for g in o.param_groups for p in g["params"]) for o in optims),
        )

    def begin(self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...]) -> None:
        """Once per resolved save: forget the learned renaming if any parameter or buffer
        object, or its name, changed. The save that follows learns it again (the public
        calls, checked) and, with it, the plan that the next save reuses: one slow save per
        new model (the first after an in-process restart), not two."""
        key = self._identity(model, optims)
        if key != self._key:
            self._key, self._model_map, self._optim_maps = key, None, {}

    def _valid(self) -> bool:
        """Whether the learned renaming may be used (each one is learned for the objects of
        the current identity: ``begin`` forgets them when it changes)."""
        return not self._broken

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
            # per-tensor detach (a DTensor detach goes through DTensor's dispatcher).
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
        """The write items of ``fqn`` holding ``obj``, made once per process for the same
        name, shape, dtype and (a DTensor) mesh and placements: the Checkpointer made after an
        in-process restart finds the items of its new model on the new, equal mesh (made
        anew they cost a DTensor dispatch each, adding up on a first save)."""
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            known = self._meshes.get(id(mesh))
            if known is None:
                known = self._meshes[id(mesh)] = (mesh, _mesh_key(mesh))
            key: tuple[Any, ...] = (fqn, "d", tuple(obj.shape), obj.dtype, known[1], obj.placements)
        elif isinstance(obj, torch.Tensor):
            key = (fqn, "t", tuple(obj.shape), obj.dtype)
        elif hasattr(obj, "__create_write_items__"):
            return _create_write_items(fqn, obj)
        else:
            key = (fqn, "b")  # a BYTE_IO item: its name alone
        items = _ITEMS.get(key)
        if items is None:
            if len(_ITEMS) >= _ITEMS_MAX:  # many models in one process: start over
                _ITEMS.clear()
            items = _ITEMS[key] = _create_write_items(fqn, obj)
        return items


# Write items by what they are made from, shared by every ResolveCache of this process
# (``ResolveCache.items_for``; WriteItems are frozen).
_ITEMS: dict[tuple[Any, ...], list[WriteItem]] = {}
_ITEMS_MAX = 1 << 16


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    """What a DTensor's write items take from its mesh: the device type, the ranks in their
    layout and this rank's coordinate in it (its local shard's shape and offset)."""
    coordinate = mesh.get_coordinate()
    return (
        mesh.device_type,
        tuple(mesh.mesh.shape),
        tuple(mesh.mesh.flatten().tolist()),
        None if coordinate is None else tuple(coordinate),
    )


class Later:
    """A value captured as its pickle, serialized with ``torch.save`` when called. It also
    stores the result in its cache: call it only while no save is being resolved (the
    stager thread's job, which the next save waits for)."""

    def __init__(self, cache: ResolveCache, fqn: str, key: bytes) -> None:
        self._cache, self._fqn, self._key = cache, fqn, key

    @property
    def estimate(self) -> int:
        """An upper bound of the payload's size (torch.save adds its archive, ~1 KiB)."""
        return 2 * len(self._key) + 4096

    def __call__(self) -> bytes:
        try:
            payload = serialize(plain_loads(self._key), plain=True)
        except pickle.UnpicklingError:
            payload = serialize(pickle.loads(self._key))
        self._cache._payloads[self._fqn] = (self._key, payload)
        return payload


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


def serialize(obj: Any, *, plain: bool = False) -> bytes:
    """``torch.save`` bytes of ``obj``. ``plain``: it holds no tensor or storage (nothing
    but containers and values that pickle without a global): then the C pickler writes it
    alone, the same bytes without torch's Python ``persistent_id`` call for every object
    (which costs far more than the pickling itself).

    Args:
        obj: a non-tensor value of a state.
        plain: ``obj`` holds no tensor, storage or global (see ``plain_loads``).

    Returns:
        What ``torch.save(obj)`` writes.
    """
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=_PLAIN if plain else pickle)
    return buf.getvalue()


class _PlainPickler:
    """``torch.save``'s pickler (subclassed there to add ``persistent_id``) for a value in
    which no object has a persistent id: the C pickler, which never calls it."""

    def __init__(self, file: Any, protocol: int) -> None:
        self._pickler = pickle.Pickler(file, protocol=protocol)

    def dump(self, obj: Any) -> None:
        self._pickler.dump(obj)


_PLAIN = types.ModuleType("unbroken_plain_pickle")
_PLAIN.Pickler = _PlainPickler  # type: ignore[attr-defined]


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}")


def plain_loads(data: bytes) -> Any:
    """The value pickled in ``data`` when it names no global (plain containers and values:
    no tensor, no storage, no other class); raises ``pickle.UnpicklingError`` else."""
    return _NoGlobals(io.BytesIO(data)).load()
