import time
from collections import Counter

import pytest
import torch

from unbroken.workload.data import MarkovLanguage, ResumableSampler, SyntheticDataset


def _dataset(*, seed: int = 0, seq_len: int = 16, num_samples: int = 100) -> SyntheticDataset:
    return SyntheticDataset(MarkovLanguage(64, seed=seed), seq_len=seq_len, num_samples=num_samples)


def test_language_is_seeded_and_skewed() -> None:
    a, b, c = MarkovLanguage(64, seed=1), MarkovLanguage(64, seed=1), MarkovLanguage(64, seed=2)
    assert (a.successors == b.successors).all()
    assert not (a.successors == c.successors).all()
    assert a.probs[0] > 0.5 and abs(a.probs.sum() - 1.0) < 1e-12
    assert a.entropy_nats < 0.5 * torch.log(torch.tensor(64.0)).item()


def test_samples_follow_the_chain() -> None:
    ds = _dataset()
    inputs, targets = ds.get_batch(list(range(8)))
    assert inputs.shape == targets.shape == (8, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    succ = ds.language.successors
    for row in range(8):
        for t in range(16):
            assert targets[row, t].item() in succ[inputs[row, t].item()]


def test_dataset_is_deterministic_and_random_access() -> None:
    ds = _dataset()
    x13, y13 = ds.get_batch([1, 3])
    x31, y31 = ds.get_batch([3, 1])
    assert torch.equal(x13, x31[[1, 0]]) and torch.equal(y13, y31[[1, 0]])
    x3, y3 = ds[3]
    assert torch.equal(x3, x13[1]) and torch.equal(y3, y13[1])
    assert torch.equal(_dataset().get_batch([1, 3])[0], x13)
    assert not torch.equal(_dataset(seed=5).get_batch([1, 3])[0], x13)
    assert not torch.equal(x13[0], x13[1])
    assert len(ds) == 100
    with pytest.raises(IndexError):
        ds.get_batch([100])


def test_get_batch_is_fast() -> None:
    ds = SyntheticDataset(MarkovLanguage(4096, seed=0), seq_len=256, num_samples=10_000)
    ds.get_batch(list(range(32)))
    start = time.perf_counter()
    for k in range(10):
        ds.get_batch(list(range(32 * k, 32 * k + 32)))
    per_batch_s = (time.perf_counter() - start) / 10
    assert per_batch_s < 0.05, per_batch_s


def _consume(samplers: list[ResumableSampler], steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        for s in samplers:
            out.extend(s.next_indices())
    return out


def _group(world_size: int, *, num_samples: int = 96, global_batch: int = 8, seed: int = 3):
    return [
        ResumableSampler(
            num_samples, global_batch=global_batch, rank=r, world_size=world_size, seed=seed
        )
        for r in range(world_size)
    ]


def test_two_ranks_cover_an_epoch_exactly_once() -> None:
    samplers = _group(2)
    seen = _consume(samplers, samplers[0].steps_per_epoch)
    assert sorted(seen) == list(range(96))
    # Ranks get disjoint contiguous slices of the same global batch.
    a, b = _group(2)
    ia, ib = a.next_indices(), b.next_indices()
    assert len(ia) == len(ib) == 4 and not set(ia) & set(ib)
    (single,) = _group(1)
    assert single.next_indices() == ia + ib


@pytest.mark.parametrize("new_world", [1, 2, 4])
def test_resume_with_another_world_size(new_world: int) -> None:
    before = _group(2)
    seen = _consume(before, 5)
    state = before[0].state_dict()
    assert state == before[1].state_dict()
    assert state["position"] == 40 and state["epoch"] == 0
    after = _group(new_world, seed=3)
    for s in after:
        s.load_state_dict(dict(state))
    seen += _consume(after, 12 - 5)
    assert Counter(seen) == Counter(range(96))
    assert all(s.epoch == 0 for s in after)


def test_epoch_rollover_drops_tail_and_reshuffles() -> None:
    (s,) = _group(1, num_samples=20, global_batch=6)
    assert s.steps_per_epoch == 3
    epoch0 = _consume([s], 3)
    assert len(set(epoch0)) == 18 and s.epoch == 0
    epoch1 = _consume([s], 3)
    assert s.epoch == 1 and len(set(epoch1)) == 18
    assert epoch0 != epoch1
    # Restoring mid-epoch-1 replays exactly.
    state = s.state_dict()
    nxt = s.next_indices()
    (t,) = _group(1, num_samples=20, global_batch=6)
    t.load_state_dict(state)
    assert t.next_indices() == nxt


@pytest.mark.parametrize(
    "kwargs",
    [
        {"global_batch": 6, "world_size": 4, "rank": 0},  # not divisible
        {"global_batch": 8, "world_size": 2, "rank": 2},  # rank out of range
        {"global_batch": 0, "world_size": 1, "rank": 0},
        {"global_batch": 200, "world_size": 1, "rank": 0},  # more than num_samples
        {"global_batch": 8, "world_size": 0, "rank": 0},
    ],
)
def test_sampler_rejects_bad_args(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ResumableSampler(96, seed=0, **kwargs)


def test_load_state_rejects_mismatch() -> None:
    (s,) = _group(1)
    state = s.state_dict()
    (other,) = _group(1, global_batch=16)
    with pytest.raises(ValueError, match="global_batch=8"):
        other.load_state_dict(state)
    (other_seed,) = _group(1, seed=4)
    with pytest.raises(ValueError, match="seed"):
        other_seed.load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        s.load_state_dict({**state, "position": 1000})


def test_bad_data_args() -> None:
    with pytest.raises(ValueError):
        MarkovLanguage(1, seed=0)
    with pytest.raises(ValueError):
        MarkovLanguage(64, seed=-1)
    with pytest.raises(ValueError):
        SyntheticDataset(MarkovLanguage(64, seed=0), seq_len=0, num_samples=10)
