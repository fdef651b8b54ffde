import io
import math

import pytest
import torch

from unbroken.workload.data import MarkovLanguage, ResumableSampler, SyntheticDataset
from unbroken.workload.model import (
    SIZES,
    ModelConfig,
    build_model,
    count_params,
    get_config,
    loss_fn,
)


def _state_bytes(model: torch.nn.Module) -> bytes:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getvalue()


@pytest.mark.slow
def test_param_counts() -> None:
    assert 0.5e6 <= count_params(build_model(get_config("tiny"), seed=0)) <= 2e6
    small = build_model(get_config("small"), seed=0, device="meta")
    assert 10e6 <= count_params(small) <= 30e6
    medium = build_model(get_config("medium"), seed=0, device="meta")
    assert 100e6 <= count_params(medium) <= 150e6
    # The published Llama 3.1 8B parameter count.
    assert count_params(build_model(get_config("llama3.1-8b"), seed=0, device="meta")) == (
        8_030_261_248
    )


def test_get_config_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="tiny"):
        get_config("huge")
    assert set(SIZES) >= {"tiny", "small", "medium", "llama3-1b", "llama3.1-8b"}


@pytest.mark.parametrize(
    "change",
    [
        {"dim": 100},  # not divisible by 8 heads
        {"n_kv_heads": 3},  # 8 heads not divisible by 3
        {"vocab_size": 0},
        {"norm_eps": 0.0},
        {"max_seq_len": 0},
    ],
)
def test_config_validation(change: dict) -> None:
    base = {"dim": 64, "n_layers": 1, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 32}
    with pytest.raises(ValueError):
        ModelConfig(**{**base, "ffn_hidden": 128, **change})


def test_init_depends_only_on_seed() -> None:
    config = get_config("tiny")
    torch.manual_seed(123)
    a = build_model(config, seed=7)
    global_state = torch.get_rng_state()
    torch.manual_seed(999)
    b = build_model(config, seed=7)
    c = build_model(config, seed=8)
    assert _state_bytes(a) == _state_bytes(b)
    assert _state_bytes(a) != _state_bytes(c)
    # Building did not advance the global RNG.
    torch.manual_seed(123)
    build_model(config, seed=7)
    assert torch.equal(torch.get_rng_state(), global_state)


def test_forward_shape_and_gqa() -> None:
    config = ModelConfig(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=50, ffn_hidden=96, max_seq_len=32
    )
    model = build_model(config, seed=0)
    attn = model.layers[0].attention
    assert attn.wk.weight.shape == (2 * 8, 64)  # n_kv_heads * head_dim
    assert attn.wq.weight.shape == (64, 64)
    tokens = torch.randint(0, 50, (3, 20))
    logits = model(tokens)
    assert logits.shape == (3, 20, 50)
    assert torch.isfinite(logits).all()
    loss = loss_fn(logits, tokens)
    loss.backward()
    assert attn.wk.weight.grad is not None and attn.wk.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_forward_is_causal() -> None:
    model = build_model(get_config("tiny"), seed=0)
    tokens = torch.randint(0, 512, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 512
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-3)


@pytest.mark.slow
def test_tiny_model_learns_markov_language() -> None:
    config = get_config("tiny")
    model = build_model(config, seed=0)
    language = MarkovLanguage(config.vocab_size, seed=0)
    data = SyntheticDataset(language, seq_len=32, num_samples=4096)
    sampler = ResumableSampler(len(data), global_batch=16, rank=0, world_size=1, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(60):
        inputs, targets = data.get_batch(sampler.next_indices())
        loss = loss_fn(model(inputs), targets)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > math.log(config.vocab_size) - 0.5
    assert last < first - 2.0, (first, last)
