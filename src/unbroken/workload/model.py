"""The reference model: a Llama-style decoder-only transformer in plain torch.

RMSNorm, rotary position embeddings, SwiGLU feed-forward, grouped-query attention through
``scaled_dot_product_attention(is_causal=True)``, and an untied output head. Blocks live in
``Transformer.layers`` so FSDP2 can shard one block at a time.

Initialization depends only on the seed: every parameter draws from its own generator, seeded
from ``(seed, parameter name)``, so neither the global RNG nor the order of construction matter.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The shape of a Transformer."""

    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads; ``dim`` must divide evenly among them."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide ``n_heads``."""
    vocab_size: int
    """Number of token ids, for the embedding and the output head."""
    ffn_hidden: int
    """Hidden width of the SwiGLU feed-forward."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon added inside RMSNorm."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {value}")
        if self.max_seq_len < 1:
            raise ValueError(f"ModelConfig.max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"ModelConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head dim dim/n_heads must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be divisible by "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


SIZES: dict[str, ModelConfig] = {
    # ~0.9M params: unit tests and the e2e fault runs on CPU.
    "tiny": ModelConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden=384,
        max_seq_len=512,
    ),
    # ~22M params: CPU benchmarks.
    "small": ModelConfig(
        dim=512, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=4096, ffn_hidden=1408,
        max_seq_len=1024,
    ),
    # ~125M params (GPT-2 small scale).
    "medium": ModelConfig(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, ffn_hidden=2048,
        max_seq_len=2048,
    ),
    # Llama 3.2 1B shape, with an untied head (~1.5B params).
    "llama3-1b": ModelConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=8192,
        max_seq_len=8192, rope_theta=500000.0,
    ),
    # The real Llama 3.1 8B shape (~8.0B params); rotary tables limited to 8192 positions.
    "llama3.1-8b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336,
        max_seq_len=8192, rope_theta=500000.0,
    ),
}  # fmt: skip


def get_config(name: str) -> ModelConfig:
    """Return the named size from ``SIZES``."""
    try:
        return SIZES[name]
    except KeyError:
        raise ValueError(f"unknown model size {name!r}; valid sizes: {', '.join(SIZES)}") from None


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in float32."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(
    config: ModelConfig, *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables of shape ``[max_seq_len, head_dim // 2]``, in float32."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, half, dtype=torch.float64, device=device) / half)
    )
    pos = torch.arange(config.max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(pos, inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, H, T, head_dim]`` by position (rotate-half convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            # Expanding explicitly works on every torch >= 2.4 (enable_gqa came in 2.5).
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm transformer block: attention then feed-forward, each residual."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only transformer: ``forward(tokens [B, T]) -> logits [B, T, vocab_size]``."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        # Non-persistent: derived from the config, so they stay out of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}; "
                "use a larger max_seq_len in the ModelConfig"
            )
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, *, seed: int) -> None:
        """Fill every parameter and the rotary tables from ``seed`` alone.

        Call on unsharded parameters (before ``fully_shard``), e.g. after ``to_empty`` on a model
        built on the meta device. Values are identical across runs on the same device type.
        """
        out_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            # Residual-branch outputs start smaller so the stream's variance stays put.
            std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            gen = torch.Generator(device=param.device)
            gen.manual_seed(_param_seed(seed, name))
            param.normal_(mean=0.0, std=std, generator=gen)
        cos, sin = rope_tables(self.config, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def build_model(
    config: ModelConfig, *, seed: int, device: torch.device | str = "cpu"
) -> Transformer:
    """Build a Transformer on ``device`` whose weights depend only on ``seed``.

    On the meta device nothing is initialized (for shapes, parameter counts, or a later
    ``to_empty`` + ``init_weights``). The global RNG is neither used nor advanced.
    """
    with torch.device(device):
        model = Transformer(config)
    if model.rope_cos.device.type != "meta":
        model.init_weights(seed=seed)
    logger.debug("built model: %d params on %s, seed %d", count_params(model), device, seed)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits [B, T, V]`` against ``targets [B, T]``, in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def count_params(model: nn.Module) -> int:
    """Number of parameter elements (unsharded) in ``model``."""
    return sum(p.numel() for p in model.parameters())
