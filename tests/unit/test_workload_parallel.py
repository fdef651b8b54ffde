from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import groups
from unbroken.workload.model import ModelConfig, build_model, loss_fn
from unbroken.workload.parallel import wrap_model

CONFIG = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, ffn_hidden=64, max_seq_len=16
)


@pytest.fixture
def gloo_group() -> Iterator[None]:
    with groups.gloo_group():
        yield


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
@pytest.mark.slow
def test_wrap_model_trains_one_step(gloo_group: None, parallel: str) -> None:
    reference = build_model(CONFIG, seed=0)
    model = wrap_model(build_model(CONFIG, seed=0), parallel=parallel, device="cpu")
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = loss_fn(model(tokens), tokens)
    ref_loss = loss_fn(reference(tokens), tokens)
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    loss.backward()
    ref_loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    if parallel == "fsdp":
        assert any(type(p).__name__ == "DTensor" for p in model.parameters())
        wk = model.layers[0].attention.wk.weight.grad.full_tensor()  # type: ignore[union-attr]
    else:
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        wk = model.module.layers[0].attention.wk.weight.grad
    ref_wk = reference.layers[0].attention.wk.weight.grad
    assert wk is not None and ref_wk is not None
    assert torch.allclose(wk, ref_wk, atol=1e-5)


def test_wrap_model_none_and_errors() -> None:
    model = build_model(CONFIG, seed=0)
    assert wrap_model(model, parallel="none", device="cpu") is model
    with pytest.raises(ValueError, match="fsdp"):
        wrap_model(model, parallel="zero3", device="cpu")
    with pytest.raises(ValueError, match="param_dtype"):
        wrap_model(model, parallel="none", device="cpu", param_dtype=torch.bfloat16)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        wrap_model(model, parallel="ddp", device="cpu")
