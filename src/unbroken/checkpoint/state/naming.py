"""A model's FQNs and state dict tensors without DCP's walk, where its keys need no renaming.

``get_model_state_dict`` is ``state_dict()`` with every key renamed by ``_get_fqns``, a walk
from the root for each key, after ``_verify_options`` has walked every parameter and buffer
the same way: a sizeable share of a fresh process's restore from memory.
For most models the renaming is the identity below the root: no FSDP1, no DDP or compiled
module below the root, no ``_fqn_modifiers``, no activation-checkpoint wrapper (FSDP2's
``fully_shard`` and plain modules), so the FQN is the key, less a root DDP's ``module.`` or a
compiled root's ``_orig_mod.``. ``plain`` tells such a model after one pass over its modules;
anything else gets None here and the public calls.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
from torch.nn.parallel import DistributedDataParallel

# FSDP2's state-dict pre-hook: it reshards the parameters, which a state dict of them needs.
_FSDP_TO_SHARDED = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"


_MODIFIERS = "_fqn_modifiers"


def _modifies(m: nn.Module) -> bool:
    """``hasattr(m, "_fqn_modifiers")`` as ``_get_fqns`` asks it, without ``nn.Module``'s
    ``__getattr__`` raising for the usual no (an exception per module)."""
    return (
        getattr(type(m), _MODIFIERS, None) is not None
        or _MODIFIERS in m.__dict__
        or any(_MODIFIERS in t for t in (m._parameters, m._buffers, m._modules))
    )


def plain(model: nn.Module) -> tuple[nn.Module, int] | None:
    """(the module below the root's DDP / compile wrappers, the length of the prefix those
    give every key of ``model.state_dict()``), when that module's keys are its FQNs; None
    when some key needs DCP's renaming."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    # A compiled model means torch._dynamo is loaded; asking torch for it would import it.
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    wrappers: tuple[type, ...] = (DistributedDataParallel, FullyShardedDataParallel)
    if isinstance(compiled, type):
        wrappers = (*wrappers, compiled)
    inner, cut = model, 0
    while True:
        if isinstance(inner, DistributedDataParallel):
            inner, cut = inner.module, cut + len("module.")
        elif compiled is not None and isinstance(inner, compiled):
            inner, cut = inner._orig_mod, cut + len("_orig_mod.")
        else:
            break
    for name, m in inner.named_modules(remove_duplicate=False):
        if isinstance(m, wrappers) or _modifies(m) or _CHECKPOINT_WRAPPED_MODULE in name:
            return None
    return inner, cut


def names(model: nn.Module) -> dict[str, str] | None:
    """``named_parameters(remove_duplicate=False)`` name -> FQN, as ``_get_fqns`` gives it;
    None where ``plain`` says no."""
    found = plain(model)
    if found is None:
        return None
    _, cut = found
    return {name: name[cut:] for name, _ in model.named_parameters(remove_duplicate=False)}


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The keys of ``get_model_state_dict(model)`` with the live parameter and buffer
    objects it would return detached (a load copies into them under ``no_grad``); None
    where it might give anything else: ``plain`` says no, a module changes what its state
    dict holds (a state-dict hook other than FSDP2's, its own ``_save_to_state_dict``,
    ``state_dict`` or extra state), or a module or tensor is reachable twice."""
    found = plain(model)
    if found is None:
        return None
    inner, _ = found
    base = nn.Module
    for m in model.modules():
        kind = type(m)
        if (
            m._state_dict_hooks
            or kind._save_to_state_dict is not base._save_to_state_dict
            or kind.state_dict is not base.state_dict
            or kind.get_extra_state is not base.get_extra_state
            or any(
                getattr(h, "__qualname__", "") != _FSDP_TO_SHARDED
                for h in m._state_dict_pre_hooks.values()
            )
        ):
            return None
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, m in inner.named_modules(remove_duplicate=False):
        if id(m) in seen:
            return None
        seen.add(id(m))
        for hook in m._state_dict_pre_hooks.values():
            hook(m, prefix, True)  # FSDP2's: the sharded parameters registered
        dot = f"{prefix}." if prefix else ""
        skip = m._non_persistent_buffers_set
        for table, persistent in ((m._parameters, None), (m._buffers, skip)):
            for name, t in table.items():
                if t is None or (persistent is not None and name in persistent):
                    continue
                if id(t) in seen:
                    return None
                seen.add(id(t))
                out[dot + name] = t
    return out
