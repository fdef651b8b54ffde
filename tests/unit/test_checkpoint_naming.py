"""``naming``: the FQNs and state dict tensors DCP would give, without its walk, or None."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_freshopt import _build, _same, _snapshot, _train
from torch import nn
from torch.distributed.checkpoint import state_dict as _sd
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

import groups
from unbroken.checkpoint.staging import memory
from unbroken.checkpoint.state import naming
from unbroken.workload.model import SIZES, build_model


@pytest.fixture
def gloo_group() -> Iterator[None]:
    with groups.gloo_group():
        yield


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    placements = t.placements if isinstance(t, DTensor) else None
    return (type(t) is DTensor or isinstance(t, DTensor), placements, t.dtype, tuple(t.shape))


@pytest.mark.parametrize("parallel", ["none", "fsdp", "ddp"])
def test_the_live_tensors_are_what_dcp_gives(gloo_group: None, parallel: str) -> None:
    model, optim = _build(parallel)
    _train(model, optim, steps=1, seed=1)
    ref = get_model_state_dict(model)
    mine = naming.model_tensors(model)
    assert mine is not None
    assert list(mine) == list(ref)  # keys and order; the non-persistent buffers left out
    for key, t in mine.items():
        assert (
            _local(t).untyped_storage().data_ptr() == _local(ref[key]).untyped_storage().data_ptr()
        )
        assert _layout(t) == _layout(ref[key]), key
    names = naming.names(model)
    assert names is not None
    assert names == {
        n: next(iter(_sd._get_fqns(model, n)))
        for n, _ in model.named_parameters(remove_duplicate=False)
    }


class _Extra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def get_extra_state(self) -> Any:
        return {"seen": 1}

    def set_extra_state(self, state: Any) -> None:
        pass


def _tiny() -> nn.Module:
    return build_model(SIZES["tiny"], seed=0)


def test_a_model_whose_state_dict_differs_gets_none() -> None:
    extra = nn.Sequential(_Extra())
    assert naming.model_tensors(extra) is None  # its extra state is in the state dict
    hooked = _tiny()
    hooked.layers[0].register_state_dict_post_hook(lambda *_: None)
    assert naming.model_tensors(hooked) is None
    pre = _tiny()
    pre.register_state_dict_pre_hook(lambda *_: None)
    assert naming.model_tensors(pre) is None
    shared = nn.Sequential(nn.Linear(2, 2))
    shared.append(shared[0])  # one module under two names
    assert naming.model_tensors(shared) is None
    assert naming.model_tensors(_tiny()) is not None


def test_a_wrapper_below_the_root_is_left_to_dcp() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _tiny()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    assert naming.plain(model) is None and naming.names(model) is None
    assert naming.model_tensors(model) is None


@pytest.mark.slow
def test_names_that_do_not_fit_the_snapshot_fall_back_to_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _build("none")
    _train(*ref, steps=2, seed=1)
    snap = _snapshot(tmp_path, *ref)
    real = naming.model_tensors

    def misnamed(model: nn.Module) -> dict[str, torch.Tensor] | None:
        found = real(model)
        return None if found is None else {f"x.{k}": t for k, t in found.items()}

    monkeypatch.setattr(naming, "model_tensors", misnamed)
    fresh = _build("none")
    pending = memory.prepare({"model": fresh[0], "optim": fresh[1]}, snap, rank=0)
    assert not pending.plan.live_model  # the second match, DCP's names
    pending.apply()
    assert _same(ref, fresh)
    monkeypatch.setattr(naming, "model_tensors", real)
    fast = _build("none")
    pending = memory.prepare({"model": fast[0], "optim": fast[1]}, snap, rank=0)
    assert pending.plan.live_model and memory._loaded_in_place(pending.plan, []) == "model"
    pending.apply()
    assert _same(ref, fast)
    memory.take((tmp_path / "ckpt").resolve()).close()  # type: ignore[union-attr]


def test_telling_a_plain_model_imports_nothing_it_does_not_use() -> None:
    # torch._dynamo loads lazily on first use of torch._dynamo (~1 s): a restore of a model
    # nobody compiled must not be the first use.
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from unbroken.checkpoint.state import naming\n"
        "assert naming.plain(nn.Sequential(nn.Linear(2, 2))) is not None\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
