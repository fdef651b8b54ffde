"""Deterministic, random-access, resumable data: a synthetic Markov language and its sampler.

Sample ``i`` depends only on the language seed and ``i``; the sampler's position is global (in
samples), so a run can stop at any step and resume with another world size and consume every
sample of the epoch exactly once.

Every random stream here comes from a ``numpy.random.SeedSequence`` of a fixed-length key
``[seed, stream, index]``, so nothing reads or advances a global RNG.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_LANGUAGE_STREAM = 0
_SAMPLE_STREAM = 1
_PERMUTATION_STREAM = 2


def _rng(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, index])))


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


class MarkovLanguage:
    """A seeded random Markov chain over ``vocab_size`` tokens.

    Each token has ``num_successors`` successors drawn at random (with replacement, so rarely
    fewer distinct ones) taken with Zipf-skewed probabilities ``p_k ~ 1 / (k + 1) ** skew``. A
    model that learns the transition table reaches a loss near ``entropy_nats``, far below
    ``log(vocab_size)``.
    """

    def __init__(
        self, vocab_size: int, *, seed: int, num_successors: int = 6, skew: float = 2.0
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if not 1 <= num_successors <= vocab_size:
            raise ValueError(
                f"num_successors must be in [1, vocab_size={vocab_size}], got {num_successors}"
            )
        if skew < 0:
            raise ValueError(f"skew must be >= 0, got {skew}")
        _check_non_negative("seed", seed)
        self.vocab_size = vocab_size
        self.seed = seed
        rng = _rng(seed, _LANGUAGE_STREAM, 0)
        self.successors: np.ndarray = rng.integers(
            0, vocab_size, size=(vocab_size, num_successors), dtype=np.int64
        )
        weights = 1.0 / np.arange(1, num_successors + 1, dtype=np.float64) ** skew
        self.probs: np.ndarray = weights / weights.sum()
        self._cdf = np.cumsum(self.probs)
        self._cdf[-1] = 1.0

    @property
    def entropy_nats(self) -> float:
        """Per-token entropy of the next token given the current one (the best achievable loss,
        up to duplicate successors)."""
        return float(-(self.probs * np.log(self.probs)).sum())

    def sample(self, keys: Sequence[int], *, length: int) -> np.ndarray:
        """Token sequences ``[len(keys), length]``; row ``j`` depends only on (seed, keys[j]).

        The first token is uniform; each next one follows the chain. Successor choices do not
        depend on the current token, so they are drawn up front and the walk is one gather per
        position across the whole batch.
        """
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        starts = np.empty(len(keys), dtype=np.int64)
        uniforms = np.empty((len(keys), max(length - 1, 0)), dtype=np.float64)
        for row, key in enumerate(keys):
            rng = _rng(self.seed, _SAMPLE_STREAM, key)
            starts[row] = rng.integers(0, self.vocab_size)
            uniforms[row] = rng.random(length - 1)
        choices = np.searchsorted(self._cdf, uniforms, side="right")
        tokens = np.empty((len(keys), length), dtype=np.int64)
        tokens[:, 0] = starts
        for t in range(1, length):
            tokens[:, t] = self.successors[tokens[:, t - 1], choices[:, t - 1]]
        return tokens


class SyntheticDataset:
    """``num_samples`` next-token samples of ``seq_len`` tokens from a MarkovLanguage.

    Sample ``i`` depends only on (language seed, ``i``, ``seq_len``): random access, in any order.
    """

    def __init__(self, language: MarkovLanguage, *, seq_len: int, num_samples: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.language = language
        self.seq_len = seq_len
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.get_batch([index])
        return inputs[0], targets[0]

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, int64 of shape ``[len(indices), seq_len]``; targets are the
        inputs shifted left by one token."""
        for index in indices:
            if not 0 <= index < self.num_samples:
                raise IndexError(f"sample index {index} out of range [0, {self.num_samples})")
        tokens = torch.from_numpy(self.language.sample(indices, length=self.seq_len + 1))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    @property
    def uniform_loss(self) -> float:
        """Loss of a model that predicts uniformly: ``log(vocab_size)``."""
        return math.log(self.language.vocab_size)


class ResumableSampler:
    """Hands each rank its share of every global batch of a seeded per-epoch permutation.

    A step consumes ``global_batch`` consecutive entries of the epoch's permutation of
    ``range(num_samples)``; rank ``r`` gets the ``r``-th contiguous slice of
    ``global_batch // world_size`` of them. When fewer than ``global_batch`` samples remain, the
    tail is dropped and the next epoch (a new permutation) begins. The position is counted in
    samples, independent of world size, so a state saved at one world size restores at another
    with the same ``global_batch``.
    """

    def __init__(
        self, num_samples: int, *, global_batch: int, rank: int, world_size: int, seed: int
    ) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if num_samples < global_batch:
            raise ValueError(
                f"num_samples ({num_samples}) must be >= global_batch ({global_batch}); "
                "use a larger dataset or a smaller batch"
            )
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if global_batch % world_size:
            raise ValueError(
                f"global_batch ({global_batch}) must be divisible by world_size ({world_size})"
            )
        _check_non_negative("seed", seed)
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.local_batch = global_batch // world_size
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (the tail that does not fill one is dropped)."""
        return self.num_samples // self.global_batch

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = _rng(self.seed, _PERMUTATION_STREAM, self.epoch)
            self._perm = rng.permutation(self.num_samples)
            self._perm_epoch = self.epoch
        return self._perm

    def next_indices(self) -> list[int]:
        """This rank's sample indices for the next step; advances the global position."""
        if self.position + self.global_batch > self.num_samples:
            self.epoch += 1
            self.position = 0
            logger.debug("sampler: epoch %d begins", self.epoch)
        start = self.position + self.rank * self.local_batch
        indices = self._permutation()[start : start + self.local_batch]
        self.position += self.global_batch
        return [int(i) for i in indices]

    def state_dict(self) -> dict[str, Any]:
        """The global position: plain ints, safe in any checkpoint."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved global position; the saving world size may differ from ours."""
        for key in ("seed", "num_samples", "global_batch"):
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}; keys seen: {sorted(state)}")
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has "
                    f"{key}={getattr(self, key)}; build the sampler with the saved {key}"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise ValueError(
                f"sampler state has epoch={epoch}, position={position}; need epoch >= 0 and "
                f"0 <= position <= num_samples ({self.num_samples})"
            )
        self.epoch = epoch
        self.position = position
