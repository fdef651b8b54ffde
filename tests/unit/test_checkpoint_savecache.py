"""The resolve cache's reuse of a model's and its optimizers' items from one save to the next
(``reuse.Plan``): every change a training loop can make to what the state holds is
noticed and resolved afresh, and a snapshot staged through reused items restores bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import groups
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.state.resolve import ResolveCache, resolve_for_save
from unbroken.workload.model import SIZES, build_model, loss_fn
from unbroken.workload.parallel import wrap_model

Change = Callable[[nn.Sequential, torch.optim.Optimizer], None]


class Cursor:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def _model(seed: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _items(state: dict[str, Any], cache: ResolveCache | None) -> list[tuple[Any, ...]]:
    r = resolve_for_save(state, rank=0, world_size=2, overlap=True, cache=cache, stage_all=True)
    out: list[tuple[Any, ...]] = [(i.index, i.fqn) for i in r.assigned]
    for i in r.items:
        t = i.tensor
        where = None if t is None else (t.data_ptr(), tuple(t.shape), t.dtype)
        out.append((i.write_item.index.fqn, i.payload, where, i.background, i.persist))
    return out + sorted(r.planner_data.items())


def _replace_state_tensor(model: nn.Sequential, optim: torch.optim.Optimizer) -> None:
    st = optim.state[model[0].weight]
    st["exp_avg"] = st["exp_avg"].clone()


def _replace_state_dict(model: nn.Sequential, optim: torch.optim.Optimizer) -> None:
    p = model[2].bias
    optim.state[p] = {k: v.clone() for k, v in optim.state[p].items()}


def _new_parameter(model: nn.Sequential, optim: torch.optim.Optimizer) -> None:
    old = model[0].weight
    model[0].weight = nn.Parameter(torch.randn(16, 8))
    optim.param_groups[0]["params"][0] = model[0].weight
    optim.state[model[0].weight] = optim.state.pop(old)


def _add_group(model: nn.Sequential, optim: torch.optim.Optimizer) -> None:
    model.append(nn.Linear(4, 2))
    optim.add_param_group({"params": list(model[3].parameters()), "lr": 0.01})
    _step(model, optim)


def _remove_module(model: nn.Sequential, optim: torch.optim.Optimizer) -> None:
    del model[1]  # the ReLU: the Linear after it is renamed "1"


def _buffer_added(model: nn.Sequential, optim: torch.optim.Optimizer) -> None:
    model[2].register_buffer("scale", torch.ones(3))


CHANGES: dict[str, tuple[Change, bool]] = {
    # name: (the change, whether the plan's structural check must refuse it)
    "optimizer state tensor replaced": (_replace_state_tensor, True),
    "optimizer state dict of a parameter replaced": (_replace_state_dict, True),
    "optimizer reloaded": (lambda m, o: o.load_state_dict(o.state_dict()), True),
    "parameter re-created": (_new_parameter, True),
    "parameter data of another shape": (
        lambda m, o: setattr(m[2].weight, "data", torch.randn(4, 16).t().contiguous().t()[:3]),
        True,
    ),
    "parameter data replaced, same shape": (
        lambda m, o: setattr(m[2].weight, "data", torch.randn(4, 16)),
        True,
    ),
    "buffer added": (_buffer_added, True),
    "module removed": (_remove_module, True),
    "module replaced under its name": (lambda m, o: m.__setitem__(1, nn.Tanh()), True),
    "module and param group added": (_add_group, True),
    "group key added": (lambda m, o: o.param_groups[0].__setitem__("initial_lr", 0.05), True),
    "learning rate changed": (lambda m, o: o.param_groups[0].__setitem__("lr", 0.01), False),
    "nothing (a training step)": (_step, False),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_the_reused_items_are_what_a_fresh_resolve_gives_after_a_change(name: str) -> None:
    change, refused = CHANGES[name]
    model, optim = _model(0)
    _step(model, optim)
    state: dict[str, Any] = {"model": model, "optim": optim, "data": Cursor()}
    cache = ResolveCache()
    assert _items(state, cache) == _items(state, None)  # learns the renaming and the plan
    assert cache.plan is not None and cache.plan.check(state, cache.plan.args)
    for _ in range(2):  # reuses it
        assert _items(state, cache) == _items(state, None)
    plan = cache.plan
    assert plan is not None and plan.check(state, plan.args)
    change(model, optim)
    assert plan.check(state, plan.args) is not refused
    assert _items(state, cache) == _items(state, None)  # the renaming and the plan relearned
    assert cache.plan is not None and cache.plan.check(state, cache.plan.args)
    assert _items(state, cache) == _items(state, None)
    assert _items(state, cache) == _items(state, None)


def test_a_plan_needs_the_same_objects_and_settings() -> None:
    model, optim = _model(0)
    _step(model, optim)
    state: dict[str, Any] = {"model": model, "optim": optim}
    cache = ResolveCache()
    _items(state, cache)
    _items(state, cache)
    plan = cache.plan
    assert plan is not None and plan.check(state, plan.args)
    other = dict(state, optim=torch.optim.AdamW(model.parameters()))
    assert not plan.check(other, plan.args)
    assert not plan.check(state, (1, *plan.args[1:]))  # another rank
    _items(other, cache)  # a fresh optimizer (no state yet): no plan
    assert cache.plan is None


def test_a_snapshot_through_reused_items_restores_bit_exact(tmp_path: Path) -> None:
    """Snapshots of steps 0-5 (the optimizer reloaded after step 2: the plan is relearned);
    after an abort the next Checkpointer restores step 5 from memory: model, optimizer and
    cursor as they were at that snapshot, though training went on after it."""
    model, optim = _model(0)
    cursor = Cursor()
    state: dict[str, Any] = {"model": model, "optim": optim, "data": cursor}
    ck = Checkpointer(tmp_path / "ckpt", every_steps=100, snapshot_every=1, overlap=True)
    want: dict[str, Any] = {}
    for step in range(6):
        _step(model, optim)
        cursor.position = step
        if step == 2:
            optim.load_state_dict(optim.state_dict())
        assert ck.snapshot(step, state)
        want = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {
                (i, k): torch.as_tensor(v).clone()
                for i, s in optim.state_dict()["state"].items()
                for k, v in s.items()
            },
        }
    _step(model, optim)  # changes every value while the last copy may still run
    ck.wait_staged()
    ck.abort()
    model2, optim2 = _model(1)
    _step(model2, optim2)
    cursor2 = Cursor()
    with Checkpointer(tmp_path / "ckpt", every_steps=100) as ck2:
        assert ck2.restore({"model": model2, "optim": optim2, "data": cursor2}) == 5
    assert cursor2.position == 5
    got = model2.state_dict()
    assert got.keys() == want["model"].keys()
    assert all(torch.equal(got[k], v) for k, v in want["model"].items())
    osd = optim2.state_dict()["state"]
    assert all(torch.equal(torch.as_tensor(osd[i][k]), v) for (i, k), v in want["optim"].items())


def test_the_fast_flatten_is_dcps() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from unbroken.checkpoint.state.reuse import flatten

    t = torch.ones(2)
    cases: list[dict[str, Any]] = [
        {"progress": {"losses": [float(i) for i in range(3000)]}, "n": 3, "s": "x"},
        {"a": [1, [2, 3], {"b": t}], "c": (t, 1), "d": [[1.0], [2.0]], "e": []},
        {"rng": {"rank0": {"torch": t, "python": (3, tuple(range(5)), None), "np": [t, 2]}}},
        {"x": [{"y": 1}], "z": [[t]], "w": [None, b"b", True], "v": {}},
    ]
    for case in cases:
        assert flatten(case) == flatten_state_dict(case)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten({"a": {"b": 1}, "a.b": 2})


def _fsdp_state(seed: int) -> dict[str, Any]:
    model = wrap_model(build_model(SIZES["tiny"], seed=seed), parallel="fsdp", device="cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, SIZES["tiny"].vocab_size, (2, 16), generator=torch.Generator())
    loss_fn(model(x), x).backward()
    optim.step()
    return {"model": model, "optim": optim, "data": Cursor()}


@pytest.mark.slow
def test_the_model_after_an_in_process_restart_reuses_items_from_its_first_save() -> None:
    """What an in-process restart does: a new process group, a new FSDP2 model and a new
    Checkpointer's cache. Its first save makes no write item anew (each is the one the
    failed iteration's cache made: same name, shape, dtype, mesh layout and placements) and
    learns the plan, which the second save reuses."""
    with groups.gloo_group():
        first = _fsdp_state(0)
        made = resolve_for_save(first, rank=0, world_size=1, overlap=True, cache=ResolveCache())
    with groups.gloo_group():
        again, cache = _fsdp_state(1), ResolveCache()
        got = resolve_for_save(again, rank=0, world_size=1, overlap=True, cache=cache)
        assert cache.plan is not None and cache.plan.check(again, cache.plan.args)
        pairs = [(a, b) for a, b in zip(made.items, got.items, strict=True) if a.tensor is not None]
        assert pairs and all(a.write_item is b.write_item for a, b in pairs)
        assert _items(again, cache) == _items(again, None)


@pytest.mark.parametrize(
    "value",
    [
        [0.1 * i for i in range(2000)],
        {"epoch": 1, "position": 5, "seed": None},
        (1, 2.5, "x", b"y", True, {3, 4}),
        [1, [2, {"a": (3,)}]],
    ],
)
def test_a_plain_value_is_saved_as_torch_save_saves_it(value: Any) -> None:
    import io
    import pickle

    from unbroken.checkpoint.state import savecache

    ref = io.BytesIO()
    torch.save(value, ref)
    key = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    fast = savecache.serialize(savecache.plain_loads(key), plain=True)
    assert fast == ref.getvalue()  # byte for byte: DCP's loader and weights_only read it
    assert torch.load(io.BytesIO(fast), weights_only=True) == value
    cache = ResolveCache()
    assert cache.serialize("k", value) == ref.getvalue()
    _, later = ResolveCache().serialize_later("k", value)
    assert later is not None and later() == ref.getvalue()


def test_a_value_holding_a_tensor_or_a_class_is_not_plain() -> None:
    import io
    import pickle

    from unbroken.checkpoint.state import savecache

    for value in ({"t": torch.ones(2)}, [complex(1, 2)], nn.Identity()):
        key = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        with pytest.raises(pickle.UnpicklingError):
            savecache.plain_loads(key)
    _, later = ResolveCache().serialize_later("k", {"t": torch.arange(3)})
    assert later is not None
    loaded = torch.load(io.BytesIO(later()), weights_only=True)
    assert torch.equal(loaded["t"], torch.arange(3))
