"""Wrap the reference model for data parallelism: FSDP2 per block, DDP, or nothing."""

from __future__ import annotations

import logging
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

Parallel = Literal["fsdp", "ddp", "none"]
PARALLEL_MODES: tuple[Parallel, ...] = get_args(Parallel)


def wrap_model(
    model: nn.Module,
    *,
    parallel: Parallel,
    device: torch.device | str,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Move ``model`` to ``device`` and wrap it for ``parallel`` in ``PARALLEL_MODES``.

    "fsdp": FSDP2 ``fully_shard`` on each block of ``model.layers``, then on the root; the
    model is sharded in place and returned. "ddp": ``DistributedDataParallel``. "none": the
    model, moved. Call after the default process group is initialized (fsdp, ddp) and before
    building the optimizer. ``param_dtype`` (fsdp only) sets the compute dtype of FSDP2's mixed
    precision; gradients are then reduced in float32.
    """
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if param_dtype is not None and parallel != "fsdp":
        raise ValueError(f"param_dtype is only supported with parallel='fsdp', got {parallel!r}")
    device = torch.device(device)
    model = model.to(device)
    if parallel == "none":
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"parallel={parallel!r} needs an initialized default process group; call "
            "torch.distributed.init_process_group first, or use parallel='none'"
        )
    if parallel == "ddp":
        device_ids = [device.index] if device.type == "cuda" and device.index is not None else None
        logger.info("wrapping model in DDP on %s", device)
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return _fully_shard(model, param_dtype=param_dtype)


def _fully_shard(model: nn.Module, *, param_dtype: torch.dtype | None) -> nn.Module:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 keeps FSDP2 under _composable
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            MixedPrecisionPolicy,
            fully_shard,
        )
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"fsdp needs the model's blocks in a `layers` nn.ModuleList; "
            f"{type(model).__name__} has none"
        )
    reduce_dtype = torch.float32 if param_dtype is not None else None
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in layers:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    logger.info("sharded model with FSDP2: %d blocks + root", len(layers))
    return model
